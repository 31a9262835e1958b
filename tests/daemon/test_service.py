"""The daemon's gRPC service on loopback: what it stores and reports of itself, health and
reflection, and the agent stream: node identity, events refused with a reason, batches sent
without waiting for acks, a node's next stream and what it is told is durable."""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import grpc
import pytest
from daemon_helpers import facts, ingest, local_findings, stale_reads, stored_findings, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.cli.process import Service
from kvguard.cli.send import send_capture
from kvguard.daemon import service
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Store
from kvguard.daemon.writer import InlineWriter
from kvguard.proto import pb
from kvguard.proto.capture import read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
EVENTS = [e for _, e in read_capture(INCIDENT)]


def test_the_daemon_stores_what_a_local_replay_finds(
    daemon: Service,
) -> None:
    summary = send_capture(INCIDENT, daemon.address)
    assert (summary.events, summary.accepted, summary.repeats, summary.rejected) == (39, 39, 0, [])
    assert facts(stored_findings(daemon.store)) == facts(local_findings())
    assert len(local_findings()) == 11


def test_prefix_hits_on_freed_pages_store_nothing_and_cluster_drift_is_stored_at_once(
    daemon: Service,
) -> None:
    """vLLM's freed blocks revived by a prefix hit (node n0) are no finding; prefill p0 and
    decode d0 of one model and cluster that disagree on kv_dtype are drift before any pairing."""
    hit = (DEFAULT_FIXTURES_DIR / "use_after_free-near-miss-prefix-hit" / "capture.jsonl").read_text()
    drift = (DEFAULT_FIXTURES_DIR / "config_drift-cluster" / "capture.jsonl").read_text()
    lines = hit.splitlines() + drift.splitlines()
    summary = send_capture(lines, daemon.address)
    assert (summary.events, summary.rejected) == (21, [])
    stored = stored_findings(daemon.store)
    assert [(f.finding, f.node, f.seq, f.details["field"], f.details["prefill_node"]) for f in stored] == [
        ("config_drift", "d0", 1, "kv_dtype", "p0")
    ]


def test_the_daemon_reports_its_own_latency_by_stage(daemon: Service) -> None:
    """FleetService.State says how long the daemon took from a batch's receipt to each
    finding's verdict and alert and to each batch's ack: one sample per finding and per batch
    (send_capture sends each run of one node's events as a batch), in a consistent order."""
    send_capture(INCIDENT, daemon.address)
    batches = 1 + sum(a.node != b.node for a, b in pairwise(EVENTS))
    with grpc.insecure_channel(daemon.address) as channel:
        fleet = svc_grpc.FleetServiceStub(channel)

        # The updates follow the commits of the findings they update, and an alert's latency
        # is taken when its own group commits: wait for the last of them.
        def alerted() -> int:
            stages = fleet.State(svc.FleetRequest()).latencies
            return next((s.count for s in stages if s.stage == "alert"), 0)

        wait_for(lambda: alerted() >= len(local_findings()) - 4 + 1 + 3)
        state = fleet.State(svc.FleetRequest())
    took = {s.stage: s for s in state.latencies}
    judged = state.counters["findings"]
    assert judged == len(local_findings())
    counts = {stage: s.count for stage, s in took.items()}
    # One alert per finding but the 4 that repeat one, and 4 updates: g1 finished before any
    # kill reached it; its 3 runs of repeats ended.
    assert (state.counters["outcomes"], state.counters["findings_repeated"]) == (1, 4)
    assert counts == {"verdict": judged, "alert": judged - 4 + 1 + 3, "ack": batches}
    for s in took.values():
        assert 0 < s.p50_ms <= s.p99_ms <= s.max_ms, s
    # The same receipt, later steps: a finding's alert (after the commit) comes after its verdict.
    assert took["alert"].max_ms >= took["verdict"].max_ms


