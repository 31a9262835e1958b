"""The `kvguard` command: one entry point, one subcommand per job.

Exit codes: 0 nothing found, 1 findings (or failed rule tests), 2 unusable input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

import orjson

from kvguard import __version__


def _open_capture(path: str) -> TextIO:
    if path == "-":
        return sys.stdin
    return open(path, encoding="utf-8", errors="replace")


def cmd_replay(args: argparse.Namespace) -> int:
    if args.to:
        return cmd_replay_to(args)
    from kvguard.ruleset import RulesetError, load_ruleset
    from kvguard.ruleset.replay import format_text, replay

    try:
        ruleset = load_ruleset(Path(args.rules) if args.rules else None)
    except RulesetError as exc:
        print(f"kvguard replay: the ruleset is not usable:\n{exc}", file=sys.stderr)
        return 2
    try:
        stream = _open_capture(args.capture)
    except OSError as exc:
        print(f"kvguard replay: cannot read capture {args.capture}: {exc.strerror}", file=sys.stderr)
        return 2
    source = "standard input" if args.capture == "-" else args.capture
    out = sys.stdout
    if args.output == "json":

        def emit(finding):  # type: ignore[no-untyped-def]
            out.write(orjson.dumps(finding.to_json_dict()).decode() + "\n")
    else:

        def emit(finding):  # type: ignore[no-untyped-def]
            out.write(format_text(finding) + "\n")

    def error(err):  # type: ignore[no-untyped-def]
        print(f"{source}:{err.line}: {err.reason}", file=sys.stderr)

    try:
        with stream:
            summary = replay(stream, ruleset, emit, error)
    except OSError as exc:
        print(f"kvguard replay: reading {source} failed: {exc}", file=sys.stderr)
        return 2
    out.flush()
    print(summary.text(source), file=sys.stderr)
    if summary.lines and not summary.applied and summary.bad:
        return 2
    return 1 if summary.total_findings else 0


def cmd_replay_to(args: argparse.Namespace) -> int:
    import grpc

    from kvguard.agents.upstream import DaemonRefused
    from kvguard.cli.send import send_capture
    from kvguard.proto.channel import from_args

    tls = from_args(args)
    source = "standard input" if args.capture == "-" else args.capture
    try:
        stream = _open_capture(args.capture)
    except OSError as exc:
        print(f"kvguard replay: cannot read capture {args.capture}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        with stream:
            summary = send_capture(stream, args.to, tls=tls)
    except (grpc.RpcError, DaemonRefused) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"kvguard replay: the daemon at {args.to} refused: {detail}", file=sys.stderr)
        return 2
    for err in summary.bad_lines:
        print(f"{source}:{err.line}: {err.reason}", file=sys.stderr)
    for line, reason in summary.rejected:
        print(f"{source}:{line}: refused by the daemon: {reason}", file=sys.stderr)
    print(
        f"sent {summary.events} events from {source} to {args.to}: {summary.accepted} stored, "
        f"{summary.repeats} already there, {len(summary.rejected)} refused, "
        f"{len(summary.bad_lines)} bad line(s)",
        file=sys.stderr,
    )
    return 0 if not (summary.rejected or summary.bad_lines) else 1


def cmd_daemon(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvguard.daemon.server import Daemon, serve
    from kvguard.daemon.store import AuditKeyError, Store, StoreError, read_audit_key
    from kvguard.proto.channel import from_args
    from kvguard.ruleset import RulesetError, load_ruleset

    tls = from_args(args)
    try:
        ruleset = load_ruleset(Path(args.rules) if args.rules else None)
    except RulesetError as exc:
        print(f"kvguard daemon: the ruleset is not usable:\n{exc}", file=sys.stderr)
        return 2
    woken = ""
    if args.cpu_latency_us is not None:
        from kvguard.daemon import cpu_latency

        try:
            cpu_latency.hold(args.cpu_latency_us)  # its descriptor stays open until the daemon exits
        except cpu_latency.CpuLatencyError as exc:
            print(f"kvguard daemon: --cpu-latency-us: {exc}", file=sys.stderr)
            return 2
        woken = f"; idle CPUs wake within {args.cpu_latency_us} µs" + (
            " (they poll)" if args.cpu_latency_us == 0 else ""
        )
    # The daemon's loop shares the GIL with gRPC's and the store's helper threads: with
    # Python's default 5 ms switch interval a reply the loop is due to send could wait that long.
    sys.setswitchinterval(0.0005)
    from kvguard.daemon.writer import StoreWriter

    try:
        key = read_audit_key(args.audit_key) if args.audit_key else None
        store = Store(args.store, key)
        if key is not None and store.sealed_from is None:
            # An empty store is sealed from its first record. One with records is sealed only
            # on purpose: a seal gone missing (removed along with a rewrite) must not be
            # replaced by a new one that vouches only for what comes next.
            if store.count():
                raise StoreError(
                    f"audit store {store.url} is not sealed but has records: seal it once with "
                    "`kvguard audit seal` (or, if it was sealed, its seal was removed: verify it)"
                )
            store.seal()
        store.write_key()  # a sealed store is written only with its key: say so now, not at the first batch
    except (AuditKeyError, StoreError) as exc:
        print(f"kvguard daemon: {exc}", file=sys.stderr)
        return 2
    # hashing and inserts run on another core, overlapping the ledger
    writer = StoreWriter(args.store, key=key)
    skew = int(args.clock_skew_ms * 1_000_000)
    try:
        daemon = Daemon(
            store,
            ruleset,
            mode=args.mode,
            writer=writer,
            clock_skew_ns=skew,
            snapshot_every=args.snapshot_every,
            store_reserve=args.store_reserve,
        )
    except StoreError as exc:  # its writer could not open the store: serving would lose every batch
        writer.close()
        print(f"kvguard daemon: {exc}", file=sys.stderr)
        return 2
    server = serve(daemon, args.listen, tls)
    port = server.port
    print(
        f"kvguard daemon listening on port {port}; store {store.url}; ledger from the snapshot after record "
        f"{daemon.counters['snapshot_through']} and {daemon.counters['rebuilt_events']} events after it"
        f"{woken}",
        file=sys.stderr,
        flush=True,
    )
    print(f"READY {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2)
    daemon.close()  # what was received is applied and submitted before the writer finishes
    writer.close()
    # The next start loads this and replays only what comes after it.
    through = daemon.save_snapshot()
    print(f"kvguard daemon: ledger snapshot saved after record {through}", file=sys.stderr, flush=True)
    store.close()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvguard.agents.agent import NodeAgent
    from kvguard.agents.probes import gpu_facts
    from kvguard.proto.channel import from_args

    tls = from_args(args)
    agent = NodeAgent(
        args.socket,
        args.daemon,
        args.spool,
        tls=tls,
        witness=args.witness or args.witness_uprobes,
        witness_uprobes=args.witness_uprobes,
        witness_buffer_pages=args.witness_buffer_pages,
    )
    for spec in args.probe or []:
        parts = spec.split(":", 3)
        if len(parts) != 4:
            print(f"kvguard agent: --probe {spec!r} is not NODE:ENGINE:ROLE:SOURCE", file=sys.stderr)
            return 2
        try:
            agent.add_probe(*parts)
        except ValueError as exc:
            print(f"kvguard agent: {exc}", file=sys.stderr)
            return 2
    print(f"kvguard agent: {gpu_facts().describe()}", file=sys.stderr)
    if agent.witness.available:
        print(
            "kvguard agent: the eBPF wire witness watches each guarded engine's TCP transfers",
            file=sys.stderr,
        )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: agent.stopping.set())
    thread = threading.Thread(target=agent.serve, daemon=True)
    thread.start()
    print(
        f"kvguard agent: guards connect to {args.socket}; daemon {args.daemon}; spool {args.spool}",
        file=sys.stderr,
    )
    print("READY", flush=True)
    agent.stopping.wait()
    thread.join(timeout=2)
    agent.stop()
    return 0


def cmd_witness(args: argparse.Namespace) -> int:
    """Wire events as JSON Lines on stdout (a capture: `kvguard replay` takes it)."""
    import signal
    import threading
    import time

    from kvguard.cuda_hooks.tcp_stream import WireReport
    from kvguard.cuda_hooks.witness import open_witness, wire_event
    from kvguard.proto import pb
    from kvguard.proto.capture import event_to_json

    seq = 0
    lock = threading.Lock()

    def report(name: str, r: WireReport) -> None:
        nonlocal seq
        with lock:
            seq += 1
            event = pb.Event(node=name, seq=seq, ts_ns=time.time_ns(), wire=wire_event(r))
            print(event_to_json(event), flush=True)

    witness = open_witness(report, uprobes=args.uprobes)
    if not witness.available:
        print(f"kvguard witness: {witness.reason}", file=sys.stderr)
        return 1
    for pid in args.pid:
        witness.watch(pid, args.node)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kvguard witness: watching {', '.join(map(str, args.pid))}", file=sys.stderr, flush=True)
    stop.wait(args.seconds or None)
    witness.close()
    return 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from kvguard.daemon.store import AuditKeyError, Store, StoreError, read_audit_key

    try:
        store = Store(args.store, *(read_audit_key(path) for path in args.audit_key or ()))
    except (AuditKeyError, StoreError) as exc:
        print(f"kvguard audit verify: {exc}", file=sys.stderr)
        return 1
    ok, n, problem = store.verify()
    if not ok:
        print(f"audit log {store.url}: NOT proven intact after {n} good records: {problem}", file=sys.stderr)
        return 1
    seals = store.seals
    sealed = "" if not seals else f", sealed with the audit key from record {seals[0]} on"
    if len(seals) > 1:
        sealed += f" (key rotated at record{'s' if len(seals) > 2 else ''} {', '.join(map(str, seals[1:]))})"
    print(f"audit log {store.url}: {n} records, chain intact{sealed}")
    # The ledger snapshot a restart would load is derived data, outside the chain, but bound
    # to it: one that does not match is not loaded (the store is replayed), and is said here.
    found = store.latest_snapshot()
    if isinstance(found, str):
        print(
            f"ledger snapshot: {found}" + ("" if found == "no snapshot" else " (a restart replays the store)")
        )
    else:
        print(f"ledger snapshot: after record {found[0]}, bound to the chain there")
    return 0


def cmd_audit_seal(args: argparse.Namespace) -> int:
    from kvguard.daemon.store import AuditKeyError, Store, StoreError, read_audit_key

    try:
        key = read_audit_key(args.audit_key)
        if args.current_key:  # a rotation: the holder of the current key seals on with a new one
            store = Store(args.store, read_audit_key(args.current_key))
            from_id = store.seal(key, rotate=True)
            print(
                f"audit log {store.url}: sealed with the new audit key from record {from_id} on (key rotated)"
            )
            return 0
        plain = Store(args.store)
        if plain.seals:
            raise StoreError(
                f"audit store {plain.url}: sealed already (the current seal from record "
                f"{plain.seals[-1]} on); to rotate its key, give the current one as --current-key"
            )
        ok, n, problem = plain.verify()
        plain.close()
        if not ok:  # sealing vouches for nothing before it, but says so only of a sound chain
            raise StoreError(f"audit store {plain.url}: not sealed: the chain is not intact ({problem})")
        store = Store(args.store, key)
        from_id = store.seal()
    except (AuditKeyError, StoreError) as exc:
        print(f"kvguard audit seal: {exc}", file=sys.stderr)
        return 1
    print(
        f"audit log {store.url}: {n} records, chain intact; "
        f"sealed with the audit key from record {from_id} on"
    )
    return 0


def cmd_audit_new_key(args: argparse.Namespace) -> int:
    from kvguard.daemon.store import new_audit_key

    try:
        new_audit_key(args.path)
    except OSError as exc:
        print(f"kvguard audit new-key: {args.path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"audit key written to {args.path} (mode 600): keep it off the database's machine or disk")
    return 0


def cmd_rules_check(args: argparse.Namespace) -> int:
    from kvguard.ruleset import RulesetError, load_ruleset

    try:
        ruleset = load_ruleset(Path(args.rules) if args.rules else None)
    except RulesetError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    for rule in ruleset.rules:
        state = "" if rule.enabled else " (disabled)"
        print(f"{rule.id:36} {','.join(rule.kinds):24} {rule.severity:9} {rule.action}{state}")
    print(f"{len(ruleset.rules)} rules OK", file=sys.stderr)
    return 0


def cmd_rules_test(args: argparse.Namespace) -> int:
    from kvguard.ruleset import RulesetError
    from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR, run_fixtures

    try:
        return run_fixtures(
            Path(args.rules) if args.rules else None,
            Path(args.fixtures) if args.fixtures else DEFAULT_FIXTURES_DIR,
            sys.stdout,
            verbose=args.verbose,
        )
    except RulesetError as exc:
        print(str(exc), file=sys.stderr)
        return 2


def cmd_testbed_up(args: argparse.Namespace) -> int:
    from kvguard.testbed.router import ClusterConfig, up

    pairs: dict[str, dict[str, str]] = {"system_prompt": {}, "rule_mode": {}}
    for option, shape in (("system_prompt", "TENANT=TEXT"), ("rule_mode", "RULE=MODE")):
        for item in getattr(args, option) or []:
            key, sep, value = item.partition("=")
            if not sep:
                print(
                    f"kvguard testbed up: --{option.replace('_', '-')} {item!r} is not {shape}",
                    file=sys.stderr,
                )
                return 2
            pairs[option][key] = value
    prompts = pairs["system_prompt"]
    try:
        config = ClusterConfig(
            port=args.port,
            faults=tuple(args.fault or ()),
            guard=args.guard,
            unguarded_roles=tuple(r for r in (args.unguarded_roles or "").split(",") if r),
            rule_modes=pairs["rule_mode"],
            audit_dir=args.audit_dir,
            agent_socket=args.agent_socket or "",
            node_prefix=args.node_prefix,
            context_len=args.context_len,
            prefill_pages=args.prefill_pages,
            system_prompts=prompts,
            prefix_cache=args.prefix_cache,
            host_cache=args.host_cache,
            device=args.device,
            prefill_timeout_s=args.prefill_timeout_s,
            prefill_ms_per_token=args.prefill_ms_per_token,
            decode_step_ms=args.decode_step_ms,
            offload_delay_ms=args.offload_delay_ms,
        )
    except ValueError as exc:
        print(f"kvguard testbed up: {exc}", file=sys.stderr)
        return 2
    return up(config)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvguard.cli.demo import run_demo

    return run_demo(Path(args.out))


def _number(text: str, parse: type[int] | type[float], what: str) -> Any:
    """`text` as a number for an argparse type, or the error that names it."""
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def power_of_two(text: str) -> int:
    """An argparse type: a positive power of two (what a BPF ring buffer's size must be)."""
    n = _number(text, int, "a whole number")
    if n < 1 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"{n} is not a power of two (1, 2, 4, ... pages)")
    return n


