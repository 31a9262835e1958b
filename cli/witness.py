"""`kvguard witness -p PID`: the KV transfers a process sends, as the kernel sees them (eBPF),
printed as wire events in JSON Lines: a capture that `kvguard replay` takes.
"""

from __future__ import annotations

import argparse
import sys

from kvguard.cli.options import Subcommands, add_command

# The witness's modules (eBPF, protobuf) are imported when the command runs, so that
# `kvguard --help` does not wait for them.


def cmd_witness(args: argparse.Namespace) -> int:
    """Wire events as JSON Lines on stdout (a capture: `kvguard replay` takes it).

    Exit 0 when stopped, 1 when the witness cannot run here (it says why)."""
    import signal
    import threading
    import time

    from kvguard.cuda_hooks.tcp_stream import WireReport
    from kvguard.cuda_hooks.witness import open_witness, wire_event
    from kvguard.proto import pb
    from kvguard.proto.capture import event_to_json
    from kvguard.proto.signals import Signals

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
    signals = Signals(signal.SIGINT, signal.SIGTERM)
    print(f"kvguard witness: watching {', '.join(map(str, args.pid))}", file=sys.stderr, flush=True)
    signals.wait(args.seconds or None)  # either signal, or the time is up
    signals.close()
    witness.close()
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `witness` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "witness",
        "print the KV transfers a process sends, as the kernel sees them (eBPF)",
        "Print the KV transfers of the given processes as the kernel sees them, as a capture (root).",
        "kvguard witness -p 4242 --node p0 --seconds 60",
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
