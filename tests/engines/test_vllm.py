"""kvguard's vLLM 0.33.0 adapter driving the real Scheduler / KVCacheManager / BlockPool in the
vLLM venv (tests/engines/vllm_scenario.py): what the guard finds live, and that replaying its
capture finds the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_venvs import kinds, replay, run_batch, run_scenario

# Run in one process of the vLLM venv (the plugin and the version refusal need their own).
BATCH = [
    "salted", "unsalted", "mixed", "small_pool", "pd_decode", "pd_decode_fail", "pd_decode_recompute",
    "pd_decode_partial", "pd_decode_short", "pd_decode_abort", "pd_prefill", "contained", "hybrid_refused",
]  # fmt: skip


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm")
    specs = [(name, root / f"{name}.jsonl", "enforce") for name in BATCH]
    results = run_batch("vllm", "vllm_scenario.py", specs)
    return {name: (results[f"{name},enforce"], capture) for name, capture, _ in specs}


def scenario(name: str, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    capture = tmp_path / f"{name}.jsonl"
    return run_scenario("vllm", "vllm_scenario.py", name, str(capture)), capture


def events(capture: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capture.read_text().splitlines() if line.strip()]


def live_kinds(result: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["finding"], f["req"]) for f in result["findings"]}


def test_salted_tenants_share_nothing(batch: dict[str, Any]) -> None:
    result, capture = batch["salted"]
    assert result["findings"] == [] and result["errors"] == [] and not result["failed"]
    assert not set(result["blocks_a"]) & set(result["blocks_b"])  # vLLM kept them apart
    assert result["finished"]["b-1"] == "FINISHED_LENGTH_CAPPED"
    seen = events(capture)
    assert not [e for e in seen if "share" in e]
    assert {e["admit"]["tenant"] for e in seen if "admit" in e} == {"tenant-a", "tenant-b"}
    assert replay(capture) == []


def test_unsalted_cross_tenant_share_is_caught_and_killed(batch: dict[str, Any]) -> None:
    result, capture = batch["unsalted"]
    shares = [f for f in result["findings"] if f["finding"] == "cross_tenant_share"]
    assert len(shares) == 1 and len(result["findings"]) == 1
    share = shares[0]
    assert (share["req"], share["tenant"]) == ("b-1", "tenant-b")
    assert (share["victim_req"], share["victim_tenant"]) == ("a-1", "tenant-a")
    assert share["pages"] == result["blocks_a"][:4]  # the four prefix blocks
    assert result["killed"] == ["b-1"] and result["finished"]["b-1"] == "FINISHED_ERROR"
    # Its client is told, in this step's outputs, by kvguard's words: nothing of tenant-a.
    ((told, why),) = result["told"]
    assert told == "b-1" and why.startswith("kvguard stopped request b-1: ") and "cross_tenant_share" in why
    assert "tenant-a" not in why and "a-1" not in why
    assert result["finished"]["a-1"] == "RUNNING"  # the rest of the batch goes on
    assert all("b-1" not in step for step in result["trace"])  # never reached a forward
    seen = events(capture)
    assert any(e.get("kill", {}).get("req") == "b-1" for e in seen)
    assert any(e.get("abort", {}).get("req") == "b-1" for e in seen)
    assert kinds(replay(capture)) == live_kinds(result) == {("cross_tenant_share", "b-1")}


def test_mixed_workload_has_no_finding(batch: dict[str, Any]) -> None:
    result, capture = batch["mixed"]
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


def test_pool_below_context_is_config_drift(batch: dict[str, Any]) -> None:
    result, capture = batch["small_pool"]
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
    assert "vllm 0.99.0 is not a version this adapter knows (0.32.0, 0.33.0)" in result["refused"]
    assert not result["attachment"] and not result["guarded"]
    assert result["status"] == "RUNNING" and result["trace"][0] == {"q-1": 16}  # the engine went on
    assert result["_stderr"].count("not a version this adapter knows") == 1
    assert not capture.exists() or capture.read_text() == ""


def test_kvguard_failure_in_a_hook_is_contained(batch: dict[str, Any]) -> None:
    result, _ = batch["contained"]
    assert result["failed"] == "schedule: RuntimeError: planted kvguard defect"
    assert result["totals"][:4] == [17, 2, 2, 2]  # schedule() returned its normal output each step
    assert result["trace"][0] == {"c-1": 16, "c-2": 1}
    assert result["_stderr"].count("planted kvguard defect") == 1


# ---------------------------------------------------------------------- P/D: vLLM's NixlConnector


def test_pd_decode_receipt_is_the_requests_own_kv(batch: dict[str, Any]) -> None:
    """d-1 waits for remote KV in the blocks vLLM granted it; the worker's finished_recving is
    its receipt for exactly those blocks and tokens, after which its decode reads them clean
    (without the receipt those blocks would be read unwritten: a stale_read)."""
    result, capture = batch["pd_decode"]
    assert result["findings"] == [] and result["errors"] == [] and not result["failed"]
    waiting = result["waiting"]
    assert waiting == {"status": "WAITING_FOR_REMOTE_KVS", "computed": 18, "blocks": [1, 2, 3, 4, 5]}
    assert result["still"] == "WAITING_FOR_REMOTE_KVS"  # nothing scheduled for it while it loads
    assert all("d-1" not in step for step in result["trace"][:3])
    assert result["promoted"] == {"scheduled": 1, "blocks": [1, 2, 3, 4, 5]}  # only the last token
    assert result["final"] == "FINISHED_LENGTH_CAPPED" and result["gone"]
    (boot,) = result["bootstrap"]
    assert (boot["prefill_node"], boot["decode_node"], boot["prompt_tokens"]) == (
        "prefill-0",
        "vllm-node",
        18,
    )
    (recv,) = result["recv"]
    assert (recv["pages"], recv["tokens"], recv["status"]) == ([1, 2, 3, 4, 5], 18, "done")
    seen = events(capture)
    order = [k for e in seen for k in ("bootstrap", "alloc", "xfer_recv") if e.get(k, {}).get("req") == "d-1"]
    assert order == ["bootstrap", "alloc", "xfer_recv"]  # reserved, then filled
    assert replay(capture) == []


def test_pd_decode_failed_load_fails_the_request_unread(batch: dict[str, Any]) -> None:
    """The first loaded block is invalid (kv_load_failure_policy=fail, vLLM's default): the
    receipt is `failed`, nothing of it counts as written, vLLM ends the request with an error
    and frees its blocks; it never ran a forward, so nothing read them: no finding is the truth."""
    result, capture = batch["pd_decode_fail"]
    assert result["findings"] == [] and result["killed"] == [] and result["errors"] == []
    (recv,) = result["recv"]
    assert (recv["pages"], recv.get("tokens", 0), recv["status"]) == ([1, 2, 3, 4, 5], 0, "failed")
    assert result["after_recv"]["status"] == result["final"] == "FINISHED_ERROR"
    assert result["promoted"] is None and all("d-1" not in step for step in result["trace"])
    seen = events(capture)
    assert any(e.get("abort", {}) == {"req": "d-1", "reason": "finished_error"} for e in seen)
    assert [e["free"]["pages"] for e in seen if e.get("free", {}).get("req") == "d-1"] == [[5, 4, 3, 2, 1]]
    assert replay(capture) == []


def test_pd_decode_failed_load_is_recomputed_by_the_request(batch: dict[str, Any]) -> None:
    """Same failure under kv_load_failure_policy=recompute: vLLM rewinds d-1 to 0 computed
    tokens, frees the blocks and prefills the whole prompt itself. The failed receipt wrote
    nothing, the request's own prefill writes every block it then reads: no finding."""
    result, capture = batch["pd_decode_recompute"]
    assert result["findings"] == [] and result["killed"] == [] and result["errors"] == []
    (recv,) = result["recv"]
    assert (recv["status"], recv.get("tokens", 0)) == ("failed", 0)
    assert result["after_recv"] == {"status": "WAITING_FOR_REMOTE_KVS", "computed": 0}
    assert result["promoted"]["scheduled"] == 18  # the whole prompt, computed locally
    assert sorted(result["promoted"]["blocks"]) == [1, 2, 3, 4, 5]
    assert result["final"] == "FINISHED_LENGTH_CAPPED"
    seen = events(capture)
    assert [k for k, _ in of_request(seen, "d-1")][:3] == [
        "alloc",
        "free",
        "alloc",
    ]  # the reservation went back first
    assert replay(capture) == []


def of_request(seen: list[dict[str, Any]], req: str) -> list[tuple[str, dict[str, Any]]]:
    """(kind, payload) of the page events of `req` in a node's capture, in order: its allocs
    and frees, and each step naming it (by name, or by the handle its admit gave it), a step
    that grants it pages preceded by an alloc (what the step's grants stand for)."""
    handles = {e["admit"].get("handle") for e in seen if "admit" in e and e["admit"]["req"] == req} - {
        None,
        0,
    }
    out = []
    for e in seen:
        for kind in ("alloc", "free"):
            if kind in e and e[kind].get("req") == req:
                out.append((kind, e[kind]))
        if "step" in e:
            step, names = e["step"], list(e["step"].get("reqs", []))
            at = [i for i, h in enumerate(step.get("handles", [])) if h in handles] or [
                i for i, name in enumerate(names) if name == req
            ]
            for i in at:
                if int((step.get("grants") or [0] * (i + 1))[i]):
                    out.append(("alloc", step))
                out.append(("step", step))
    return out


def test_pd_decode_partial_load_is_a_short_transfer(batch: dict[str, Any]) -> None:
    """The third loaded block is invalid (policy recompute): vLLM keeps the first two blocks
    (8 tokens) as loaded and would recompute the rest. The receipt says what landed: 8 tokens
    in blocks 1-2 of the 18 the bootstrap expected, which is a short transfer
    (transfer_mismatch, a kill in the default ruleset): d-1 is aborted before any forward."""
    result, capture = batch["pd_decode_partial"]
    (recv,) = result["recv"]
    assert (recv["pages"], recv["tokens"], recv["status"]) == ([1, 2], 8, "done")
    assert result["after_recv"]["computed"] == 8  # vLLM's own rewind agrees on what landed
    assert live_kinds(result) == {("transfer_mismatch", "d-1")} and result["killed"] == ["d-1"]
    assert result["final"] == "FINISHED_ERROR" and result["gone"]
    assert [rid for rid, _ in result["told"]] == ["d-1"]
    assert all("d-1" not in step for step in result["trace"])
    assert kinds(replay(capture)) == {("transfer_mismatch", "d-1")}


def test_pd_decode_receipt_short_of_the_prompt_is_a_mismatch(batch: dict[str, Any]) -> None:
    """The prefill holds 3 blocks (12 tokens) of d-1's 18-token prompt, yet the connector
    reports the load finished (it carries no count): the receipt is 12 tokens in blocks 1-3
    of the 5 reserved, against the bootstrap's 18: transfer_mismatch, d-1 killed before its
    first decode (which would read blocks 4-5, never written)."""
    result, capture = batch["pd_decode_short"]
    (recv,) = result["recv"]
    assert (recv["pages"], recv["tokens"], recv["status"]) == ([1, 2, 3], 12, "done")
    assert result["bootstrap"][0]["prompt_tokens"] == 18
    assert live_kinds(result) == {("transfer_mismatch", "d-1")} and result["killed"] == ["d-1"]
    assert result["final"] == "FINISHED_ERROR" and result["gone"]
    assert [rid for rid, _ in result["told"]] == ["d-1"]
    assert all("d-1" not in step for step in result["trace"])
    seen = events(capture)
    assert any(e.get("kill", {}).get("req") == "d-1" for e in seen)
    assert kinds(replay(capture)) == {("transfer_mismatch", "d-1")}


def test_pd_decode_abort_waits_for_the_load_in_flight(batch: dict[str, Any]) -> None:
    """d-2 is aborted while its load is in flight: vLLM keeps its blocks (delay_free_blocks)
    until finished_recving, then frees them; kvguard holds them for the transfer meanwhile."""
    result, capture = batch["pd_decode_abort"]
    assert result["findings"] == [] and result["errors"] == []
    assert result["kept"]["in_requests"] and result["kept"]["free"] == 34  # 39 usable, 5 kept
    assert result["gone"] and result["free_blocks"] == 39
    pages = result["blocks"]
    assert [(h["pages"], h["holder"]) for h in result["hold"]] == [(pages, "transfer_recv")]
    assert [(h["pages"], h["holder"]) for h in result["release"]] == [(pages, "transfer_recv")]
    assert result["free"] == [{"req": "d-2", "pages": pages[::-1]}]
    seen = events(capture)
    order = [k for e in seen for k in ("abort", "hold", "xfer_recv", "release", "free") if k in e]
    assert order == ["abort", "hold", "xfer_recv", "release", "free"]
    assert replay(capture) == []


def test_pd_prefill_frees_only_after_the_send(batch: dict[str, Any]) -> None:
    """p-1 finishes its prefill; NIXL keeps its blocks for the decode engine to read, and vLLM
    frees them on finished_sending: xfer_send of exactly its blocks and tokens while held, then
    the free. p-2, aborted mid-prefill, is not sent (NIXL sends only finished requests): its
    blocks are freed at once. No finding."""
    result, capture = batch["pd_prefill"]
    assert result["findings"] == [] and result["errors"] == []
    p1 = result["blocks"]["p-1"]
    assert p1 == [1, 2, 3, 4, 5]
    held = result["held"]
    assert (held["status"], held["in_requests"], held["blocks"]) == ("FINISHED_LENGTH_CAPPED", True, p1)
    assert held["free"] == 34 and result["gone"] and result["free_blocks"] == 39
    assert [(s["req"], s["pages"], s["tokens"], s["status"]) for s in result["send"]] == [
        ("p-1", p1, 18, "done")
    ]
    assert [(h["pages"], h["holder"]) for h in result["hold"]] == [(p1, "transfer_send")]
    assert result["release"] == [{"req": "p-1", "pages": p1, "holder": "transfer_send"}]
    assert result["free"] == {
        "p-1": [{"req": "p-1", "pages": p1[::-1]}],
        "p-2": [{"req": "p-2", "pages": result["blocks"]["p-2"][::-1]}],
    }
    assert result["p2_gone"] and result["ends"]["p-2"] == [{"req": "p-2", "reason": "finished_aborted"}]
    seen = events(capture)
    order = [
        k
        for e in seen
        for k in ("finish", "hold", "xfer_send", "release", "free")
        if e.get(k, {}).get("req") == "p-1"
    ]
    assert order == ["finish", "hold", "xfer_send", "release", "free"]
    assert replay(capture) == []


def test_a_hybrid_layout_is_refused_when_its_manager_is_made(batch: dict[str, Any]) -> None:
    result, capture = batch["hybrid_refused"]
    assert result["refused"] is True and result["guarded"] is False
    assert result["failed"] == (
        "kvguard: this vLLM KV cache layout (2 group(s), hybrid, context parallel 1/1) is not mapped yet; "
        "not guarding it rather than guarding it wrongly"
    )
    assert events(capture) == []  # nothing reported of a pool kvguard does not guard
