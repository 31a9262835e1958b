"""A restart's rebuild of the ledger from the audit store: the stored events applied as bytes
(`Store.event_batches` + `Ledger.replay`: clean runs in C, the rest one at a time, as the
daemon applies them live) beside parsed one at a time (`Store.events` + `Ledger.apply`, the
daemon's rebuild before), side by side in one process on one store, and the state each
leaves checked equal to the byte.

The store holds what the daemon writes at the ingest benchmark's load: its workload (16
nodes, 64-page request lifecycles, a planted stale read now and then) in 64-event batches,
one group a commit (SQLite, WAL). A restart replays what came after the newest snapshot: up
to --snapshot-every events (4,194,304 by default), so the rate here is the restart's time.

    python bench/rebuild.py [--groups N] [--repeat N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest  # the ingest benchmark's workload

from kvguard.daemon.snapshots import SNAPSHOT_EVERY
from kvguard.daemon.store import EventRun, Store, rows_of
from kvguard.ledger import snapshot
from kvguard.ledger.ledger import Ledger
from kvguard.proto import wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3000, help="64-event batches stored")
    parser.add_argument("--repeat", type=int, default=3, help="rebuilds each way, alternating")
    args = parser.parse_args()
    agents = 16
    per_agent = args.groups * 64 // agents + 64
    workloads = [ingest.build_agent(f"n{k}", per_agent, 64, 64, 1 << 16, 4, k) for k in range(agents)]
    batches = [(w.node, [w.setup]) for w in workloads]
    for rounds in zip(*[w.bodies for w in workloads], strict=False):
        batches += [(w.node, bodies) for w, bodies in zip(workloads, rounds, strict=False)]
    batches = batches[: args.groups + agents]
    times: dict[str, list[float]] = {"parsed": [], "bytes": []}
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-rebuild-") as tmp:
        store = Store(str(Path(tmp) / "audit.db"))
        try:
            live = Ledger()
            for node, bodies in batches:
                batch = wire.batch_of(bodies)
                live.replay(batch, node)  # the state the daemon had when it stopped
                store.append(rows_of([batch], [EventRun(0, 0, len(bodies))]))
            events = store.count("event")
            want = snapshot.dump(live)
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                parsed = Ledger()
                for event in store.events():
                    parsed.apply(event)
                t1 = time.perf_counter()
                raw = Ledger()
                for node, batch, skip in store.event_batches():
                    raw.replay(batch, node, skip)
                t2 = time.perf_counter()
                times["parsed"].append(t1 - t0)
                times["bytes"].append(t2 - t1)
                if not snapshot.dump(parsed) == snapshot.dump(raw) == want:
                    raise SystemExit("the rebuilt ledgers differ from the one that wrote the store")
        finally:
            store.close()
    best = {way: min(ts) for way, ts in times.items()}
    print(f"{events} stored events (64-page requests), best of {args.repeat}; the same state each way")
    print(f"{'rebuild':>32} {'s':>7} {'µs/event':>9} {'events/s':>10} {'4 M events':>11}")
    names = {"parsed": "events() + apply, one at a time", "bytes": "event_batches() + replay"}
    for way, seconds in best.items():
        per = seconds / events
        whole = per * SNAPSHOT_EVERY
        print(f"{names[way]:>32} {seconds:>7.2f} {per * 1e6:>9.2f} {1 / per:>10,.0f} {whole:>10.1f}s")
    print(f"bytes: {best['parsed'] / best['bytes']:.2f}x faster")
    print(f"command: python bench/rebuild.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
