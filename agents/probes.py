"""What the host and its engines say about themselves: GPU facts through NVML, and each
engine's KV pool and context length read where the engine states them (SGLang and vLLM
startup log lines, SGLang's /get_server_info, the OpenAI /v1/models of either).

Invariant: a probe reports only what the engine stated, with `source` naming the line or
endpoint it came from, and never guesses a number it did not read (an unknown field stays 0,
which the ledger treats as unknown). The facts become `pool` events, so a pool smaller than
the context is caught as config_drift at the engine's start.
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvguard.proto import pb


@dataclass(frozen=True)
class PoolFacts:
    engine: str
    pool_tokens: int = 0
    context_len: int = 0
    page_size: int = 0
    max_prompt_tokens: int = 0
    engine_version: str = ""
    model: str = ""
    kv_dtype: str = ""
    tp_size: int = 0
    mem_fraction: float = 0.0
    sources: tuple[str, ...] = ()

    def merged(self, other: PoolFacts) -> PoolFacts:
        """Fill what is unknown here from `other` (a second source of the same engine)."""
        values = {
            name: getattr(other, name)
            for name in self.__dataclass_fields__
            if name not in ("engine", "sources") and not getattr(self, name) and getattr(other, name)
        }
        return replace(self, **values, sources=self.sources + other.sources)

    def report(self, pool: int, role: str) -> pb.PoolReport:
        """The pool event's payload. Engines that manage KV per token (SGLang's default page
        size 1) are reported with that page size; the pool's tokens are what matters."""
        page = self.page_size or 1
        return pb.PoolReport(
            pool=pool,
            role=role,
            engine=self.engine,
            engine_version=self.engine_version,
            model=self.model,
            page_size=page,
            num_pages=max(1, math.ceil(self.pool_tokens / page)) if self.pool_tokens else 0,
            context_len=self.context_len,
            max_prompt_tokens=self.max_prompt_tokens,
            kv_dtype=self.kv_dtype,
            tp_size=self.tp_size,
            mem_fraction=self.mem_fraction,
            source="; ".join(self.sources),
        )


