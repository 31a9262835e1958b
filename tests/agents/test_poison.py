"""One event no store could keep, sent through a real guard sink, node agent and daemon: it is
refused at the door with its reason, reported once, never resent, and the node's next events
are applied and judged as if it had never come."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from agent_helpers import leak, stored, wait_for

from kvguard.agents.guard import AgentSink, Guard
from kvguard.cli.process import start_agent, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import load_ruleset


def counters(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        return dict(svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters)


def test_a_poison_event_is_refused_once_and_the_node_is_judged_on(tmp_path: Path) -> None:
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store, 0)
    agent = start_agent(str(tmp_path / "agent.sock"), daemon.address, str(tmp_path / "spool"))
    try:
        judged_on(tmp_path, store, daemon.address)
        # Never resent: a new agent on the same spool sends nothing the daemon refuses again.
        agent.stop()
        agent = start_agent(str(tmp_path / "agent.sock"), daemon.address, str(tmp_path / "spool"))
        time.sleep(1.0)
        assert counters(daemon.address)["out_of_range"] == 1
    finally:
        agent.stop()
        daemon.stop()


def judged_on(tmp_path: Path, store: str, address: str) -> None:
    kills: list[str] = []
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    rules = load_ruleset()
    guard = Guard("d0", mode="monitor", ruleset=rules, sink=sink, on_kill=lambda r, why: kills.append(r))
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    guard.admit("a0", "acme", 16, "decode")
    guard.alloc("a0", 0, [3])
    # A uint64 sequence number the store's signed 64-bit column cannot hold (it used to stop
    # the daemon at every start, its agent resending it), then the node's own next events.
    poison = pb.Event(
        node="d0", seq=2**63, epoch=guard.epoch, admit=pb.Admit(req="x", tenant="t", stage="decode")
    )
    assert sink.put(poison.SerializeToString())
    leak(guard)  # judged on: the daemon's verdict on the guard's events comes back as a kill of g1
    assert wait_for(lambda: kills == ["g1"])
    assert sink.flush()
    assert wait_for(lambda: len(stored(store)) == guard._seq)
    assert [e.seq for e in stored(store)] == list(range(1, guard._seq + 1))
    assert counters(address)["out_of_range"] == 1
    sink.close()
    # Kept in the audit log once, as evidence, with why (its bytes as they came: the seq
    # column could not hold its number).
    s = Store(store)
    try:
        (refusal,) = [svc.Refusal.FromString(body) for _, _, body in s.rows(kind="refused")]
        assert s.verify()[0]
    finally:
        s.close()
    assert (refusal.kind, refusal.event) == ("out_of_range", poison.SerializeToString())