def milliseconds(text: str) -> float:
    """An argparse type: a duration in milliseconds, not negative."""
    ms = _number(text, float, "a number of milliseconds")
    if not 0 <= ms < 1e9:
        raise argparse.ArgumentTypeError(f"{ms} ms is not a duration from 0 up")
    return ms


def microseconds(text: str) -> int:
    """An argparse type: a whole number of microseconds, not negative."""
    from kvguard.daemon.cpu_latency import MAX_US

    us = _number(text, int, "a whole number of microseconds")
    if not 0 <= us <= MAX_US:
        raise argparse.ArgumentTypeError(f"{us} µs is not between 0 and {MAX_US}")
    return us


def byte_count(text: str) -> int:
    """An argparse type: bytes, whole, with an optional K, M, G or T (powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = scale.get(body[-1:], 1)
    n = _number(body[:-1] if unit > 1 else body, float, "a size in bytes (e.g. 256M, 2G)")
    if not 0 <= n * unit < 1 << 60:
        raise argparse.ArgumentTypeError(f"{text} is not a size from 0 up")
    return int(n * unit)


def events_count(text: str) -> int:
    """An argparse type: a number of events, 0 or more."""
    n = _number(text, int, "a whole number of events")
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} events: it cannot be negative")
    return n


def build_parser() -> argparse.ArgumentParser:
    from kvguard.daemon.server import SNAPSHOT_EVERY
    from kvguard.ledger.ledger import CLOCK_SKEW_NS

    parser = argparse.ArgumentParser(
        prog="kvguard", description="KV-cache ownership guard for shared LLM inference."
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvguard.proto.channel import add_arguments as tls_arguments

    p = sub.add_parser("replay", help="run a JSON Lines capture through the ledger and the ruleset")
    p.add_argument("capture", help="capture file (JSON Lines of kvguard.v1 events), or - for standard input")
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="findings format")
    p.add_argument(
        "--to", metavar="ADDR", help="send the events to the daemon at ADDR instead, as agents would"
    )
    tls_arguments(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("daemon", help="the global ledger, audit store and alert feed over gRPC")
    p.add_argument("--listen", default="127.0.0.1:7463", help="gRPC address (host:port)")
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    p.add_argument(
        "--mode", choices=("monitor", "enforce"), default="enforce", help="monitor: never order a kill"
    )
    p.add_argument(
        "--clock-skew-ms",
        type=milliseconds,
        default=CLOCK_SKEW_NS / 1e6,
        metavar="MS",
        help="how far the nodes' clocks may disagree (default %(default)s): an RDMA write seen posted "
        "within this of a change of the page it hit is not judged",
    )
    p.add_argument(
        "--snapshot-every",
        type=events_count,
        default=SNAPSHOT_EVERY,
        metavar="EVENTS",
        help="every this many events, save a ledger snapshot (dumped by a forked copy of the daemon while it "
        "goes on), so that a start after a crash replays only what came after it (0: only at a clean stop; "
        "default %(default)s)",
    )
    p.add_argument(
        "--audit-key",
        metavar="FILE",
        help="seal the audit chain with this key (HMAC-SHA256; `kvguard audit new-key`), kept outside the "
        "database, so that no one who can write the database but lacks the key can rewrite it unnoticed; "
        "a sealed store needs it",
    )
    p.add_argument(
        "--cpu-latency-us",
        type=microseconds,
        metavar="US",
        help="while the daemon runs, no idle CPU of the machine may take longer than this to wake up (Linux "
        "PM QoS, /dev/cpu_dma_latency: root). 0: idle CPUs poll instead of sleeping, which cuts the alert "
        "latency's tail on VMs whose idle vCPUs halt to the host, at the price of cores that always look "
        "busy (default: the machine's own idle policy)",
    )
    p.add_argument(
        "--store-reserve",
        type=byte_count,
        default="256M",  # daemon/room.py RESERVE
        metavar="SIZE",
        help="take no more events while the store's file system has less than this free (agents keep "
        "them spooled and resend them once there is room), rather than fail a commit on a full disk; "
        "0: never (default 256M; SQLite only: a PostgreSQL server's disk is not seen from here)",
    )
    tls_arguments(p)
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("agent", help="the node agent: guards' events to the daemon, durably; kills back")
    p.add_argument("--socket", default="/run/kvguard/agent.sock", help="Unix socket the guards connect to")
    p.add_argument("--daemon", default="127.0.0.1:7463", help="the daemon's gRPC address")
    p.add_argument("--spool", default="/var/lib/kvguard/spool", help="where unacknowledged events wait")
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
    tls_arguments(p)
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser(
        "witness", help="print the KV transfers a process sends, as the kernel sees them (eBPF)"
    )
    p.add_argument(
        "-p", "--pid", type=int, required=True, action="append", help="process to watch (repeatable)"
    )
    p.add_argument("--node", default="witness", help="node name of the wire events (default: witness)")
    p.add_argument("--uprobes", action="store_true", help="also named transfers' CUDA copies and RDMA posts")
    p.add_argument(
        "--seconds", type=float, default=0.0, help="stop after this long (default: until interrupted)"
    )
    p.set_defaults(func=cmd_witness)

    audit = sub.add_parser("audit", help="the audit log").add_subparsers(dest="audit_command", required=True)
    p = audit.add_parser("verify", help="prove that no record was altered, removed or reordered")
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    p.add_argument(
        "--audit-key",
        metavar="FILE",
        action="append",
        help="a key the store is sealed with (needed to prove what it sealed; once per key a rotation left)",
    )
    p.set_defaults(func=cmd_audit_verify)
    p = audit.add_parser(
        "seal", help="seal a store's chain with an audit key from its next record on (daemon stopped)"
    )
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    p.add_argument("--audit-key", metavar="FILE", required=True, help="the key (`kvguard audit new-key`)")
    p.add_argument(
        "--current-key",
        metavar="FILE",
        help="rotate: the key the store is sealed with now; the new one follows it",
    )
    p.set_defaults(func=cmd_audit_seal)
    p = audit.add_parser("new-key", help="write a new random audit key (for --audit-key), mode 600")
    p.add_argument("path", help="where (never over an existing file)")
    p.set_defaults(func=cmd_audit_new_key)
    from kvguard.cli.audit import add_parsers as add_audit_queries

    add_audit_queries(audit)
    from kvguard.cli.fleet import add_parser as add_fleet

    add_fleet(sub)

    rules = sub.add_parser("rules", help="check or test a ruleset").add_subparsers(
        dest="rules_command", required=True
    )
    p = rules.add_parser("check", help="validate a rules directory and list its rules")
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    p.set_defaults(func=cmd_rules_check)
    p = rules.add_parser(
        "test", help="replay each rule fixture and compare its findings with the expected ones"
    )
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    p.add_argument("--fixtures", metavar="DIR", help="fixtures directory (default: the bundled fixtures)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every finding of every fixture")
    p.set_defaults(func=cmd_rules_test)

    testbed = sub.add_parser("testbed", help="the testbed engine").add_subparsers(
        dest="testbed_command", required=True
    )
    p = testbed.add_parser("up", help="run a router, a prefill and a decode worker in the foreground")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API (0: any)")
    p.add_argument("--fault", action="append", metavar="NAME", help="turn a fault switch on (repeatable)")
    p.add_argument("--guard", choices=("off", "monitor", "enforce"), default="enforce")
    p.add_argument("--unguarded-roles", metavar="ROLES", help="comma-separated roles run without a guard")
    p.add_argument("--rule-mode", action="append", metavar="RULE=MODE", help="monitor or enforce one rule")
    p.add_argument("--audit-dir", default="kvguard-audit", help="where the guards write their captures")
    p.add_argument(
        "--agent-socket", metavar="PATH", help="send the guards' events to this node agent instead"
    )
    p.add_argument("--node-prefix", default="", help="prefix of the workers' node names")
    p.add_argument("--context-len", type=int, default=1024, help="max_model_len")
    p.add_argument(
        "--prefill-pages", type=int, default=0, help="prefill KV pool size (0: sized to the context)"
    )
    p.add_argument("--system-prompt", action="append", metavar="TENANT=TEXT", help="a tenant's hidden prompt")
    p.add_argument("--prefix-cache", action="store_true", help="reuse the pages of identical prompts")
    p.add_argument("--host-cache", action="store_true", help="offload prompts' KV to host memory")
    p.add_argument(
        "--device", default="cpu", help="where the workers keep KV and compute (cpu, cuda, cuda:N)"
    )
    p.add_argument("--prefill-timeout-s", type=float, default=30.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="test control: slow prefill")
    p.add_argument("--decode-step-ms", type=float, default=0.0, help="test control: slow decode steps")
    p.add_argument("--offload-delay-ms", type=float, default=50.0, help="test control: offload copy delay")
    p.set_defaults(func=cmd_testbed_up)

    p = sub.add_parser("demo", help="the 2026 PD leak on the testbed, unguarded and guarded")
    p.add_argument("--out", default="kvguard-demo", help="where the audit captures go")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvguard.proto.channel import TlsError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TlsError as exc:  # unusable --tls-* options, from any command that takes them
        print(f"kvguard {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
