"""The load witness, kvguard's half in vLLM's workers: did the blocks a synchronous KV
connector loads change? Read from the worker's own KV tensors, so that a load filling fewer
blocks than the connector reported is seen without trusting the connector.

On a step with synchronous loads (SchedulerOutput.has_sync_kv_loads), around the
connector's `start_load_kv`: one digest per block before and after it, for the blocks that
hold each new request's computed tokens (its prefix hits and what the connector loads;
the forward's own writes come later), in the first and the last attention layer. The blocks
that did not change ride back to the scheduler in vLLM's own channel for load failures,
KVConnectorOutput.invalid_block_ids, encoded as negative ids no block has: MARK says this
step was witnessed, and -(b + 2) that block b did not change. vLLM's aggregator unions the
sets of all tensor-parallel ranks, so a block one rank did not get counts as not landed.
The scheduler's half (state.py, `taken`) removes them before vLLM reads the set.

Invariants: it only reads the KV tensors (a digest is a change detector, not a checksum two
nodes compare); it never raises into the worker: anything it cannot witness is left
unwitnessed (no MARK), and the scheduler's half then takes the connector at its word.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

log = logging.getLogger("kvguard.adapter")

MARK = -1  # in invalid_block_ids: the loads of this step were witnessed
_PATCHED: dict[str, Any] = {}


def encoded(unchanged: np.ndarray) -> set[int]:
    return {MARK, *(-(unchanged + 2)).tolist()}


def taken(invalid: set[int]) -> tuple[bool, np.ndarray]:
    """The witness's part of an invalid_block_ids set, removed from it: (witnessed, the blocks
    that did not change)."""
    ours = {b for b in invalid if b < 0}
    if not ours:
        return False, np.zeros(0, np.int64)
    invalid -= ours
    unchanged = np.fromiter((-b - 2 for b in ours if b != MARK), np.int64)
    return MARK in ours, unchanged


CHUNK = 256  # blocks digested at a time: bounds the scratch memory on the tensor's device


def digests(layers: list[tuple[Any, int]], blocks: np.ndarray) -> np.ndarray:
    """One digest per block over the given (tensor, block dimension) layers: the block's
    bytes read as 32-bit words, weighted by position and summed, on the tensor's device."""
    import torch

    total = np.zeros(len(blocks), np.int64)
    for tensor, dim in layers:
        parts = []
        for at in range(0, len(blocks), CHUNK):
            index = torch.as_tensor(blocks[at : at + CHUNK], dtype=torch.long, device=tensor.device)
            rows = tensor.index_select(dim, index).movedim(dim, 0).contiguous()
            words = rows.view(torch.uint8).reshape(len(index), -1)
            if words.shape[1] % 4 == 0:
                words = words.view(torch.int32)
            words = words.to(torch.int64)
            weights = torch.arange(1, words.shape[1] + 1, device=words.device, dtype=torch.int64)
            parts.append((words * weights).sum(dim=1).cpu().numpy())
        total = total * 1_000_003 + np.concatenate(parts)
    return total


def kv_layers(forward_context: Any, num_blocks: int) -> list[tuple[Any, int]]:
    """The first and the last attention layer's KV tensor, each with its block dimension
    (the one of num_blocks); none when a tensor has not exactly one."""
    tensors = []
    for layer in getattr(forward_context, "no_compile_layers", {}).values():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if kv is not None and hasattr(kv, "shape") and kv.numel() > 0:
            tensors.append(kv)
    chosen = tensors[:1] + tensors[-1:] if len(tensors) > 1 else tensors
    layers = []
    for kv in chosen:
        dims = [d for d, n in enumerate(kv.shape) if n == num_blocks]
        if len(dims) != 1:
            return []
        layers.append((kv, dims[0]))
    return layers


def watched_blocks(scheduler_output: Any, block_size: int) -> np.ndarray:
    """The blocks of the step's new requests that hold their computed tokens (group 0)."""
    parts = [
        np.asarray(new.block_ids[0][: -(-new.num_computed_tokens // block_size)], np.int64)
        for new in scheduler_output.scheduled_new_reqs
        if new.num_computed_tokens and new.block_ids
    ]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


class _Watch:
    def __init__(self, connector: Any, scheduler_output: Any) -> None:
        from vllm.forward_context import get_forward_context

        config = connector._vllm_config
        num_blocks = int(config.cache_config.num_gpu_blocks or 0)
        self.layers = kv_layers(get_forward_context(), num_blocks)
        self.blocks = watched_blocks(scheduler_output, config.cache_config.block_size)
        self.before = digests(self.layers, self.blocks) if self.layers and len(self.blocks) else None
        self.after: np.ndarray | None = None

    def loaded(self) -> None:
        if self.before is not None:
            self.after = digests(self.layers, self.blocks)

    def report(self, output: Any) -> None:
        if self.after is None or output is None:
            return
        unchanged = self.blocks[self.after == self.before]
        output.invalid_block_ids = set(output.invalid_block_ids or ()) | encoded(unchanged)


def _watch(scheduler_output: Any) -> _Watch | None:
    try:
        if not getattr(scheduler_output, "has_sync_kv_loads", False):
            return None
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return _Watch(get_kv_transfer_group(), scheduler_output)
    except Exception as exc:  # kvguard's own: this step's loads go unwitnessed
        log.error("kvguard: load witness: %s: %s", type(exc).__name__, exc)
        return None


def install() -> bool:
    """Wrap the worker's KV connector lifecycle (once per process); False where vLLM has none."""
    if _PATCHED:
        return True
    try:
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    except ImportError:
        return False
    original = KVConnectorModelRunnerMixin._get_kv_connector_output

    @contextlib.contextmanager
    @functools.wraps(original)
    def _get_kv_connector_output(scheduler_output: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        watch = _watch(scheduler_output)
        if watch is None:
            with original(scheduler_output, *args, **kwargs) as output:
                yield output
            return
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        start = connector.start_load_kv

        def start_load_kv(*a: Any, **kw: Any) -> Any:
            result = start(*a, **kw)
            try:
                watch.loaded()  # right after the load, before the forward writes anything
            except Exception as exc:
                log.error("kvguard: load witness: %s: %s", type(exc).__name__, exc)
            return result

        connector.start_load_kv = start_load_kv
        try:
            with original(scheduler_output, *args, **kwargs) as output:
                yield output
        finally:
            del connector.start_load_kv
        watch.report(output)

    _PATCHED["_get_kv_connector_output"] = original
    KVConnectorModelRunnerMixin._get_kv_connector_output = staticmethod(_get_kv_connector_output)
    return True
