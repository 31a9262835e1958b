"""What a finding costs the daemon's loop, stage by stage, on the ingest benchmark's workload.

The events are applied as the daemon applies a batch (bench/ingest.py's agent, 64-event
batches of 64-page requests with a planted stale read every 4th batch): runs of clean events
in one C call (Ledger.apply_clean), the event it stops at through apply_serialized. Timed
for each planted read: the event itself (the read check, its victims, the Finding), the
ruleset's verdict, its store record and its kill command, as the daemon's _judge makes them.
The event is timed twice in one run, alternating batch by batch on two ledgers fed the same
stream: a refused read judged in C (PoolPages.read_victims, the daemon's path for a reader
with no prefix pages in the pool) and by the NumPy statements the ledger keeps for readers
with prefix pages (Ledger._shared_read_victims, given an empty share), so the ratio is of
one moment of this shared machine. Between findings the caches hold the clean path's code
and data, as in the daemon: this is the finding's cost there, not in a loop of findings.

    python bench/finding.py [--events N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collections import Counter

import ingest  # the ingest benchmark's workload

from kvguard.daemon.commands import Commands
from kvguard.daemon.store import Record
from kvguard.ledger import Ledger
from kvguard.ledger import pages as pages_module
from kvguard.ledger.access import Shared, shared_read_victims
from kvguard.proto import wire
from kvguard.ruleset import load_ruleset

NO_SHARE = Shared(np.zeros(0, np.intp), np.zeros(0, np.uint32), np.zeros(0, np.int32), np.zeros(0, np.uint32))


def numpy_victims(pp: pages_module.PoolPages, pages: np.ndarray, req: int, tokens: int) -> Any:
    """read_victims by the ledger's NumPy statements (its path for a reader with a share)."""
    reader, pool = SimpleNamespace(idx=req), SimpleNamespace(pages=pp)
    return shared_read_victims(reader, pool, pages, tokens, NO_SHARE)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=400_000, help="events in the stream")
    args = parser.parse_args()
    w = ingest.build_agent("n0", args.events, 64, 64, 1 << 17, 4, 0)
    ruleset = load_ruleset()
    commands = Commands("enforce", 0, Counter())  # the daemon's command builder alone
    in_c = pages_module.PoolPages.read_victims
    ledgers = {"C": Ledger(), "NumPy": Ledger()}
    for ledger in ledgers.values():
        ledger.apply_serialized(w.setup, "n0")
    times: dict[str, list[float]] = {name: [] for name in ("C", "NumPy", "verdict", "record", "commands")}
    findings = 0
    said: dict[str, list[str]] = {name: [] for name in ledgers}  # each ledger's findings, in order
    for k, bodies in enumerate(w.bodies):
        order = ("C", "NumPy") if k % 2 else ("NumPy", "C")
        for name in order:
            ledger = ledgers[name]
            pages_module.PoolPages.read_victims = in_c if name == "C" else numpy_victims  # type: ignore[method-assign]
            batch = wire.batch_of(bodies)  # as the daemon reads a batch: its heads once
            i, stop = 0, len(bodies)
            while i < stop:
                i = ledger.apply_clean(batch, i, stop, "n0")
                if i == stop:
                    break
                t0 = time.perf_counter()
                found = ledger.apply_serialized(bodies[i], "n0")
                t1 = time.perf_counter()
                i += 1
                if not found:
                    continue
                times[name].append(t1 - t0)
                said[name] += [f.message for f in found]
                if name != "C":
                    continue
                findings += len(found)
                for f in found:
                    t0 = time.perf_counter()
                    evaluated = ruleset.evaluate(f)
                    t1 = time.perf_counter()
                    assert evaluated is not None
                    Record.of_finding(evaluated)
                    t2 = time.perf_counter()
                    for command in commands.of(evaluated):
                        command.SerializeToString()
                    t3 = time.perf_counter()
                    times["verdict"].append(t1 - t0)
                    times["record"].append(t2 - t1)
                    times["commands"].append(t3 - t2)
    pages_module.PoolPages.read_victims = in_c  # type: ignore[method-assign]
    assert said["C"] == said["NumPy"] and len(said["C"]) == findings  # the same judgment either way
    print(
        f"{len(w.bodies)} batches of 64 events (64-page requests), {findings} planted stale reads; "
        "µs each, median / p90"
    )
    for name, label in (
        ("NumPy", "the event, refused read judged in NumPy"),
        ("C", "the event, refused read judged in C"),
        ("verdict", "the ruleset's verdict"),
        ("record", "its store record"),
        ("commands", "its kill command"),
    ):
        values = sorted(times[name])
        p90 = values[int(len(values) * 0.9)]
        print(f"  {label:42} {statistics.median(values) * 1e6:7.1f} / {p90 * 1e6:7.1f}")
    ratio = statistics.median(times["NumPy"]) / statistics.median(times["C"])
    print(f"the finding event: {ratio:.2f}x faster judged in C (medians, alternating in one run)")
    print(f"command: python bench/finding.py --events {args.events}")


if __name__ == "__main__":
    main()
