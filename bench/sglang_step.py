"""The SGLang adapter's cost per decode step on SGLang 0.5.23's own scheduling code, beside the
step's own scheduling time. Run with the SGLang venv's Python (make engines):

    .engines/sglang/bin/python bench/sglang_step.py [--quick]

A step is the host work of one decode iteration of SGLang's scheduler on its own classes,
without the model runner: what update_running_batch does to a running batch
(`ScheduleBatch.filter_batch`, `check_decode_mem`, `prepare_for_decode`, whose
`alloc_for_decode` is the allocator's `alloc_decode` and the batch's `req_to_token` write),
and what process_batch_result_decode does for each request (`Req.time_stats`, its token,
`Req.update_finish_state`), under a published runtime context as in the scheduler process.
Guarded, kvguard's hooks see those calls and the adapter makes its one guard call for the
step (`forward_step`, as the `run_batch` hook does: the step's writes and the check before
attention). Unguarded, the
same code runs on a pool the adapter does not guard (its hooks pass it through). The two
engines are stepped in alternating rounds so that the machine's noise falls on both;
medians are printed. The guard's sink is a NullSink: the engine's host time is what is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from array import array
from pathlib import Path

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from kvguard.agents.attach import Attachment, Settings
from kvguard.agents.sglang import plugin
from kvguard.agents.sglang.adapter import SglangAdapter

PAGE, PROMPT = 16, 1024


def server_args() -> ServerArgs:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines"))
    from tiny_model import llama_dir  # the tests' tiny model config

    model = llama_dir(vocab_size=32000, max_position_embeddings=8192)
    args = ServerArgs(model_path=str(model), skip_tokenizer_init=True, device="cpu", page_size=PAGE)
    publish(args, role="scheduler")
    return args


def params(steps: int) -> SamplingParams:
    """As the tokenizer manager hands them over (normalized: no stop strings)."""
    sampling = SamplingParams(max_new_tokens=steps + 8)
    sampling.normalize(None)
    return sampling


class Engine:
    """One scheduler's pool and a running decode batch of `batch` requests."""

    def __init__(self, args: ServerArgs, batch: int, steps: int, adapter: SglangAdapter | None) -> None:
        context = PROMPT + steps + PAGE
        size = batch * context
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
        alloc = PagedTokenToKVPoolAllocator(
            size=size, page_size=PAGE, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False
        )
        self.r2t = ReqToTokenPool(
            size=batch, max_context_len=context, device="cpu", enable_memory_saver=False
        )
        tree = RadixCache(
            CacheInitParams(
                disable=True, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=alloc, page_size=PAGE
            )
        )
        self.adapter = adapter
        if adapter is not None:
            adapter.report_pool(alloc, role="colocated", context_len=context, req_to_token_pool=self.r2t)
        reqs = [
            Req(f"r{i}", "", array("q", range(i, i + PROMPT)), params(steps), cache_salt=f"t{i % 4}")
            for i in range(batch)
        ]
        for r in reqs:
            r.init_next_round_input(tree)
            r.extend_end = PROMPT
        self.batch = ScheduleBatch.init_new(
            reqs, self.r2t, alloc, tree, ModelConfig.from_server_args(args), False, SpeculativeAlgorithm.NONE
        )
        self.batch.prepare_for_extend()
        self.forward()

    def forward(self) -> None:
        b = self.batch
        if self.adapter is not None:  # what the run_batch hook does
            verdict = self.adapter.forward_step(
                b.reqs,
                b.req_pool_indices,
                b.seq_lens,
                b.out_cache_loc,
                self.r2t,
                b.extend_lens if b.forward_mode.is_extend() else None,
            )
            assert not verdict.kill, verdict.findings
        b.output_ids = torch.ones(len(b.reqs), dtype=torch.int64)

    def step(self) -> None:
        """One decode iteration's host work in SGLang's scheduler, on its own classes: what
        update_running_batch does to the batch (filter_batch, check_decode_mem,
        prepare_for_decode), the forward (only the run_batch hook's part), and
        process_batch_result_decode's part for each request (its time stamp, its token,
        update_finish_state)."""
        b = self.batch
        b.filter_batch()
        b.check_decode_mem()
        b.prepare_for_decode()
        self.forward()
        for r in b.reqs:
            r.time_stats.set_last_decode_finish_time()
            r.output_ids.append(1)
            r.update_finish_state(1)


def measure(args: ServerArgs, batch: int, rounds: int, steps: int) -> tuple[float, float]:
    attachment = Attachment("sglang", Settings(node=f"bench-{batch}", mode="enforce"))
    adapter = plugin.install(SglangAdapter(attachment))
    guarded = Engine(args, batch, rounds * steps, adapter)
    plain = Engine(args, batch, rounds * steps, None)
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    for i in range(rounds):
        order = (
            (("plain", plain), ("guarded", guarded)) if i % 2 else (("guarded", guarded), ("plain", plain))
        )
        for name, engine in order:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    assert not attachment.failed and not adapter.guard.findings, (attachment.failed, adapter.guard.findings)
    return statistics.median(times["plain"]), statistics.median(times["guarded"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    rounds, steps = (5, 8) if parser.parse_args().quick else (21, 16)
    args = server_args()
    import sglang

    print(
        f"SGLang {sglang.__version__} decode iteration's host work (filter_batch, check_decode_mem, "
        f"prepare_for_decode, each request's result), page {PAGE}, "
        f"prompt {PROMPT}; {os.cpu_count()} CPUs; median of {rounds} alternating rounds of {steps} steps"
    )
    print(f"{'batch':>6} {'SGLang step µs':>15} {'with kvguard µs':>16} {'added µs':>9} {'added':>8}")
    for batch in (32, 128, 256):
        plain, guarded = measure(args, batch, rounds, steps)
        print(
            f"{batch:>6} {plain:>15.1f} {guarded:>16.1f} {guarded - plain:>9.1f} {guarded / plain - 1:>8.0%}"
        )


if __name__ == "__main__":
    main()
