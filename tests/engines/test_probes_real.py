"""kvguard's engine probes on what SGLang 0.5.23 and vLLM 0.33.0 themselves write and serve
(tests/engines/probe_sglang.py and probe_vllm.py, run in each engine's venv): the facts read
from each line and document, an undersized pool and a PD pair that disagrees reaching the
ledger as config_drift, and a real agent reading real documents over HTTP into the daemon."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import HTTPServer
from pathlib import Path
from typing import Any

import pytest
from endpoints import serve
from engine_venvs import run_scenario
from log_lines import said as said_lines

from kvguard.agents.engine_watch import read_engine
from kvguard.agents.probes import (
    from_openai_models,
    from_sglang_metrics,
    from_sglang_server_info,
    from_vllm_metrics,
    parse_prometheus,
    parse_sglang_log,
    parse_vllm_log,
)
from kvguard.daemon.store import Store
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    return run_scenario("sglang", "probe_sglang.py")["nodes"]


@pytest.fixture(scope="module")
def vllm() -> dict[str, Any]:
    return run_scenario("vllm", "probe_vllm.py")["nodes"]


@pytest.fixture
def endpoints() -> Iterator[list[HTTPServer]]:
    servers: list[HTTPServer] = []
    yield servers
    for http in servers:
        http.shutdown()
        http.server_close()


def sglang_routes(node: dict[str, Any], *, deprecated_only: bool = False) -> dict[str, tuple[int, str]]:
    info = json.dumps(node["server_info"])
    routes = {"/v1/models": (200, json.dumps(node["models"])), "/metrics": (200, node["metrics"])}
    routes["/get_server_info" if deprecated_only else "/server_info"] = (200, info)
    return routes


def vllm_routes(node: dict[str, Any]) -> dict[str, tuple[int, str]]:
    return {"/v1/models": (200, json.dumps(node["models"])), "/metrics": (200, node["metrics"])}


def pools(reports: dict[str, pb.PoolReport]) -> list[Finding]:
    """The findings of a ledger that is sent each node's pool event."""
    ledger = Ledger()
    found: list[Finding] = []
    for node, report in reports.items():
        found += ledger.apply(pb.Event(node=node, seq=1, ts_ns=1, pool=report))
    return found


