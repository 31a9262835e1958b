"""Page transitions per second through the ledger and through `kvguard replay`.

Workload: requests cycle through a pool in batches of B pages (16, 64, 256): alloc, write,
one attention read, free; that is 4 page transitions per page per request, all correct (no
finding), the path every event of a healthy engine takes: applied as protobuf objects
(`ledger`), as the bytes a guard writes or an agent sends (`bytes`: one event at a time, its
node known), as the daemon takes those bytes in batches of 64 (`runs`: the batch's heads read
once, then runs of clean events in one C call, Ledger.apply_clean) and from a capture file
(`replay`). Printed beside each figure: the
floor, a plain NumPy scatter of the same page arrays in the same Python loop, and the ratio,
measured in the same run (these machines are shared: compare ratios, not absolute times).

    python bench/ledger.py [--transitions N] [--pool-pages N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvguard.ledger import Ledger
from kvguard.proto import pb, wire
from kvguard.proto.capture import event_to_json
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.replay import replay


def workload(batch: int, transitions: int, pool_pages: int) -> list[pb.Event]:
    """Events of one node for about `transitions` page transitions at `batch` pages each."""
    events = [
        pb.Event(
            node="n0", seq=1, pool=pb.PoolReport(pool=0, role="colocated", page_size=16, num_pages=pool_pages)
        )
    ]
    rng = np.random.default_rng(0)
    requests = transitions // (4 * batch)
    for i in range(requests):
        req = f"r{i}"
        pages = rng.choice(pool_pages, batch, replace=False).tolist()
        events += [
            pb.Event(node="n0", alloc=pb.Alloc(req=req, pool=0, pages=pages)),
            pb.Event(node="n0", write=pb.Write(req=req, pool=0, pages=pages)),
            pb.Event(
                node="n0", read=pb.Read(reads=[pb.ReadEntry(req=req, pool=0, pages=pages, tokens=16 * batch)])
            ),
            pb.Event(node="n0", free=pb.Free(req=req, pool=0, pages=pages)),
        ]
    for seq, event in enumerate(events, 1):
        event.seq, event.ts_ns = seq, seq * 1000
    return events


def page_list(event: pb.Event) -> list[int]:
    kind = event.WhichOneof("payload")
    if kind == "read":
        return list(event.read.reads[0].pages)
    return list(getattr(event, kind).pages) if kind != "pool" else []


def time_ledger(events: list[pb.Event] | list[bytes]) -> tuple[float, int]:
    """The events applied as objects (the guard's path) or, given as bytes, as an agent
    sends them (the daemon's path)."""
    ledger = Ledger()
    if isinstance(events[0], bytes):  # as a guard or the daemon applies one event's bytes: its node known

        def apply(body: Any) -> object:
            return ledger.apply_serialized(body, "n0")
    else:
        apply = ledger.apply
    started = time.perf_counter()
    for event in events:
        if apply(event):
            raise SystemExit("benchmark workload produced a finding: the ledger is wrong")
    return time.perf_counter() - started, ledger.stats.page_transitions


def time_runs(bodies: list[bytes], batch_events: int = 64) -> tuple[float, int]:
    """The bytes applied as the daemon applies a batch: runs of clean events in one C call
    each (`Ledger.apply_clean`), apply_serialized where a run stops (here: the pool report)."""
    ledger = Ledger()
    frames = [wire.frame(bodies[at : at + batch_events]) for at in range(0, len(bodies), batch_events)]
    started = time.perf_counter()
    for frame in frames:  # as the daemon takes a batch: its heads read once on receipt, then applied
        batch = wire.decode_batch(frame)
        i = 0
        while i < len(batch):
            i = ledger.apply_clean(batch, i, len(batch), "n0")
            if i < len(batch):
                if ledger.apply_serialized(batch.event(i), "n0"):
                    raise SystemExit("benchmark workload produced a finding: the ledger is wrong")
                i += 1
    return time.perf_counter() - started, ledger.stats.page_transitions


def time_floor(arrays: list[np.ndarray], pool_pages: int) -> float:
    owner = np.zeros(pool_pages, np.int32)
    started = time.perf_counter()
    for i, pages in enumerate(arrays):
        owner[pages] = i
    return time.perf_counter() - started


def time_replay(path: str) -> tuple[float, int]:
    ruleset = load_ruleset()
    found: list[object] = []
    with open(path, "rb") as f:
        started = time.perf_counter()
        summary = replay(f, ruleset, found.append, found.append)
        elapsed = time.perf_counter() - started
    if found or summary.applied != summary.lines:
        raise SystemExit("replay of the benchmark capture reported findings or errors")
    return elapsed, summary.page_transitions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transitions", type=int, default=4_000_000, help="page transitions per batch size")
    parser.add_argument("--pool-pages", type=int, default=1 << 17)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs")
    args = parser.parse_args()
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, best of {args.repeat} runs, "
        f"{args.transitions} page transitions per batch size"
    )
    print(f"{'batch':>5} {'path':8} {'Mtrans/s':>9} {'floor Mtrans/s':>15} {'ratio':>7} {'us/event':>9}")
    for batch in (16, 64, 256):
        events = workload(batch, args.transitions, args.pool_pages)
        arrays = [np.array(page_list(e), dtype=np.intp) for e in events]
        floor = min(time_floor(arrays, args.pool_pages) for _ in range(args.repeat))
        runs = [time_ledger(events) for _ in range(args.repeat)]
        elapsed, transitions = min(runs)
        rate, floor_rate = transitions / elapsed / 1e6, transitions / floor / 1e6
        print(
            f"{batch:>5} {'ledger':8} {rate:>9.2f} {floor_rate:>15.2f} {elapsed / floor:>6.1f}x "
            f"{elapsed / len(events) * 1e6:>9.2f}"
        )
        bodies = [e.SerializeToString() for e in events]
        elapsed, transitions = min(time_ledger(bodies) for _ in range(args.repeat))
        rate = transitions / elapsed / 1e6
        print(
            f"{batch:>5} {'bytes':8} {rate:>9.2f} {floor_rate:>15.2f} {elapsed / floor:>6.1f}x "
            f"{elapsed / len(events) * 1e6:>9.2f}"
        )
        elapsed, transitions = min(time_runs(bodies) for _ in range(args.repeat))
        rate = transitions / elapsed / 1e6
        print(
            f"{batch:>5} {'runs':8} {rate:>9.2f} {floor_rate:>15.2f} {elapsed / floor:>6.1f}x "
            f"{elapsed / len(events) * 1e6:>9.2f}"
        )
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            for event in events:
                f.write(event_to_json(event) + "\n")
            path = f.name
        try:
            size = os.path.getsize(path)
            elapsed, transitions = min(time_replay(path) for _ in range(args.repeat))
            rate = transitions / elapsed / 1e6
            print(
                f"{batch:>5} {'replay':8} {rate:>9.2f} {floor_rate:>15.2f} {elapsed / floor:>6.1f}x "
                f"{elapsed / len(events) * 1e6:>9.2f}  ({len(events)} events, {size / 1e6:.0f} MB capture)"
            )
        finally:
            os.unlink(path)


if __name__ == "__main__":
    main()
