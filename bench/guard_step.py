"""The guard's whole host cost per decode step, per-request API against the step API, side by side.

A guard (NullSink: the bytes are made and handed over, nowhere sent) holds a decode batch
whose contexts are already written. Every step, each request writes its next token and, every
`page_size` tokens, is granted a new page (the contexts are staggered, so a step makes about
batch / page_size grants, as a running engine does); then the check before attention reads
every context. The per-request API makes that an `alloc` call per grant, a `write` call per
request and a whole `check_attention`; the step API one `step` call with `grants` for the
grants and the writes, and the check with `stable` (each row read past what it verified before,
as the adapters call it: flat in the context; timed here as `step` and `check_attention`, to
show the parts: an engine passes the block tables to `step` and makes one call). Only the
guard's calls are timed, not the engine's own arrays. The two alternate step by step on twin
guards, so the machine's drift hits both alike. Reported: median µs a step for each, the step
API's parts against the goals (grants and writes: 20 µs + 0.2 µs a request; the whole check:
5 ns a block-table entry, timed alone, C on the host).

    python bench/guard_step.py [--steps N] [--grid B:CTX,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvguard.agents.guard import Guard
from kvguard.ruleset import load_ruleset

DEFAULT_GRID = "32:1024,32:8192,128:1024,128:4096,256:1024,256:8192"
PAGE = 16


class Decode:
    """One guard and its decode batch: request i owns pages [i * per, (i + 1) * per)."""

    def __init__(self, batch: int, context: int, steps: int) -> None:
        self.per = -(-(context + PAGE + steps + 1) // PAGE)
        self.guard = Guard("d0", ruleset=RULES, epoch=1)
        self.guard.pool(0, "decode", page_size=PAGE, num_pages=batch * self.per, context_len=1 << 20)
        self.reqs = [f"r{i}" for i in range(batch)]
        self.lens = context + np.arange(batch) % PAGE  # staggered: grants spread over the steps
        self.tables = np.arange(batch * self.per, dtype=np.int32).reshape(batch, self.per)
        for i, req in enumerate(self.reqs):
            have = -(-int(self.lens[i]) // PAGE)
            pages = self.tables[i, :have]
            self.guard.admit(req, "acme", int(self.lens[i]), "decode")
            self.guard.alloc(req, 0, pages)
            slots = np.full(have, PAGE, np.int64)
            slots[-1] = int(self.lens[i]) - (have - 1) * PAGE
            self.guard.write(req, 0, pages, slots)

    def plan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step as the engine has it before it calls the guard (untimed: the engine's own
        work): each request's page for its next token, the slots valid after it, and 1 where
        that page is new to the request (its last page was full), else 0."""
        pages = self.tables[np.arange(len(self.reqs)), self.lens // PAGE]
        return pages, self.lens % PAGE + 1, (self.lens % PAGE == 0).astype(np.int64)

    def per_request(self) -> int:
        """One step by the per-request API: the ns its guard calls took."""
        pages, slots, new = self.plan()
        guard, lens = self.guard, self.lens + 1
        t0 = time.perf_counter_ns()
        for i in np.flatnonzero(new).tolist():
            guard.alloc(self.reqs[i], 0, pages[i : i + 1])
        for i, req in enumerate(self.reqs):
            guard.write(req, 0, pages[i : i + 1], slots[i : i + 1])
        verdict = guard.check_attention(0, self.reqs, self.tables, lens)
        t1 = time.perf_counter_ns()
        self.lens = lens
        assert verdict.ok and not guard.errors, (verdict, guard.errors)
        return t1 - t0

    def stepped(self) -> tuple[int, int]:
        """One step by the step API: the ns its grants and writes (one `step` call with
        `grants`) and its check took."""
        pages, slots, new = self.plan()
        guard, lens = self.guard, self.lens + 1
        t0 = time.perf_counter_ns()
        verdict = guard.step(0, self.reqs, pages, slots, grants=new)
        t1 = time.perf_counter_ns()
        # As an engine with append-only tables calls it: the entries before the page each
        # request writes now are as they were at its last check.
        checked = guard.check_attention(0, self.reqs, self.tables, lens, stable=self.lens // PAGE)
        t2 = time.perf_counter_ns()
        self.lens = lens
        assert verdict.ok and checked.ok and not guard.errors, (verdict, checked, guard.errors)
        return t1 - t0, t2 - t1


RULES = load_ruleset()


def measure(batch: int, context: int, steps: int) -> dict[str, float]:
    a, b = Decode(batch, context, steps + 2), Decode(batch, context, steps + 2)
    a.per_request()  # warm-up
    b.stepped()
    per_request, stepped, writes, checks = [], [], [], []
    for _ in range(steps):
        per_request.append(a.per_request())
        written, checked = b.stepped()
        stepped.append(written + checked)
        writes.append(written)
        checks.append(checked)
    ledger = b.guard.ledger
    entries = int(np.sum(-(-b.lens // PAGE)))
    alone = []
    for _ in range(max(3, steps // 2)):
        t0 = time.perf_counter_ns()
        clean = ledger.batch_clean("d0", 0, b.reqs, b.tables, b.lens)
        alone.append(time.perf_counter_ns() - t0)
        assert clean.all()
    median = statistics.median
    return {
        "per_request_us": median(per_request) / 1e3,
        "step_us": median(stepped) / 1e3,
        "writes_us": median(writes) / 1e3,
        "check_us": median(checks) / 1e3,
        "goal_us": 20 + 0.2 * batch,
        "whole_us": median(alone) / 1e3,
        "check_ns_entry": median(alone) / entries,
    }


def table(steps: int, grid: str) -> None:
    print("guard host cost a decode step, per-request API against step API (median µs a step);")
    print("the step API's parts: grants and writes (step with grants), check (check_attention with")
    print("`stable`: each row past what it verified before, as the adapters call it); whole: the check")
    print("of every entry, timed alone (C); goal: grants + writes <= 20 µs + 0.2 µs a request, the")
    print("whole check <= 5 ns an entry")
    print(
        f"{'batch':>5} {'context':>7} {'per-req':>8} {'step':>7} {'ratio':>6} "
        f"{'g+w':>7} {'goal':>6} {'check':>7} {'whole':>7} {'ns/entry':>9}"
    )
    for item in grid.split(","):
        batch, context = (int(x) for x in item.split(":"))
        r = measure(batch, context, steps)
        print(
            f"{batch:>5} {context:>7} {r['per_request_us']:>8.1f} {r['step_us']:>7.1f} "
            f"{r['per_request_us'] / r['step_us']:>6.1f} "
            f"{r['writes_us']:>7.1f} {r['goal_us']:>6.1f} {r['check_us']:>7.1f} {r['whole_us']:>7.1f} "
            f"{r['check_ns_entry']:>9.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="measured steps per API and configuration")
    parser.add_argument("--grid", default=DEFAULT_GRID, help="batch:context pairs")
    args = parser.parse_args()
    table(args.steps, args.grid)


if __name__ == "__main__":
    main()
