"""The vLLM adapter's added host time per scheduler step, on vLLM 0.33.0's real classes (CPU).

Two real `Scheduler`s (KVCacheManager, BlockPool; a tiny local Llama config.json, no weights)
hold the same decode batch: `batch` running requests, each with a ~1k-token prompt already
prefilled (staggered lengths, so block grants spread over the steps), block size 16, a pool
that never preempts. One is guarded by kvguard's adapter (`attach` with a NullSink guard, so
the guard's own host time is what is measured, not a sink's I/O); the other is not. The
adapter's patches are class-wide but dispatch by instance, so the unguarded scheduler is built
before `attach` and then has vLLM's original methods bound on it and on its KV cache manager:
it runs vLLM's own code, without even the adapter's pass-through wrappers. A step is vLLM's
`Scheduler.schedule()` + `update_from_output()` (the runner's part: a `ModelRunnerOutput` with
one sampled token a request, built outside the timing). The two schedulers alternate step by
step, in alternating order, so the machine's drift hits both alike; reported: median µs a
step for each, the difference and its ratio to the unguarded step. Run with the vLLM venv:

    .engines/vllm/bin/python bench/vllm_step.py [--quick] [--steps N] [--batches 32,128,256]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvguard.agents.attach import Attachment, Settings
from kvguard.agents.vllm import attach

BS = 16
PROMPT = 1024
PREFILL_TOKENS = 16384  # max_num_batched_tokens: the prefill takes a few steps, decode one
# The methods the adapter patches, as vLLM defines them (taken before `attach`).
PATCHED = {
    Scheduler: ("schedule", "_free_request", "update_from_output"),
    KVCacheManager: ("allocate_slots", "free", "pop_blocks_for_free"),
}
ORIGINAL = {cls: {name: getattr(cls, name) for name in names} for cls, names in PATCHED.items()}

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def model_dir() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines"))
    from tiny_model import llama_dir  # the tests' tiny model config

    config = {"num_attention_heads": 4, "vocab_size": 32000, "max_position_embeddings": 8192}
    return str(llama_dir(**config, rms_norm_eps=1e-6, tie_word_embeddings=False))


def scheduler(model: str, batch: int, max_model_len: int) -> Scheduler:
    num_blocks = batch * -(-max_model_len // BS) + 1  # every request at full length, + the null block
    mc = ModelConfig(
        model=model, dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len
    )
    sc = SchedulerConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=PREFILL_TOKENS,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(
        block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
    )
    vc = VllmConfig(
        model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu")
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kc = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)]
    )
    cc.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
    )


def unpatch(s: Scheduler) -> None:
    """vLLM's own methods on this instance: the adapter's class patches never see it."""
    for target in (s, s.kv_cache_manager):
        for name, fn in ORIGINAL[type(target)].items():
            setattr(target, name, types.MethodType(fn, target))


def fill(s: Scheduler, batch: int, max_tokens: int) -> None:
    """`batch` distinct tenants' requests, prefilled; then every request decodes."""
    for i in range(batch):
        n = PROMPT + i % BS
        prompt = [(i * 7919 + k) % 31000 + 1 for k in range(n)]  # distinct: no prefix hits
        tenant = f"t{i % 8}"
        s.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                None,
                cache_salt=tenant,
                block_hasher=HASHER,
            )
        )
    while any(r.is_prefill_chunk or r.num_computed_tokens == 0 for r in s.requests.values()):
        step(s)
    assert len(s.running) == batch, (len(s.running), batch)


def step(s: Scheduler) -> int:
    """One engine step; the ns vLLM's schedule() and update_from_output() took (the runner's
    output is built between them, untimed)."""
    t0 = time.perf_counter_ns()
    out = s.schedule()
    t1 = time.perf_counter_ns()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if not s.requests[r].is_prefill_chunk else [] for r in ids]
    mro = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    t2 = time.perf_counter_ns()
    s.update_from_output(out, mro)
    return t1 - t0 + time.perf_counter_ns() - t2


def lengths(batch: int, steps: int, warm: int) -> tuple[int, int]:
    """Each request's max_tokens (the first prefilled decode while the rest prefill, and all
    decode through the run) and the model's max length."""
    max_tokens = steps + warm + BS + 2 * batch * (PROMPT + BS) // PREFILL_TOKENS
    return max_tokens, -(-(PROMPT + BS + max_tokens) // BS) * BS


def measure(plain: Scheduler, model: str, batch: int, steps: int, warm: int) -> dict[str, float]:
    """`plain` was built before any adapter was attached: it has no pool state."""
    max_tokens, max_model_len = lengths(batch, steps, warm)
    unpatch(plain)
    attachment = Attachment("vllm", Settings(node="bench"))  # no socket, no capture: NullSink
    adapter = attach(attachment)
    guarded = scheduler(model, batch, max_model_len)
    assert (
        "_kvguard" in guarded.kv_cache_manager.__dict__ and "_kvguard" not in plain.kv_cache_manager.__dict__
    )
    for s in (plain, guarded):
        fill(s, batch, max_tokens)
    for _ in range(warm):
        step(plain)
        step(guarded)
    bare, kept = [], []
    for k in range(steps):
        if k % 2:
            bare.append(step(plain))
            kept.append(step(guarded))
        else:
            kept.append(step(guarded))
            bare.append(step(plain))
    guard = attachment.guard
    # The guard saw every step, judged nothing wrong and failed nowhere; the batch stayed whole.
    assert not attachment.failed and not guard.errors and not guard.findings and not guard.killed, (
        attachment.failed,
        guard.errors,
        guard.findings,
    )
    assert len(guarded.running) == len(plain.running) == batch
    assert adapter.pools >= 1
    u, g = statistics.median(bare) / 1e3, statistics.median(kept) / 1e3
    return {"unguarded": u, "guarded": g, "added": g - u, "pct": 100 * (g - u) / u}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=0, help="measured steps per scheduler and batch")
    parser.add_argument("--batches", default="32,128,256")
    args = parser.parse_args()
    steps = args.steps or (40 if args.quick else 600)
    warm = 4 if args.quick else 16
    model = model_dir()
    print(
        f"vLLM {vllm.__version__} adapter, added host time a decode step (schedule + update_from_output); "
        f"{platform.system()} {platform.machine()}, os.cpu_count()={os.cpu_count()}, python "
        f"{platform.python_version()}; prompt ~{PROMPT} tokens, block {BS}, {steps} steps each, median"
    )
    print(f"{'batch':>5} {'unguarded µs':>13} {'guarded µs':>11} {'added µs':>9} {'added %':>8}")
    batches = [int(b) for b in args.batches.split(",")]
    # Every unguarded scheduler is built before the first `attach`: once an adapter is active,
    # each new KV cache manager gets its pool state.
    plain = {b: scheduler(model, b, lengths(b, steps, warm)[1]) for b in batches}
    for batch in batches:
        r = measure(plain.pop(batch), model, batch, steps, warm)
        print(
            f"{batch:>5} {r['unguarded']:>13.1f} {r['guarded']:>11.1f} {r['added']:>9.1f} {r['pct']:>7.1f}%",
            flush=True,
        )


if __name__ == "__main__":
    main()
