"""`kvguard fleet`: the daemon's state as an operator reads it at a terminal: its nodes (their
agent's stream, their guard as the agent last said, how long ago it said so, their events a
second and lag), the findings so far, the input it refused, on the bus which daemon holds which
cell, its own latency, and the audit store's room (a table), or the FleetState message as JSON
(proto/message_json.py: zero and false fields included, 64-bit integers as numbers).

Invariant: it only reads (FleetService.State); an unreachable daemon is an error that names
the address and exits 2, never an empty table; a node's guard is what its agent said last
(connected, gone, none), with the age of that word by the daemon's clock, never inferred from
the agent's stream being open.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from kvguard.cli.options import (
    Subcommands,
    add_command,
    add_daemon_argument,
    add_output_argument,
    add_tls_arguments,
    tls_from_args,
)

if TYPE_CHECKING:  # grpc and protobuf load when the command runs, not for every kvguard command
    from kvguard.proto.kvguard.v1 import services_pb2 as svc


# The ledger's counters of its normal work (daemon/daemon.py adds `ledger_` to LedgerStats'
# names). Every other `ledger_` counter is input it could not see or judge: listed under
# "refused or unjudged", so that one added later is shown there until it is placed here.
LEDGER_WORK = frozenset(
    {"ledger_page_transitions", "ledger_suppressed", "ledger_retired", "ledger_forgotten", "ledger_restarts"}
)


def age(ns: int) -> str:
    """A duration for people: 0.4s, 12s, 5m, 3h, 2d."""
    s = max(ns, 0) / 1e9
    if s < 10:
        return f"{s:.1f}s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size:.0f}{unit}"
    return f"{s:.0f}s"


def _node_row(node: svc.NodeState, now_ns: int) -> tuple[str, ...]:
    pools = ", ".join(
        f"{p.report.pool}:{p.report.role} {p.pages_in_use}/{p.report.num_pages}" for p in node.pools
    )
    if node.HasField("status"):
        status = node.status
        guard, heard = status.guard, age(now_ns - node.status_ns)
        if status.canary_late:
            canary = f"LATE {age(now_ns - status.canary_waiting_since_ns)}"
        elif status.canary_ok_ns:
            canary = f"ok {status.canary_rtt_us / 1000:.0f}ms"
        else:
            canary = "-"  # the agent sends none (--canary-interval 0), or none came back yet
    else:
        guard = heard = canary = "-"
    agent = "yes" if node.connected else "no"
    rate = f"{node.events_per_s:.1f}" if node.received_ns else "-"
    lag = f"{node.lag_ms:.0f}" if node.received_ns else "-"
    return (node.node, str(node.last_seq), agent, guard, canary, heard, rate, lag, str(node.dropped), pools)


def render(state: svc.FleetState, out: TextIO) -> None:
    from kvguard.daemon.room import size

    room = state.store
    free = f"{size(room.free_bytes)} free" if room.free_known else "free space not visible from the daemon"
    full = f", the reserve in {room.full_in_s / 3600:.1f} h" if room.full_in_s else ""
    out.write(
        f"store: {size(room.used_bytes)}, {free}, growing {size(room.growth_bytes_per_s)}/s{full}; "
        f"reserve {size(room.reserve_bytes) if room.reserve_bytes else 'none'}\n"
    )
    if room.refusing:
        out.write(f"REFUSING EVENTS: {room.refusing}\n")
    mode = f"; mode {state.mode}" if state.mode else ""
    out.write(f"{state.events} events, {state.requests} requests known{mode}\n\n")
    rows = [
        (
            "NODE",
            "LAST SEQ",
            "AGENT",
            "GUARD",
            "CANARY",
            "HEARD AGO",
            "EV/S",
            "LAG MS",
            "DROPPED",
            "POOLS (pages in use / pages)",
        )
    ]
    rows += [_node_row(node, state.now_ns) for node in state.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] + "\n")
    if state.findings:
        out.write("\nfindings: " + ", ".join(f"{k} {n}" for k, n in sorted(state.findings.items())) + "\n")
    work = {k: n for k, n in state.counters.items() if n and k in LEDGER_WORK}
    if work:
        out.write("ledger: " + ", ".join(f"{k.removeprefix('ledger_')} {n}" for k, n in sorted(work.items())))
        out.write("\n")
    refused = {
        k: n
        for k, n in state.counters.items()
        if n and k not in LEDGER_WORK and k.startswith(("stream_", "rejected", "ledger_"))
    }
    if refused:
        out.write("refused or unjudged: " + ", ".join(f"{k} {n}" for k, n in sorted(refused.items())) + "\n")
    if state.daemon:  # on the bus: which daemon holds which cell
        held = sum(1 for c in state.cells if c.daemon == state.daemon)
        out.write(f"\non the bus as {state.daemon}: {held} of {len(state.cells)} cells held here\n")
        rows = [("CELL", "DAEMON", "NODES")]
        rows += [(c.cell, c.daemon or "(between daemons)", ", ".join(c.sources)) for c in state.cells]
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        for r in rows:
            out.write(f"{r[0].ljust(width[0])}  {r[1].ljust(width[1])}  {r[2]}\n")
    if state.latencies:
        out.write("\nSTAGE     COUNT      p50 ms    p99 ms    max ms\n")
        for s in state.latencies:
            out.write(f"{s.stage:<9} {s.count:<9} {s.p50_ms:>7.2f}  {s.p99_ms:>8.2f}  {s.max_ms:>8.2f}\n")


def cmd_fleet(args: argparse.Namespace) -> int:
    import grpc
    import orjson

    from kvguard.proto.channel import channel
    from kvguard.proto.kvguard.v1 import services_pb2 as svc
    from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
    from kvguard.proto.message_json import message_json_dict

    try:
        with channel(args.daemon, tls_from_args(args)) as ch:
            state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=args.timeout)
    except grpc.RpcError as exc:
        from kvguard.proto.client import WORDS

        words = WORDS.get(exc.code().name, exc.code().name)
        print(f"kvguard fleet: daemon {args.daemon}: {words}: {exc.details()}", file=sys.stderr)
        return 2
    if args.output == "json":
        sys.stdout.write(orjson.dumps(message_json_dict(state)).decode() + "\n")
    else:
        render(state, sys.stdout)
    return 1 if state.store.refusing else 0


def add_parser(sub: Subcommands) -> None:
    """Add `fleet` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "fleet",
        "the daemon's nodes, findings, refused input, latency and store room (exit 1: refusing)",
        "Show the daemon's state: its nodes, findings, refused input, latency and the store's room.",
        "kvguard fleet --daemon 10.0.0.5:7463 -o json",
    )
    add_daemon_argument(p)
    add_output_argument(
        p, help="output format (json: the FleetState message, zero and false fields included)"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")
    add_tls_arguments(p)
    p.set_defaults(func=cmd_fleet)