def test_a_node_may_speak_only_for_itself(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        p0 = AgentStream(channel, "p0")
        ack = p0.send([EVENTS[0], EVENTS[1]])  # p0's pool report, then d0's
        assert ack.accepted == 1 and [r.reason for r in ack.rejected] == [
            "event of node 'd0' on the stream of 'p0'"
        ]
        with pytest.raises(DaemonRefused, match="identity: node 'p0' is already connected"):
            AgentStream(channel, "p0")
        p0.close()
        out = iter([svc.AgentMessage(batch=svc.EventBatch(events=[EVENTS[0]]))])
        first = next(svc_grpc.AgentServiceStub(channel).Stream(out))
        assert first.error.code == "identity" and "hello" in first.error.message
        counters = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters
        assert (counters["identity"], counters["stream_identity"]) == (1, 2)
    assert Store(daemon.store).count("event") == 1


def test_bad_events_are_refused_with_a_reason_and_the_rest_kept(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        stream = AgentStream(channel, "p0")
        bad = pb.Event(node="p0", seq=2, alloc=pb.Alloc(req="r", pool=0, pages=[99]))
        good = pb.Event(node="p0", seq=2, alloc=pb.Alloc(req="r", pool=0, pages=[1]))
        ack = stream.send([EVENTS[0], bad, good, good])
        assert (ack.accepted, ack.repeats, ack.durable_seq) == (2, 1, 2)
        assert [(r.seq, r.reason) for r in ack.rejected] == [
            (2, "alloc: page 99 out of range for pool 0 of node p0 (6 pages)")
        ]
        too_big = r"oversized: message of 18874\d\d\d bytes \(at most 16777216\)"
        with pytest.raises(DaemonRefused, match=too_big):
            huge = pb.Event(node="p0", seq=3, alloc=pb.Alloc(req="r", pool=0, pages=[300] * (9 << 20)))
            stream.send([huge])
        counters = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters
        assert (counters["malformed"], counters["repeat"], counters["stream_oversized"]) == (1, 1, 1)
    assert Store(daemon.store).count("event") == 2


def test_an_event_that_is_not_one_is_refused_and_the_batch_around_it_kept(daemon: Service) -> None:
    # The daemon reads a batch's events as the bytes they arrived as: one that is no event
    # (or another node's) is refused with its reason, and the events around it are applied
    # and stored; the store's writer, which reads them too, reads only the accepted ones.
    alloc = pb.Event(node="p0", seq=2, alloc=pb.Alloc(req="r", pool=0, pages=[1]))
    cut = pb.Event(node="p0", seq=3, free=pb.Free(req="r", pool=0, pages=[1])).SerializeToString()[:-1]
    other = pb.Event(node="d0", seq=3, free=pb.Free(req="r", pool=0, pages=[1]))
    free = pb.Event(node="p0", seq=3, free=pb.Free(req="r", pool=0, pages=[1]))
    with grpc.insecure_channel(daemon.address) as channel:
        stream = AgentStream(channel, "p0")
        bodies = [EVENTS[0].SerializeToString(), alloc.SerializeToString(), cut, other.SerializeToString()]
        ack = stream.send_serialized([*bodies, free.SerializeToString()])
        assert (ack.accepted, ack.durable_seq) == (3, 3)
        assert [(r.seq, r.reason.split(":")[0]) for r in ack.rejected] == [
            (0, "the bytes are not a kvguard.v1.Event"),
            (3, "event of node 'd0' on the stream of 'p0'"),
        ]
        counters = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters
        assert (counters["malformed"], counters["identity"]) == (1, 1)
        stream.close()
    stored = Store(daemon.store)
    try:
        assert [(e.seq, e.WhichOneof("payload")) for e in stored.events()] == [
            (1, "pool"),
            (2, "alloc"),
            (3, "free"),
        ]
    finally:
        stored.close()


def test_stock_grpc_tools_see_health_and_services(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "kvguard.v1.AgentService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        response = next(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
        names = {s.name for s in response.list_services_response.service}
        assert {
            "kvguard.v1.AgentService",
            "kvguard.v1.AlertService",
            "kvguard.v1.AuditService",
            "kvguard.v1.FleetService",
            "grpc.health.v1.Health",
        } <= names


def test_an_agent_may_send_batches_without_waiting_for_acks(daemon: Service) -> None:
    events = stale_reads("p9", 40)
    batches = [events[i : i + 11] for i in range(0, len(events), 11)]
    hello = svc.AgentMessage(hello=svc.Hello(node="p9")).SerializeToString()
    frames = [svc.AgentMessage(batch=svc.EventBatch(events=b)).SerializeToString() for b in batches]
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.stream_stream(
            "/kvguard.v1.AgentService/Stream",
            request_serializer=None,
            response_deserializer=svc.DaemonMessage.FromString,
        )
        replies = [m for m in call(iter([hello, *frames])) if m.WhichOneof("body") == "ack"]
    # One ack for the hello, then one per batch, in order, each durable up to its last event.
    assert [m.ack.durable_seq for m in replies] == [0, *[b[-1].seq for b in batches]]
    assert sum(m.ack.accepted for m in replies) == len(events)
    assert Store(daemon.store).count("event") == len(events)


def test_a_node_may_open_a_new_stream_once_its_last_one_ended(daemon: Service) -> None:
    # An agent whose stream broke (or that closed it) opens the next one for the same node.
    with grpc.insecure_channel(daemon.address) as channel:
        first = AgentStream(channel, "p3")
        assert first.send(stale_reads("p3", 1)).accepted == 4
        first.close()
        second = connect_again(channel, "p3")  # refused for good if p3's first stream held on
        assert second.durable_seq == 4
        second.close()


def test_a_new_stream_is_told_only_what_is_durable(
    tmp_path: Path,
    held_writer: type[InlineWriter],
) -> None:
    # The hello's ack tells an agent what it may drop from its spool: what the store holds,
    # not what the ledger has applied. (A stream's own batches are durable before it lets its
    # node go, but a stream the server cancels does not wait for that.)
    store = Store(str(tmp_path / "audit.db"))
    writer = held_writer(store)
    daemon = Daemon(store, writer=writer)
    grpc_server = service.serve(daemon, "127.0.0.1:0")
    events = stale_reads("p9", 2)
    try:
        ingest(daemon, "p9", events, lambda _: None)
        deadline = time.monotonic() + 10
        while daemon.ledger.nodes.get("p9") is None or daemon.ledger.nodes["p9"].last_seq < len(events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
            stream = connect_again(channel, "p9")
            assert stream.durable_seq == 0  # applied, not committed
            stream.close()
        writer.release()
        while daemon.durable_seq("p9") < len(events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
            stream = connect_again(channel, "p9")
            assert stream.durable_seq == len(events)
            stream.close()
    finally:
        writer.release()
        grpc_server.stop(grace=1)
        store.close()


def connect_again(channel: grpc.Channel, node: str) -> AgentStream:
    """A stream for `node`, once the daemon has let the node's previous stream go."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return AgentStream(channel, node)
        except DaemonRefused:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
