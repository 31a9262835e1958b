"""A tiny local Llama model config (config.json only: no weights, no download) for the engines'
own config classes (SGLang's ServerArgs and ModelConfig, vLLM's VllmConfig) in the engine
venvs: the scenarios, the probes' scenarios and the adapters' benchmarks build them from it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "torch_dtype": "float16",
}


def llama_dir(root: Path | None = None, name: str = "tiny-llama", **fields: Any) -> Path:
    """A directory holding the tiny model's config.json, `fields` overriding LLAMA's."""
    path = Path(tempfile.mkdtemp(prefix="kvguard-model-")) if root is None else root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return path
