"""The guard's GPU kernels beside what they guard, on one GPU (under 3 minutes on an H200).

1. Page-tag check per decode step, beside the step's attention: a batch of requests with
   long contexts in a paged pool; the guard's work per step is syncing the device tags of
   the pages the step wrote (one batched scatter), one tag-check launch and the verdicts
   back to the host; the attention is PyTorch's scaled_dot_product_attention over the same
   KV (bf16, grouped-query), one layer timed and multiplied by the layer count. Goal: the
   tag check costs at most 0.5 % of the step.
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

import numpy as np
import torch

from kvguard.cuda_hooks import kernels


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


def tag_check_vs_attention(args: argparse.Namespace, device: str) -> None:
    ms = timer(device)
    b, ctx, ps, heads, kv_heads, hd = args.batch, args.context, 16, args.heads, args.kv_heads, 128
    per_req = -(-ctx // ps)
    pool_pages = b * per_req + 1
    gen = torch.Generator().manual_seed(0)
    tables = (
        torch.randperm(pool_pages - 1, generator=gen)[: b * per_req].reshape(b, per_req).to(torch.int32) + 1
    )
    lens = torch.full((b,), ctx, dtype=torch.int32)
    readers = torch.arange(1, b + 1, dtype=torch.int32)
    own = np.zeros(pool_pages, np.int32)
    valid = np.zeros(pool_pages, np.uint32)
    own[tables.numpy()] = readers.numpy()[:, None]
    valid[tables.numpy()] = ps
    step_pages = tables[:, -1].numpy()  # each request's page written this step
    if device == "cuda":
        import cupy

        tags = kernels.DeviceTags()
        tags.sync(own, valid)
        d_tables, d_lens, d_readers = (cupy.asarray(t.numpy()) for t in (tables, lens, readers))

        def guard() -> object:
            tags.touch(step_pages)
            tags.sync(own, valid)
            return cupy.asnumpy(kernels.tag_check(tags.own, tags.valid, d_tables, d_lens, d_readers, ps))

    else:

        def guard() -> object:
            return kernels.tag_check(own, valid, tables.numpy(), lens.numpy(), readers.numpy(), ps)

    assert bool(np.all(guard())), "the benchmark's batch must be clean"
    q = torch.randn(b, heads, 1, hd, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, kv_heads, ctx, hd, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, kv_heads, ctx, hd, device=device, dtype=torch.bfloat16)

    def attention() -> object:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    rounds = [(ms(attention, args.repeats), ms(guard, args.repeats)) for _ in range(3)]
    layer_ms = statistics.median(r[0] for r in rounds)
    guard_ms = statistics.median(r[1] for r in rounds)
    step_ms = layer_ms * args.layers
    kv_gb = 2 * b * kv_heads * ctx * hd * 2 * args.layers / 1e9
    print(
        f"tag check: batch {b}, context {ctx} ({per_req} pages of {ps} each), {args.layers} layers, "
        f"{heads}/{kv_heads} heads of {hd}, bf16 ({kv_gb:.1f} GB of KV read per step)"
    )
    print("| attention ms/layer | attention ms/step | tag check ms/step | ratio |")
    print("|---:|---:|---:|---:|")
    share = guard_ms / step_ms
    print(f"| {layer_ms:.3f} | {step_ms:.2f} | {guard_ms:.4f} | {share:.5f} ({100 * share:.3f} %) |")


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
    print("| checksum GB/s | copy GB/s | ratio |")
    print("|---:|---:|---:|")
    sum_rate, copy_rate = total / sum_ms / 1e6, total / copy_ms / 1e6
    print(f"| {sum_rate:.1f} | {copy_rate:.1f} | {sum_rate / copy_rate:.3f} |")


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
