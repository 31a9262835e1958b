"""Operators' actions (ControlService.Act) on a real daemon over real gRPC: a kill reaches a
real guard through its agent, a quarantine, an acknowledgement and a rule's mode are stored
with who did them (as `action` records, in the chain `kvguard audit verify` proves, shown by
`kvguard audit query`), a rule set to enforce on a monitor daemon orders kills, also after a
restart; and bad input is refused by name, with nothing ordered or stored."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from agent_helpers import stored, wait_for
from daemon_helpers import stale_reads

from kvguard.agents.guard import AgentSink, Guard
from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service, start_agent, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.proto.pool_map import state_name
from kvguard.ruleset import load_ruleset
from kvguard.sinks import ocsf

RULES = load_ruleset()


def act(address: str, action: svc.Action, user: str | None = "alice") -> svc.ActionResult:
    metadata = [("kvguard-user", user)] if user is not None else None
    with channel(address, None) as ch:
        return svc_grpc.ControlServiceStub(ch).Act(action, metadata=metadata, timeout=10)


def refused(address: str, action: svc.Action) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        act(address, action)
    return caught.value.code(), caught.value.details()


def records(store: str, kind: str) -> list[tuple[int, bytes]]:
    s = Store(store)
    try:
        return [(record_id, body) for record_id, _, body in s.rows(kind=kind)]
    finally:
        s.close()


def kvguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvguard", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def guarded(tmp_path: Path, store_url: str) -> Iterator[tuple[Service, Guard, list[tuple[str, str]]]]:
    """A daemon, an agent and a monitor-mode guard of d0 whose engine records the kills."""
    daemon = start_daemon(store_url)
    agent = start_agent(str(tmp_path / "agent.sock"), daemon.address, str(tmp_path / "spool"))
    kills: list[tuple[str, str]] = []
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink, on_kill=lambda *kill: kills.append(kill))
    try:
        yield daemon, guard, kills
    finally:
        sink.close()
        agent.stop()
        daemon.stop()


def applied(address: str, node: str, seq: int) -> bool:
    with channel(address, None) as ch:
        state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
    return any(n.node == node and n.last_seq >= seq for n in state.nodes)


def test_an_operators_kill_reaches_the_guard_and_is_stored_with_who_ordered_it(
    guarded: tuple[Service, Guard, list[tuple[str, str]]],
) -> None:
    daemon, guard, kills = guarded
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    guard.admit("r1", "acme", 16, "decode")
    guard.alloc("r1", 0, [5, 6])
    assert wait_for(lambda: applied(daemon.address, "d0", 3))
    done = act(daemon.address, svc.Action(kill=svc.KillRequest(req="r1"), reason="runaway tenant"))
    # Every node where r1 holds pages: d0; its one command, numbered 1.
    assert (done.action.by, list(done.action.commands), list(done.action.nodes)) == (
        "unverified:alice",
        [1],
        ["d0"],
    )
    assert done.message == "kill of r1 ordered to d0 (command 1)"
    assert wait_for(lambda: kills == [("r1", "killed by unverified:alice: runaway tenant")])
    # Stored: the command (with who ordered it), then the action, the last record when it was answered.
    ((command_id, command_body),) = records(daemon.store, "command")
    ((action_id, action_body),) = records(daemon.store, "action")
    assert action_id == done.record == command_id + 1
    command = svc.Command.FromString(command_body)
    assert (command.id, command.kill.req, command.by) == (1, "r1", "unverified:alice")
    assert command.kill.message == "runaway tenant"
    action = svc.Action.FromString(action_body)
    assert action == done.action and action.reason == "runaway tenant" and action.ts_ns > 0
    # The guard's record of the kill reaches the daemon: r1 has ended, a second kill is refused.
    assert wait_for(lambda: [e.kill.req for e in stored(daemon.store) if e.HasField("kill")] == ["r1"])
    assert refused(daemon.address, svc.Action(kill=svc.KillRequest(req="r1"))) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "kill: request 'r1' has already ended (killed: operator_kill by unverified:alice)",
    )
    # The request's timeline holds the command and the action.
    with channel(daemon.address, None) as ch:
        timeline = list(svc_grpc.AuditServiceStub(ch).Query(svc.AuditQuery(req="r1"), timeout=10))
    assert [(r.kind, r.id) for r in timeline if r.kind in ("command", "action")] == [
        ("command", command_id),
        ("action", action_id),
    ]
    assert next(r for r in timeline if r.kind == "action").action == action


def test_a_rejected_request_that_still_holds_pages_can_be_killed_one_that_freed_them_cannot(
    guarded: tuple[Service, Guard, list[tuple[str, str]]],
) -> None:
    # The 2026 incident's shape: rejected, yet its pages stay in use. Its end is only its word.
    daemon, guard, kills = guarded
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    guard.admit("r1", "acme", 16, "decode")
    guard.alloc("r1", 0, [5, 6])
    guard.reject("r1", "prompt too long")
    guard.admit("r2", "acme", 16, "decode")
    guard.alloc("r2", 0, [7])
    guard.reject("r2", "prompt too long")
    guard.free("r2", 0, [7])
    assert wait_for(lambda: applied(daemon.address, "d0", 8))
    done = act(daemon.address, svc.Action(kill=svc.KillRequest(req="r1"), reason="rejected, still running"))
    assert done.message == "kill of r1 ordered to d0 (command 1)"
    assert wait_for(lambda: kills == [("r1", "killed by unverified:alice: rejected, still running")])
    assert refused(daemon.address, svc.Action(kill=svc.KillRequest(req="r2"))) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "kill: request 'r2' has already ended (rejected: prompt too long)",
    )


def test_acknowledgements_and_rule_modes_are_stored_verified_and_shown(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        stream = AgentStream(ch, "p9")
        stream.send(stale_reads("p9", 1))
        stream.close()
    ((cursor, body),) = records(daemon.store, "finding")
    finding = pb.Finding.FromString(body)
    ack = act(daemon.address, svc.Action(acknowledge=svc.Acknowledge(cursor=cursor), reason="known test"))
    assert ack.message == f"alert {cursor} acknowledged"
    # The SIEM hears of it: an update of the alert (OCSF: Update, In Progress, who and why).
    assert wait_for(lambda: len(records(daemon.store, "finding")) == 2)
    update = pb.Finding.FromString(records(daemon.store, "finding")[1][1])
    assert (update.details["update_of"], update.details["acknowledged_by"]) == (
        str(cursor),
        "unverified:alice",
    )
    assert (update.req, update.finding, update.details["acknowledged_record"]) == (
        finding.req,
        finding.finding,
        str(ack.record),
    )
    event = ocsf.event(svc.Alert(cursor=cursor + 9, finding=update))
    assert (event["activity_name"], event["status"], event["finding_info"]["uid"]) == (
        "Update",
        "In Progress",
        f"kvguard-{cursor}",
    )
    assert event["status_detail"] == "acknowledged by unverified:alice: known test"
    assert event["finding_info"]["modified_time"] == ack.action.ts_ns // 1_000_000
    assert update.ts_ns == finding.ts_ns  # the finding's time; the acknowledgement's is modified_time
    mode = act(
        daemon.address, svc.Action(rule_mode=svc.RuleMode(rule="stale_read", mode="monitor")), user=None
    )
    assert (mode.action.by, mode.message) == (
        "unverified:unknown",
        "rule stale_read is applied in monitor mode",
    )
    back = act(daemon.address, svc.Action(rule_mode=svc.RuleMode(rule="stale_read")), user="bob")
    assert back.message == "rule stale_read is applied in the daemon's mode (enforce) again"
    assert [record_id for record_id, _ in records(daemon.store, "action")] == [
        ack.record,
        mode.record,
        back.record,
    ]
    daemon.stop()
    shown = kvguard("audit", "query", "--store", daemon.store, "--kind", "action")
    header, *lines = shown.stdout.splitlines()
    assert header.split() == ["ID", "TIME", "KIND", "NODE", "SEQ", "REQ", "TENANT", "WHAT", "MESSAGE"]
    assert [line.split()[2:] for line in lines] == [
        [
            "action",
            finding.node,
            "acknowledge",
            "alert",
            str(cursor),
            "by",
            "unverified:alice",
            "known",
            "test",
        ],
        ["action", "rule", "stale_read", "mode=monitor", "by", "unverified:unknown"],
        ["action", "rule", "stale_read", "mode=daemon", "by", "unverified:bob"],
    ]
    assert shown.stderr.strip() == f"3 records from {daemon.store}"
    as_json = [
        json.loads(line)
        for line in kvguard("audit", "query", "--store", daemon.store, "-o", "json").stdout.splitlines()
    ]
    # JSON as the CLI writes every message: zero and empty fields kept (proto/message_json.py).
    empty = {"node": "", "reason": "", "commands": [], "nodes": []}
    assert [r["action"] for r in as_json if r["kind"] == "action"] == [
        empty
        | {
            "acknowledge": {"cursor": cursor},
            "node": finding.node,
            "reason": "known test",
            "by": "unverified:alice",
            "ts_ns": ack.action.ts_ns,
        },
        empty
        | {
            "rule_mode": {"rule": "stale_read", "mode": "monitor"},
            "by": "unverified:unknown",
            "ts_ns": mode.action.ts_ns,
        },
        empty
        | {
            "rule_mode": {"rule": "stale_read", "mode": ""},
            "by": "unverified:bob",
            "ts_ns": back.action.ts_ns,
        },
    ]
    verified = kvguard("audit", "verify", "--store", daemon.store)
    assert verified.returncode == 0, verified.stderr
    assert (
        f"audit log {Store(daemon.store).url}: {Store(daemon.store).count()} records, chain intact"
        in verified.stdout
    )
    assert Store(daemon.store).count("event") == 4  # the actions are not counted as events


def test_a_rule_set_to_enforce_on_a_monitor_daemon_kills_also_after_a_restart(store_url: str) -> None:
    events = stale_reads("p9", 3)  # the pool; then three stale reads (requests p9-r0..r2)

    def send(address: str, part: list[pb.Event]) -> list[svc.Command]:
        with grpc.insecure_channel(address) as ch:
            stream = AgentStream(ch, "p9")
            stream.send(part)  # a command goes out before the ack of the batch that caused it
            stream.close()
        return stream.commands

    first = start_daemon(store_url, 0, "--mode", "monitor")
    try:
        assert send(first.address, events[:4]) == []  # monitor: the finding orders nothing
        act(first.address, svc.Action(rule_mode=svc.RuleMode(rule="stale_read", mode="enforce")))
        (kill,) = send(first.address, events[4:7])
        assert (kill.id, kill.kill.req, kill.kill.rule, kill.by) == (1, "p9-r1", "stale_read", "")
        quarantine = svc.Action(quarantine=svc.QuarantinePages(pool=0, pages=[61, 60]), node="p9")
        assert list(act(first.address, quarantine).action.commands) == [2]
    finally:
        first.stop()
    second = start_daemon(store_url, 0, "--mode", "monitor")
    try:
        with channel(second.address, None) as ch:
            rules = svc_grpc.FleetServiceStub(ch).Rules(svc.RulesRequest(), timeout=10)
        assert rules.mode == "monitor"
        (stale_read,) = [r for r in rules.rules if r.overridden]
        assert (stale_read.id, stale_read.mode, stale_read.by) == (
            "stale_read",
            "enforce",
            "unverified:alice",
        )
        (kill,) = send(second.address, events[7:])
        assert (kill.id, kill.kill.req) == (3, "p9-r2")
        # The quarantine ordered before the restart still holds the pages of p9's engine.
        with channel(second.address, None) as ch:
            found = svc_grpc.FleetServiceStub(ch).Pool(svc.PoolMapRequest(node="p9", pool=0), timeout=10)
        assert [p for p, code in enumerate(found.states) if state_name(code) == "quarantined"] == [60, 61]
    finally:
        second.stop()
    commands = [svc.Command.FromString(body) for _, body in records(store_url, "command")]
    assert [c.WhichOneof("body") for c in commands] == ["kill", "quarantine", "kill"]
    assert [c.by for c in commands] == ["", "unverified:alice", ""]


def test_bad_actions_are_refused_by_name_and_nothing_is_ordered_or_stored(tmp_path: Path) -> None:
    daemon = start_daemon(str(tmp_path / "audit.db"))
    try:
        log = EventLog()
        log.add("d0", "pool", pool=0, role="decode", page_size=16, num_pages=16)
        log.add("d0", "admit", req="done", tenant="acme", prompt_tokens=16, stage="decode")
        log.add("d0", "finish", req="done", output_tokens=1)
        log.add("d0", "admit", req="idle", tenant="acme", prompt_tokens=16, stage="decode")
        with grpc.insecure_channel(daemon.address) as ch:
            stream = AgentStream(ch, "d0")
            stream.send(log.events)
            stream.close()
        code = grpc.StatusCode
        rules = ", ".join(rule.id for rule in RULES.rules)
        cases = [
            (
                svc.Action(),
                code.INVALID_ARGUMENT,
                "an action needs a body: kill, quarantine, acknowledge or rule_mode",
            ),
            (
                svc.Action(kill=svc.KillRequest(req="r1"), reason="x" * 1025),
                code.INVALID_ARGUMENT,
                "kill: the reason is 1025 characters (at most 1024)",
            ),
            (
                svc.Action(kill=svc.KillRequest()),
                code.INVALID_ARGUMENT,
                "kill: no request named (Action.kill.req)",
            ),
            (
                svc.Action(kill=svc.KillRequest(req="nope")),
                code.NOT_FOUND,
                "kill: request 'nope' is not known to the daemon's ledger",
            ),
            (
                svc.Action(kill=svc.KillRequest(req="done")),
                code.FAILED_PRECONDITION,
                "kill: request 'done' has already ended (finished)",
            ),
            (
                svc.Action(kill=svc.KillRequest(req="idle")),
                code.FAILED_PRECONDITION,
                "kill: request 'idle' holds no pages on any node: name its node (Action.node)",
            ),
            (
                svc.Action(kill=svc.KillRequest(req="idle"), node="d7"),
                code.NOT_FOUND,
                "kill: node 'd7' is not known to the daemon",
            ),
            (
                svc.Action(quarantine=svc.QuarantinePages(pool=0, pages=[1])),
                code.INVALID_ARGUMENT,
                "quarantine: no node named (Action.node)",
            ),
            (
                svc.Action(quarantine=svc.QuarantinePages(pool=0, pages=[1]), node="d7"),
                code.NOT_FOUND,
                "quarantine: node 'd7' is not known to the daemon's ledger",
            ),
            (
                svc.Action(quarantine=svc.QuarantinePages(pool=2, pages=[1]), node="d0"),
                code.NOT_FOUND,
                "quarantine: node 'd0' has no pool 2 (its pools: 0)",
            ),
            (
                svc.Action(quarantine=svc.QuarantinePages(pool=0), node="d0"),
                code.INVALID_ARGUMENT,
                "quarantine: no pages listed",
            ),
            (
                svc.Action(quarantine=svc.QuarantinePages(pool=0, pages=[3, 99, 16]), node="d0"),
                code.INVALID_ARGUMENT,
                "quarantine: page 16 (and 1 more) is out of range for pool 0 of node 'd0' "
                "(16 pages: 0 to 15)",
            ),
            (
                svc.Action(acknowledge=svc.Acknowledge()),
                code.INVALID_ARGUMENT,
                "acknowledge: no cursor given (the alert's cursor: its finding's record id)",
            ),
            (
                svc.Action(acknowledge=svc.Acknowledge(cursor=2)),
                code.NOT_FOUND,
                "acknowledge: record 2 is not a finding (no alert has that cursor)",
            ),
            (
                svc.Action(rule_mode=svc.RuleMode(rule="stale_read", mode="panic")),
                code.INVALID_ARGUMENT,
                "rule_mode: mode 'panic' is not monitor, enforce, or \"\" "
                "(back to the daemon's mode, enforce)",
            ),
            (
                svc.Action(rule_mode=svc.RuleMode(rule="no_such_rule", mode="monitor")),
                code.NOT_FOUND,
                f"rule_mode: rule 'no_such_rule' is not in the daemon's ruleset (its rules: {rules})",
            ),
        ]
        for action, want, said in cases:
            assert refused(daemon.address, action) == (want, said)
        with channel(daemon.address, None) as ch:
            counters = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10).counters
        assert counters["actions_refused"] == len(cases)
    finally:
        log_text = daemon.stop()
    assert records(daemon.store, "action") == [] and records(daemon.store, "command") == []
    assert log_text.count("unverified:alice: action refused: ") == len(cases)
