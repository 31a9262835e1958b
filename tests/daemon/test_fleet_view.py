"""What the daemon tells a dashboard about its fleet, over real gRPC: each node's stream, its
agent's last word (NodeStatus: kept, not stored; a malformed one refused), its batches' rate and
lag, a pool page by page (FleetService.Pool: owned, shared, held, free, reserved, quarantined,
and whose), the rules and their modes, and `kvguard fleet`'s table of it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_helpers import wait_for

from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.cli.process import Service, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.proto.pool_map import state_name

USER = [("kvguard-user", "alice")]


@pytest.fixture
def sqlite_daemon(tmp_path: Path) -> Iterator[Service]:
    """A daemon on SQLite, for what does not touch the store."""
    d = start_daemon(str(tmp_path / "audit.db"))
    yield d
    d.stop()


def fleet(address: str) -> svc.FleetState:
    with channel(address, None) as ch:
        return svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)


def node_state(address: str, name: str) -> svc.NodeState | None:
    return next((n for n in fleet(address).nodes if n.node == name), None)


def status(guard: str, spooled: int = 0) -> svc.NodeStatus:
    return svc.NodeStatus(
        guard=guard,
        guard_since_ns=123,
        guard_pid=4242 if guard == "connected" else 0,
        gpu_unavailable="pynvml is not installed",
        spooled=spooled,
        agent_version="kvguard-agent test",
    )


def test_a_status_is_the_nodes_last_word_and_a_stream_its_liveness(sqlite_daemon: Service) -> None:
    """A node with a stream and a status but no event yet is in the fleet; its status is the
    last one sent; when its stream ends it shows as not connected, from then on."""
    before = time.time_ns()
    with grpc.insecure_channel(sqlite_daemon.address) as ch:
        stream = AgentStream(ch, "n1")
        stream.status(status("connected", spooled=7))
        wait_for(lambda: (n := node_state(sqlite_daemon.address, "n1")) is not None and n.HasField("status"))
        stream.status(status("gone"))
        wait_for(lambda: node_state(sqlite_daemon.address, "n1").status.guard == "gone")  # type: ignore[union-attr]
        state = fleet(sqlite_daemon.address)
        (n1,) = state.nodes
        assert n1.connected and before <= n1.connected_ns <= n1.status_ns <= state.now_ns
        assert n1.status == status("gone")
        assert (n1.last_seq, n1.received_ns, n1.events_per_s, len(n1.pools)) == (0, 0, 0.0, 0)
        assert state.mode == "enforce"
        stream.close()
    wait_for(lambda: not node_state(sqlite_daemon.address, "n1").connected)  # type: ignore[union-attr]
    n1 = node_state(sqlite_daemon.address, "n1")
    assert n1 is not None and n1.connected_ns > n1.status_ns and n1.status.guard == "gone"
    assert Store(sqlite_daemon.store).count() == 0  # a status is not stored


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (svc.NodeStatus(guard="maybe"), "status: guard 'maybe' is not connected, gone or none"),
        (
            svc.NodeStatus(guard="none", gpu_unavailable="x" * 70000),
            "status of {size} bytes (at most 65536)",
        ),
    ],
)
def test_a_malformed_status_ends_the_stream_with_the_reason(
    sqlite_daemon: Service, message: svc.NodeStatus, said: str
) -> None:
    with grpc.insecure_channel(sqlite_daemon.address) as ch:
        stream = AgentStream(ch, "n2")
        stream.status(message)
        with pytest.raises(DaemonRefused) as refused:
            stream.next_ack(timeout=10)
        stream.close()
    size = len(svc.AgentMessage(status=message).SerializeToString())
    assert str(refused.value) == f"malformed: {said.format(size=size)}"
    assert fleet(sqlite_daemon.address).counters["stream_malformed"] == 1


def test_batches_give_a_node_its_rate_and_lag(sqlite_daemon: Service) -> None:
    sent = time.time_ns()
    log = EventLog(clock=lambda: sent)  # every event stamped now: the lag is the trip's
    log.add("n3", "pool", pool=0, role="decode", page_size=16, num_pages=8)
    for _ in range(9):
        log.add("n3", "heartbeat", agent_version="test")
    with grpc.insecure_channel(sqlite_daemon.address) as ch:
        stream = AgentStream(ch, "n3")
        assert stream.send(log.events[:5]).accepted == 5
        assert stream.send(log.events[5:]).accepted == 5
        stream.close()
    n3 = node_state(sqlite_daemon.address, "n3")
    assert n3 is not None and n3.last_seq == 10
    assert n3.received_ns > sent and n3.events_per_s == 10 / 10  # 10 events over the 10 s window
    assert 0 < n3.lag_ms == pytest.approx((n3.received_ns - sent) / 1e6, abs=1e-3)
    assert not n3.HasField("status")


# ---------------------------------------------------------------------------------- pool maps


def pool_events() -> list[pb.Event]:
    """Pool 0 of d0 (16 pages, page 0 reserved): a1 (acme) owns 1-2; b1's page 3 is read by
    c1 (globex); x1 (acme) freed 4 and 5, 4 still held by its transfer; y1's 6 held by an
    offload, z1's 7 by the prefix cache (initech); w1 (umbrella) aborted, 8 held by its abort."""
    log = EventLog()
    n = "d0"

    def request(req: str, tenant: str, pages: list[int], *, holder: str = "", end: str = "") -> None:
        log.add(n, "admit", req=req, tenant=tenant, prompt_tokens=16, stage="decode")
        log.add(n, "alloc", req=req, pool=0, pages=pages)
        log.add(n, "write", req=req, pool=0, pages=pages)
        if holder:
            log.add(n, "hold", req=req, pool=0, pages=pages[:1], holder=holder)
        if end == "abort":
            log.add(n, "abort", req=req, reason="client gone")
        if end:
            log.add(n, "free", req=req, pool=0, pages=pages)

    log.add(n, "pool", pool=0, role="colocated", page_size=16, num_pages=16, reserved_pages=1)
    request("a1", "acme", [1, 2])
    request("b1", "globex", [3])
    log.add(n, "admit", req="c1", tenant="globex", prompt_tokens=16, stage="decode")
    log.add(n, "share", req="c1", pool=0, pages=[3], origin_req="b1")
    request("x1", "acme", [4, 5], holder="transfer_send", end="free")
    request("y1", "initech", [6], holder="offload", end="free")
    request("z1", "initech", [7], holder="prefix_cache", end="free")
    request("w1", "umbrella", [8], holder="abort", end="abort")
    return log.events


