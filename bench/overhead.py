"""Decode-step time of the testbed's transformer with the in-engine guard off and on.

A random-weight TinyTransformer (4 layers, d_model 512, 8 heads, MLP 2048, pages of 16)
decodes a batch whose KV is already in the pool. Guard on means what an engine does every
step: one `step` call (an `alloc` where a request needs a new page, the batch's new tokens as
one event, and the check before attention over the whole batch). Steps with the guard off
and on alternate in one run, on the same batch, so drift on this shared machine hits both alike;
the figure is the ratio of the medians. Then the guard's own host cost a decode step, the
per-request API against the step API side by side (bench/guard_step.py: batch 32-256,
contexts 1k-8k), with the check before attention alone in ns per block-table entry.

    python bench/overhead.py [--steps N] [--grid B:CTX,...] [--api-steps N] [--api-grid B:CTX,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from guard_step import DEFAULT_GRID as API_GRID
from guard_step import table as api_table

from kvguard.agents.guard import Guard
from kvguard.ruleset import load_ruleset
from kvguard.testbed.models import TinyTransformer, TransformerConfig

DEFAULT_GRID = "8:1024,8:8192,32:1024,32:4096,128:1024"


class Batch:
    """A decode batch with its block tables, context lengths and (optionally) a guard."""

    def __init__(self, model: TinyTransformer, batch: int, context: int, steps: int) -> None:
        cfg = model.config
        self.ps = cfg.page_size
        self.pages_per_req = -(-(context + 2 * steps + 1) // self.ps)
        self.pool = model.pool(batch * self.pages_per_req)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # KV of the prompts: random, as a prefill would leave it
            self.pool.k.normal_(generator=gen)
            self.pool.v.normal_(generator=gen)
        self.tables = np.arange(batch * self.pages_per_req, dtype=np.int64).reshape(batch, self.pages_per_req)
        self.lens = np.full(batch, context, dtype=np.int64)
        self.last = torch.randint(0, cfg.vocab, (batch,), generator=gen)
        self.reqs = [f"r{i}" for i in range(batch)]
        self.guard = Guard("bench", ruleset=load_ruleset())
        self.guard.pool(0, "decode", self.ps, batch * self.pages_per_req, context_len=1 << 20)
        for i, req in enumerate(self.reqs):
            self.guard.admit(req, f"tenant{i % 4}", context, "decode")
            used = -(-context // self.ps)
            self.guard.alloc(req, 0, self.tables[i, :used])
            slots = [self.ps] * (used - 1) + [context - self.ps * (used - 1)]
            self.guard.write(req, 0, self.tables[i, :used], slots)
        self.granted = np.full(batch, -(-context // self.ps), dtype=np.int64)

    def guard_step(self) -> None:
        """The guard's part of one step, one call: the grants where requests need a new page,
        every request's new token, and the check before attention."""
        ps = self.ps
        at = self.lens // ps
        new = (at >= self.granted).astype(np.int64)
        self.granted += new
        pages = self.tables[np.arange(len(self.reqs)), at]
        verdict = self.guard.step(
            0,
            self.reqs,
            pages,
            self.lens % ps + 1,
            grants=new,
            block_tables=self.tables,
            context_lens=self.lens + 1,
        )
        if not verdict.ok:
            raise SystemExit(f"the guard rejected a correct batch: {verdict.findings}")

    def model_step(self, model: TinyTransformer) -> None:
        with torch.no_grad():
            self.last = model.decode_step(
                self.pool, torch.from_numpy(self.tables), torch.from_numpy(self.lens), self.last
            )
        self.lens += 1


def measure(model: TinyTransformer, batch: int, context: int, steps: int) -> dict[str, float]:
    b = Batch(model, batch, context, steps)
    off, on, guard_only = [], [], []
    b.model_step(model)  # warm-up (allocator, caches)
    for _ in range(steps):
        # guard off: the model alone; the guard then catches up, untimed, to stay consistent
        t0 = time.perf_counter()
        b.model_step(model)
        off.append(time.perf_counter() - t0)
        b.lens -= 1
        b.guard_step()
        b.lens += 1
        # guard on: the guard's calls, then the model
        t0 = time.perf_counter()
        b.guard_step()
        t1 = time.perf_counter()
        b.model_step(model)
        on.append(time.perf_counter() - t0)
        guard_only.append(t1 - t0)
    return {
        "off_ms": statistics.median(off) * 1e3,
        "on_ms": statistics.median(on) * 1e3,
        "guard_ms": statistics.median(guard_only) * 1e3,
        "ratio": statistics.median(on) / statistics.median(off),
        "share": 1 + statistics.median(guard_only) / statistics.median(off),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per variant and configuration")
    parser.add_argument("--grid", default=DEFAULT_GRID, help="batch:context pairs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--api-steps", type=int, default=64, help="steps per API in the guard's own table")
    parser.add_argument("--api-grid", default=API_GRID, help="batch:context pairs of the guard's own table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TransformerConfig()
    model = TinyTransformer(config)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {sys.platform}; TinyTransformer "
        f"{config.num_layers} layers, d_model {config.d_model}, {config.num_heads} heads, "
        f"MLP {config.mlp_hidden}, page {config.page_size}; median of {args.steps} steps per variant"
    )
    print("ratio: median step with the guard / without; guard share: 1 + the guard's own time / the step")
    print(f"{'batch':>5} {'context':>7} {'off ms':>9} {'on ms':>9} {'guard ms':>9} {'ratio':>7} {'share':>7}")
    for item in args.grid.split(","):
        batch, context = (int(x) for x in item.split(":"))
        r = measure(model, batch, context, args.steps)
        print(
            f"{batch:>5} {context:>7} {r['off_ms']:>9.1f} {r['on_ms']:>9.1f} {r['guard_ms']:>9.3f} "
            f"{r['ratio']:>7.4f} {r['share']:>7.4f}",
            flush=True,
        )
    print()
    api_table(args.api_steps, args.api_grid)


if __name__ == "__main__":
    main()
