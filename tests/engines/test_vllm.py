"""kvguard's vLLM 0.33.0 adapter driving the real Scheduler / KVCacheManager / BlockPool in the
vLLM venv (tests/engines/vllm_scenario.py): what the guard finds live, and that replaying its
capture finds the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine_venvs import kinds, replay, run_scenario


def scenario(name: str, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    capture = tmp_path / f"{name}.jsonl"
    return run_scenario("vllm", "vllm_scenario.py", name, str(capture)), capture


def events(capture: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capture.read_text().splitlines() if line.strip()]


def live_kinds(result: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["finding"], f["req"]) for f in result["findings"]}


def test_salted_tenants_share_nothing(tmp_path: Path) -> None:
    result, capture = scenario("salted", tmp_path)
    assert result["findings"] == [] and result["errors"] == [] and not result["failed"]
    assert not set(result["blocks_a"]) & set(result["blocks_b"])  # vLLM kept them apart
    assert result["finished"]["b-1"] == "FINISHED_LENGTH_CAPPED"
    seen = events(capture)
    assert not [e for e in seen if "share" in e]
    assert {e["admit"]["tenant"] for e in seen if "admit" in e} == {"tenant-a", "tenant-b"}
    assert replay(capture) == []


def test_unsalted_cross_tenant_share_is_caught_and_killed(tmp_path: Path) -> None:
    result, capture = scenario("unsalted", tmp_path)
    shares = [f for f in result["findings"] if f["finding"] == "cross_tenant_share"]
    assert len(shares) == 1 and len(result["findings"]) == 1
    share = shares[0]
    assert (share["req"], share["tenant"]) == ("b-1", "tenant-b")
    assert (share["victim_req"], share["victim_tenant"]) == ("a-1", "tenant-a")
    assert share["pages"] == result["blocks_a"][:4]  # the four prefix blocks
    assert result["killed"] == ["b-1"] and result["finished"]["b-1"] == "FINISHED_ABORTED"
    assert result["finished"]["a-1"] == "RUNNING"  # the rest of the batch goes on
    assert all("b-1" not in step for step in result["trace"])  # never reached a forward
    seen = events(capture)
    assert any(e.get("kill", {}).get("req") == "b-1" for e in seen)
    assert any(e.get("abort", {}).get("req") == "b-1" for e in seen)
    assert kinds(replay(capture)) == live_kinds(result) == {("cross_tenant_share", "b-1")}


def test_mixed_workload_has_no_finding(tmp_path: Path) -> None:
    result, capture = scenario("mixed", tmp_path)
    assert result["findings"] == [] and result["errors"] == [] and not result["failed"]
    assert result["steps"] >= 30 and len(result["aborted"]) == 3 and result["preempted"]
    seen = events(capture)
    steps = [e["step"] for e in seen if "step" in e]
    assert len(steps) >= 30
    assert any(c > 1 for s in steps for c in s["counts"])  # chunked prefill: several pages a step
    freed: set[str] = set()
    revived = own = 0
    for e in seen:
        if "free" in e:
            freed.add(e["free"]["req"])
        share = e.get("share")
        if share:
            revived += share["origin_req"] in freed
            own += share["origin_req"] == share["req"]
    assert revived > 0  # hits on blocks of ended requests, revived from the free queue
    assert own > 0  # a preempted request resumed on its own freed blocks
    assert replay(capture) == []


def test_pool_below_context_is_config_drift(tmp_path: Path) -> None:
    result, capture = scenario("small_pool", tmp_path)
    assert live_kinds(result) == {("config_drift", "")}
    pool = next(e["pool"] for e in events(capture) if "pool" in e)
    assert (int(pool["num_pages"]), int(pool["page_size"]), int(pool["context_len"])) == (9, 4, 64)
    assert int(pool["reserved_pages"]) == 1 and pool["engine"] == "vllm" and pool["role"] == "colocated"
    assert kinds(replay(capture)) == {("config_drift", "")}


def test_plugin_entry_point_reports_the_pool(tmp_path: Path) -> None:
    result, capture = scenario("plugin", tmp_path)
    assert result["installed"] and not result["refused"] and result["node"] == "vllm-plugin-node"
    seen = events(capture)
    assert seen[0]["node"] == "vllm-plugin-node"
    pool = seen[0]["pool"]
    assert pool["engine"] == "vllm" and pool["engine_version"] == "0.33.0" and int(pool["num_pages"]) == 40
    assert any(e.get("admit", {}).get("req") == "p-1" for e in seen)
    assert replay(capture) == []


def test_unknown_version_is_refused_in_one_line(tmp_path: Path) -> None:
    result, capture = scenario("refused", tmp_path)
    assert "vllm 0.99.0 is not a version this adapter knows (0.33.0)" in result["refused"]
    assert not result["attachment"] and not result["guarded"]
    assert result["status"] == "RUNNING" and result["trace"][0] == {"q-1": 16}  # the engine went on
    assert result["_stderr"].count("not a version this adapter knows") == 1
    assert not capture.exists() or capture.read_text() == ""


def test_kvguard_failure_in_a_hook_is_contained(tmp_path: Path) -> None:
    result, _ = scenario("contained", tmp_path)
    assert result["failed"] == "schedule: RuntimeError: planted kvguard defect"
    assert result["totals"][:4] == [17, 2, 2, 2]  # schedule() returned its normal output each step
    assert result["trace"][0] == {"c-1": 16, "c-2": 1}
    assert result["_stderr"].count("planted kvguard defect") == 1