def pool_map(address: str, node: str, pool: int) -> svc.PoolMap:
    with channel(address, None) as ch:
        return svc_grpc.FleetServiceStub(ch).Pool(svc.PoolMapRequest(node=node, pool=pool), timeout=10)


def act(address: str, action: svc.Action) -> svc.ActionResult:
    with channel(address, None) as ch:
        return svc_grpc.ControlServiceStub(ch).Act(action, metadata=USER, timeout=10)


def test_a_pool_map_says_each_pages_state_and_tenant(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        stream = AgentStream(ch, "d0")
        assert stream.send(pool_events()).rejected == []
        stream.close()
    quarantine = svc.QuarantinePages(pool=0, pages=[11, 10, 11])
    done = act(daemon.address, svc.Action(quarantine=quarantine, node="d0", reason="suspect DIMM"))
    assert (list(done.action.quarantine.pages), done.action.nodes) == ([10, 11], ["d0"])
    found = pool_map(daemon.address, "d0", 0)
    assert (found.node, found.pool, found.page_size, found.epoch) == ("d0", 0, 16, 0)
    states = [state_name(code) for code in found.states]
    assert states == [
        "reserved",
        "owned",
        "owned",
        "shared",
        "transfer",
        "free",
        "offload",
        "prefix_cache",
        "abort",
        "free",
        "quarantined",
        "quarantined",
        *["free"] * 4,
    ]
    tenants = [found.tenants[t] for t in found.tenant]
    assert tenants == [
        "",
        "acme",
        "acme",
        "globex",
        "acme",
        "acme",
        "initech",
        "initech",
        "umbrella",
        *[""] * 7,
    ]
    assert found.tenants[0] == "" and len(set(found.tenants)) == len(found.tenants)
    # ... and the request that holds or last held each page: the one a dashboard would kill.
    reqs = [found.reqs[r] for r in found.req]
    assert reqs == ["", "a1", "a1", "b1", "x1", "x1", "y1", "z1", "w1", *[""] * 7]


def test_a_pool_map_of_what_is_not_there_is_not_found_by_name(sqlite_daemon: Service) -> None:
    with grpc.insecure_channel(sqlite_daemon.address) as ch:
        stream = AgentStream(ch, "d0")
        stream.send(pool_events()[:1])
        stream.close()
    for node, pool, said in [
        ("d9", 0, "node 'd9' is not known to the daemon's ledger (its nodes: d0)"),
        ("d0", 3, "node 'd0' has no pool 3 (its pools: 0)"),
    ]:
        with pytest.raises(grpc.RpcError) as missing:
            pool_map(sqlite_daemon.address, node, pool)
        assert (missing.value.code(), missing.value.details()) == (grpc.StatusCode.NOT_FOUND, said)


def test_the_rules_say_the_mode_each_is_applied_in(sqlite_daemon: Service) -> None:
    act(sqlite_daemon.address, svc.Action(rule_mode=svc.RuleMode(rule="double_free", mode="monitor")))
    with channel(sqlite_daemon.address, None) as ch:
        rules = svc_grpc.FleetServiceStub(ch).Rules(svc.RulesRequest(), timeout=10)
    assert rules.mode == "enforce"
    by_id = {r.id: r for r in rules.rules}
    assert by_id["double_free"] == svc.RuleState(
        id="double_free",
        finding="double_free",
        severity="high",
        action="alert+quarantine",
        mode="monitor",
        overridden=True,
        by="unverified:alice",
    )
    assert by_id["stale_read"] == svc.RuleState(
        id="stale_read", finding="stale_read", severity="high", action="kill", mode="enforce"
    )
    assert [r.id for r in rules.rules if r.overridden] == ["double_free"]


def test_kvguard_fleet_shows_each_nodes_guard_and_when_its_agent_last_spoke(sqlite_daemon: Service) -> None:
    with grpc.insecure_channel(sqlite_daemon.address) as ch:
        stream = AgentStream(ch, "e0")
        stream.status(status("gone"))
        wait_for(lambda: (n := node_state(sqlite_daemon.address, "e0")) is not None and n.HasField("status"))
        shown = subprocess.run(
            [sys.executable, "-m", "kvguard", "fleet", "--daemon", sqlite_daemon.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        stream.close()
    lines = shown.stdout.splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    names = "NODE LAST SEQ AGENT GUARD CANARY HEARD AGO EV/S LAG MS DROPPED POOLS (pages in use / pages)"
    assert header.split() == names.split()
    (row,) = [line.split() for line in lines if line.startswith("e0 ")]
    assert row[:5] == ["e0", "0", "yes", "gone", "-"] and row[6:] == ["-", "-", "0"]  # no canary
    assert row[5].endswith("s") and float(row[5][:-1]) >= 0
    assert "; mode enforce" in shown.stdout
