"""What integrity receipts cost (issue 44), per 1,000 requests: the same simulated fleet's
batches through an in-process daemon with a receipt key and without one, side by side,
alternately, `--runs` times each, on a SQLite store in a temporary directory.

Printed: the ingest's time to apply and commit every batch (what the receipts add to the
loop: one request's numbers read at its end, the findings noted), as a ratio; the signer's
lag after the last batch is durable until the last receipt is (it signs and stores off the
loop, in batches); and Ed25519 signing alone, per 1,000 receipts.

    python bench/receipts.py --cells 8 --ticks 60 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvguard.daemon.daemon import Daemon
from kvguard.daemon.ingest import Batch
from kvguard.daemon.store import Store
from kvguard.proto import receipt, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.testbed.fleet import fleet


def once(batches: list, key: object, where: Path) -> tuple[float, float, int]:
    """(seconds until every batch is durable, seconds more until every receipt is, receipts)."""
    store = Store(str(where / "audit.db"))
    daemon = Daemon(store, snapshot_every=0, receipt_key=key)
    acked = [0]
    frames = [
        (node, svc.AgentMessage(batch=svc.EventBatch(events=events)).SerializeToString())
        for node, events in batches
    ]
    try:
        began = time.perf_counter()
        for node, data in frames:
            batch = Batch(node, wire.decode_batch(data), lambda _: acked.__setitem__(0, acked[0] + 1))
            daemon.loop.call_soon_threadsafe(daemon.ingest, batch)
        while acked[0] < len(frames):
            time.sleep(0.001)
        durable = time.perf_counter() - began
        if daemon.receipts is not None:
            daemon.receipts.flush(120)
        lag = time.perf_counter() - began - durable
        return durable, lag, daemon.counters["receipts"]
    finally:
        daemon.close()
        store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", type=int, default=8)
    p.add_argument("--ticks", type=int, default=60)
    p.add_argument("--arrivals", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    f = fleet(args.cells, ticks=args.ticks, arrivals=args.arrivals)
    with tempfile.TemporaryDirectory() as tmp:
        receipt.new_key(Path(tmp) / "r.key", Path(tmp) / "r.pub")
        key = receipt.load_private(Path(tmp) / "r.key")
        plain, signed, lags, issued = [], [], [], 0
        for i in range(args.runs):
            for with_key in (False, True):
                where = Path(tmp) / f"{i}-{with_key}"
                where.mkdir()
                durable, lag, made = once(f.batches, key if with_key else None, where)
                (signed if with_key else plain).append(durable)
                if with_key:
                    lags.append(lag)
                    issued = made
        sample = svc.Receipt(req="cmpl-0123456789abcdef", tenant="acme", verdict="clean")
        began = time.perf_counter()
        for _ in range(1000):
            receipt.sign(sample, key)
        sign_ms = (time.perf_counter() - began) * 1e3
    a, b = statistics.median(plain), statistics.median(signed)
    per = 1000 / max(issued, 1)
    print(f"{f.events} events, {issued} requests ended with a receipt, {len(f.cells)} cells; ", end="")
    print(f"{args.runs} runs each")
    print(f"ingest to durable: {a:.3f} s without receipts, {b:.3f} s with ({b / a:.3f}x)")
    print(f"  per 1,000 requests: {(b - a) * per * 1e3:+.1f} ms on the ingest path")
    print(f"signer lag after the last batch is durable: {statistics.median(lags) * 1e3:.0f} ms (median)")
    print(f"Ed25519 signing alone: {sign_ms:.1f} ms per 1,000 receipts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
