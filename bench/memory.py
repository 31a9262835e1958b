"""The ledger's memory over a long run, with retirement (the default) beside without it, and
what a snapshot of each costs (the daemon saves one when it stops and loads it at start).

Workload: one node, a 131,072-page pool; each request is admitted, granted 64 pages, writes
them, reads them once, frees them and finishes (6 events), and requests follow each other
through the pool: the shape of a daemon's day, compressed. Each variant runs in its own
process (its peak RSS is its own) over the same events; printed: requests the ledger still
knows, index slots, peak RSS (before the snapshot), time per event, the snapshot's size and
the time to dump and to load it, and the ratios of the two variants. (Under load the daemon's
periodic snapshot is built by a worker process from the store: its loop does not stall.)

    python bench/memory.py [--requests N]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time

from kvguard.ledger import snapshot
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb

PAGES, POOL = 64, 131072


def run(requests: int, retire: bool) -> dict[str, float]:
    ledger = Ledger() if retire else Ledger(retire_idle=0)
    gc.freeze()  # as the daemon does once a second: the long-lived set is not rescanned
    pool = pb.PoolReport(pool=0, role="colocated", page_size=16, num_pages=POOL)
    ledger.apply(pb.Event(node="n", seq=1, ts_ns=1, pool=pool))
    seq = 1
    start = time.perf_counter()
    for i in range(requests):
        req = f"cmpl-{i:032x}"
        first = (i * PAGES) % POOL
        pages = list(range(first, first + PAGES))
        payloads = (
            {"admit": pb.Admit(req=req, tenant=f"t{i % 7}", prompt_tokens=PAGES * 16, stage="prefill")},
            {"alloc": pb.Alloc(req=req, pool=0, pages=pages)},
            {"write": pb.Write(req=req, pool=0, pages=pages)},
            {"read": pb.Read(reads=[pb.ReadEntry(req=req, pool=0, pages=pages, tokens=PAGES * 16)])},
            {"free": pb.Free(req=req, pool=0, pages=pages)},
            {"finish": pb.Finish(req=req, output_tokens=5)},
        )
        for payload in payloads:
            seq += 1
            ledger.apply(pb.Event(node="n", seq=seq, ts_ns=seq, **payload))
        if i % 20000 == 0:
            gc.freeze()
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    begin = time.perf_counter()
    saved = snapshot.dump(ledger)
    dumped = time.perf_counter()
    snapshot.load(saved)
    loaded = time.perf_counter()
    return {
        "snapshot_mb": len(saved) / 1e6,
        "dump_s": dumped - begin,
        "load_s": loaded - dumped,
        "events": seq,
        "known": ledger.known_requests,
        "slots": len(ledger.requests),
        "forgotten": ledger.stats.forgotten,
        "rss_mb": rss,
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests per variant (6 events each)")
    ap.add_argument("--variant", choices=("retire", "keep"), help=argparse.SUPPRESS)  # one child's run
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run(args.requests, args.variant == "retire")))
        return
    results = {}
    for variant in ("retire", "keep"):
        out = subprocess.run(
            [sys.executable, __file__, "--requests", str(args.requests), "--variant", variant],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results[variant] = json.loads(out)
    r, k = results["retire"], results["keep"]
    print(f"python {sys.version.split()[0]}; {args.requests} requests of {PAGES} pages, {r['events']} events")
    head = f"{'variant':8} {'known':>9} {'slots':>9} {'forgotten':>10} {'peak RSS MB':>12} {'us/event':>9}"
    print(f"{head} {'snapshot MB':>12} {'dump s':>7} {'load s':>7}")
    for name, x in results.items():
        us = x["seconds"] / x["events"] * 1e6
        counts = f"{x['known']:9.0f} {x['slots']:9.0f} {x['forgotten']:10.0f}"
        saved = f"{x['snapshot_mb']:12.1f} {x['dump_s']:7.2f} {x['load_s']:7.2f}"
        print(f"{name:8} {counts} {x['rss_mb']:12.0f} {us:9.2f} {saved}")
    print(
        f"ratio retire/keep: peak RSS {r['rss_mb'] / k['rss_mb']:.2f}, known {r['known'] / k['known']:.2f}, "
        f"time {r['seconds'] / k['seconds']:.2f}, snapshot {r['snapshot_mb'] / k['snapshot_mb']:.2f}"
    )
    print(f"command: python bench/memory.py --requests {args.requests}")


if __name__ == "__main__":
    main()
