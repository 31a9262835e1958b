"""The goal's paced run (bench/ingest.py, 16 agents, 64-page events, 2 M page transitions/s
offered as batches) against two daemons in turn: this tree's and another checkout's.

Only the daemon changes between the two sides: the workload is built once, and the client,
the subscriber and the measurement are this tree's. Rounds alternate the sides, so a noisy
spell of this shared machine hits both (compare the sides round by round, not with figures
from another day). Per run: the end-to-end alert p50/p99 (scheduled send to the subscriber's
receipt) and the daemon's own stages (FleetState.latencies); at the end, each side's p99s.

The other checkout must be importable as `kvguard` from its parent folder, its C extensions
built in place: `git worktree add /tmp/base/kvguard COMMIT && (cd /tmp/base/kvguard && python
setup.py build_ext --inplace)`.

    python bench/ab_ingest.py --other /tmp/base/kvguard [--rounds N] [--paced TRANS_PER_S]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import ingest  # bench/ is not a package: its folder is on the path

HERE = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--other", type=Path, required=True, help="the other checkout (a folder named kvguard)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--paced", type=float, default=ingest.GOAL_TRANSITIONS)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--cpu-latency-us", default="", metavar="US", help="both daemons' --cpu-latency-us (default: none)"
    )
    args = parser.parse_args()
    other = args.other.resolve()
    if other.name != "kvguard" or not (other / "daemon").is_dir():
        raise SystemExit(f"--other {other}: not a kvguard checkout in a folder named kvguard")
    sys.setswitchinterval(0.0005)  # as bench/ingest.py: the agents are threads of this process
    sides = {"this": (HERE, ""), "other": (other, str(other.parent))}
    total = int(ingest.GOAL_TRANSITIONS * args.seconds * 1.25 / 64)
    workloads = [
        ingest.build_agent(f"n{k}", total // 16, 64, 64, 1 << 16, 4, k, ingest.first_plant(k, 4, False), True)
        for k in range(16)
    ]
    gc.collect()
    gc.freeze()
    print(
        f"paced {args.paced / 1e6:g} M trans/s, 16 agents, 64-page events, "
        f"{ingest.woken(args.cpu_latency_us)}; this = {HERE}, other = {other}"
    )
    p99s: dict[str, list[float]] = {side: [] for side in sides}
    cpus: dict[str, list[dict[str, float]]] = {side: [] for side in sides}  # µs an event
    with tempfile.TemporaryDirectory(prefix="kvguard-ab-") as tmp:
        for i in range(args.rounds):
            for side, (tree, path) in sides.items():
                os.environ["PYTHONPATH"] = path  # the daemon's process imports kvguard from there
                os.chdir(tree)
                run, _ = ingest.daemon_run(
                    workloads,
                    args.seconds,
                    Path(tmp),
                    f"{side}{i}",
                    None,
                    args.paced,
                    wake=args.cpu_latency_us,
                )
                for f in Path(tmp).iterdir():
                    if f.is_file():  # the run's store and logs: each run starts empty
                        f.unlink()
                if run.errors or not run.alerts:
                    print(f"{i} {side:5} ERROR {run.errors[:1]}", flush=True)
                    continue
                p50, p99 = (float(np.percentile(run.alerts, q)) * 1e3 for q in (50, 99))
                p99s[side].append(p99)
                cpus[side].append({k: v / run.events * 1e6 for k, v in run.cpu.items()})
                stages = ", ".join(f"{s} {a:.2f}/{b:.2f}" for s, (a, b, _) in run.stages.items())
                print(
                    f"{i} {side:5} {run.rate / 1e6:.3f} M/s kept up, alert p50 {p50:6.2f} p99 {p99:7.2f} ms; "
                    f"daemon p50/p99 ms: {stages}; CPU: {ingest.cpu_use(run)}; "
                    f"machine: {ingest.machine_use(run)}; alerts over stolen time {run.stolen}, the others' "
                    f"p99 {ingest.ms(run.alerts_unstolen, 99)} ms",
                    flush=True,
                )
    for side, values in p99s.items():
        v = np.array(values)
        used = {k: np.median([c[k] for c in cpus[side]]) for k in cpus[side][0]} if cpus[side] else {}
        print(f"{side:5} CPU µs an event, median: " + ", ".join(f"{k} {x:.1f}" for k, x in used.items()))
        print(
            f"{side:5} alert p99 median {np.median(v):.2f} ms, under 10 ms in {(v < 10).sum()}/{len(v)}: "
            f"{', '.join(f'{x:.1f}' for x in values)}"
        )


if __name__ == "__main__":
    main()