def _int(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


# SGLang's scheduler at start: "max_total_num_tokens=681280, chunked_prefill_size=8192,
# max_prefill_tokens=16384, max_running_requests=4096, context_len=1048576, ..."
_SGLANG_POOL = re.compile(r"max_total_num_tokens=(\d+)")
_SGLANG_CONTEXT = re.compile(r"\bcontext_len=(\d+)")
# SGLang's ServerArgs dump: "server_args=ServerArgs(model_path='...', ..., page_size=16, ...)"
_SGLANG_ARGS = {
    "page_size": re.compile(r"\bpage_size=(\d+)"),
    "tp_size": re.compile(r"\btp_size=(\d+)"),
    "mem_fraction": re.compile(r"\bmem_fraction_static=([0-9.]+)"),
    "model": re.compile(r"\bmodel_path='([^']*)'"),
    "kv_dtype": re.compile(r"\bkv_cache_dtype='([^']*)'"),
}
_SGLANG_TYPES = {"page_size": int, "tp_size": int, "mem_fraction": float, "model": str, "kv_dtype": str}
# vLLM at start: "GPU KV cache size: 681,280 tokens" and
# "Maximum concurrency for 1,048,576 tokens per request: 0.65x"; older versions print
# "# GPU blocks: 42580, # CPU blocks: 2048" with the block size in the engine config line.
_VLLM_POOL = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_VLLM_CONTEXT = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request")
_VLLM_MAX_LEN = re.compile(r"max_seq_len=(\d+)|max model len (\d+)", re.IGNORECASE)
_VLLM_BLOCKS = re.compile(r"# GPU blocks: (\d+)")
_VLLM_BLOCK_SIZE = re.compile(r"\bblock_size=(\d+)")
_VLLM_VERSION = re.compile(r"vLLM API server version ([\w.+-]+)|Initializing .*?engine \(v([\w.+-]+)\)")


def parse_sglang_log(lines: Iterable[str]) -> PoolFacts | None:
    """Pool facts from SGLang's startup log, or None if its pool line is not there yet."""
    facts: dict[str, Any] = {}
    sources: list[str] = []
    for number, line in enumerate(lines, 1):
        if (m := _SGLANG_POOL.search(line)) and "pool_tokens" not in facts:
            facts["pool_tokens"] = int(m.group(1))
            sources.append(f"log line {number}: max_total_num_tokens")
            if m := _SGLANG_CONTEXT.search(line):
                facts["context_len"] = int(m.group(1))
        if "ServerArgs(" in line:
            for name, pattern in _SGLANG_ARGS.items():
                if m := pattern.search(line):
                    facts[name] = _SGLANG_TYPES[name](m.group(1))
    if "pool_tokens" not in facts:
        return None
    return PoolFacts("sglang", sources=tuple(sources), **facts)


def parse_vllm_log(lines: Iterable[str]) -> PoolFacts | None:
    """Pool facts from vLLM's startup log, or None if its KV cache line is not there yet."""
    facts: dict[str, Any] = {}
    sources: list[str] = []
    blocks = 0
    for number, line in enumerate(lines, 1):
        if m := _VLLM_POOL.search(line):
            facts["pool_tokens"] = _int(m.group(1))
            sources.append(f"log line {number}: GPU KV cache size")
        if m := _VLLM_CONTEXT.search(line):
            facts["context_len"] = _int(m.group(1))
        elif (m := _VLLM_MAX_LEN.search(line)) and "context_len" not in facts:
            facts["context_len"] = int(m.group(1) or m.group(2))
        if m := _VLLM_BLOCKS.search(line):
            blocks = int(m.group(1))
            sources.append(f"log line {number}: # GPU blocks")
        if (m := _VLLM_BLOCK_SIZE.search(line)) and "page_size" not in facts:
            facts["page_size"] = int(m.group(1))
        if m := _VLLM_VERSION.search(line):
            facts["engine_version"] = m.group(1) or m.group(2)
    if "pool_tokens" not in facts and blocks and facts.get("page_size"):
        facts["pool_tokens"] = blocks * facts["page_size"]
    if "pool_tokens" not in facts:
        return None
    return PoolFacts("vllm", sources=tuple(sources), **facts)


def from_sglang_server_info(info: dict[str, Any], source: str = "/get_server_info") -> PoolFacts:
    """SGLang's server-info document: server args at the top level, internal states below."""
    states = info.get("internal_states") or [{}]
    first = states[0] if isinstance(states, list) and states else {}
    pool = info.get("max_total_num_tokens") or first.get("max_total_num_tokens") or 0
    return PoolFacts(
        "sglang",
        pool_tokens=int(pool),
        context_len=int(info.get("context_length") or first.get("context_len") or 0),
        page_size=int(info.get("page_size") or 0),
        engine_version=str(info.get("version", "")),
        model=str(info.get("model_path", "")),
        kv_dtype=str(info.get("kv_cache_dtype", "")),
        tp_size=int(info.get("tp_size") or 0),
        mem_fraction=float(info.get("mem_fraction_static") or 0.0),
        sources=(source,),
    )


def from_openai_models(models: dict[str, Any], engine: str, source: str = "/v1/models") -> PoolFacts:
    """The context length an OpenAI-compatible server advertises (vLLM's max_model_len)."""
    data = models.get("data") or [{}]
    first = data[0] if data else {}
    return PoolFacts(
        engine,
        context_len=int(first.get("max_model_len") or 0),
        model=str(first.get("id", "")),
        sources=(source,),
    )


def fetch_json(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass
class GpuFacts:
    gpus: list[dict[str, Any]] = field(default_factory=list)
    driver: str = ""
    unavailable: str = ""  # why NVML could not be used, in words; empty when it could

    def describe(self) -> str:
        if self.unavailable:
            return f"no GPU facts: {self.unavailable}"
        names = ", ".join(f"{g['name']} ({g['memory_total'] / 2**30:.0f} GiB)" for g in self.gpus)
        return f"{len(self.gpus)} GPU(s), driver {self.driver}: {names}"


def gpu_facts() -> GpuFacts:
    """The host's GPUs through NVML; says plainly why not when it cannot."""
    try:
        import pynvml
    except ImportError:
        return GpuFacts(unavailable="pynvml is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses; none of them is fatal here
        return GpuFacts(unavailable=f"NVML did not start ({exc}); this host has no usable NVIDIA GPU")
    try:
        facts = GpuFacts(driver=str(pynvml.nvmlSystemGetDriverVersion()))
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            facts.gpus.append(
                {
                    "index": i,
                    "name": str(pynvml.nvmlDeviceGetName(handle)),
                    "uuid": str(pynvml.nvmlDeviceGetUUID(handle)),
                    "memory_total": int(memory.total),
                    "memory_used": int(memory.used),
                }
            )
        if not facts.gpus:
            facts.unavailable = "NVML found no GPU on this host"
        return facts
    finally:
        pynvml.nvmlShutdown()
