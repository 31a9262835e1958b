"""The dashboard's cost on the daemon: a 64-node decode fleet (bench/ingest_fleet.py's workload:
one `step` a forward pass) streams to a fresh daemon in a closed loop, with no dashboard and
with one real `kvguard top` attached (in a pseudo-terminal of --size, on the screen --screen
shows, refreshing as it does for an operator), alternately, --rounds times each.

It prints each run's ingest rate (request-steps/s) and the daemon's CPU a forward pass, then
the medians and their ratios, dashboard over none. The goal: the rate with a dashboard within
5 % of the rate without. The dashboard runs at nice 19: on an operator's desk it is another
machine's CPU; here it shares the daemon's two cores, and only its calls into the daemon are
the daemon's cost (its autogroup is set to nice 19 too, where Linux groups a session's
processes: without it, nice alone does not yield).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import os
import pty
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ingest_fleet import build_node
from ingest_runs import daemon_run
from ingest_workload import first_plant

GOAL = 0.95  # the rate with a dashboard, over the rate without, at least


def dashboard(args: argparse.Namespace, log: Path, drawn: list[int]) -> Callable[[str], Callable[[], None]]:
    """What starts `kvguard top` against a daemon's address in a pseudo-terminal of
    args.size, and returns what stops it (its screen's bytes are read and dropped, as a
    terminal would; how many it drew while the fleet streamed is appended to `drawn`: a
    dashboard starved of CPU would draw, and ask the daemon, less)."""
    cols, rows = (int(n) for n in args.size.split("x"))

    def attach(address: str) -> Callable[[], None]:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        cmd = ["nice", "-n", "19", sys.executable, "-m", "kvguard", "top", "--daemon", address]
        cmd += shlex.split(args.screen)
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(cols), LINES=str(rows))
        # Textual draws on stderr: all three ends are the terminal's (`log` is for the bench's notes).
        proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        # In its own session the dashboard is in its own autogroup (Linux), where its nice value
        # only ranks it against itself: the group's nice is what yields the CPU to the daemon.
        with contextlib.suppress(OSError):
            Path(f"/proc/{proc.pid}/autogroup").write_text("19")
        seen = [0]

        def drain() -> None:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    return
                if not data:
                    return
                seen[0] += len(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        time.sleep(args.settle)  # the app up and its first refresh made, before the clock starts
        settled = seen[0]

        def detach() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"kvguard top exited early ({proc.returncode}): see {log}")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            drawn.append(seen[0] - settled)
            os.close(master)
            reader.join(5)
            if seen[0] < 1000:
                raise RuntimeError(f"kvguard top drew {seen[0]} bytes: it did not run (see {log})")

        return detach

    return attach


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64, help="simulated nodes streaming")
    parser.add_argument("--batch", type=int, default=32, help="each node's decode batch")
    parser.add_argument("--seconds", type=float, default=5.0, help="each run's length")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternating")
    parser.add_argument("--size", default="160x48", help="the dashboard's terminal, COLSxROWS")
    parser.add_argument(
        "--screen", default="--screen pool --node n0", help="`kvguard top` arguments after --daemon"
    )
    parser.add_argument("--settle", type=float, default=3.0, help="seconds for the dashboard to start")
    args = parser.parse_args()
    steps = int(args.seconds * 400) + 1  # more passes a node than a closed-loop run can send
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-top-") as tmp:
        store_dir = Path(tmp)
        built = time.perf_counter()
        workloads = [
            build_node(f"n{k}", steps, args.batch, 512, 512, 4, k, first_plant(k, 4, False))
            for k in range(args.nodes)
        ]
        gc.collect()
        gc.freeze()
        print(f"{args.nodes} nodes x batch {args.batch}: built in {time.perf_counter() - built:.1f} s")
        drawn: list[int] = []
        attach = dashboard(args, store_dir / "top.log", drawn)
        results: dict[str, list[tuple[float, float]]] = {"none": [], "dashboard": []}
        failed = 0
        for round_ in range(args.rounds):
            for kind in ("none", "dashboard") if round_ % 2 == 0 else ("dashboard", "none"):
                run, _ = daemon_run(
                    workloads,
                    args.seconds,
                    store_dir,
                    f"{kind}-{round_}",
                    None,
                    attach=attach if kind == "dashboard" else None,
                )
                passes = run.transitions / args.batch
                cpu = run.cpu.get("daemon", 0.0) / passes * 1e6 if passes else 0.0
                results[kind].append((run.rate, cpu))
                print(
                    f"round {round_} {kind:9}: {run.rate / 1e6:.3f} M request-steps/s, "
                    f"daemon {cpu:.0f} µs/pass"
                    f"{f', dashboard drew {drawn[-1] / 1024:.0f} KiB' if kind == 'dashboard' else ''}"
                    f"{'; ERRORS: ' + '; '.join(run.errors) if run.errors else ''}",
                    flush=True,
                )
                failed += bool(run.errors)
    rate = {k: statistics.median(r for r, _ in v) for k, v in results.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in results.items()}
    ratio = rate["dashboard"] / rate["none"] if rate["none"] else 0.0
    print(
        f"\nmedians: none {rate['none'] / 1e6:.3f} M/s, {cpu['none']:.0f} µs/pass; "
        f"dashboard {rate['dashboard'] / 1e6:.3f} M/s, {cpu['dashboard']:.0f} µs/pass"
    )
    print(
        f"ingest rate with a dashboard / without: {ratio:.3f} (goal >= {GOAL}: "
        f"{'met' if ratio >= GOAL else 'MISSED'}); daemon CPU a pass, with / without: "
        f"{cpu['dashboard'] / cpu['none'] if cpu['none'] else 0:.3f}"
    )
    print(f"command: python bench/top_cost.py {shlex.join(sys.argv[1:])}".rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
