"""The periodic ledger snapshot, built by a process of its own from the store: the store's
latest snapshot loaded, the events stored after it applied up to the record the store ends at
when it looks, and the ledger dumped; the daemon stores it (daemon/snapshots.py). On the bus,
a cell's (`--nodes`): its previous snapshot given on stdin, the events of its nodes after it
(of a node it does not hold, all of them), kept in the bus's object store (cell_snapshots.py). It is
started by exec (`python -m kvguard.daemon.snapshot_worker`), never by a fork of the daemon,
whose gRPC threads make a forked copy undefined behaviour; it shares nothing with the daemon
but the store, read only, so the daemon's loop never waits for it.

Invariants: the snapshot is the ledger a restart would rebuild after that record (the same
code: `restored` and `Ledger.replay`), so loading it and applying what follows goes on exactly
as the daemon did; it is taken at a record where a committed group ends (the store's end as
read, one transaction). Its output on stdout is `KVGSNAP <through> <bytes>\\n` and the body;
anything else (a failure) is exit status 1 and one line on stderr. It dies with the daemon
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import signal
import sys
from typing import Any

MAGIC = b"KVGSNAP"


def build(
    store_url: str, keys: list[bytes], head_file: str | None, settings: dict[str, Any]
) -> tuple[int, bytes]:
    """(the record it is taken after, the snapshot's bytes: empty when the store holds nothing
    after its latest snapshot), for a ledger constructed with `settings` (the daemon's)."""
    from kvguard.daemon.snapshots import restored
    from kvguard.daemon.store import Store
    from kvguard.ledger import Ledger, snapshot
    from kvguard.ledger.limits import UNBOUNDED

    store = Store(store_url, *keys, head_file=head_file)
    try:
        until = store.last_id()  # where this snapshot ends: a committed group's end
        ledger, through = restored(store, Ledger(**settings, limits=UNBOUNDED))
        if through >= until:
            return through, b""  # nothing new since the latest snapshot
        ledger.limits = UNBOUNDED  # what was applied once is applied again, whatever the limits
        for node, batch, skip in store.event_batches(after=through, until=until):
            for _ in ledger.replay(batch, node, skip):
                pass  # refused now as at the daemon's start: said there (a store edited by hand)
        return until, snapshot.dump(ledger)
    finally:
        store.close()


def build_cell(
    store_url: str,
    keys: list[bytes],
    head_file: str | None,
    settings: dict[str, Any],
    nodes: list[str],
    previous: bytes,
    after: int,
    held: list[str],
) -> tuple[int, bytes]:
    """(the record it is taken after, the snapshot's bytes: empty when nothing of its nodes
    was stored after the previous one) of a cell with `nodes`, from its `previous` snapshot
    (taken after record `after`, holding nodes `held`; empty: none)."""
    from kvguard.daemon.store import Store
    from kvguard.ledger import Ledger, snapshot
    from kvguard.ledger.limits import UNBOUNDED

    store = Store(store_url, *keys, head_file=head_file)
    try:
        until = store.last_id()
        if previous and not store.snapshot_covers(held, after, nodes):
            previous, after, held = b"", 0, []  # a node it lacks stored events before it: whole again
        ledger = snapshot.load(previous) if previous else Ledger(**settings)
        if snapshot.settings(ledger) != settings:
            raise snapshot.SnapshotError("the previous one was taken with other ledger settings")
        ledger.limits = UNBOUNDED
        stored = store.event_batches(
            after=after if previous else 0, until=until, nodes=set(nodes) | set(held)
        )
        applied = 0
        for node, batch, skip in stored:
            applied += len(batch) - skip
            for _ in ledger.replay(batch, node, skip):
                pass  # said by the daemon that rebuilt the cell from the store
        if previous and not applied:
            return after, b""
        return until, snapshot.dump(ledger)
    finally:
        store.close()


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the daemon still kills it at its stop
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvguard-snapshot-worker")
    parser.add_argument("--store", required=True)
    parser.add_argument("--head-file")
    parser.add_argument("--settings", required=True, help="the daemon's ledger settings (JSON)")
    parser.add_argument("--nodes", help="a cell's nodes (JSON list): its snapshot, the previous on stdin")
    parser.add_argument("--after", type=int, default=0, help="the record the previous one was taken after")
    parser.add_argument("--held", default="[]", help="the nodes the previous one holds (JSON list)")
    args = parser.parse_args(argv)
    _die_with_parent()
    # The audit keys, never in argv, on the first line; a cell's previous snapshot after it.
    first, _, previous = sys.stdin.buffer.read().partition(b"\n")
    keys = [bytes.fromhex(key) for key in first.decode().split()]
    try:
        settings = json.loads(args.settings)
        if args.nodes is not None:
            nodes, held = json.loads(args.nodes), json.loads(args.held)
            through, body = build_cell(
                args.store, keys, args.head_file, settings, nodes, previous, args.after, held
            )
        else:
            through, body = build(args.store, keys, args.head_file, settings)
    except Exception as exc:  # said by the daemon, which counts the failure and goes on
        print(f"{type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    out = sys.stdout.buffer
    out.write(MAGIC + f" {through} {len(body)}\n".encode())
    out.write(body)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
