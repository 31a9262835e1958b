"""What vLLM 0.33 itself says about its KV pool, for kvguard's probes: the startup log lines,
the /v1/models document and the /metrics exposition of engines of several shapes.

All of it comes from vLLM's own code on CPU: a real VllmConfig (model config from a tiny
architecture registered through vLLM's ModelRegistry, so no weights are needed), a real
KVCacheConfig, `update_kv_cache_capacity` logging through vLLM's logger and formatter,
`OpenAIModelRegistry.show_available_models`, and `PrometheusStatLogger.log_engine_initialized`
exposed by prometheus_client's `generate_latest` (as vLLM's /metrics does). Only the engine's
"Initializing a V1 LLM engine" line is formatted here, with the format string read from
vllm/v1/engine/core.py (EngineCore cannot start on CPU), the real config and version.
Prints {"version", "nodes": {name: {"log", "models", "metrics", "num_blocks", ...}}}.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

import torch
from probe_support import capture, done, format_of
from prometheus_client import generate_latest
from tiny_model import llama_dir
from vllm import ModelRegistry
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
from vllm.logger import _DATE_FORMAT, _FORMAT, _VllmLogRecordFactory, set_vllm_process_name
from vllm.logging_utils import NewLineFormatter
from vllm.v1.core import kv_cache_utils
from vllm.v1.engine import core
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import get_prometheus_registry
from vllm.version import __version__ as VLLM_VERSION


class KvguardTinyForCausalLM(torch.nn.Module):
    """An architecture for ModelConfig to inspect; never run."""

    def __init__(self, *, vllm_config: VllmConfig | None = None, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: object) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# name: (max_model_len, num_gpu_blocks, block_size, kv cache dtype)
SHAPES = {
    "fits": (4096, 1025, 16, "auto"),  # 1024 usable blocks and the null block: 4 requests
    "short": (4096, 200, 16, "auto"),  # --num-gpu-blocks-override 200: 3200 tokens < 4096
    # A PD pair whose decode side lays KV out otherwise. Shapes differ from the above: vLLM
    # logs each distinct capacity line once per process (info_once).
    "prefill": (4096, 1041, 16, "auto"),
    "decode": (4096, 513, 32, "fp8"),
}


def model_dir(root: Path) -> Path:
    return llama_dir(
        root,
        "acme-tiny",
        architectures=["KvguardTinyForCausalLM"],
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=8192,
        torch_dtype="float32",
        rms_norm_eps=1e-5,
    )


def node(model: Path, max_len: int, blocks: int, block: int, dtype: str) -> dict[str, object]:
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, max_model_len=max_len, dtype="float32"
        ),
        cache_config=CacheConfig(block_size=block, cache_dtype=dtype, num_gpu_blocks_override=blocks),
        device_config=DeviceConfig(device="cpu"),
    )
    log = capture("vllm", NewLineFormatter(_FORMAT, _DATE_FORMAT))
    started = format_of(core, "Initializing a V1 LLM engine")
    logging.getLogger(core.__name__).info(started, VLLM_VERSION, config)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)]
    )
    config.cache_config.num_gpu_blocks = kv.num_blocks  # as EngineCore does before logging
    kv_cache_utils.update_kv_cache_capacity(config, kv)
    registry = OpenAIModelRegistry(
        config.model_config, [BaseModelPath(name="acme/tiny", model_path=str(model))]
    )
    models = asyncio.run(registry.show_available_models()).model_dump()
    metrics = PrometheusStatLogger(config, engine_indexes=[0])
    metrics.log_engine_initialized()
    logging.getLogger("vllm").removeHandler(log)
    return {
        "log": log.take(),
        "models": models,
        "metrics": generate_latest(get_prometheus_registry()).decode(),
        "num_blocks": blocks,
        "block_size": block,
        "max_model_len": max_len,
        "kv_cache_size_tokens": config.cache_config.kv_cache_size_tokens,
        "model": str(model),
    }


def main() -> None:
    # What vLLM's logging setup installs (skipped in this venv: VLLM_CONFIGURE_LOGGING is unset).
    logging.setLogRecordFactory(_VllmLogRecordFactory(logging.getLogRecordFactory()))
    set_vllm_process_name("EngineCore")
    ModelRegistry.register_model("KvguardTinyForCausalLM", KvguardTinyForCausalLM)
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp))
        nodes = {name: node(model, *shape) for name, shape in SHAPES.items()}
    done({"version": VLLM_VERSION, "nodes": nodes})


if __name__ == "__main__":
    main()
