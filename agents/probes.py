"""What the host and its engines say about themselves: GPU facts through NVML, and each
engine's KV pool and context length read where the engine states them: SGLang's and vLLM's
startup log lines, SGLang's /server_info, the OpenAI /v1/models of either, and the
Prometheus /metrics of either (SGLang's `sglang:*` constants, vLLM's `vllm:cache_config_info`).

Invariants: a probe reports only what the engine stated, with `source` naming the line or
endpoint it came from, and never guesses a number it did not read (an unknown field stays 0
or empty, which the ledger treats as unknown); every reading names, source by source, what it
could not read (`Reading.problems`), as long as something it needs is missing. The facts
become `pool` events, so a pool smaller than the context is caught as config_drift.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvguard.proto import pb

# A probe with the pool but no context length reports the pool anyway after this long: a
# prefill and a decode pool can then be compared, though their capacity cannot be judged.
CONTEXT_WAIT_S = 30.0
HTTP_TIMEOUT_S = 5.0
_NEEDED = {
    "pool_tokens": "the pool's tokens",
    "context_len": "the context length",
    "page_size": "the page size",
}


@dataclass(frozen=True)
class PoolFacts:
    engine: str
    pool_tokens: int = 0  # tokens a request can be granted (reserved pages excluded)
    context_len: int = 0
    page_size: int = 0
    reserved_pages: int = 0  # pages never handed out, beside the pool's tokens
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

    def missing(self) -> list[str]:
        """What a pool report needs that is not known yet, in words."""
        return [words for name, words in _NEEDED.items() if not getattr(self, name)]

    def report(self, pool: int, role: str) -> pb.PoolReport:
        """The pool event's payload: pool tokens = page_size x (num_pages - reserved_pages).
        A page size that was not stated is reported as 1 (the pool's tokens are what matter)."""
        page = self.page_size or 1
        # Whole pages only: a part page a pool cannot have is not counted as capacity.
        usable = max(1, self.pool_tokens // page) if self.pool_tokens else 0
        return pb.PoolReport(
            pool=pool,
            role=role,
            engine=self.engine,
            engine_version=self.engine_version,
            model=self.model,
            page_size=page,
            num_pages=usable + self.reserved_pages if usable else 0,
            reserved_pages=self.reserved_pages if usable else 0,
            context_len=self.context_len,
            max_prompt_tokens=self.max_prompt_tokens,
            kv_dtype=self.kv_dtype,
            tp_size=self.tp_size,
            mem_fraction=self.mem_fraction,
            source="; ".join(self.sources),
        )


@dataclass(frozen=True)
class Reading:
    """One read of an engine: what it stated (None: nothing yet), and each thing that could
    not be read, naming its source (empty once nothing needed is missing)."""

    facts: PoolFacts | None
    problems: tuple[str, ...] = ()


def _int(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


def _dtype(text: str) -> str:
    return text.removeprefix("torch.")


# SGLang's scheduler at start: "max_total_num_tokens=681280, chunked_prefill_size=8192,
# max_prefill_tokens=16384, max_running_requests=4096, context_len=1048576, ..."
_SGLANG_POOL = re.compile(r"\bmax_total_num_tokens=(\d+)")
_SGLANG_CONTEXT = re.compile(r"\bcontext_len=(\d+)")
# tp_worker.get_worker_info, when the served pool is below the context:
_SGLANG_SHORT = re.compile(r"KV pool holds (\d+) tokens, fewer than --context-length (\d+)")
# memory_pool at allocation: "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 681280, ..."
_SGLANG_ALLOC = re.compile(r"(?<!draft )KV [Cc]ache (?:is )?allocated\. dtype: ([\w.]+), #tokens: (\d+)")
# The ServerArgs dump: "server_args={'model_path': 'm', 'page_size': 16, ...}" (0.5.x), or
# "server_args=ServerArgs(model_path='m', page_size=16, ...)" (older).
_SGLANG_ARGS = (
    "model_path",
    "page_size",
    "tp_size",
    "mem_fraction_static",
    "kv_cache_dtype",
    "context_length",
)


def _arg(line: str, name: str) -> str | None:
    """A value in a dumped dict or dataclass repr: 'name': v or name=v (quotes removed)."""
    m = re.search(rf"(?:'{name}':\s*|\b{name}=)('([^']*)'|[^,)}}\s]+)", line)
    if m is None:
        return None
    return m.group(2) if m.group(2) is not None else m.group(1)


def _number(value: str | None, kind: Callable[[str], Any] = int) -> Any:
    try:
        return kind(value) if value not in (None, "None", "null") else 0  # type: ignore[arg-type]
    except ValueError:
        return 0


def parse_sglang_log(lines: Iterable[str]) -> PoolFacts | None:
    """Pool facts from SGLang's startup log, or None if no line states the pool yet."""
    facts: dict[str, Any] = {}
    sources: list[str] = []
    alloc_dtype = ""
    stated = ""  # the line the pool was read from: the scheduler's outranks the others
    for number, line in enumerate(lines, 1):
        if m := _SGLANG_POOL.search(line):
            if stated != "scheduler":
                facts["pool_tokens"], stated = int(m.group(1)), "scheduler"
                sources.append(f"log line {number}: max_total_num_tokens")
                if m := _SGLANG_CONTEXT.search(line):
                    facts["context_len"] = int(m.group(1))
        elif m := _SGLANG_SHORT.search(line):
            facts.setdefault("pool_tokens", int(m.group(1)))
            facts.setdefault("context_len", int(m.group(2)))
            sources.append(f"log line {number}: KV pool holds fewer than --context-length")
        elif m := _SGLANG_ALLOC.search(line):
            alloc_dtype = alloc_dtype or _dtype(m.group(1))
            if "pool_tokens" not in facts:
                facts["pool_tokens"] = int(m.group(2))
                sources.append(f"log line {number}: KV Cache is allocated")
        elif "server_args=" in line:
            args = {name: _arg(line, name) for name in _SGLANG_ARGS}
            facts["page_size"] = _number(args["page_size"])
            facts["tp_size"] = _number(args["tp_size"])
            facts["mem_fraction"] = _number(args["mem_fraction_static"], float)
            facts["model"] = args["model_path"] or ""
            facts["kv_dtype"] = args["kv_cache_dtype"] or ""
            if context := _number(args["context_length"]):
                facts.setdefault("context_len", context)
            sources.append(f"log line {number}: server_args")
    if "pool_tokens" not in facts:
        return None
    if facts.get("kv_dtype", "auto") == "auto" and alloc_dtype:
        facts["kv_dtype"] = alloc_dtype  # what was allocated, where the configuration says "auto"
    return PoolFacts("sglang", reserved_pages=1, sources=tuple(sources), **facts)


# vLLM 0.33 at start, one line (kv_cache_utils.update_kv_cache_capacity): "GPU KV cache size:
# 681,280 tokens, Maximum concurrency for 1,048,576 tokens per request: 0.65x" (the device is
# CPU, XPU, ... elsewhere); older versions print "# GPU blocks: 42580, # CPU blocks: 2048".
_VLLM_POOL = re.compile(r"\b[A-Z]+(?: \+ host)? KV cache size: ([\d,]+) tokens")
_VLLM_CONTEXT = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request")
_VLLM_MAX_LEN = re.compile(r"\bmax_seq_len=(\d+)|'max_model_len': (\d+)|max model len (\d+)", re.IGNORECASE)
_VLLM_BLOCKS = re.compile(r"# GPU blocks: (\d+)")
_VLLM_BLOCK_SIZE = re.compile(r"'block_size': (\d+)|\bblock_size=(\d+)")
_VLLM_VERSION = re.compile(r"vLLM API server version ([\w.+-]+)|Initializing .*?engine \(v([\w.+-]+)\)")
_VLLM_CONFIG = re.compile(r"engine \(v[\w.+-]+\) with config: ")


def parse_vllm_log(lines: Iterable[str]) -> PoolFacts | None:
    """Pool facts from vLLM's startup log, or None if its KV cache line is not there yet."""
    facts: dict[str, Any] = {}
    sources: list[str] = []
    blocks = 0
    for number, line in enumerate(lines, 1):
        if m := _VLLM_POOL.search(line):
            facts["pool_tokens"] = _int(m.group(1))
            sources.append(f"log line {number}: KV cache size")
        if m := _VLLM_CONTEXT.search(line):
            facts["context_len"] = _int(m.group(1))
        elif (m := _VLLM_MAX_LEN.search(line)) and "context_len" not in facts:
            facts["context_len"] = int(next(g for g in m.groups() if g))
        if m := _VLLM_BLOCKS.search(line):
            blocks = int(m.group(1))
            sources.append(f"log line {number}: # GPU blocks")
        if m := _VLLM_BLOCK_SIZE.search(line):
            facts.setdefault("page_size", int(m.group(1) or m.group(2)))
        if m := _VLLM_VERSION.search(line):
            facts["engine_version"] = m.group(1) or m.group(2)
        if _VLLM_CONFIG.search(line):
            facts["model"] = _arg(line, "model") or ""
            facts["tp_size"] = _number(_arg(line, "tensor_parallel_size"))
            facts["kv_dtype"] = _arg(line, "kv_cache_dtype") or ""
    if "pool_tokens" not in facts and blocks and facts.get("page_size"):
        facts["pool_tokens"] = blocks * facts["page_size"]
    if "pool_tokens" not in facts:
        return None
    return PoolFacts("vllm", sources=tuple(sources), **facts)


def from_sglang_server_info(info: dict[str, Any], source: str = "/server_info") -> PoolFacts:
    """SGLang's server-info document: the resolved server args and the scheduler's info at
    the top level, each DP rank's internal state below."""
    states = info.get("internal_states") or [{}]
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    capacity = (first.get("memory_usage") or {}).get("token_capacity") if first else None
    pool = info.get("max_total_num_tokens") or first.get("max_total_num_tokens") or capacity or 0
    dtype = str(info.get("kv_cache_dtype") or "")
    return PoolFacts(
        "sglang",
        pool_tokens=int(pool),
        context_len=int(info.get("context_length") or first.get("context_len") or 0),
        page_size=int(info.get("page_size") or 0),
        reserved_pages=1,
        engine_version=str(info.get("version", "")),
        model=str(info.get("model_path") or ""),
        kv_dtype=dtype,
        tp_size=int(info.get("tp_size") or 0),
        mem_fraction=float(info.get("mem_fraction_static") or 0.0),
        sources=(source,),
    )


def from_openai_models(models: dict[str, Any], engine: str, source: str = "/v1/models") -> PoolFacts:
    """The context length an OpenAI-compatible server advertises (`max_model_len`)."""
    data = models.get("data") or [{}]
    first = next((card for card in data if not card.get("parent")), data[0]) if data else {}
    return PoolFacts(
        engine,
        context_len=int(first.get("max_model_len") or 0),
        model=str(first.get("root") or first.get("id") or ""),
        sources=(source,),
    )


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _unescape(m: re.Match[str]) -> str:
    return "\n" if m[1] == "n" else m[1]


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition: each metric's samples as (labels, value)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not (m := _SAMPLE.match(line.strip())):
            continue
        labels = {k: _ESCAPE.sub(_unescape, v) for k, v in _LABEL.findall(m[2] or "")}
        try:
            samples.setdefault(m[1], []).append((labels, float(m[3])))
        except ValueError:
            continue
    return samples


def from_sglang_metrics(samples: dict[str, list[tuple[dict[str, str], float]]], source: str) -> PoolFacts:
    """SGLang's constants on /metrics (--enable-metrics), one sample per scheduler rank: the
    smallest pool and the largest context of them, which is what a request meets."""

    def values(name: str) -> list[int]:
        return [int(v) for _, v in samples.get(f"sglang:{name}", [])]

    pool, context, page = values("max_total_num_tokens"), values("context_len"), values("page_size")
    names = [labels.get("model_name", "") for labels, _ in samples.get("sglang:max_total_num_tokens", [])]
    return PoolFacts(
        "sglang",
        pool_tokens=min(pool, default=0),
        context_len=max(context, default=0),
        page_size=min(page, default=0),
        reserved_pages=1,
        model=names[0] if names else "",
        sources=(source,),
    )


def from_vllm_metrics(samples: dict[str, list[tuple[dict[str, str], float]]], source: str) -> PoolFacts:
    """vLLM's `vllm:cache_config_info` labels (its CacheConfig, as strings). num_gpu_blocks
    counts the null block; with several engines (data parallel) it is their sum, so the pool
    is read from kv_cache_size_tokens, each engine's own."""
    info = [labels for labels, _ in samples.get("vllm:cache_config_info", [])]
    if not info:
        return PoolFacts("vllm", sources=(source,))
    first = info[0]
    page = _number(first.get("block_size"))
    blocks = _number(first.get("num_gpu_blocks"))
    engines = {labels.get("engine", "") for labels in info}
    if len(engines) == 1 and blocks and page:
        pool, reserved = (blocks - 1) * page, 1
    else:
        pool, reserved = _number(first.get("kv_cache_size_tokens")), 0
    return PoolFacts(
        "vllm",
        pool_tokens=pool,
        page_size=page,
        reserved_pages=reserved,
        kv_dtype=first.get("cache_dtype", ""),
        mem_fraction=_number(first.get("gpu_memory_utilization"), float),
        sources=(source,),
    )


def fetch(url: str, timeout: float = HTTP_TIMEOUT_S) -> tuple[str | None, str | None, int]:
    """(body, None, 200) or (None, what went wrong in words, HTTP status or 0)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace"), None, 200
    except urllib.error.HTTPError as exc:
        return None, f"GET {url}: HTTP {exc.code}", exc.code
    except urllib.error.URLError as exc:
        return None, f"GET {url}: unreachable ({exc.reason})", 0
    except (OSError, ValueError) as exc:  # a timeout, a reset, a malformed URL
        return None, f"GET {url}: unreachable ({exc})", 0


def fetch_json(url: str, timeout: float = HTTP_TIMEOUT_S) -> tuple[dict[str, Any] | None, str | None, int]:
    body, problem, status = fetch(url, timeout)
    if body is None:
        return None, problem, status
    try:
        doc = json.loads(body)
    except ValueError as exc:
        return None, f"GET {url}: not JSON ({exc})", status
    if not isinstance(doc, dict):
        return None, f"GET {url}: not a JSON object", status
    return doc, None, status


def _lacks(source: str, facts: PoolFacts, names: dict[str, str]) -> list[str]:
    return [f"{source}: no {words}" for name, words in names.items() if not getattr(facts, name)]


def read_sglang_http(base: str) -> tuple[PoolFacts | None, list[str]]:
    problems: list[str] = []
    facts: PoolFacts | None = None
    url = base + "/server_info"
    info, problem, status = fetch_json(url)
    if status == 404:  # an SGLang older than /server_info
        url = base + "/get_server_info"
        info, problem, status = fetch_json(url)
    if info is None:
        problems.append(str(problem))
    else:
        facts = from_sglang_server_info(info, url)
        problems += _lacks(url, facts, {"pool_tokens": "max_total_num_tokens", "page_size": "page_size"})
    if facts is None or not facts.context_len:
        url = base + "/v1/models"
        models, problem, _ = fetch_json(url)
        if models is None:
            problems.append(str(problem))
        else:
            more = from_openai_models(models, "sglang", url)
            problems += _lacks(url, more, {"context_len": "max_model_len"})
            facts = facts.merged(more) if facts else more
    if facts is None or facts.missing():
        url = base + "/metrics"
        text, problem, _ = fetch(url)
        if text is None:
            problems.append(f"{problem} (SGLang serves it with --enable-metrics)")
        else:
            more = from_sglang_metrics(parse_prometheus(text), url)
            problems += _lacks(url, more, {"pool_tokens": "sglang:max_total_num_tokens"})
            facts = facts.merged(more) if facts else more
    return facts, problems


def read_vllm_http(base: str) -> tuple[PoolFacts | None, list[str]]:
    problems: list[str] = []
    facts: PoolFacts | None = None
    url = base + "/v1/models"
    models, problem, _ = fetch_json(url)
    if models is None:
        problems.append(str(problem))
    else:
        facts = from_openai_models(models, "vllm", url)
        problems += _lacks(url, facts, {"context_len": "max_model_len"})
    url = base + "/metrics"
    text, problem, _ = fetch(url)
    if text is None:
        problems.append(str(problem))
    else:
        more = from_vllm_metrics(parse_prometheus(text), url)
        if not more.page_size:
            problems.append(f"{url}: no vllm:cache_config_info")
        elif not more.pool_tokens:
            problems.append(f"{url}: vllm:cache_config_info has no num_gpu_blocks yet (not profiled)")
        facts = facts.merged(more) if facts else more
    return facts, problems


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


def _text(value: Any) -> str:
    """An NVML string: bytes in older pynvml releases, str in newer ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def gpu_facts() -> GpuFacts:
    """The host's GPUs through NVML (read once, at the agent's start: the node's status carries
    them); says plainly why not when it cannot, never raises."""
    try:
        import pynvml
    except ImportError:
        return GpuFacts(unavailable="pynvml is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses; none of them is fatal here
        return GpuFacts(unavailable=f"NVML did not start ({exc}); this host has no usable NVIDIA GPU")
    facts = GpuFacts()
    try:
        facts.driver = _text(pynvml.nvmlSystemGetDriverVersion())
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            facts.gpus.append(
                {
                    "index": i,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "memory_total": int(memory.total),
                    "memory_used": int(memory.used),
                }
            )
        if not facts.gpus:
            facts.unavailable = "NVML found no GPU on this host"
    except Exception as exc:  # a GPU NVML cannot read (fallen off the bus, ...): said, not raised
        facts.unavailable = f"NVML could not read GPU {len(facts.gpus)} ({exc}); {len(facts.gpus)} read"
    finally:
        pynvml.nvmlShutdown()
    return facts
