"""The audit store writer's CPU per `step` record (a decode batch's forward pass, one event
naming up to --batch requests): build the rows (C split) and append them (hash chain, the
`named` index, insert, commit), one node's steps --per-group to a transaction, on a fresh
SQLite store (WAL, synchronous=FULL, as the daemon writes it). CPU time of this thread.
Run it from two trees (before and after a change to the rows) to compare them:

    PYTHONPATH=TREE_PARENT python bench/writer_steps.py [--steps N] [--batch N] [--per-group N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvguard.daemon.store import EventRun, Store, rows_of
from kvguard.proto import wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000, help="step events in all")
    parser.add_argument("--batch", type=int, default=256, help="requests a step")
    parser.add_argument("--per-group", type=int, default=16, help="steps a group (one transaction)")
    parser.add_argument("--lone", action="store_true", help="each step a record of its own")
    args = parser.parse_args()
    reqs = [f"n0-req-{i:08d}" for i in range(args.batch)]
    pages = np.arange(args.batch, dtype=np.int64)
    slots = np.full(args.batch, 7, dtype=np.int64)
    counts = np.ones(args.batch, dtype=np.int64)
    groups = []
    for g in range(args.steps // args.per_group):
        bodies = [
            wire.encode_step(
                "n0", 1 + g * args.per_group + i, 10**15 + 1000 * i, 0, 0, reqs, counts, pages, slots
            )
            for i in range(args.per_group)
        ]
        groups.append(wire.batch_of(bodies))
    build = append = 0.0
    index_rows = records = 0
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-steps-") as tmp:
        store = Store(str(Path(tmp) / "audit.db"))
        try:
            for batch in groups:
                n = len(batch)
                parts = [EventRun(0, i, i + 1) for i in range(n)] if args.lone else [EventRun(0, 0, n)]
                t0 = time.thread_time()
                rows = rows_of([batch], parts)
                t1 = time.thread_time()
                store.append(rows)
                t2 = time.thread_time()
                build += t1 - t0
                append += t2 - t1
                index_rows += sum(len(r.named) for r in rows)
                records += len(rows)
        finally:
            store.close()
    steps = len(groups) * args.per_group
    print(
        f"{steps} steps of {args.batch} in {records} records: "
        f"{1e6 * (build + append) / steps:.1f} µs a step (rows {1e6 * build / steps:.1f}, "
        f"append {1e6 * append / steps:.1f}); {index_rows / steps:.1f} index rows a step"
    )


if __name__ == "__main__":
    main()
