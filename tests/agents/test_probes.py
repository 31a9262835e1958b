"""Engine and host probes: pool facts read where SGLang and vLLM state them, NVML facts or a
plain statement that there are none, and an unguarded engine's undersized pool reaching the
daemon as config_drift through the agent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from kvguard.agents.probes import (
    from_openai_models,
    from_sglang_server_info,
    gpu_facts,
    parse_sglang_log,
    parse_vllm_log,
)
from kvguard.daemon.store import Store
from kvguard.proto import pb

SGLANG_LOG = """\
[2026-03-02 10:00:01] server_args=ServerArgs(model_path='acme/llm-1m', tokenizer_path='acme/llm-1m', \
tp_size=8, mem_fraction_static=0.82, kv_cache_dtype='fp8_e4m3', page_size=16, disaggregation_mode='prefill')
[2026-03-02 10:00:40 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=41.02 GB
[2026-03-02 10:00:41 TP0] KV Cache is allocated. #tokens: 681280, K size: 10.40 GB, V size: 10.40 GB
[2026-03-02 10:00:52] max_total_num_tokens=681280, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=4096, context_len=1048576, available_gpu_mem=12.31 GB
"""

VLLM_LOG = """\
INFO 03-02 10:00:00 [api_server.py:1] vLLM API server version 0.11.2
INFO 03-02 10:00:05 [core.py:77] Initializing a V1 LLM engine (v0.11.2) with config: model='acme/llm-1m', \
max_seq_len=1048576, tensor_parallel_size=8, block_size=16
INFO 03-02 10:01:03 [kv_cache_utils.py:1087] GPU KV cache size: 681,280 tokens
INFO 03-02 10:01:03 [kv_cache_utils.py:1091] Maximum concurrency for 1,048,576 tokens per request: 0.65x
"""


def test_sglang_startup_log() -> None:
    facts = parse_sglang_log(SGLANG_LOG.splitlines())
    assert facts is not None
    assert (facts.pool_tokens, facts.context_len, facts.page_size, facts.tp_size) == (681280, 1048576, 16, 8)
    assert (facts.model, facts.kv_dtype, facts.mem_fraction) == ("acme/llm-1m", "fp8_e4m3", 0.82)
    report = facts.report(0, "prefill")
    assert (report.num_pages, report.page_size, report.context_len) == (42580, 16, 1048576)
    assert "log line 4: max_total_num_tokens" in report.source
    assert parse_sglang_log(SGLANG_LOG.splitlines()[:2]) is None  # not stated yet: nothing guessed


def test_vllm_startup_log() -> None:
    facts = parse_vllm_log(VLLM_LOG.splitlines())
    assert facts is not None
    assert (facts.pool_tokens, facts.context_len, facts.page_size, facts.engine_version) == (
        681280,
        1048576,
        16,
        "0.11.2",
    )
    old = parse_vllm_log(
        ["INFO ... block_size=16, max_seq_len=4096", "INFO # GPU blocks: 2048, # CPU blocks: 512"]
    )
    assert old is not None and (old.pool_tokens, old.context_len) == (32768, 4096)


def test_server_info_documents() -> None:
    info = {
        "model_path": "m",
        "page_size": 64,
        "tp_size": 2,
        "version": "0.5.4",
        "internal_states": [{"max_total_num_tokens": 100000, "context_len": 131072}],
    }
    facts = from_sglang_server_info(info)
    assert (facts.pool_tokens, facts.context_len, facts.page_size, facts.engine_version) == (
        100000,
        131072,
        64,
        "0.5.4",
    )
    models = from_openai_models({"data": [{"id": "m", "max_model_len": 32768}]}, "vllm")
    assert models.context_len == 32768 and models.pool_tokens == 0
    merged = models.merged(parse_vllm_log(VLLM_LOG.splitlines()))  # type: ignore[arg-type]
    assert (merged.context_len, merged.pool_tokens) == (32768, 681280)


def test_gpu_facts_say_plainly_when_there_are_none() -> None:
    facts = gpu_facts()
    if facts.unavailable:
        assert facts.gpus == [] and facts.describe().startswith("no GPU facts: ")
    else:  # a host with a GPU
        assert facts.gpus and facts.gpus[0]["memory_total"] > 0


def test_an_unguarded_engines_undersized_pool_reaches_the_daemon(tmp_path: Path) -> None:
    store = str(tmp_path / "audit.db")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "daemon", "--listen", "127.0.0.1:0", "--store", store],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    port = daemon.stdout.readline().split()[1]  # type: ignore[union-attr]

    class Info(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"data": [{"id": "m", "max_model_len": 32768}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    log = tmp_path / "sglang.log"
    log.write_text(SGLANG_LOG.splitlines()[0] + "\n")  # the engine is still starting
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard",
            "agent",
            "--socket",
            str(tmp_path / "a.sock"),
            "--daemon",
            f"127.0.0.1:{port}",
            "--spool",
            str(tmp_path / "spool"),
            "--probe",
            f"sglang-p0:sglang:prefill:{log}",
            "--probe",
            f"vllm-d0:vllm:decode:http://127.0.0.1:{http.server_address[1]}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout.readline().startswith("READY")  # type: ignore[union-attr]
        time.sleep(0.5)
        log.write_text(SGLANG_LOG)  # the pool line appears
        deadline = time.monotonic() + 20
        found: list[pb.Finding] = []
        while time.monotonic() < deadline and not found:
            time.sleep(0.3)
            s = Store(store)
            found = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
            s.close()
        assert [(f.finding, f.node) for f in found] == [("config_drift", "sglang-p0")]
        assert "681280 tokens" in found[0].message and "1048576" in found[0].message
    finally:
        agent.send_signal(signal.SIGTERM)
        err = agent.communicate(timeout=20)[1]
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=20)
        http.shutdown()
        http.server_close()
    assert "no GPU facts:" in err or "GPU(s)" in err  # the agent says what it found
