"""`kvguard agent`: the node agent. The in-engine guards of one machine connect to its Unix
socket; it spools their events to disk, delivers them to the daemon in order, and carries
the daemon's kill and quarantine commands back. It prints `READY` on stdout once it serves.

Under systemd (Type=notify; deploy/systemd/) it says READY=1 once its socket listens, STOPPING=1
on stop and, with WatchdogSec=, WATCHDOG=1 only while its accept loop goes round
(proto/sd_notify.py). SIGHUP (systemctl reload) reloads nothing, as the agent has no
configuration it can change while it runs: it says its counters, between RELOADING=1 and
READY=1, so that a reload of every kvguard unit succeeds and shows the agent alive.
"""

from __future__ import annotations

import argparse

from kvguard.cli.options import (
    AGENT_SOCKET,
    Subcommands,
    add_bus_arguments,
    add_command,
    add_daemon_argument,
    add_log_arguments,
    add_tls_arguments,
    bus_from_args,
    positive_count,
    power_of_two,
    seconds,
    seconds_or_off,
    tls_from_args,
)
from kvguard.proto.logs import configure as configure_logs
from kvguard.proto.logs import logger

log = logger("agent")

# The agent's modules (grpc, NVML, eBPF) are imported when the command runs, so that
# `kvguard --help` does not wait for them.


def cmd_agent(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM: exit 0, or 2 on a --probe it cannot use or a --socket it
    cannot listen on."""
    import signal
    import threading

    from kvguard.agents.agent import NodeAgent
    from kvguard.cli.reload import reload_logs
    from kvguard.proto.sd_notify import Notifier, Watchdog
    from kvguard.proto.signals import Signals

    configure_logs(args.log_level, args.log_format)
    notifier = Notifier(component="agent")  # systemd's, when it started the agent (Type=notify)
    tls = tls_from_args(args)
    bus = bus_from_args(args)
    agent = NodeAgent(
        args.socket,
        args.daemon,
        args.spool,
        tls=tls,
        witness=args.witness or args.witness_uprobes,
        witness_uprobes=args.witness_uprobes,
        witness_buffer_pages=args.witness_buffer_pages,
        max_guards=args.max_guards,
        frame_timeout=args.frame_timeout,
        canary_interval_s=args.canary_interval,
        bus=bus,
        cell=args.cell,
    )
    for spec in args.probe or []:
        parts = spec.split(":", 3)
        if len(parts) != 4:
            log.error(f"--probe {spec!r} is not NODE:ENGINE:ROLE:SOURCE")
            return 2
        try:
            agent.add_probe(*parts)
        except ValueError as exc:
            log.error(str(exc))
            return 2
    log.info(agent.gpu.describe())  # as its node statuses say
    if agent.witness.available:
        log.info("the eBPF wire witness watches each guarded engine's TCP transfers")
    signals = Signals(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        agent.listen()
    except OSError as exc:
        log.error(f"cannot listen on --socket {args.socket}: {exc}")
        agent.stop()
        return 2
    metrics = None
    if args.metrics_listen:
        from kvguard.agents.metrics import AgentCollector
        from kvguard.proto.metrics_http import MetricsError, serve_metrics

        try:
            metrics = serve_metrics(args.metrics_listen, AgentCollector(agent), tls)
        except MetricsError as exc:
            log.error(str(exc))
            agent.stop()
            return 2
        log.info(f"metrics on {metrics.url}")
    thread = threading.Thread(target=agent.serve, daemon=True)
    thread.start()
    log.info(f"guards connect to {args.socket}; {agent.upstream}; spool {args.spool}")
    print("READY", flush=True)
    status = f"guards connect to {args.socket}; {agent.upstream}"
    notifier.ready(status)
    watchdog = None
    if notifier.watchdog_s is not None:  # WatchdogSec=: pinged only while the accept loop goes round
        watchdog = Watchdog(notifier, lambda: agent.heartbeat_at, "the agent's accept loop").start()
    while True:
        taken = signals.wait()
        if taken & {signal.SIGINT, signal.SIGTERM}:
            agent.stopping.set()
            break
        if signal.SIGHUP in taken:
            notifier.reloading("SIGHUP: the log settings read again; saying the counters")
            agent.say_counters()
            reload_logs(args)
            notifier.ready(status)
    notifier.stopping("stopping: the spool keeps what the daemon has not acknowledged")
    thread.join(timeout=2)
    if watchdog is not None:
        watchdog.stop()
    if metrics is not None:
        metrics.stop()
    agent.stop()
    notifier.close()
    signals.close()
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `agent` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "agent",
        "the node agent: guards' events to the daemon, durably; kills back",
        "Take this machine's guards' events, spool them, deliver them to the daemon; carry its kills back.",
        "kvguard agent --daemon 10.0.0.5:7463 --probe p1:vllm:prefill:http://127.0.0.1:8100 --witness",
    )
    p.add_argument(
        "--socket",
        default=AGENT_SOCKET,
        help="Unix socket the guards connect to (owner-only: guards run as the agent's user, or as root)",
    )
    p.add_argument(
        "--max-guards",
        type=positive_count,
        default=128,
        metavar="N",
        help="guard connections served at once (each holds a thread; default 128); more are refused "
        "and counted",
    )
    p.add_argument(
        "--frame-timeout",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="how long a guard may take to say hello, or to finish a message it has begun (default 5); "
        "a connection past it is closed and counted",
    )
    p.add_argument(
        "--canary-interval",
        type=seconds_or_off,
        default=0.0,
        metavar="SECONDS",
        help="how often each connected guard is asked for a self-test canary, which must come back "
        "from the daemon on the command path (node status, metrics; overdue after 3 intervals, said "
        "once); 0: none",
    )
    add_daemon_argument(p)
    # the unit's StateDirectory (kvguard-agent.service): root's, apart from the daemon's
    p.add_argument("--spool", default="/var/lib/kvguard-agent/spool", help="where unacknowledged events wait")
    p.add_argument(
        "--probe",
        action="append",
        metavar="NODE:ENGINE:ROLE:SOURCE",
        help="report an unguarded engine's pool (ENGINE sglang|vllm; SOURCE a log file or http://host:port)",
    )
    p.add_argument(
        "--witness",
        action="store_true",
        help="watch each guarded engine's KV transfers from the kernel (eBPF; root) and report them as wire "
        "events of NODE/ebpf, to be reconciled with what the engine claims it sent",
    )
    p.add_argument(
        "--witness-uprobes",
        action="store_true",
        help="--witness, and also count each named transfer's CUDA copies and RDMA work requests with "
        "uprobes (they trap every such call of a watched engine: about a microsecond each on bare metal)",
    )
    p.add_argument(
        "--witness-buffer-pages",
        type=power_of_two,
        default=1024,
        metavar="N",
        help="the witness's kernel ring buffer, shared by all CPUs, in pages (a power of two; default 1024): "
        "what it holds while the agent is busy; events beyond it are lost, counted and reported as "
        "NODE/ebpf's dropped",
    )
    add_tls_arguments(p)
    add_bus_arguments(p, cell=True)
    add_log_arguments(p)
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off)",
    )
    p.set_defaults(func=cmd_agent)
