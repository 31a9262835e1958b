"""The SGLang adapter's cost per decode step on SGLang 0.5.23's own classes, beside the step's
own KV work. Run with the SGLang venv's Python (make engines):

    .engines/sglang/bin/python bench/sglang_step.py [--quick]

Per step, unguarded: SGLang's `alloc_decode` for the batch and the batch's `req_to_token`
write (the originals, under the hooks). Guarded: the same calls through kvguard's hooks (new
pages granted from the row write) plus the adapter's one guard call for the step (the step's
writes and the check before attention over `req_to_token[row, :seq_len]`). Two engines, one
each, stepped in alternating rounds so the machine's noise falls on both; medians printed.
The guard's sink is a NullSink: what is timed is the engine's host time, not the agent's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from array import array

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams

from kvguard.agents.attach import Attachment, Settings
from kvguard.agents.sglang import plugin
from kvguard.agents.sglang.adapter import SglangAdapter

PAGE, PROMPT = 16, 1024


class Engine:
    def __init__(self, batch: int, steps: int, adapter: SglangAdapter | None) -> None:
        size = batch * (PROMPT + steps + PAGE) + PAGE
        kv = MHATokenToKVPool(
            size=size,
            page_size=PAGE,
            dtype=torch.float16,
            head_num=1,
            head_dim=8,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        self.alloc = PagedTokenToKVPoolAllocator(
            size=size, page_size=PAGE, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False
        )
        self.r2t = ReqToTokenPool(
            size=batch, max_context_len=PROMPT + steps + PAGE, device="cpu", enable_memory_saver=False
        )
        self.adapter = adapter
        if adapter is not None:
            adapter.report_pool(self.alloc, role="colocated", context_len=PROMPT + steps + PAGE)
        self.reqs = [
            Req(
                f"r{i}",
                "",
                array("q", range(PROMPT)),
                SamplingParams(max_new_tokens=steps),
                cache_salt=f"t{i % 4}",
            )
            for i in range(batch)
        ]
        write = ReqToTokenPool.write if adapter else ReqToTokenPool.write.__wrapped__
        assert self.r2t.alloc(self.reqs) is not None
        rows = torch.tensor([r.kv.req_pool_idx for r in self.reqs])
        slots = self.alloc.alloc(batch * PROMPT).reshape(batch, PROMPT)
        for r, row_slots in zip(self.reqs, slots, strict=True):
            write(self.r2t, (r.kv.req_pool_idx, slice(0, PROMPT)), row_slots.to(torch.int32))
            r.kv.kv_allocated_len = PROMPT
            r.extend_input_len = PROMPT
        self.rows = rows
        self.lens = torch.full((batch,), PROMPT, dtype=torch.int64)
        if adapter is not None:  # the prefill's writes, so that the decode reads are clean
            adapter.forward_step(self.reqs, rows, self.lens, slots.reshape(-1), self.r2t)
            for r in self.reqs:
                r.extend_input_len = None

    def step(self) -> None:
        self.lens += 1
        last = self.r2t.req_to_token[self.rows, self.lens - 2].long()
        if self.adapter is None:
            slots = PagedTokenToKVPoolAllocator.alloc_decode.__wrapped__(
                self.alloc, seq_lens=self.lens, seq_lens_cpu=self.lens, last_loc=last
            )
            ReqToTokenPool.write.__wrapped__(self.r2t, (self.rows, self.lens - 1), slots.to(torch.int32))
            return
        slots = self.alloc.alloc_decode(seq_lens=self.lens, seq_lens_cpu=self.lens, last_loc=last)
        self.r2t.write((self.rows, self.lens - 1), slots.to(torch.int32))
        verdict = self.adapter.forward_step(self.reqs, self.rows, self.lens, slots, self.r2t)
        assert not verdict.kill, verdict.findings


def measure(batch: int, rounds: int, steps: int) -> tuple[float, float]:
    attachment = Attachment("sglang", Settings(node=f"bench-{batch}", mode="enforce"))
    adapter = plugin.install(SglangAdapter(attachment))
    plain, guarded = Engine(batch, rounds * steps, None), Engine(batch, rounds * steps, adapter)
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    for _ in range(rounds):
        for name, engine in (("plain", plain), ("guarded", guarded)):
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    assert not attachment.failed, attachment.failed
    return statistics.median(times["plain"]), statistics.median(times["guarded"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args()
    rounds, steps = (5, 8) if args.quick else (21, 16)
    import sglang

    print(
        f"SGLang {sglang.__version__} decode step, page {PAGE}, prompt {PROMPT}; {os.cpu_count()} CPUs; "
        f"median of {rounds} alternating rounds of {steps} steps"
    )
    print(f"{'batch':>6} {'SGLang KV work µs':>18} {'with kvguard µs':>16} {'added µs':>9} {'added':>8}")
    for batch in (32, 128, 256):
        plain, guarded = measure(batch, rounds, steps)
        print(
            f"{batch:>6} {plain:>18.1f} {guarded:>16.1f} {guarded - plain:>9.1f} {guarded / plain - 1:>8.0%}"
        )


if __name__ == "__main__":
    main()
