"""What SGLang 0.5.23 itself says about its KV pool, for kvguard's probes: the startup log
lines, the /server_info and /v1/models documents and the /metrics exposition of engines of
several shapes.

From SGLang's own code on CPU: a real ServerArgs and ModelConfig (from a tiny local HF
config), logging configured by SGLang's `configure_logger`; the ServerArgs dump by engine.py's
own f-string and _server_args_for_logging (compiled from engine.py's source: the module needs
uvloop to import); a real MHATokenToKVPool writing "KV Cache is allocated"; /server_info built as
http_server.server_info builds it (build_server_info, Scheduler.get_init_info, the internal
state's build_memory_usage); /v1/models as SGLang's ModelList; /metrics from a real
SchedulerMetricsCollector's emit_constants through prometheus_client's generate_latest. Two
lines come from code that needs a whole scheduler, so their formats are read from the
installed source and filled here: the scheduler's "max_total_num_tokens=..." f-string
(scheduler.py) and tp_worker.get_worker_info's "KV pool holds %d tokens" warning.
Prints {"version", "nodes": {name: {"log", "server_info", "models", "metrics", ...}}}.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from probe_support import done, format_of, function_of, render_fstring
from prometheus_client import REGISTRY, generate_latest
from sglang.srt import runtime_context
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList
from sglang.srt.managers import scheduler, tp_worker
from sglang.srt.managers.scheduler_components.memory_usage import build_memory_usage
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import build_server_info, configure_logger
from sglang.srt.utils.msgspec_utils import msgspec_to_builtins
from sglang.version import __version__ as SGLANG_VERSION
from tiny_model import llama_dir

# name: (pool tokens, page size, kv cache dtype, disaggregation mode)
SHAPES = {
    "fits": (8192, 16, "auto", "null"),
    "short": (2048, 16, "auto", "null"),  # below the model's 4096 context
    "prefill": (8192, 16, "auto", "prefill"),  # a PD pair whose decode side lays KV out otherwise
    "decode": (8192, 32, "fp8_e4m3", "decode"),
}
CONTEXT = 4096
ENGINE = "sglang.srt.entrypoints.engine"


def model_dir(root: Path) -> Path:
    return llama_dir(
        root,
        "acme-tiny",
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=CONTEXT,
        torch_dtype="bfloat16",
        rms_norm_eps=1e-5,
    )


def unregister_sglang_metrics() -> None:
    """A second collector in one process would clash with the first's metric names."""
    for collector in list(REGISTRY._collector_to_names):  # prometheus_client has no public list
        if any(name.startswith("sglang:") for name in REGISTRY._collector_to_names[collector]):
            REGISTRY.unregister(collector)


def node(model: Path, pool: int, page: int, kv_dtype: str, mode: str) -> dict[str, object]:
    args = ServerArgs(
        model_path=str(model),
        page_size=page,
        kv_cache_dtype=kv_dtype,
        tp_size=1,
        device="cpu",
        disaggregation_mode=mode,
        enable_metrics=True,
    )
    configure_logger(args, prefix=" TP0")  # SGLang's own format, to stderr: read back below
    log = io.StringIO()
    logging.getLogger().handlers[0].setStream(log)  # type: ignore[attr-defined]
    runtime_context.publish(args, role="scheduler")
    model_config = ModelConfig.from_server_args(args)
    # engine.py imports uvloop, which this CPU venv lacks: its code is read, not imported.
    dump = function_of(
        ENGINE, "_server_args_for_logging", {"redact_watermark_secrets": redact_watermark_secrets}
    )
    names = {"server_args": args, "_server_args_for_logging": dump}
    logging.getLogger(ENGINE).info(render_fstring(ENGINE, "server_args=", names))
    dtype = torch.float8_e4m3fn if kv_dtype.startswith("fp8") else torch.bfloat16
    MHATokenToKVPool(
        size=pool, page_size=page, dtype=dtype, head_num=1, head_dim=4, layer_num=1, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    context = model_config.context_len
    if pool < context:  # tp_worker.get_worker_info's warning, before the scheduler's line
        logging.getLogger(tp_worker.__name__).warning(format_of(tp_worker, "KV pool holds"), pool, context)
    max_req_input_len = min(context - 1, pool - 1) - 5
    state = SimpleNamespace(
        max_total_num_tokens=pool,
        max_prefill_tokens=16384,
        max_running_requests=256,
        model_config=model_config,
        device="cpu",
        startup_available_gpu_memory_gb=12.5,
        max_req_input_len=max_req_input_len,
        startup_time=time.time(),
        page_size=page,
        _hicache_l3_layout=lambda: None,
    )
    names = {"self": state, "get_schedule": runtime_context.get_schedule}
    logging.getLogger(scheduler.__name__).info(render_fstring(scheduler, "max_total_num_tokens=", names))
    init_info = scheduler.Scheduler.get_init_info(state)  # type: ignore[arg-type]
    internal = {
        **runtime_context.get_context().resolved_server_args_dict(),
        "memory_usage": build_memory_usage(
            weight_gb=0.1,
            kv_cache_gb=0.2,
            startup_available_gb=12.5,
            token_capacity=pool,
            token_capacity_swa=None,
            target_graph_memory_usage=None,
            draft_graph_memory_usage=None,
        ),
    }
    server_info = msgspec_to_builtins(
        redact_watermark_secrets(
            {
                **build_server_info(args, init_info),
                "startup_time": init_info["startup_time"],
                "internal_states": [internal],
                "version": SGLANG_VERSION,
                "frontend": "python",
            }
        )
    )
    served = runtime_context.get_serving().served_model_name
    models = ModelList(data=[ModelCard(id=served, root=served, max_model_len=context)]).model_dump()
    unregister_sglang_metrics()
    engine_type = DisaggregationMode.to_engine_type(runtime_context.get_disagg().disaggregation_mode)
    labels = {"model_name": served, "engine_type": engine_type, "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
    collector = SchedulerMetricsCollector(labels=labels, server_args=args)
    collector.emit_constants(
        max_total_num_tokens=pool,
        max_total_num_tokens_swa=None,
        weight_memory_usage_gb=0.1,
        kv_cache_memory_usage_gb=0.2,
        graph_memory_usage_gb={},
        max_running_requests_under_SLO=None,
        page_size=page,
        num_pages=pool // page,
        context_len=context,
        startup_available_gpu_memory_gb=12.5,
    )
    return {
        "log": log.getvalue().splitlines(),
        "server_info": json.loads(json.dumps(server_info, default=str)),
        "models": models,
        "metrics": generate_latest(REGISTRY).decode(),
        "pool": pool,
        "page_size": page,
        "context_len": context,
        "model": str(model),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp))
        nodes = {name: node(model, *shape) for name, shape in SHAPES.items()}
    done({"version": SGLANG_VERSION, "nodes": nodes})


if __name__ == "__main__":
    main()
