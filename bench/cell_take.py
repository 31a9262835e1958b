"""What a cell's snapshot saves the daemon that takes it over (issue 43): the time to rebuild
one cell with a long history from the shared PostgreSQL store alone, against from its
snapshot (taken after most of that history) and the events stored after it, side by side in
one run, as a ratio. Also the snapshot worker's own time to build that snapshot from the
store (paid by the daemon that held the cell, off its loop).

A cell of one prefill and three decode nodes (testbed/fleet.py) is judged by an in-process
daemon into a fresh database ($KVGUARD_TEST_PG); its snapshot is built after `--snapshot-at`
of its batches; the rest follow. Then Daemon.adopt (what a daemon on the bus runs as it
takes the cell) is timed both ways, alternately, `--runs` times each; the two ledgers are
checked to be the same, byte for byte.

    python bench/cell_take.py --ticks 400 --arrivals 4 --length 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bus import database, drop  # noqa: E402

from kvguard.daemon.daemon import CellStart, Daemon  # noqa: E402
from kvguard.daemon.ingest import Batch  # noqa: E402
from kvguard.daemon.snapshot_worker import build_cell  # noqa: E402
from kvguard.daemon.store import Store  # noqa: E402
from kvguard.ledger import snapshot  # noqa: E402
from kvguard.proto import wire  # noqa: E402
from kvguard.proto.kvguard.v1 import services_pb2 as svc  # noqa: E402
from kvguard.testbed.fleet import fleet  # noqa: E402


def judge(store: Store, batches: list) -> None:
    """The batches through a daemon into the store, all of them durable on return."""
    daemon = Daemon(store, snapshot_every=0)
    acked = [0]
    try:
        for node, events in batches:
            data = svc.AgentMessage(batch=svc.EventBatch(events=events)).SerializeToString()
            batch = Batch(node, wire.decode_batch(data), lambda _: acked.__setitem__(0, acked[0] + 1))
            daemon.loop.call_soon_threadsafe(daemon.ingest, batch)
        while acked[0] < len(batches):
            time.sleep(0.01)
    finally:
        daemon.close()


def adopt(daemon: Daemon, nodes: list[str], kept: tuple[int, bytes] | None) -> tuple[float, bytes]:
    """Take the cell from the store alone (`kept` None) or from its snapshot (through, bytes),
    loaded as the daemon loads it: (seconds, the ledger's bytes)."""
    began = time.perf_counter()
    start = CellStart(snapshot.load(kept[1]), kept[0], frozenset(nodes)) if kept else None
    ledger = asyncio.run_coroutine_threadsafe(daemon.adopt("cell000", nodes, start), daemon.loop).result()
    took = time.perf_counter() - began
    return took, snapshot.dump(ledger)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ticks", type=int, default=400)
    p.add_argument("--arrivals", type=int, default=4)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--snapshot-at", type=float, default=0.9, help="share of the batches before the snapshot")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    f = fleet(1, ticks=args.ticks, arrivals=args.arrivals, length=args.length)
    nodes = f.cells["cell000"]
    cut = int(len(f.batches) * args.snapshot_at)
    url = database()
    store = Store(url)
    try:
        judge(store, f.batches[:cut])
        settings = snapshot.settings(Daemon(store, snapshot_every=0, rebuild=False).fresh())
        began = time.perf_counter()
        through, body = build_cell(url, [], None, settings, nodes, b"", 0, [])
        built = time.perf_counter() - began
        judge(store, f.batches[cut:])
        daemon = Daemon(store, snapshot_every=0, rebuild=False)
        whole, snapped = [], []
        try:
            for _ in range(args.runs):
                took, everything = adopt(daemon, nodes, None)
                whole.append(took)
                took, tail = adopt(daemon, nodes, (through, body))
                snapped.append(took)
                assert tail == everything, "the ledger from the snapshot differs from the whole history's"
        finally:
            daemon.close()
        events = sum(len(e) for _, e in f.batches)
        a, b = statistics.median(whole), statistics.median(snapped)
        print(f"a cell of {len(nodes)} nodes, {events} events stored; ", end="")
        print(f"snapshot after {cut} of {len(f.batches)} batches")
        print(f"snapshot built by the worker from the store: {built:.2f} s ({len(body) / 1e6:.1f} MB)")
        print(f"take from the store alone:        {a:.3f} s (median of {args.runs})")
        print(f"take from the snapshot and after: {b:.3f} s (its load included, its fetch from the bus not)")
        print(f"ratio: {a / b:.1f}x faster from the snapshot")
    finally:
        store.close()
        drop(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
