"""The guard's GPU kernels beside what they guard, on one GPU (under 3 minutes on an H200).

1. Page-tag check per decode step, beside the step's attention: a batch of requests with
   long contexts in a paged pool, in a real guard's ledger; the step writes one page per
   request, so the check first brings those pages' tags to the device (in the same copy and
   launch), then the verdicts come back to the host. The attention is PyTorch's
   scaled_dot_product_attention over the same KV (bf16, grouped-query), one layer timed and
   multiplied by the layer count, beside its floor (a copy moving as many bytes). Shown also:
   the same check in separate copies and launches (the first version), and the guard's whole
   step (Guard.step: the new tokens as one step event, then the check). Goal: the whole guard,
   step event included, costs at most 0.5 % of the step.
2. Page checksums over a pool, read in place through the page list, in bytes per second
   beside a device-to-device copy of the same bytes. Goal: at least 80 % of the copy's rate.

Both are timed with CUDA events, the variants interleaved, medians of repeats.

    python bench/gpu.py [--batch 128 --context 4096 --layers 32] [--pool-gib 8]

Without a GPU it runs the same code on the CPU at a toy size (a smoke test of the script;
its figures mean nothing for the goals).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvguard.agents.guard import Guard
from kvguard.cuda_hooks import kernels
from kvguard.ledger.pages import check_tags
from kvguard.ruleset import load_ruleset


def timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """Median milliseconds of `fn` over `repeats` runs (CUDA events on a GPU)."""

    def run(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm up (compiles the kernel on first use)
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def guarded_batch(b: int, ctx: int, ps: int, device: str) -> tuple[Guard, list[str], Any, Any]:
    """A guard whose ledger holds a decode batch of b requests of ctx tokens each in one
    pool (pages shuffled), with the block tables and lengths where the engine keeps them."""
    per_req = -(-ctx // ps)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(b * per_req, generator=gen).reshape(b, per_req).to(torch.int32).numpy()
    guard = Guard("bench", ruleset=load_ruleset())
    guard.pool(0, "decode", ps, b * per_req, context_len=1 << 20)
    reqs = [f"r{i}" for i in range(b)]
    slots = [ps] * (per_req - 1) + [ctx - ps * (per_req - 1)]
    for i, req in enumerate(reqs):
        guard.admit(req, f"tenant{i % 4}", ctx, "decode")
        guard.alloc(req, 0, tables[i])
        guard.write(req, 0, tables[i], slots)
    lens = np.full(b, ctx, np.int32)
    if device == "cuda":
        import cupy

        return guard, reqs, cupy.asarray(tables), cupy.asarray(lens)
    return guard, reqs, tables, lens


def tag_check_vs_attention(args: argparse.Namespace, device: str) -> None:
    ms = timer(device)
    b, ctx, ps, heads, kv_heads, hd = args.batch, args.context, 16, args.heads, args.kv_heads, 128
    guard, reqs, tables, lens = guarded_batch(b, ctx, ps, device)
    pages = guard.ledger.nodes["bench"].pools[0].pages
    host_tables = tables.get() if device == "cuda" else tables
    last = host_tables[:, -1]  # each request's page written this step
    fill = [ctx - ps * (host_tables.shape[1] - 1)]
    readers = guard.ledger.reader_indices(reqs)

    slots = np.full(b, fill[0], np.int64)  # each request's new token, as its page's valid slots

    if device == "cuda":
        import cupy

        tags = kernels.DeviceTags()
        tags.sync(pages.own, pages.valid)

        def kernel_path() -> object:  # the step's tag updates, the launch, the verdicts back
            tags.touch(last)
            return tags.check(pages.own, pages.valid, tables, lens, readers, ps)

        def kernel_path_before() -> object:  # the same, as this script's first version did it
            tags.touch(last)
            tags.sync(pages.own, pages.valid)
            found = kernels.tag_check(tags.own, tags.valid, tables, lens, cupy.asarray(readers), ps)
            return cupy.asnumpy(found)

    else:

        def kernel_path() -> object:
            return check_tags(pages.own, pages.valid, tables, lens, readers, ps)

        kernel_path_before = kernel_path

    def guard_path() -> object:  # the engine's one call a step: the new tokens' step event, the check
        verdict = guard.step(0, reqs, last, slots, block_tables=tables, context_lens=lens)
        assert verdict.ok, "the benchmark's batch must be clean"
        return verdict

    def guard_ms() -> float:
        times = []
        guard_path()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            guard_path()  # synchronous: its verdicts are on the host when it returns
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    assert bool(np.all(np.asarray(kernel_path()) > 0)), "the benchmark's batch must be clean"
    q = torch.randn(b, heads, 1, hd, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, kv_heads, ctx, hd, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, kv_heads, ctx, hd, device=device, dtype=torch.bfloat16)
    k_copy = torch.empty_like(k)

    def attention() -> object:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def floor() -> object:  # moves as many bytes as reading K and V once: the layer's floor
        return k_copy.copy_(k)

    rounds = [
        (
            ms(attention, args.repeats),
            ms(floor, args.repeats),
            ms(kernel_path, args.repeats),
            ms(kernel_path_before, args.repeats),
            guard_ms(),
        )
        for _ in range(3)
    ]
    layer_ms, floor_ms, kernel_ms, before_ms, whole_ms = (
        statistics.median(r[i] for r in rounds) for i in range(5)
    )
    step_ms, floor_step_ms = layer_ms * args.layers, floor_ms * args.layers
    kv_gb = 2 * b * kv_heads * ctx * hd * 2 * args.layers / 1e9
    print(
        f"tag check: batch {b}, context {ctx} ({host_tables.shape[1]} pages of {ps} each), {args.layers} "
        f"layers, {heads}/{kv_heads} heads of {hd}, bf16 ({kv_gb:.1f} GB of KV read per step); "
        f"the step writes one page per request"
    )
    print(
        f"attention: {layer_ms:.3f} ms a layer, {step_ms:.2f} ms a step (scaled_dot_product_attention); "
        f"its floor (copying K, i.e. moving K and V's bytes once): {floor_ms:.3f} ms a layer, "
        f"{floor_step_ms:.2f} ms a step"
    )
    print("| per decode step | ms | share of the step | share of the step's floor |")
    print("|---|---:|---:|---:|")
    for name, t in (
        ("tag updates + check + verdicts (DeviceTags.check)", kernel_ms),
        ("the same, separate copies and launches (before)", before_ms),
        ("the guard's whole step: step event + check (Guard.step)", whole_ms),
    ):
        print(f"| {name} | {t:.4f} | {100 * t / step_ms:.3f} % | {100 * t / floor_step_ms:.3f} % |")


def checksum_vs_copy(args: argparse.Namespace, device: str) -> None:
    ms = timer(device)
    layers, ps, kv_heads, hd = 32, 16, 8, 128
    page_bytes = 2 * layers * ps * kv_heads * hd * 2
    pages = max(8, int(args.pool_gib * 2**30 // page_bytes))
    k = torch.randn(layers, pages, ps, kv_heads, hd, device=device).to(torch.bfloat16)
    v = torch.randn(layers, pages, ps, kv_heads, hd, device=device).to(torch.bfloat16)
    order = torch.randperm(pages, device=device)
    dst_k, dst_v = torch.empty_like(k), torch.empty_like(v)

    def checksum() -> object:
        return kernels.page_checksums(k, v, order)

    def copy() -> object:
        dst_k.copy_(k)
        return dst_v.copy_(v)

    rounds = [(ms(checksum, args.repeats), ms(copy, args.repeats)) for _ in range(3)]
    sum_ms = statistics.median(r[0] for r in rounds)
    copy_ms = statistics.median(r[1] for r in rounds)
    total = pages * page_bytes
    print(f"checksums: {pages:,} pages of {page_bytes // 1024} KiB ({total / 2**30:.2f} GiB), bf16, shuffled")
    print("| checksum GB/s | copy GB/s (bytes copied) | ratio | copy GB/s (read + written) |")
    print("|---:|---:|---:|---:|")
    sum_rate, copy_rate = total / sum_ms / 1e6, total / copy_ms / 1e6
    print(f"| {sum_rate:.1f} | {copy_rate:.1f} | {sum_rate / copy_rate:.3f} | {2 * copy_rate:.1f} |")
    if device == "cuda":  # the launch shape: blocks per (page, layer, K or V) block
        shapes = {
            c: ms(lambda c=c: kernels._checksums_gpu(k, v, order, chunks=c), args.repeats)
            for c in (1, 2, 4, 8)
        }
        print(
            "launch shape, checksum GB/s by blocks per K/V block: "
            + ", ".join(f"{c}: {total / t / 1e6:.1f}" for c, t in shapes.items())
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--pool-gib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        args.batch, args.context, args.layers, args.pool_gib, args.repeats = 4, 256, 2, 0.01, 3
        print("no GPU: a smoke run on the CPU at a toy size (not figures for the goals)")
    else:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    tag_check_vs_attention(args, device)
    checksum_vs_copy(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
