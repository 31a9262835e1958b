"""The load witness of a guarded vLLM pool (`LoadWitness`): did the blocks a KV connector
says it loaded change? Read from the engine's own KV tensors, in this process, so that a load
filling fewer blocks than the connector reported is seen without trusting the connector.

Invariants: it only reads (the first and the last attention layer's tensors, the blocks asked
for, one digest per block: a change detector, not a checksum two nodes compare); where the KV
tensors are not in this process (workers in processes of their own) or a tensor has no one
block dimension, `find` gives None and the reason, and loads are taken at the connector's word.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class LoadWitness:
    def __init__(self, tensors: list[Any], dims: list[int]) -> None:
        self.tensors = tensors
        self.dims = dims

    def digests(self, blocks: np.ndarray) -> np.ndarray:
        """One digest per block, over the witnessed layers; one torch call per layer."""
        import torch

        total = np.zeros(len(blocks), np.int64)
        if not len(blocks):
            return total
        for tensor, dim in zip(self.tensors, self.dims, strict=True):
            index = torch.as_tensor(blocks, dtype=torch.long, device=tensor.device)
            rows = tensor.index_select(dim, index).movedim(dim, 0).contiguous()
            raw = rows.view(torch.uint8).reshape(len(blocks), -1).to(torch.int64)
            weights = torch.arange(1, raw.shape[1] + 1, device=raw.device, dtype=torch.int64)
            total = total * 1_000_003 + (raw * weights).sum(dim=1).cpu().numpy()
        return total

    def landed(self, blocks: np.ndarray, before: np.ndarray) -> int:
        """How many of `blocks`, from the first, changed since `before` was taken."""
        changed = self.digests(blocks) != before
        return len(blocks) if changed.all() else int(np.argmin(changed))


def find(vllm_config: Any, num_blocks: int) -> tuple[LoadWitness | None, str]:
    """The witness of this process's KV tensors, from vLLM's forward context; else why not."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    tensors: list[tuple[str, Any]] = []
    for name, layer in (context or {}).items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if kv is not None and hasattr(kv, "shape") and kv.numel() > 0:
            tensors.append((name, kv))
    if not tensors:
        return None, "no attention layer's KV tensor is in this process"
    chosen = [tensors[0]] if len(tensors) == 1 else [tensors[0], tensors[-1]]
    dims = []
    for name, kv in chosen:
        found = [d for d, n in enumerate(kv.shape) if n == num_blocks]
        if len(found) != 1:
            return (
                None,
                f"layer {name}'s KV tensor {tuple(kv.shape)} has no one dimension of {num_blocks} blocks",
            )
        dims.append(found[0])
    return LoadWitness([kv for _, kv in chosen], dims), ""
