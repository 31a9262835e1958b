"""The audit store writer's CPU per event: runs (a batch's consecutive events as one record)
beside one record per event, side by side in one process on the same groups.

The groups are what the daemon submits at 2 M page transitions/s in 64-page events: one
EventBatch of --batch-events events as received (the ingest benchmark's workload: request
lifecycles of alloc / write / read / free, a planted stale read now and then), committed one
group a transaction, on a fresh SQLite store each (WAL, synchronous=FULL, as the daemon
writes it). Each layout's time is split into building the rows (parsing the batch, index
columns; for runs also the request index) and appending them (hash chain, insert, commit).
CPU time of this thread (time.thread_time), so the numbers are the writer's cost, not the
machine's load; the layouts alternate group by group so drift hits both alike.

    python bench/writer.py [--groups N] [--batch-events N] [--req-pages R]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest  # the ingest benchmark's workload

from kvguard.daemon.store import EventRun, Record, Store, rows_of
from kvguard.proto import wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3000, help="groups committed per layout")
    parser.add_argument("--batch-events", type=int, default=64, help="events per batch (one batch a group)")
    parser.add_argument("--req-pages", type=int, default=64, help="pages per request")
    parser.add_argument(
        "--req-names", choices=("random", "sequential"), default="random", help="as bench/ingest.py's"
    )
    args = parser.parse_args()
    agents = 16
    per_agent = args.groups * args.batch_events // agents + args.batch_events
    named_at_random = args.req_names == "random"
    workloads = [
        ingest.build_agent(
            f"n{k}", per_agent, args.batch_events, args.req_pages, 1 << 16, 4, k, None, named_at_random
        )
        for k in range(agents)
    ]
    groups: list[bytes] = []
    for batches in zip(*[w.bodies for w in workloads], strict=False):
        for bodies in batches:  # interleaved nodes, as the daemon receives them
            groups.append(wire.frame(bodies))
    groups = groups[: args.groups]

    def one_a_record(message: bytes) -> list[Record]:
        return [Record.of_event(e) for e in svc.AgentMessage.FromString(message).batch.events]

    def runs(message: bytes) -> list[Record]:
        batch = wire.decode_batch(message)  # as the daemon reads it on receipt
        return rows_of([batch], [EventRun(0, 0, len(batch))])

    layouts = {"one record an event": one_a_record, "runs": runs}
    cpu = {name: [0.0, 0.0] for name in layouts}  # building rows, appending them
    rows_written = dict.fromkeys(layouts, 0)
    events = 0
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-writer-") as tmp:
        stores = {name: Store(str(Path(tmp) / f"{i}.db")) for i, name in enumerate(layouts)}
        try:
            for message in groups:
                for name, build in layouts.items():
                    t0 = time.thread_time()
                    rows = build(message)
                    t1 = time.thread_time()
                    stores[name].append(rows)
                    t2 = time.thread_time()
                    cpu[name][0] += t1 - t0
                    cpu[name][1] += t2 - t1
                    rows_written[name] += len(rows)
                events += sum(r.ids for r in rows)
            for store in stores.values():
                assert store.count("event") == events and store.verify() == (True, events, "")
            sizes = {name: (Path(tmp) / f"{i}.db").stat().st_size for i, name in enumerate(layouts)}
        finally:
            for store in stores.values():
                store.close()
    print(
        f"{len(groups)} groups of {args.batch_events} events ({args.req_pages}-page requests, named "
        f"{'at random' if args.req_names == 'random' else 'in turn'}), "
        f"{events} events per layout; CPU µs per event"
    )
    print(f"{'layout':>20} {'rows':>8} {'build':>7} {'append':>7} {'total':>7} {'store MB':>9}")
    totals = {}
    for name in layouts:
        build, append = (1e6 * t / events for t in cpu[name])
        totals[name] = build + append
        print(
            f"{name:>20} {rows_written[name]:>8} {build:>7.2f} {append:>7.2f} {build + append:>7.2f} "
            f"{sizes[name] / 1e6:>9.1f}"
        )
    ratio = totals["one record an event"] / totals["runs"]
    print(f"runs: {ratio:.2f}x less writer CPU per event")
    print(f"command: python bench/writer.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
