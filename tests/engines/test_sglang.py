"""kvguard's SGLang adapter on SGLang 0.5.23's own classes (installed from PyPI in its own
venv): the incident, a short transfer, a rejected request that flows on, a clean mixed
workload, the plugin path, an unknown version and a failure of kvguard itself. Every
scenario's capture replays to the findings the guard raised in the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_venvs import kinds, replay, run_batch, run_scenario

FAILED, SUCCESS = 0, 4  # SGLang's KVPoll
# Run in one process of the SGLang venv, in this order (the last breaks its own adapter).
BATCH = [
    ("incident", "enforce"),
    ("incident", "monitor"),
    ("short_send", "enforce"),
    ("rejected", "enforce"),
    ("mixed", "enforce"),
    ("decode_faults", "enforce"),
    ("contained", "enforce"),
]


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sglang")
    specs = [(name, root / f"{name}-{mode}.jsonl", mode) for name, mode in BATCH]
    results = run_batch("sglang", "sglang_scenarios.py", specs)
    for name, capture, mode in specs:
        results[f"{name},{mode}"]["_capture"] = capture
    return results


def scenario(batch: dict[str, Any], name: str, mode: str = "enforce") -> tuple[dict, list[dict]]:
    result = batch[f"{name},{mode}"]
    assert result.get("adapter_failed", "") == "", result
    capture = result["_capture"]
    return result, replay(capture) if capture.exists() else []


def alone(tmp_path: Path, name: str, **env: str) -> dict:
    """A scenario that needs a process of its own (SGLang's plugin loader runs once a process)."""
    result = run_scenario("sglang", "sglang_scenarios.py", name, str(tmp_path / f"{name}.jsonl"), env=env)
    assert result.get("adapter_failed", "") == "", result
    return result


def test_incident_reservation_of_8_with_1_written_is_stopped_before_its_forward(batch: dict) -> None:
    result, replayed = scenario(batch, "incident")
    assert result["stale_pages"] == 7  # SGLang's own pool: 7 of B's 8 pages hold A's K
    assert result["poll"] == FAILED  # the receiver's Success turned into SGLang's failure path
    assert result["killed"] == ["b-1"]
    assert result["findings"] == ["transfer_mismatch"]
    assert kinds(replayed) == {("transfer_mismatch", "b-1")}
    (mismatch,) = replayed
    assert "expected 32 prompt tokens" in mismatch["message"] and "delivered 4" in mismatch["message"]


def test_incident_in_monitor_mode_names_the_victim_and_lets_it_run(batch: dict[str, Any]) -> None:
    result, replayed = scenario(batch, "incident", "monitor")
    assert result["poll"] == SUCCESS and result["killed"] == []
    stale = [f for f in replayed if f["finding"] == "stale_read"]
    assert stale and stale[0]["req"] == "b-1" and stale[0]["victim_req"] == "a-1"
    assert stale[0]["victim_tenant"] == "tenant-a" and stale[0]["pages"] == [2, 3, 4, 5, 6, 7, 8]
    assert {"transfer_mismatch", "stale_read"} == {f["finding"] for f in replayed}


def test_fake_sender_success_after_1_of_8_pages_is_a_transfer_mismatch(batch: dict[str, Any]) -> None:
    result, replayed = scenario(batch, "short_send")
    assert result["poll"] == FAILED and result["killed"] == ["r-1"]
    assert kinds(replayed) == {("transfer_mismatch", "r-1")}
    assert "after sending 4 of the 32 prompt tokens" in replayed[0]["message"]


def test_rejected_request_that_flows_on_is_caught(batch: dict[str, Any]) -> None:
    result, replayed = scenario(batch, "rejected")
    assert result["stub_len"] == 1 and result["finished"] is False  # SGLang's own rejected state
    assert result["killed"] == ["long-1"] and result["poll"] == FAILED
    assert ("rejected_progress", "long-1") in kinds(replayed)
    progress = {f["message"].rsplit(": ", 1)[-1] for f in replayed if f["finding"] == "rejected_progress"}
    assert any("xfer_send" in p for p in progress), progress
    assert kinds(replayed) == {(f, "long-1") for f in result["findings"]}


def test_mixed_workload_with_every_fault_off_has_no_finding(batch: dict[str, Any]) -> None:
    result, replayed = scenario(batch, "mixed")
    assert result["findings"] == [] and result["killed"] == [] and result["errors"] == []
    assert result["events"] > 50
    assert replayed == []


def test_a_decode_step_taken_whole_finds_what_its_calls_as_made_find(batch: dict[str, Any]) -> None:
    result, _ = scenario(batch, "decode_faults")
    held, as_made = result["held"], result["as made"]
    assert held == as_made, (held, as_made)
    assert held["clean_steps_findings"] == 0 and not held["errors"]
    # The page handed out twice: the request that was given b's page is stopped, b goes on.
    assert held["findings"] and "a-1" in held["killed"] and "b-1" not in held["killed"], held


def test_sglang_loads_the_plugin_through_its_entry_point(tmp_path: Path) -> None:
    capture = tmp_path / "env.jsonl"
    result = alone(tmp_path, "plugin_path", KVGUARD_NODE="gpu-7", KVGUARD_CAPTURE=str(capture))
    assert result["hooked"] and result["node"] == "gpu-7"
    lines = capture.read_text().splitlines()
    assert (
        '"pool"' in lines[0] and '"engine_version":"0.5.23"' in lines[0] and '"reserved_pages":1' in lines[0]
    )
    assert '"admit":{"req":"env-1","tenant":"tenant-e"' in lines[1]
    assert '"alloc":{"req":"env-1","pages":[1,2]}' in lines[2]


def test_an_unknown_sglang_version_is_refused_in_one_line(tmp_path: Path) -> None:
    result = alone(tmp_path, "version_refused")
    assert result["hooked"] is False
    assert "sglang 0.6.0 is not a version this adapter knows (0.5.23)" in result["refused"]
    assert result["_stderr"].count("not a version this adapter knows") == 1


def test_what_the_adapter_does_not_map_is_refused_at_the_schedulers_start(tmp_path: Path) -> None:
    """MLA, hybrid SWA and HiCache pools, and the Mooncake and NIXL transfer backends (their
    senders and receivers override poll and send): each named at start, and the engine then
    runs unguarded (never guarded wrongly), even under KVGUARD_ON_FAILURE=stop."""
    result = alone(tmp_path, "unmapped_refused")
    found = result["unmapped"]
    assert found["mapped"] == []
    assert found["mla"] == ["KV pool MLATokenToKVPool (MLA, SWA and hybrid pools are not mapped)"]
    assert found["mooncake"] == [
        "PD transfer backend mooncake (its senders and receivers override poll and send)"
    ]
    assert found["nixl"] == ["PD transfer backend nixl (its senders and receivers override poll and send)"]
    assert found["hicache"] == ["HiCache (the hierarchical cache)"]
    assert found["swa"] == ["hybrid sliding-window pools"]
    assert result["refused"] == (
        "kvguard: this SGLang setup is not mapped yet (PD transfer backend mooncake (its senders and "
        "receivers override poll and send)); not guarding it rather than guarding it wrongly"
    )
    assert result["stopped"] is False and result["reported"] is False
    assert result["_stderr"].count("is not mapped yet") == 1


def test_a_failure_of_kvguard_never_reaches_sglang(batch: dict[str, Any]) -> None:
    result = batch["contained,enforce"]
    assert result["first"] == list(range(4, 12)) and result["second"] == list(range(12, 20))
    assert result["failures"] == 1 and "allocator alloc: TypeError" in result["failed"]
    assert result["_stderr"].count("kvguard sglang adapter failed") == 1
