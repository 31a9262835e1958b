"""`kvguard daemon`: the global ledger, the audit store and the alert feed, served over gRPC
until SIGINT or SIGTERM. It prints `READY PORT` on stdout once it serves (cli/process.py
waits for that line) and saves a ledger snapshot on a clean stop. SIGHUP, or a change to its
configuration files or rules, reloads them (cli/reload.py).

Under systemd (Type=notify; deploy/systemd/) it says READY=1 once the store, ledger, rules and
listener are up, RELOADING=1 then READY=1 around a reload, STOPPING=1 on stop, and, with
WatchdogSec=, WATCHDOG=1 only while its loop goes round (proto/sd_notify.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvguard.cli.options import (
    Subcommands,
    add_bus_arguments,
    add_command,
    add_log_arguments,
    add_tls_arguments,
    bus_from_args,
    byte_count,
    events_count,
    listen_address,
    microseconds,
    milliseconds,
    positive_count,
    seconds_or_off,
    tls_from_args,
)
from kvguard.proto.logs import configure as configure_logs
from kvguard.proto.logs import logger

if TYPE_CHECKING:
    from kvguard.proto.channel import Tls
    from kvguard.proto.crl import Crl

log = logger("daemon")

# The daemon's modules (grpc, SQLAlchemy) and the ruleset (CEL) are imported when the command
# runs, so that `kvguard --help` does not wait for them.


def cmd_daemon(args: argparse.Namespace) -> int:
    """Serve until stopped: exit 0, or 2 on an unusable ruleset, store, key or option."""
    import signal
    import socket

    from kvguard.cli.reload import Reloader, fingerprint, watched
    from kvguard.daemon.access import ListenerError, check_listener
    from kvguard.daemon.daemon import Daemon
    from kvguard.daemon.service import serve
    from kvguard.daemon.store import AuditKeyError, RowError, Store, StoreError, read_audit_key
    from kvguard.ledger.limits import Limits
    from kvguard.proto.sd_notify import Notifier, Watchdog
    from kvguard.proto.signals import Signals
    from kvguard.ruleset import RulesetError, load_ruleset

    configure_logs(args.log_level, args.log_format)
    notifier = Notifier(component="daemon")  # systemd's, when it started the daemon (Type=notify)
    # systemctl reload (ExecReload): one that comes while the daemon starts waits for READY.
    signals = Signals(signal.SIGHUP)
    tls = tls_from_args(args)
    bus = bus_from_args(args)
    if bus is not None and not args.store.startswith("postgresql"):
        log.error(
            f"--bus: the daemons on the bus share one PostgreSQL audit store; --store {args.store} is not one"
        )
        return 2
    try:  # before anything is opened: a listener that must not serve stops the start
        warning = check_listener(args.listen, tls=tls is not None, insecure=args.insecure)
    except ListenerError as exc:
        log.error(str(exc))
        return 2
    if warning is not None:
        log.warning(warning)
    first_read = fingerprint(watched(args))  # what the files were before they are read: a reload's baseline
    try:
        crl = load_crl(args, tls)
    except ValueError as exc:
        log.error(str(exc))
        return 2
    try:
        ruleset = load_ruleset(Path(args.rules) if args.rules else None)
    except RulesetError as exc:
        log.error(f"the ruleset is not usable:\n{exc}")
        return 2
    receipt_key = None
    if args.receipt_key:
        from kvguard.proto.receipt import ReceiptError, load_private

        try:
            receipt_key = load_private(args.receipt_key)
        except ReceiptError as exc:
            log.error(f"--receipt-key: {exc}")
            return 2
    woken = ""
    if args.cpu_latency_us is not None:
        from kvguard.daemon import cpu_latency

        try:
            cpu_latency.hold(args.cpu_latency_us)  # its descriptor stays open until the daemon exits
        except cpu_latency.CpuLatencyError as exc:
            log.error(f"--cpu-latency-us: {exc}")
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
        store = Store(args.store, key, head_file=args.audit_head)
        if key is not None and store.sealed_from is None:
            # An empty store is sealed from its first record. One with records is sealed only
            # on purpose: a seal gone missing (removed along with a rewrite) must not be
            # replaced by a new one that vouches only for what comes next.
            if store.count():
                raise StoreError(
                    f"audit store {store.shown} is not sealed but has records: seal it once with "
                    "`kvguard audit seal` (or, if it was sealed, its seal was removed: verify it)"
                )
            store.seal()
        store.write_key()  # a sealed store is written only with its key: say so now, not at the first batch
        if bus is not None and store.head_file is not None and not Path(store.head_file).exists():
            # A daemon new to a store the fleet's daemons share: its head starts from the end as
            # it stands (each daemon's head proves the end up to its own last commit).
            log.info(f"audit store {store.shown}: shared on the bus; this daemon's head starts at its end")
            try:
                store.adopt_head()
            except OSError as exc:
                raise StoreError(
                    f"audit head file {store.head_file} cannot be written: {exc.strerror}"
                ) from None
        # A store that lost records from its end (or its head) is not written to: the next
        # commit's head would cover the loss up.
        complete = store.completeness()
        if not complete.proven:
            raise StoreError(f"audit store {store.shown}: not proven complete: {complete.said}")
        if complete.through < store.count():  # a head that lags (a crash): caught up, as a commit would
            log.warning(f"audit store {store.shown}: {complete.said}")
            store.adopt_head()
    except (AuditKeyError, StoreError) as exc:
        log.error(str(exc))
        return 2
    except RowError as exc:  # a row edited outside kvguard: the rows after it cannot be trusted to read
        log.error(f"audit store {args.store}: {exc}; see `kvguard audit verify`")
        return 2
    # hashing and inserts run on another core, overlapping the ledger
    writer = StoreWriter(args.store, key=key, head_file=store.head_file)
    skew = int(args.clock_skew_ms * 1_000_000)
    try:
        daemon = Daemon(
            store,
            ruleset,
            mode=args.mode,
            writer=writer,
            clock_skew_ns=skew,
            # On the bus the daemon holds the cells it leases, rebuilt as it takes them.
            snapshot_every=0 if bus is not None else args.snapshot_every,
            rebuild=bus is None,
            store_reserve=args.store_reserve,
            receipt_key=receipt_key,
            name=args.bus_name or socket.gethostname(),
            limits=Limits(
                pages_per_pool=args.max_pages_per_pool,
                pools_per_node=args.max_pools_per_node,
                pages_per_node=args.max_pages_per_node,
                read_entries=args.max_read_entries,
            ),
        )
    except StoreError as exc:  # its writer could not open the store: serving would lose every batch
        writer.close()
        log.error(str(exc))
        return 2
    except RowError as exc:  # met while rebuilding the ledger from the store
        writer.close()
        log.error(f"audit store {args.store}: {exc}; see `kvguard audit verify`")
        return 2
    try:
        server = serve(daemon, args.listen, tls, insecure=args.insecure, crl=crl)
    except OSError as exc:  # the address is taken, or not this host's
        daemon.close()
        writer.close()
        store.close()
        log.error(str(exc))
        return 2
    port = server.port
    intake = None
    if bus is not None:
        from kvguard.daemon.bus import BusIntake

        intake = BusIntake(
            daemon,
            bus,
            args.bus_name or f"{socket.gethostname()}-{port}",
            lease_s=args.bus_lease,
            snapshot_every=args.snapshot_every,  # each cell's, in the bus's object store
        )
        try:
            intake.start()
        except Exception as exc:  # the bus down, refused, or misconfigured: said, not served without it
            server.stop(grace=0)
            daemon.close()
            writer.close()
            store.close()
            log.error(f"--bus {args.bus}: {type(exc).__name__} {exc}".rstrip())
            return 2
        log.info(f"on the bus {args.bus} as daemon {intake.name} of cluster {bus.cluster}")
    metrics = None
    if args.metrics_listen:
        from kvguard.daemon.metrics import DaemonCollector
        from kvguard.proto.metrics_http import MetricsError, serve_metrics

        try:
            own = DaemonCollector(lambda: daemon.fleet(own=True), daemon.latencies)  # its own nodes only
            metrics = serve_metrics(args.metrics_listen, own, tls)
        except MetricsError as exc:
            server.stop(grace=0)
            daemon.close()
            writer.close()
            store.close()
            log.error(str(exc))
            return 2
        log.info(f"metrics on {metrics.url}")
    log.info(
        f"listening on port {port}; store {store.shown}; ledger from the snapshot after "
        f"record {daemon.counters['snapshot_through']} and {daemon.counters['rebuilt_events']} events "
        "after it"
        f"{woken}"
    )
    signals.listen(signal.SIGINT, signal.SIGTERM)
    print(f"READY {port}", flush=True)
    notifier.ready(f"serving on port {port}")
    watchdog = None
    if notifier.watchdog_s is not None:  # WatchdogSec=: pinged only while the loop goes round
        daemon.start_heartbeat(min(1.0, notifier.watchdog_s / 4))
        watchdog = Watchdog(notifier, lambda: daemon.heartbeat_at, "the daemon's loop").start()
    reloader = Reloader(args, daemon, notifier, port, server, first_read)
    while True:
        taken = signals.wait(args.reload_interval or None)
        if taken & {signal.SIGINT, signal.SIGTERM}:
            break
        if signal.SIGHUP in taken:
            reloader.reload("SIGHUP")
        elif args.reload_interval and reloader.changed():
            reloader.reload("a file changed")
    notifier.stopping("stopping: committing what was received, then saving a ledger snapshot")
    if metrics is not None:
        metrics.stop()
    if intake is not None:  # its cells given back once what was taken of them is stored
        intake.close()
    server.stop(grace=2)
    daemon.close()  # what was received is applied and submitted before the writer finishes
    if watchdog is not None:
        watchdog.stop()
    writer.close()
    if intake is None:
        # The next start loads this and replays only what comes after it.
        through = daemon.save_snapshot()
        log.info(f"ledger snapshot saved after record {through}")
    store.close()
    notifier.close()
    signals.close()
    return 0


def load_crl(args: argparse.Namespace, tls: Tls | None) -> Crl | None:
    """The CRL --tls-crl names, checked against --tls-ca (None when none is named); a
    ValueError that names the file and the reason otherwise. A stale one is said, and used."""
    from kvguard.proto.crl import Crl

    if not args.tls_crl:
        return None
    if tls is None:
        raise ValueError(
            f"--tls-crl {args.tls_crl}: a CRL needs mutual TLS (--tls-ca, --tls-cert, --tls-key)"
        )
    crl = Crl.load(args.tls_crl, tls.ca)
    if crl.stale():
        log.warning(
            f"CRL {crl.path}: past its next update ({crl.next_update:%Y-%m-%d %H:%M} UTC); the "
            f"{len(crl.revoked)} certificate(s) it revokes stay revoked: `kvguard certs revoke` writes "
            "a new one"
        )
    return crl


def add_parser(sub: Subcommands) -> None:
    """Add `daemon` to the `kvguard` subcommands."""
    from kvguard.daemon.snapshots import SNAPSHOT_EVERY
    from kvguard.ledger.ledger import CLOCK_SKEW_NS
    from kvguard.ledger.limits import PAGE_BYTES, Limits

    p = add_command(
        sub,
        "daemon",
        "the global ledger, audit store and alert feed over gRPC",
        "Judge all nodes' events in one ledger, keep the audit log, alert, and in enforce mode order kills.",
        "kvguard daemon --listen 0.0.0.0:7463 --store /var/lib/kvguard/audit.db --audit-key audit.key "
        "--tls-ca ca.pem --tls-cert daemon.pem --tls-key daemon.key",
    )
    p.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:7463",
        help="gRPC address (host[:port], port 7463 if none); without mutual TLS only a loopback address, "
        "unless --insecure",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext gRPC on an address other hosts can reach: anyone who reaches it can read the "
        "audit log and speak as any node (for a network you trust; said once at start)",
    )
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    add_log_arguments(p)
    p.add_argument(
        "--reload-interval",
        type=seconds_or_off,
        default=2.0,
        metavar="S",
        help="how often the configuration files and the --rules directory are checked for changes, "
        "which reload them as SIGHUP does (0: only on SIGHUP)",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (counts, nodes, pools, latencies; "
        "no tenant or request is named; default: off)",
    )
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
        help="every this many events, save a ledger snapshot (built from the store by a worker process while "
        "the daemon goes on), so that a start after a crash replays only what came after it (0: only at a "
        "clean stop; default %(default)s); on the bus, every this many events of a cell, that cell's, kept "
        "in the bus's object store for the daemon that takes it next (0: never)",
    )
    p.add_argument(
        "--receipt-key",
        metavar="FILE",
        help="sign each request's integrity receipt with this Ed25519 key (PEM, owner-only; "
        "`kvguard certs init` makes receipt.key): see docs/receipts.md",
    )
    p.add_argument(
        "--audit-key",
        metavar="FILE",
        help="seal the audit chain with this key (HMAC-SHA256; `kvguard audit new-key`), kept outside the "
        "database, so that no one who can write the database but lacks the key can rewrite it unnoticed; "
        "a sealed store needs it",
    )
    p.add_argument(
        "--audit-head",
        metavar="FILE",
        help="where the audit chain's head (its record count and last hash, sealed with the audit key) is "
        "kept, outside the database, so that records deleted from its end are found (default: beside a "
        "SQLite store, its file name + .head; for PostgreSQL, kvguard-audit-DATABASE.head in "
        "$STATE_DIRECTORY, else the working directory)",
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
    limits = p.add_argument_group(
        "ledger limits (a pool report or read event above them is refused, counted as `limit`; a node's "
        f"pages cost the daemon about {PAGE_BYTES} bytes each)"
    )
    for flag, name, what in (
        ("--max-pages-per-pool", "pages_per_pool", "pages one pool may report"),
        ("--max-pools-per-node", "pools_per_node", "pools one node may report"),
        ("--max-pages-per-node", "pages_per_node", "pages all of one node's pools may hold together"),
        (
            "--max-read-entries",
            "read_entries",
            "requests one read event may list (the guard sends at most "
            f"{Limits().read_entries} an event: do not go below it)",
        ),
    ):
        default = getattr(Limits(), name)
        limits.add_argument(
            flag, type=positive_count, default=default, metavar="N", help=f"{what} (default %(default)s)"
        )
    bus = add_bus_arguments(p, cell=False)
    bus.add_argument("--bus-name", default="", help="this daemon's name on the bus (default: host-port)")
    bus.add_argument(
        "--bus-lease",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long a cell stays this daemon's after it last renewed its lease: a lost daemon's cells "
        "move after this",
    )
    add_tls_arguments(p).add_argument(
        "--tls-crl",
        metavar="PEM",
        help="the CA's certificate revocation list (`kvguard certs revoke`): a client certificate it names "
        "is refused every call, and its open streams are cut when a reload brings it in",
    )
    p.set_defaults(func=cmd_daemon)
