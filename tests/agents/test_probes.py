"""Engine and host probes: pool facts read where SGLang and vLLM state them (here in the
formats of earlier versions; tests/engines/test_probes_real.py reads what the pinned engines
themselves write and serve), what a probe says when it cannot read them, NVML facts or a
plain statement that there are none, and an unguarded engine's undersized pool reaching the
daemon as config_drift through the agent, which says each thing it could not read once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from endpoints import serve
from log_lines import said as said_lines

from kvguard.agents.engine_watch import read_engine
from kvguard.agents.probes import (
    from_openai_models,
    from_sglang_server_info,
    from_vllm_metrics,
    gpu_facts,
    parse_prometheus,
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
    # SGLang's page 0 is padding: 42580 pages to grant, one more in the pool.
    assert (report.num_pages, report.reserved_pages, report.page_size) == (42581, 1, 16)
    assert report.context_len == 1048576
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


def test_prometheus_exposition_and_a_data_parallel_vllm() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0",num_gpu_blocks="2050",'
        'kv_cache_size_tokens="16400",note="a \\"quoted\\" }"} 1.0\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="1",num_gpu_blocks="2050",'
        'kv_cache_size_tokens="16400",note=""} 1.0\n'
    )
    samples = parse_prometheus(text)
    assert [labels["engine"] for labels, _ in samples["vllm:cache_config_info"]] == ["0", "1"]
    assert samples["vllm:cache_config_info"][0][0]["note"] == 'a "quoted" }'
    # Two engines: num_gpu_blocks is their sum, so each engine's own capacity is read instead.
    facts = from_vllm_metrics(samples, "/metrics")
    assert (facts.pool_tokens, facts.page_size, facts.reserved_pages, facts.kv_dtype) == (16400, 16, 0, "fp8")


def test_what_a_probe_could_not_read_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.log"
    assert read_engine("sglang", str(missing)).problems == (
        f"log {missing}: cannot read (No such file or directory)",
    )
    early = tmp_path / "early.log"
    early.write_text(SGLANG_LOG.splitlines()[0] + "\n")
    assert read_engine("sglang", str(early)).problems == (
        f"log {early}: no 'max_total_num_tokens=' (scheduler) line yet",
    )
    vllm = tmp_path / "vllm.log"
    vllm.write_text(
        "INFO ... CPU KV cache size: 3,200 tokens, Maximum concurrency for 4,096 tokens per request: 0.78x\n"
    )
    reading = read_engine("vllm", str(vllm))
    assert reading.facts is not None and (reading.facts.pool_tokens, reading.facts.context_len) == (
        3200,
        4096,
    )
    assert reading.problems == (
        f"log {vllm}: the page size is not stated (block_size is logged only when set; reported as 1)",
    )
    routes = {"/server_info": (500, "Internal Server Error"), "/get_server_info": (200, "{}")}
    routes |= {"/v1/models": (200, "<html>not json</html>")}
    http, url = serve(routes)
    try:
        reading = read_engine("sglang", url)
    finally:
        http.shutdown()
        http.server_close()
    assert reading.facts is None
    assert reading.problems[0] == f"GET {url}/server_info: HTTP 500"
    assert reading.problems[1].startswith(f"GET {url}/v1/models: not JSON (")
    assert reading.problems[2] == f"GET {url}/metrics: HTTP 404 (SGLang serves it with --enable-metrics)"
    http, url = serve({"/v1/models": (200, '{"data": [{"max_model_len": "long"}]}')})
    try:
        reading = read_engine("vllm", url)
    finally:
        http.shutdown()
        http.server_close()
    assert reading.facts is None and reading.problems[0].startswith(f"{url}: a document is not as")
    closed = f"http://127.0.0.1:{_free_port()}"
    assert read_engine("vllm", closed).problems[0].startswith(f"GET {closed}/v1/models: unreachable (")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    # A vLLM whose server fails: its probe says so once, however often it reads.
    http, url = serve({"/v1/models": (503, "starting")})
    log = tmp_path / "sglang.log"
    log.write_text(SGLANG_LOG.splitlines()[0] + "\n")  # the engine is still starting
    gone = tmp_path / "gone.log"
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "kvguard", "agent", "--socket", str(tmp_path / "a.sock"),
            "--daemon", f"127.0.0.1:{port}", "--spool", str(tmp_path / "spool"),
            "--probe", f"sglang-p0:sglang:prefill:{log}",
            "--probe", f"vllm-d0:vllm:decode:{url}",
            "--probe", f"gone-0:sglang:colocated:{gone}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert agent.stdout.readline().startswith("READY")  # type: ignore[union-attr]
        time.sleep(5)  # two reads or more of each probe
        whole = tmp_path / "sglang.log.new"
        whole.write_text(SGLANG_LOG)
        whole.replace(log)  # the pool line appears (at once: a half-written log would say less)
        deadline = time.monotonic() + 20
        found: list[pb.Finding] = []
        while time.monotonic() < deadline and not found:
            time.sleep(0.3)
            s = Store(store)
            found = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
            s.close()
        time.sleep(2.5)  # one more read of each, after the log's recovery
    finally:
        agent.send_signal(signal.SIGTERM)
        err = agent.communicate(timeout=20)[1]
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=20)
        http.shutdown()
        http.server_close()
    assert [(f.finding, f.node) for f in found] == [("config_drift", "sglang-p0")]
    assert "681280 tokens" in found[0].message and "1048576" in found[0].message
    said = [line.split(" (after ")[0] for line in said_lines(err) if line.startswith("kvguard agent: probe ")]
    unread = [line for line in said if "pool of" not in line and "read in full again" not in line]
    assert sorted(unread) == sorted(
        [
            f"kvguard agent: probe sglang-p0: log {log}: no 'max_total_num_tokens=' (scheduler) line yet",
            f"kvguard agent: probe vllm-d0: GET {url}/v1/models: HTTP 503",
            f"kvguard agent: probe vllm-d0: GET {url}/metrics: HTTP 404",
            f"kvguard agent: probe gone-0: log {gone}: cannot read (No such file or directory)",
        ]
    )  # each once, though each probe read its source several times
    assert said.count(f"kvguard agent: probe sglang-p0: {log} read in full again") == 1
    assert "probe_unreadable=4" in err
    assert "no GPU facts:" in err or "GPU(s)" in err  # the agent says what it found
