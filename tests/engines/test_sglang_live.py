"""kvguard's SGLang adapter end to end, every part a real process: `kvguard daemon` (enforce, a
SQLite store), `kvguard agent`, and SGLang 0.5.23's own KV classes in its venv started through
`kvguard run --node sg-d0 --mode monitor` (sglang_live.py). The incident on the decode node:
the local guard only watches, the daemon's findings are in its audit store, and its kill comes
back through the agent into SGLang's own abort path (`Req.to_finish`) while another tenant's
request goes on; the guard's record of that kill is in the audit log too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from audit_cli import commands, events, query, until
from engine_venvs import ROOT, engine_python

from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import pb

NODE = "sg-d0"
SUCCESS = 4  # SGLang's KVPoll
TOLD = (
    "kvguard stopped request b-1: it failed a KV-isolation check (transfer_mismatch) on node sg-d0; "
    "nothing computed from KV it does not own was returned. Operators: kvguard audit request b-1"
)
MISMATCH = (
    "KV transfer of tenant-b request b-1 does not add up (tokens): decode sg-d0 expected 32 prompt "
    "tokens (8 page(s) reserved) for b-1 but transfer room-42 delivered 4 (1 page(s))"
)


def engine_under_kvguard_run(sock: str) -> dict[str, Any]:
    """sglang_live.py in SGLang's venv, started as an operator starts an engine: `kvguard run`."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)  # the engine venv sees kvguard through its own link
    command = [
        sys.executable, "-m", "kvguard", "run", "--node", NODE, "--agent-socket", sock, "--mode", "monitor",
        "--", str(engine_python("sglang")), str(ROOT / "tests" / "engines" / "sglang_live.py"), "20",
    ]  # fmt: skip
    # run() kills the engine if it overruns (or the test is interrupted) before it raises.
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd="/tmp")
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-4000:]
    result = json.loads(lines[-1])
    result["_stderr"] = done.stderr
    return result


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], str]]:
    """One run of the whole path: (what the engine saw, the daemon's store)."""
    tmp = tmp_path_factory.mktemp("sglang-live")
    store = str(tmp / "audit.db")
    daemon = start_daemon(store, 0, "--mode", "enforce")
    try:
        sock = str(tmp / "agent.sock")
        agent = start_agent(sock, daemon.address, str(tmp / "spool"))
        try:
            yield engine_under_kvguard_run(sock), store
        finally:
            agent.stop()
    finally:
        daemon.stop()


def test_the_daemon_stores_the_decode_nodes_findings_under_its_name(
    live: tuple[dict[str, Any], str],
) -> None:
    result, store = live
    assert result["adapter_failed"] == "" and result["errors"] == []
    assert result["node"] == NODE and result["mode"] == "monitor"  # as `kvguard run` set them
    assert result["stale_pages"] == 7 and result["poll"] == SUCCESS  # SGLang let B go on
    assert result["killed_locally"] == []
    assert "with kvguard attached (monitor; node sg-d0; events to agent" in result["_stderr"]
    found = until(
        lambda: query(store, "--kind", "finding", "--node", NODE),
        lambda records: {r["finding"]["finding"] for r in records} >= {"transfer_mismatch", "stale_read"},
    )
    updates = [r["finding"] for r in found if "update_of" in r["finding"].get("details", {})]
    found = [r for r in found if "update_of" not in r["finding"].get("details", {})]
    by_kind = {r["finding"]["finding"]: r["finding"] for r in found}
    assert set(by_kind) == {"transfer_mismatch", "stale_read"}, found
    mismatch, stale = by_kind["transfer_mismatch"], by_kind["stale_read"]
    assert (mismatch["node"], mismatch["req"], mismatch["tenant"]) == (NODE, "b-1", "tenant-b")
    assert mismatch["message"] == MISMATCH
    assert (stale["node"], stale["req"], stale["rule"]) == (NODE, "b-1", "stale_read_cross_tenant")
    assert (stale["victim_req"], stale["victim_tenant"]) == ("a-1", "tenant-a")
    assert stale["pages"] == [2, 3, 4, 5, 6, 7, 8]
    # What became of b-1, once the daemon heard: its kill took effect (if it has heard yet).
    assert all((u["req"], u["details"]["outcome"]) == ("b-1", "killed") for u in updates), updates
    # The victim's tenant finds it too, as the operator asks.
    assert {r["finding"]["req"] for r in query(store, "--kind", "finding", "--tenant", "tenant-a")} == {"b-1"}


def test_the_daemons_kill_reaches_sglangs_abort_path_and_only_that_request(
    live: tuple[dict[str, Any], str],
) -> None:
    result, store = live
    # The daemon, enforcing, ordered a kill for each finding naming b-1, in their order.
    ordered = until(
        lambda: [c.kill for c in commands(store) if c.HasField("kill")],
        lambda kills: len(kills) >= 2,
    )
    assert [(k.req, k.finding) for k in ordered] == [("b-1", "transfer_mismatch"), ("b-1", "stale_read")]
    # The first arrived within the scenario's bound, as SGLang's own abort of b-1: the first
    # kill stands (a later one for the same request does not swap its reason).
    assert result["waited_s"] < 20
    # What b-1's client reads: kvguard's words, without the finding's (which name tenant-b's
    # transfer and node: for the operator, in the audit log).
    assert result["b_to_finish"] == {"type": "FINISH_ABORT", "message": TOLD}
    assert result["b_finished"] == result["b_to_finish"]  # SGLang's update_finish_state took it
    assert result["c_to_finish"] is None and result["c_after_step"] is None  # c-1 went on
    assert result["killed"] == {"b-1": "transfer_mismatch"}
    assert result["findings"] == ["transfer_mismatch:b-1", "stale_read:b-1"]  # none names c-1


def test_the_audit_log_records_the_kill_the_daemon_ordered(live: tuple[dict[str, Any], str]) -> None:
    _, store = live

    def ended(evs: list[pb.Event]) -> bool:
        return any(e.HasField("abort") for e in evs) and any(e.HasField("kill") for e in evs)

    evs = until(lambda: events(store), ended)
    kills = [(e.node, e.kill.req, e.kill.finding, e.kill.by) for e in evs if e.HasField("kill")]
    assert kills == [(NODE, "b-1", "transfer_mismatch", "daemon")]
    aborts = [(e.node, e.abort.req, e.abort.reason) for e in evs if e.HasField("abort")]
    assert aborts == [(NODE, "b-1", TOLD)]
    ends = {e.finish.req for e in evs if e.HasField("finish")}
    assert ends == {"a-1"}  # c-1 neither finished nor aborted: it was still running
    seq = {e.HasField("kill"): e.seq for e in evs if e.HasField("kill") or e.HasField("abort")}
    assert seq[True] < seq[False]  # the engine recorded the kill before SGLang ended the request