def test_sglang_log_lines(sglang: dict[str, Any]) -> None:
    fits = parse_sglang_log(sglang["fits"]["log"])
    assert fits is not None
    assert (fits.pool_tokens, fits.context_len, fits.page_size, fits.reserved_pages) == (8192, 4096, 16, 1)
    assert (fits.model, fits.tp_size, fits.kv_dtype) == (sglang["fits"]["model"], 1, "bfloat16")
    assert 0.0 < fits.mem_fraction < 1.0
    assert any(s.endswith(": max_total_num_tokens") for s in fits.sources)
    report = fits.report(0, "colocated")
    assert (report.num_pages, report.reserved_pages, report.page_size) == (8192 // 16 + 1, 1, 16)
    decode = parse_sglang_log(sglang["decode"]["log"])
    assert decode is not None and (decode.page_size, decode.kv_dtype) == (32, "fp8_e4m3")
    # Up to the allocation only: the pool is known, the context is not; nothing is guessed.
    cut = next(i for i, line in enumerate(sglang["short"]["log"]) if "KV Cache is allocated" in line)
    early = parse_sglang_log(sglang["short"]["log"][: cut + 1])
    assert early is not None and (early.pool_tokens, early.context_len) == (2048, 0)
    # Before the allocation: no pool stated yet.
    assert parse_sglang_log(sglang["short"]["log"][:cut]) is None


def test_sglang_documents(sglang: dict[str, Any]) -> None:
    node = sglang["decode"]
    info = from_sglang_server_info(node["server_info"])
    assert (info.pool_tokens, info.page_size, info.kv_dtype, info.engine_version) == (
        8192,
        32,
        "fp8_e4m3",
        "0.5.23",
    )
    assert info.context_len == 0  # /server_info has no context unless --context-length was given
    models = from_openai_models(json.loads(json.dumps(node["models"])), "sglang")
    assert models.context_len == 4096
    metrics = from_sglang_metrics(parse_prometheus(node["metrics"]), "/metrics")
    assert (metrics.pool_tokens, metrics.context_len, metrics.page_size) == (8192, 4096, 32)


def test_sglang_over_http(sglang: dict[str, Any], endpoints: list[HTTPServer]) -> None:
    http, url = serve(sglang_routes(sglang["prefill"]))
    endpoints.append(http)
    reading = read_engine("sglang", url)
    assert reading.problems == ()
    assert reading.facts is not None
    facts = reading.facts
    assert (facts.pool_tokens, facts.context_len, facts.page_size, facts.reserved_pages) == (
        8192,
        4096,
        16,
        1,
    )
    assert facts.sources == (f"{url}/server_info", f"{url}/v1/models")
    # An SGLang that answers only the deprecated /get_server_info, and no /v1/models:
    routes = sglang_routes(sglang["short"], deprecated_only=True)
    del routes["/v1/models"]
    http, url = serve(routes)
    endpoints.append(http)
    reading = read_engine("sglang", url)
    assert reading.problems == () and reading.facts is not None
    assert (reading.facts.pool_tokens, reading.facts.context_len) == (2048, 4096)
    assert reading.facts.sources == (f"{url}/get_server_info", f"{url}/metrics")


def test_vllm_log_lines(vllm: dict[str, Any]) -> None:
    facts = parse_vllm_log(vllm["fits"]["log"])
    assert facts is not None
    assert (facts.pool_tokens, facts.context_len, facts.engine_version) == (16400, 4096, "0.33.0")
    assert (facts.model, facts.tp_size, facts.kv_dtype) == (vllm["fits"]["model"], 1, "auto")
    assert facts.page_size == 0  # vLLM logs its block size only when it was set: not guessed
    short = parse_vllm_log(vllm["short"]["log"])
    assert short is not None and (short.pool_tokens, short.context_len) == (3200, 4096)
    assert parse_vllm_log(vllm["short"]["log"][:1]) is None  # the engine has not sized its pool yet


def test_vllm_over_http(vllm: dict[str, Any], endpoints: list[HTTPServer]) -> None:
    metrics = from_vllm_metrics(parse_prometheus(vllm["decode"]["metrics"]), "/metrics")
    assert (metrics.pool_tokens, metrics.page_size, metrics.reserved_pages) == ((513 - 1) * 32, 32, 1)
    assert (metrics.kv_dtype, metrics.mem_fraction) == ("fp8", 0.92)
    http, url = serve(vllm_routes(vllm["fits"]))
    endpoints.append(http)
    reading = read_engine("vllm", url)
    assert reading.problems == () and reading.facts is not None
    facts = reading.facts
    assert (facts.pool_tokens, facts.context_len, facts.page_size, facts.reserved_pages) == (
        16384,
        4096,
        16,
        1,
    )
    assert facts.model == vllm["fits"]["model"]
    report = facts.report(0, "decode")
    assert (report.num_pages, report.reserved_pages) == (1025, 1)  # vLLM's own num_gpu_blocks
    # /v1/models alone says the context but not the pool: the probe says which source failed.
    http, url = serve({"/v1/models": vllm_routes(vllm["fits"])["/v1/models"]})
    endpoints.append(http)
    reading = read_engine("vllm", url)
    assert reading.facts is None
    assert reading.problems == (f"GET {url}/metrics: HTTP 404",)


def test_an_undersized_pool_is_config_drift(
    sglang: dict[str, Any], vllm: dict[str, Any], endpoints: list[HTTPServer]
) -> None:
    http, sglang_url = serve(sglang_routes(sglang["short"]))
    endpoints.append(http)
    http, vllm_url = serve(vllm_routes(vllm["short"]))
    endpoints.append(http)
    read = {
        "sglang-log": parse_sglang_log(sglang["short"]["log"]),
        "sglang-http": read_engine("sglang", sglang_url).facts,
        "vllm-log": parse_vllm_log(vllm["short"]["log"]),
        "vllm-http": read_engine("vllm", vllm_url).facts,
        "sglang-fits": parse_sglang_log(sglang["fits"]["log"]),
        "vllm-fits": parse_vllm_log(vllm["fits"]["log"]),
    }
    found = pools({node: facts.report(0, "colocated") for node, facts in read.items() if facts})
    assert len(read) == 6 and all(read.values())
    short = {f.node: (f.finding, f.details["pool_tokens"], f.details["limit"]) for f in found}
    assert short == {
        "sglang-log": ("config_drift", "2048", "4096"),
        "sglang-http": ("config_drift", "2048", "4096"),
        "vllm-log": ("config_drift", "3200", "4096"),
        "vllm-http": ("config_drift", str((200 - 1) * 16), "4096"),
    }


def test_a_pd_pair_that_lays_kv_out_differently_is_config_drift(
    sglang: dict[str, Any], vllm: dict[str, Any], endpoints: list[HTTPServer]
) -> None:
    http, url = serve(vllm_routes(vllm["decode"]))
    endpoints.append(http)
    pairs = {
        "sglang": (parse_sglang_log(sglang["prefill"]["log"]), parse_sglang_log(sglang["decode"]["log"])),
        "vllm": (parse_vllm_log(vllm["prefill"]["log"]), read_engine("vllm", url).facts),
    }
    for engine, (prefill, decode) in pairs.items():
        assert prefill is not None and decode is not None
        found = pools({"p0": prefill.report(0, "prefill"), "d0": decode.report(0, "decode")})
        drift = {(f.details["field"], f.details["prefill"], f.details["decode"]) for f in found}
        expected = {"sglang": {("page_size", "16", "32"), ("kv_dtype", "bfloat16", "fp8_e4m3")}}
        # vLLM's log does not state the block size (reported as 1): the kv dtype and the page
        # size read from the decode side's /metrics still differ from the prefill's.
        expected["vllm"] = {("page_size", "1", "32"), ("kv_dtype", "auto", "fp8")}
        assert drift == expected[engine], engine
        assert {f.finding for f in found} == {"config_drift"}


def test_a_real_agent_reads_real_engines_into_the_daemon(
    sglang: dict[str, Any], vllm: dict[str, Any], endpoints: list[HTTPServer], tmp_path: Path
) -> None:
    store = str(tmp_path / "audit.db")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "daemon", "--listen", "127.0.0.1:0", "--store", store],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    port = daemon.stdout.readline().split()[1]  # type: ignore[union-attr]
    http, prefill_url = serve(sglang_routes(sglang["prefill"]))
    endpoints.append(http)
    routes = vllm_routes(vllm["short"])
    metrics = routes.pop("/metrics")  # not served yet: the engine runs without them at first
    http, short_url = serve(routes)
    endpoints.append(http)
    decode_log = tmp_path / "sglang-decode.log"
    decode_log.write_text("\n".join(sglang["decode"]["log"]) + "\n")
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "kvguard", "agent", "--socket", str(tmp_path / "a.sock"),
            "--daemon", f"127.0.0.1:{port}", "--spool", str(tmp_path / "spool"),
            "--probe", f"sg-p0:sglang:prefill:{prefill_url}",
            "--probe", f"sg-d0:sglang:decode:{decode_log}",
            "--probe", f"vllm-c0:vllm:colocated:{short_url}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert agent.stdout.readline().startswith("READY")  # type: ignore[union-attr]
        time.sleep(5)  # the vLLM probe reads /metrics more than once meanwhile, and says so once
        routes["/metrics"] = metrics
        deadline = time.monotonic() + 30
        found: list[pb.Finding] = []
        while time.monotonic() < deadline and len(found) < 3:
            time.sleep(0.3)
            s = Store(store)
            found = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
            s.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        err = agent.communicate(timeout=20)[1]
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=20)
    undersized = [f for f in found if f.node == "vllm-c0"]
    assert [(f.finding, f.details["pool_tokens"], f.details["limit"]) for f in undersized] == [
        ("config_drift", str((200 - 1) * 16), "4096")
    ]
    pair = {
        (f.details["field"], f.details["prefill_node"], f.details["decode_node"])
        for f in found
        if "field" in f.details
    }
    # /server_info says the configured "auto"; the decode side's log says fp8_e4m3.
    assert pair == {("page_size", "sg-p0", "sg-d0"), ("kv_dtype", "sg-p0", "sg-d0")}
    assert "probe sg-p0: pool of 8192 tokens (513 pages of 16, 1 reserved), context 4096" in err
    said = [line for line in said_lines(err) if line.startswith("kvguard agent: probe vllm-c0: GET")]
    assert len(said) == 1 and said[0].startswith(
        f"kvguard agent: probe vllm-c0: GET {short_url}/metrics: HTTP 404"
    )
    assert f"probe vllm-c0: {short_url} read in full again" in err
    assert "probe_unreadable=1" in err  # the one thing it could not read, counted once
