"""The daemon over real gRPC on loopback: durable acknowledgement, idempotent redelivery,
restart from the store, node identity on the stream, alerts resumable by cursor, kill
commands back to the right node, health and reflection, a tamper-evident audit log."""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import grpc
import pytest
from alembic import command
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sqlalchemy import create_engine, inspect, text

from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.cli.process import Service, start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon import server
from kvguard.daemon.store import EventRun, Record, Store, StoreError, migrations
from kvguard.daemon.store import store_url as url_of
from kvguard.daemon.writer import InlineWriter, StoreWriter
from kvguard.ledger import snapshot
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb, wire
from kvguard.proto.builder import EventLog
from kvguard.proto.capture import read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR
from kvguard.ruleset.replay import replay

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
EVENTS = [e for _, e in read_capture(INCIDENT)]


def Daemon(store: str) -> Service:
    return start_daemon(store)


def batch_of(node: str, events: Sequence[pb.Event], reply: server.Reply) -> server.Batch:
    """A batch as a stream hands it to the daemon: the message's bytes, its events' bytes."""
    data = svc.AgentMessage(batch=svc.EventBatch(events=events)).SerializeToString()
    return server.Batch(node, wire.decode_batch(data), reply)


def ingest(daemon: server.Daemon, node: str, events: Sequence[pb.Event], reply: server.Reply) -> None:
    """A batch handed to the daemon's loop, as a stream hands it (from the test's thread)."""
    daemon.loop.call_soon_threadsafe(daemon.ingest, batch_of(node, events, reply))


def run_until(loop: asyncio.AbstractEventLoop, done: Callable[[], bool], timeout: float = 10) -> None:
    """Run `loop` (not running elsewhere) until `done()`."""

    async def wait() -> None:
        while not done():
            await asyncio.sleep(0.005)

    loop.run_until_complete(asyncio.wait_for(wait(), timeout))


@pytest.fixture
def daemon(store_url: str) -> Iterator[Service]:
    d = Daemon(store_url)
    yield d
    d.stop()


def facts(findings: list[pb.Finding] | list) -> Counter:
    return Counter((f.finding, f.rule, f.node, f.req, f.victim_req, tuple(f.pages), f.seq) for f in findings)


def local_findings() -> list:
    found: list = []
    replay(INCIDENT, load_ruleset(), found.append, lambda e: None, Ledger())
    return found


def stored_findings(store: str) -> list[pb.Finding]:
    s = Store(str(store))
    try:
        return [pb.Finding.FromString(body) for _, _, body in s.rows(kind="finding")]
    finally:
        s.close()


def test_the_daemon_stores_what_a_local_replay_finds(daemon: Service) -> None:
    summary = send_capture(INCIDENT, daemon.address)
    assert (summary.events, summary.accepted, summary.repeats, summary.rejected) == (39, 39, 0, [])
    assert facts(stored_findings(daemon.store)) == facts(local_findings())
    assert len(local_findings()) == 11


def test_the_daemon_reports_its_own_latency_by_stage(daemon: Service) -> None:
    """FleetService.State says how long the daemon took from a batch's receipt to each
    finding's verdict and alert and to each batch's ack: one sample per finding and per batch
    (send_capture sends each run of one node's events as a batch), in a consistent order."""
    send_capture(INCIDENT, daemon.address)
    batches = 1 + sum(a.node != b.node for a, b in pairwise(EVENTS))
    with grpc.insecure_channel(daemon.address) as channel:
        state = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest())
    took = {s.stage: s for s in state.latencies}
    judged = state.counters["findings"]
    assert judged == len(local_findings())
    counts = {stage: s.count for stage, s in took.items()}
    assert counts == {"verdict": judged, "alert": judged, "ack": batches}
    for s in took.values():
        assert 0 < s.p50_ms <= s.p99_ms <= s.max_ms, s
    # The same receipt, later steps: a finding's alert (after the commit) comes after its verdict.
    assert took["alert"].max_ms >= took["verdict"].max_ms


def test_the_daemon_times_each_live_alert_until_it_is_written_to_a_subscriber(daemon: Service) -> None:
    # "sent": receipt to the alert written to a live subscriber's stream (an alert read back
    # from the store by a subscriber catching up has no receipt to time from).
    with grpc.insecure_channel(daemon.address) as channel:
        stream = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter())
        send_capture(INCIDENT, daemon.address)
        assert len([next(stream) for _ in range(11)]) == 11  # the subscription is live from here on
        agent = AgentStream(channel, "p9")
        agent.send(stale_reads("p9", 3))
        assert [next(stream).finding.req for _ in range(3)] == ["p9-r0", "p9-r1", "p9-r2"]
        agent.close()
        fleet = svc_grpc.FleetServiceStub(channel)

        def sent() -> svc.StageLatency | None:
            return next((s for s in fleet.State(svc.FleetRequest()).latencies if s.stage == "sent"), None)

        deadline = time.monotonic() + 10
        while (took := sent()) is None or took.count < 3:  # recorded once the write completes
            assert time.monotonic() < deadline, took
            time.sleep(0.02)
        stream.cancel()
    assert 3 <= took.count <= 14
    assert 0 < took.p50_ms <= took.p99_ms <= took.max_ms


def test_redelivery_and_a_killed_daemon_lose_and_double_nothing(store_url: str) -> None:
    store = store_url
    first = Daemon(store)
    half = [line for line in INCIDENT if line.startswith("{")][:20]
    assert send_capture(half, first.address).accepted == 20
    first.kill()  # SIGKILL: no shutdown, no flush
    second = Daemon(store)
    try:
        again = send_capture(INCIDENT, second.address)  # the agent resends what it holds
        assert (again.accepted, again.repeats, again.rejected) == (19, 20, [])
        with grpc.insecure_channel(second.address) as channel:
            state = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest())
        assert {n.node: n.last_seq for n in state.nodes} == {"p0": 17, "d0": 22}
    finally:
        second.stop()
    s = Store(str(store))
    events = [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")]
    assert sorted((e.node, e.seq) for e in events) == sorted((e.node, e.seq) for e in EVENTS)
    assert s.verify() == (True, s.count(), "")
    s.close()
    assert facts(stored_findings(store)) == facts(local_findings())


def test_a_store_of_an_earlier_schema_is_upgraded_in_place(store_url: str) -> None:
    """Migrations run on open: a store written under revision 0001 keeps every record and its
    chain, and loses only the indexes 0002 and 0005 drop."""
    s = Store(store_url)
    s.append([Record.of_event(e) for e in EVENTS])
    s.close()
    with create_engine(url_of(store_url)).begin() as conn:
        command.downgrade(migrations(conn), "0001")
    assert {"records_event_node_seq", "records_tenant"} <= indexes(store_url)
    s = Store(store_url)
    try:
        events = [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")]
        assert events == EVENTS
        assert s.verify() == (True, len(EVENTS), "")
    finally:
        s.close()
    assert indexes(store_url) == {"records_req", "records_kind_ts"}


def indexes(where: str) -> set[str]:
    engine = create_engine(url_of(where))
    try:
        return {i["name"] for i in inspect(engine).get_indexes("records")}
    finally:
        engine.dispose()


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


def test_alerts_resume_from_a_cursor(daemon: Service) -> None:
    send_capture(INCIDENT, daemon.address)
    with grpc.insecure_channel(daemon.address) as channel:
        alerts = svc_grpc.AlertServiceStub(channel)
        stream = alerts.Subscribe(svc.AlertFilter())
        first = [next(stream) for _ in range(11)]
        stream.cancel()
        assert [a.finding.finding for a in first].count("stale_read") == 2
        cursors = [a.cursor for a in first]
        assert cursors == sorted(cursors)
        resumed = alerts.Subscribe(svc.AlertFilter(after=cursors[4], severities=["critical"]))
        rest = [next(resumed) for _ in range(6)]
        resumed.cancel()
        assert [a.cursor for a in rest] == cursors[5:]
        only = alerts.Subscribe(svc.AlertFilter(findings=["stale_read"], tenant="acme"))
        leaks = [next(only) for _ in range(2)]
        only.cancel()
        assert {a.finding.victim_req for a in leaks} == {"a1", "a2"}


def test_kill_commands_reach_the_node_that_holds_the_request(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        streams = {node: AgentStream(channel, node) for node in ("p0", "d0")}
        for event in EVENTS:
            streams[event.node].send([event])
        streams["p0"].send([])  # collect what is queued for p0
        streams["d0"].send([])
        kills = {node: {(c.kill.req, c.kill.finding) for c in s.commands} for node, s in streams.items()}
        for stream in streams.values():
            stream.close()
    assert ("g1", "stale_read") in kills["d0"] and ("g1", "transfer_mismatch") in kills["d0"]
    assert ("g1", "rejected_progress") in kills["p0"] and all(req == "g1" for req, _ in kills["p0"])


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


def test_audit_verify_finds_an_altered_record(daemon: Service) -> None:
    send_capture(INCIDENT, daemon.address)
    daemon.stop()
    verify = [sys.executable, "-m", "kvguard", "audit", "verify", "--store", daemon.store]
    ok = subprocess.run(verify, capture_output=True, text=True)
    assert ok.returncode == 0 and "60 records, chain intact" in ok.stdout
    assert "ledger snapshot: after record 60, bound to the chain there" in ok.stdout  # saved at the stop
    engine = create_engine(Store(daemon.store).url)
    with engine.begin() as db:
        db.execute(
            text("UPDATE records SET victim_tenant = 'x' WHERE kind = 'finding' AND victim_tenant = 'acme'")
        )
    bad = subprocess.run(verify, capture_output=True, text=True)
    assert bad.returncode == 1 and "was altered" in bad.stderr
    with engine.begin() as db:
        db.execute(text("DELETE FROM records WHERE id = 3"))
    engine.dispose()
    gone = subprocess.run(verify, capture_output=True, text=True)
    assert gone.returncode == 1 and "NOT proven intact" in gone.stderr


def test_the_requests_a_record_names_are_indexed_and_the_index_verified(store_url: str) -> None:
    # A decode step's launch names its whole batch; a request's timeline must find it by any
    # entry, and a row taken out of that index (outside the chain) must not go unnoticed.
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=16)
    reads = [{"req": r, "pool": 0, "pages": [i], "tokens": 16} for i, r in enumerate(["a", "b", "c", "b"])]
    launch = log.add("n0", "read", reads=reads)
    s = Store(store_url)
    try:
        s.append([Record.of_event(e) for e in log.events])
        assert [r[0] for r in s.rows(req="b")] == [2] and [r[0] for r in s.rows(req="c")] == [2]
        assert pb.Event.FromString(next(s.rows(req="c"))[2]) == launch
        assert s.verify() == (True, 2, "")
        engine = create_engine(url_of(store_url))
        with engine.begin() as db:
            db.execute(text("DELETE FROM named WHERE req = 'c'"))
        assert s.verify() == (False, 1, "record 2: the index of the requests it names was altered")
        assert list(s.rows(req="c")) == []  # what such a removal would hide
        with engine.begin() as db:
            db.execute(text("INSERT INTO named (record_id, req) VALUES (2, 'c'), (1, 'z')"))
        assert s.verify() == (False, 0, "record 1: the index of the requests it names was altered")
        with engine.begin() as db:
            db.execute(text("DELETE FROM named WHERE req = 'z'"))
            db.execute(text("INSERT INTO named (record_id, req) VALUES (9, 'z')"))
        assert s.verify() == (False, 2, "the index of named requests lists record 9, past the last record")
        engine.dispose()
    finally:
        s.close()


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvguard", "audit", *args], capture_output=True, text=True)


def rechain(where: str, key: bytes | None) -> None:
    """What someone who can write the database does to hide an edit: recompute every hash."""
    from kvguard.daemon.store import GENESIS, _chain

    engine = create_engine(url_of(where))
    with engine.begin() as db:
        prev = GENESIS
        for row in db.execute(text("SELECT * FROM records ORDER BY id")).mappings().all():
            columns = [row[c] for c in ("kind", "node", "seq", "ts_ns", "req", "tenant")]
            columns += [row[c] for c in ("victim_tenant", "finding", "severity")]
            digest = _chain(prev, row["id"], columns, row["body"], key)
            db.execute(
                text("UPDATE records SET prev_hash = :p, hash = :h WHERE id = :i"),
                {"p": prev, "h": digest, "i": row["id"]},
            )
            prev = digest
    engine.dispose()


def test_a_sealed_chain_cannot_be_rewritten_without_its_key(store_url: str, tmp_path: Path) -> None:
    key, other = tmp_path / "audit.key", tmp_path / "other.key"
    made = audit("new-key", str(key))
    assert made.returncode == 0 and (key.stat().st_mode & 0o777) == 0o600
    assert audit("new-key", str(key)).returncode == 1  # never over an existing key
    audit("new-key", str(other))
    d = start_daemon(store_url, 0, "--audit-key", str(key))
    send_capture(INCIDENT, d.address)
    d.stop()
    store = ["--store", store_url]
    ok = audit("verify", *store, "--audit-key", str(key))
    assert ok.returncode == 0, ok.stderr
    assert "60 records, chain intact, sealed with the audit key from record 1 on" in ok.stdout
    assert "ledger snapshot: after record 60, bound to the chain there" in ok.stdout
    unkeyed = audit("verify", *store)
    assert (
        unkeyed.returncode == 1
        and "records from 1 on are sealed with an audit key not given" in unkeyed.stderr
    )
    wrong = audit("verify", *store, "--audit-key", str(other))
    assert wrong.returncode == 1 and "an audit key given is not one its chain is sealed with" in wrong.stderr
    # Without the key a sealed store takes no records: the daemon does not start.
    with pytest.raises(
        RuntimeError,
        match=r"sealed \(the current seal from record 1 on\); writing to it needs that audit key",
    ):
        start_daemon(store_url)
    # A rewrite by someone who can write the database: a victim's tenant changed, the chain
    # recomputed. Caught with the key, whether the seal is left in place or removed too.
    engine = create_engine(url_of(store_url))
    with engine.begin() as db:
        db.execute(text("UPDATE records SET victim_tenant = 'x' WHERE victim_tenant = 'acme'"))
    rechain(store_url, None)
    caught = audit("verify", *store, "--audit-key", str(key))
    assert caught.returncode == 1 and "record 1 (event of p0) was altered" in caught.stderr
    with engine.begin() as db:
        db.execute(text("DELETE FROM seal"))
    engine.dispose()
    assert audit("verify", *store).returncode == 0  # what a plain chain cannot tell
    with pytest.raises(RuntimeError, match="is not sealed but has records: seal it once"):
        start_daemon(store_url, 0, "--audit-key", str(key))  # no new seal over a rewrite
    unsealed = audit("verify", *store, "--audit-key", str(key))
    assert (
        unsealed.returncode == 1
        and "the chain is not sealed (never sealed, or the seal was removed)" in unsealed.stderr
    )


def test_a_store_sealed_later_is_proven_plain_before_the_seal_and_keyed_after(tmp_path: Path) -> None:
    where, key = str(tmp_path / "audit.db"), tmp_path / "audit.key"
    audit("new-key", str(key))
    d = start_daemon(where)
    send_capture(INCIDENT[:20], d.address)
    d.stop()
    first = Store(where).count()
    with pytest.raises(
        RuntimeError, match="is not sealed but has records: seal it once with `kvguard audit seal`"
    ):
        start_daemon(where, 0, "--audit-key", str(key))
    sealed = audit("seal", "--store", where, "--audit-key", str(key))
    assert sealed.returncode == 0 and f"sealed with the audit key from record {first + 1} on" in sealed.stdout
    again = audit("seal", "--store", where, "--audit-key", str(key))
    assert (
        again.returncode == 1
        and f"sealed already (the current seal from record {first + 1} on)" in again.stderr
    )
    d = start_daemon(where, 0, "--audit-key", str(key))
    send_capture(INCIDENT, d.address)  # the first 20 lines are repeats: refused, not stored
    d.stop()
    ok = audit("verify", "--store", where, "--audit-key", str(key))
    assert ok.returncode == 0, ok.stderr
    assert f"sealed with the audit key from record {first + 1} on" in ok.stdout
    assert Store(where).count() > first + 10
    assert facts(stored_findings(where)) == facts(local_findings())


def test_the_audit_key_rotates_and_each_key_proves_what_it_sealed(tmp_path: Path) -> None:
    where, k1, k2 = str(tmp_path / "audit.db"), tmp_path / "k1", tmp_path / "k2"
    audit("new-key", str(k1))
    audit("new-key", str(k2))
    d = start_daemon(where, 0, "--audit-key", str(k1))
    send_capture(INCIDENT[:20], d.address)
    d.stop()
    first = Store(where).count()
    store = ["--store", where]
    refused = audit("seal", *store, "--audit-key", str(k2))
    assert (
        refused.returncode == 1
        and "to rotate its key, give the current one as --current-key" in refused.stderr
    )
    impostor = audit("seal", *store, "--audit-key", str(k1), "--current-key", str(k2))
    assert impostor.returncode == 1 and "not one its chain is sealed with" in impostor.stderr
    rotated = audit("seal", *store, "--audit-key", str(k2), "--current-key", str(k1))
    assert rotated.returncode == 0 and f"from record {first + 1} on (key rotated)" in rotated.stdout
    with pytest.raises(RuntimeError, match=f"the current seal from record {first + 1} on"):
        start_daemon(where, 0, "--audit-key", str(k1))  # the old key writes no more
    d = start_daemon(where, 0, "--audit-key", str(k2))
    send_capture(INCIDENT, d.address)
    d.stop()
    both = audit("verify", *store, "--audit-key", str(k1), "--audit-key", str(k2))
    assert both.returncode == 0, both.stderr
    assert f"sealed with the audit key from record 1 on (key rotated at record {first + 1})" in both.stdout
    assert "bound to the chain there" in both.stdout  # the snapshot, under the current key
    old_only = audit("verify", *store, "--audit-key", str(k1))
    assert (
        old_only.returncode == 1
        and f"records from {first + 1} on are sealed with an audit key not given" in old_only.stderr
    )
    new_only = audit("verify", *store, "--audit-key", str(k2))
    assert (
        new_only.returncode == 1
        and "records from 1 on are sealed with an audit key not given" in new_only.stderr
    )
    assert facts(stored_findings(where)) == facts(local_findings())


def test_an_audit_key_others_may_read_or_too_short_is_refused(tmp_path: Path) -> None:
    where, key = str(tmp_path / "audit.db"), tmp_path / "audit.key"
    key.write_text("k" * 64)
    key.chmod(0o640)
    with pytest.raises(RuntimeError, match=r"others may read or write it \(mode 640\); chmod 600 it"):
        start_daemon(where, 0, "--audit-key", str(key))
    key.chmod(0o600)
    key.write_text("short\n")
    with pytest.raises(RuntimeError, match="5 bytes, at least 32 needed"):
        start_daemon(where, 0, "--audit-key", str(key))
    missing = audit("verify", "--store", where, "--audit-key", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "No such file or directory" in missing.stderr


def one_page_requests(node: str, n: int, *, written: bool) -> list[pb.Event]:
    """A pool report, then n requests that each take a page, read it (having written it, or
    not: a stale read, one finding each) and free it."""
    log = EventLog()
    log.add(node, "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    for i in range(n):
        req, page = f"{node}-r{i}", [i % 64]
        log.add(node, "alloc", req=req, pool=0, pages=page)
        if written:
            log.add(node, "write", req=req, pool=0, pages=page)
        log.add(node, "read", reads=[{"req": req, "pool": 0, "pages": page, "tokens": 16}])
        log.add(node, "free", req=req, pool=0, pages=page)
    return log.lines


def stale_reads(node: str, n: int) -> list[pb.Event]:
    """n requests that each read a page they never wrote (n findings)."""
    return one_page_requests(node, n, written=False)


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


def test_a_subscriber_that_falls_behind_catches_up_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A live queue of 4 alerts: while the subscriber does not read, the daemon drops from it,
    # and the stream reads what it missed from the store; every alert arrives once, in order.
    monkeypatch.setattr(server, "SUBSCRIBER_QUEUE", 4)
    store = Store(str(tmp_path / "audit.db"))
    daemon = server.Daemon(store, mode="monitor")
    grpc_server = server.serve(daemon, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
            stream = AgentStream(channel, "p8")
            first = stale_reads("p8", 1)
            stream.send(first)
            alerts = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter())
            seen = [next(alerts)]  # live now; from here on it does not read for a while
            events = stale_reads("p8", 601)[len(first) :]
            for i in range(0, len(events), 300):
                stream.send(events[i : i + 300])
            seen += [next(alerts) for _ in range(600)]
            alerts.cancel()
            stream.close()
        assert [a.finding.req for a in seen] == [f"p8-r{i}" for i in range(601)]
        cursors = [a.cursor for a in seen]
        assert cursors == sorted(set(cursors))
        assert daemon.counters["subscriber_caught_up"] >= 1
        wait_for(lambda: daemon._delivering == 0)  # not left counting a stream that ended
    finally:
        grpc_server.stop(grace=1)
        store.close()


def test_quarantine_commands_name_the_pages_a_lifetime_finding_names(daemon: Service) -> None:
    log = EventLog()
    log.add("p7", "pool", pool=0, role="colocated", page_size=16, num_pages=16)
    log.add("p7", "alloc", req="a", pool=0, pages=[3, 4])
    log.add("p7", "free", req="a", pool=0, pages=[3, 4])
    log.add("p7", "free", req="a", pool=0, pages=[4])  # double free: alert+quarantine
    log.add("p7", "alloc", req="b", pool=0, pages=[5])
    log.add("p7", "free", req="b", pool=0, pages=[5])
    log.add("p7", "write", req="b", pool=0, pages=[5])  # use after free: kill+quarantine
    with grpc.insecure_channel(daemon.address) as channel:
        stream = AgentStream(channel, "p7")
        stream.send(log.lines)
        stream.close()
        counters = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters
    commands = [
        (c.WhichOneof("body"), c.kill.req, c.quarantine.finding, list(c.quarantine.pages))
        for c in stream.commands
    ]
    assert commands == [
        ("quarantine", "", "double_free", [4]),
        ("kill", "b", "", []),
        ("quarantine", "", "use_after_free", [5]),
    ]
    assert (counters["kills"], counters["quarantines"]) == (1, 2)
    s = Store(daemon.store)
    stored = [svc.Command.FromString(body) for _, _, body in s.rows(kind="command")]
    s.close()
    assert [c.id for c in stored] == [c.id for c in stream.commands]


def test_a_kill_ordered_while_its_node_is_away_reaches_its_next_stream(tmp_path: Path) -> None:
    # An agent that loses its stream after sending a batch resends the batch on its next
    # stream; the ledger has it already, so the kill it caused is never ordered again. The
    # daemon keeps the command for the node's next stream instead of dropping it.
    store = Store(str(tmp_path / "audit.db"))
    daemon = server.Daemon(store)
    grpc_server = server.serve(daemon, "127.0.0.1:0")
    try:
        events = stale_reads("p6", 1)
        acked: list[svc.DaemonMessage] = []
        ingest(daemon, "p6", events, acked.append)
        deadline = time.monotonic() + 10
        while not acked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert acked and acked[0].ack.accepted == len(events)  # durable, and nobody to tell
        with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
            stream = AgentStream(channel, "p6")
            assert stream.durable_seq == len(events)
            stream.send([])  # a round trip: what was queued for p6 has arrived
            stream.close()
        assert [(c.kill.req, c.kill.finding) for c in stream.commands] == [("p6-r0", "stale_read")]
        assert daemon.counters["commands_late"] == 1
    finally:
        grpc_server.stop(grace=1)
        store.close()


def clean_requests(node: str, n: int) -> list[pb.Event]:
    """n requests that each write and read their own page (no finding)."""
    return one_page_requests(node, n, written=True)


def wait_for(done: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@dataclass
class Held:
    """A daemon whose store writer holds its commits until `writer.release()` (a slow disk)."""

    store: Store
    writer: Any  # conftest's HeldWriter (tests cannot import conftest)
    daemon: server.Daemon


@pytest.fixture
def held(tmp_path: Path, held_writer: type[InlineWriter]) -> Iterator[Held]:
    store = Store(str(tmp_path / "audit.db"))
    writer = held_writer(store)
    daemon = server.Daemon(store, writer=writer)
    try:
        yield Held(store, writer, daemon)
    finally:
        writer.release()
        daemon.close()  # done with the store before it closes
        store.close()


def test_batches_that_arrive_while_a_group_commits_are_committed_together_next(held: Held) -> None:
    # Group commit: while one group commits, whatever the streams deliver is applied at once
    # and committed as the next group, in one transaction, when the one before is durable.
    store, writer, daemon = held.store, held.writer, held.daemon
    sent: dict[str, list[svc.DaemonMessage]] = {n: [] for n in ("g1", "g2", "g3")}
    for node, box in sent.items():
        assert daemon.connect(node, box.append)
    for n, node in enumerate(sent, 1):
        ingest(daemon, node, clean_requests(node, n), sent[node].append)
    wait_for(lambda: "g3" in daemon.ledger.nodes and daemon.ledger.nodes["g3"].last_seq == 13)
    # Every batch applied, none committed, one group out.
    assert writer.held is not None and [len(batches) for batches, _ in writer.held] == [1]
    assert not any(sent.values())
    writer.release()
    wait_for(lambda: all(box and box[-1].WhichOneof("body") == "ack" for box in sent.values()))
    assert [len(batches) for batches in writer.committed] == [1, 2]  # g1 alone, then g2 + g3
    assert [[m.ack.accepted for m in box] for box in sent.values()] == [[5], [9], [13]]
    assert store.count("event") == 27 and store.verify()[0]


def test_a_group_holding_an_alert_goes_to_the_writer_without_waiting_for_the_commit_before(
    held: Held,
) -> None:
    # An alert waits for its group's commit: that group is handed to the writer as soon as
    # the event that raised it is judged, queued behind the commit in flight (with what was
    # applied before it), not when that commit is reported nor once the rest of its batch is
    # applied. A batch cut so goes on in the next group and is acknowledged once, after its
    # last event is durable. Commits, acks and alert cursors keep their order.
    store, writer, daemon = held.store, held.writer, held.daemon
    sent: dict[str, list[svc.DaemonMessage]] = {n: [] for n in ("a1", "a2", "a3")}
    alerts: list[tuple[int, server.Finding]] = []
    sub = server.Subscriber(svc.AlertFilter())
    daemon.loop.call_soon_threadsafe(daemon.subscribers.append, sub)
    for node, box in sent.items():
        assert daemon.connect(node, box.append)
    ingest(daemon, "a1", clean_requests("a1", 1), sent["a1"].append)
    ingest(daemon, "a2", clean_requests("a2", 2), sent["a2"].append)
    ingest(daemon, "a3", stale_reads("a3", 2), sent["a3"].append)
    wait_for(lambda: writer.held is not None and len(writer.held) == 3)
    # a1; a2 + a3 through its first alert, not waiting for a1's commit; then the rest of a3
    # (its second alert does not end the step: the first one's group is committing)
    assert [len(batches) for batches, _ in writer.held] == [1, 2, 1]
    assert [[(p.start, p.stop) for p in parts if isinstance(p, EventRun)] for _, parts in writer.held] == [
        [(0, 5)],
        [(0, 9), (0, 3)],
        [(3, 6), (6, 7)],
    ]
    assert [m.WhichOneof("body") for m in sent["a3"]] == ["command"] * 2  # judged, not yet durable
    assert not sent["a1"] and not sent["a2"] and sub.live.empty()
    writer.release()
    wait_for(lambda: all(box and box[-1].WhichOneof("body") == "ack" for box in sent.values()))
    assert [len(batches) for batches in writer.committed] == [1, 2, 1]
    assert [[m.ack.accepted for m in box if m.ack.accepted] for box in sent.values()] == [[5], [9], [7]]
    while not sub.live.empty():
        record_id, finding, _ = sub.live.get_nowait()
        alerts.append((record_id, finding))
    stored = {record_id: pb.Finding.FromString(body) for record_id, _, body in store.rows(kind="finding")}
    assert [f.req for _, f in alerts] == ["a3-r0", "a3-r1"]
    assert [stored[record_id].req for record_id, _ in alerts] == ["a3-r0", "a3-r1"]  # cursors name them
    assert store.count("event") == 21 and store.verify()[0]


def test_an_alert_late_in_a_large_batch_is_committed_before_the_rest_of_it(held: Held) -> None:
    # A batch larger than a step is applied over several, and its group waits for the last
    # (its ack does) unless an alert is raised in it: then the events applied so far go to
    # the writer at once, and the rest follow in the next group. One ack says the whole batch.
    store, writer, daemon = held.store, held.writer, held.daemon
    sent: list[svc.DaemonMessage] = []
    assert daemon.connect("big", sent.append)
    log = EventLog()
    log.add("big", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    for i in range(160):  # clean requests, and half way (after a step) one that reads a stale page
        req, page = f"big-r{i}", [i % 64]
        log.add("big", "alloc", req=req, pool=0, pages=page)
        if i != 80:
            log.add("big", "write", req=req, pool=0, pages=page)
        else:
            alert_at = len(log.lines)
        log.add("big", "read", reads=[{"req": req, "pool": 0, "pages": page, "tokens": 16}])
        log.add("big", "free", req=req, pool=0, pages=page)
    events = log.lines
    assert server.APPLY_SLICE < alert_at < len(events) - server.APPLY_SLICE
    ingest(daemon, "big", events, sent.append)
    wait_for(lambda: "big" in daemon.ledger.nodes and daemon.ledger.nodes["big"].last_seq == events[-1].seq)
    assert writer.held is not None
    assert [[(p.start, p.stop) for p in parts if isinstance(p, EventRun)] for _, parts in writer.held] == [
        [(0, alert_at + 1)]
    ]
    assert [m.WhichOneof("body") for m in sent] == ["command"]  # the kill; no ack: nothing is durable
    writer.release()
    wait_for(lambda: bool(sent) and sent[-1].WhichOneof("body") == "ack")
    assert [len(batches) for batches in writer.committed] == [1, 1]  # through the alert, then the rest
    assert [m.WhichOneof("body") for m in sent] == ["command", "ack"]
    assert sent[1].ack.accepted == len(events) and sent[1].ack.durable_seq == events[-1].seq
    assert store.count("event") == len(events) and store.count("finding") == 1 and store.verify()[0]
    assert [e.seq for e in store.events()] == [e.seq for e in events]


def test_batches_are_applied_in_small_steps_while_alerts_are_being_written(tmp_path: Path) -> None:
    # A subscriber's stream writes one alert at a time, each write waiting for a turn of the
    # loop: while one has alerts to write, a batch is applied DELIVERING_SLICE events a step
    # (that write waits behind one small step), and APPLY_SLICE once every stream is written out.
    store = Store(str(tmp_path / "audit.db"))
    daemon = server.Daemon(store, mode="monitor")
    sub = server.Subscriber(svc.AlertFilter())
    applied: list[int] = []

    def batch_then_look(node: str) -> None:  # in one step: a batch, then a delivery's turn
        daemon.ingest(batch_of(node, clean_requests(node, 50), lambda msg: None))
        daemon.loop.call_soon(lambda: applied.append(daemon.ledger.nodes[node].last_seq))

    try:
        daemon.loop.call_soon_threadsafe(daemon.subscribers.append, sub)
        ingest(daemon, "d0", stale_reads("d0", 1), lambda msg: None)
        wait_for(lambda: not sub.live.empty())  # an alert to write: the stream is delivering
        daemon.loop.call_soon_threadsafe(batch_then_look, "d1")
        wait_for(lambda: len(applied) == 1)
        assert 0 < applied[0] <= server.DELIVERING_SLICE
        daemon.loop.call_soon_threadsafe(daemon.delivered, sub)  # written out, as its stream says
        daemon.loop.call_soon_threadsafe(batch_then_look, "d2")
        wait_for(lambda: len(applied) == 2)
        assert applied[1] == 201  # the whole batch in one step (< APPLY_SLICE events)
        assert daemon._delivering == 0
    finally:
        daemon.close()
        store.close()


def test_a_kill_does_not_wait_for_the_disk(held: Held) -> None:
    # The read is a leak in progress: the kill goes out as soon as the ledger has judged it.
    # Its alert and the batch's ack wait for the commit (an alert's cursor names a durable
    # record), and the command is stored with them.
    store, writer, daemon = held.store, held.writer, held.daemon
    sent: list[svc.DaemonMessage] = []
    assert daemon.connect("p7", sent.append)
    events = stale_reads("p7", 1)
    ingest(daemon, "p7", events, sent.append)
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # an ack sent after the kill would have arrived by now
    assert [m.WhichOneof("body") for m in sent] == ["command"]
    assert (sent[0].command.kill.req, sent[0].command.kill.finding) == ("p7-r0", "stale_read")
    assert store.count() == 0  # nothing durable yet
    writer.release()
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [m.WhichOneof("body") for m in sent] == ["command", "ack"]
    assert sent[1].ack.accepted == len(events)
    commands = [svc.Command.FromString(body) for _, _, body in store.rows(kind="command")]
    assert commands == [sent[0].command]


def test_a_command_reaches_an_agent_that_is_sending_nothing(tmp_path: Path) -> None:
    # Commands are not piggybacked on acks: an agent with nothing to send (its engine idle, or
    # its batch already acknowledged) gets a kill the moment the daemon orders it.
    store = Store(str(tmp_path / "audit.db"))
    daemon = server.Daemon(store)
    grpc_server = server.serve(daemon, "127.0.0.1:0")
    arrived: queue.Queue[svc.Command] = queue.Queue()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
            stream = AgentStream(channel, "p8", on_command=arrived.put)
            kill = svc.Command(id=7, kill=svc.KillRequest(req="p8-r3", finding="stale_read"))
            daemon.send_command("p8", kill)
            assert arrived.get(timeout=10) == kill
            assert stream.commands == []  # handed to on_command, not kept
            stream.close()
    finally:
        grpc_server.stop(grace=1)
        store.close()


def test_the_store_writer_commits_what_it_was_given_and_exits_when_closed(tmp_path: Path) -> None:
    # close() used to leave the writer blocked on a pipe the daemon's reply thread still held
    # open: every daemon stop waited out the join timeout, then killed the writer.
    where = str(tmp_path / "audit.db")
    Store(where).close()
    writer = StoreWriter(where)
    batch = wire.decode_batch(svc.AgentMessage(batch=svc.EventBatch(events=EVENTS[:5])).SerializeToString())
    writer.submit([batch], [EventRun(0, 0, 5)])
    writer.close()  # without waiting for the commit's report
    assert writer._proc.exitcode == 0  # it finished on its own, it was not killed
    s = Store(where)
    try:
        assert [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")] == EVENTS[:5]
    finally:
        s.close()


def test_a_writer_that_cannot_open_the_store_stops_the_daemon_from_starting(tmp_path: Path) -> None:
    # The writer opens the store in its own process; the daemon waits for that before it
    # serves, so a store the writer cannot open is refused at start, not at the first batch.
    where = tmp_path / "audit.db"
    where.write_bytes(b"this is not an SQLite database, and it is long enough to be read" * 64)
    writer = StoreWriter(str(where))
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(StoreError, match="the store writer cannot open the store"):
            writer.start(loop, lambda first: None, lambda exc: None)
    finally:
        writer.close()
        loop.close()
    assert writer._proc.exitcode is not None  # it ended, and nothing was written
    assert where.read_bytes().startswith(b"this is not an SQLite database")


def test_groups_queued_at_the_writer_keep_their_order_and_their_ids(tmp_path: Path) -> None:
    # Submitted back to back, the groups queue up in the writer's pipe, which commits them
    # together: each must still be reported with its own group's first record id, in order.
    where = str(tmp_path / "audit.db")
    Store(where).close()
    writer = StoreWriter(where)
    loop = asyncio.new_event_loop()
    committed: list[int] = []
    failed: list[Exception] = []
    writer.start(loop, committed.append, failed.append)
    sizes = [3, 1, 4, 1, 5]
    start = 0
    for n in sizes:
        data = svc.AgentMessage(batch=svc.EventBatch(events=EVENTS[start : start + n])).SerializeToString()
        writer.submit([wire.decode_batch(data)], [EventRun(0, 0, n)])
        start += n
    run_until(loop, lambda: len(committed) == len(sizes))
    assert committed == [1, 4, 5, 9, 10] and failed == []
    writer.close()
    loop.close()
    s = Store(where)
    try:
        assert [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")] == EVENTS[:14]
        assert s.verify() == (True, 14, "")
    finally:
        s.close()


def test_a_closing_daemon_commits_everything_it_was_sent(tmp_path: Path) -> None:
    # Stopping: the server stops, then the daemon applies and submits what is still queued,
    # then the writer commits it and exits. Closing the writer first would lose the tail.
    where = str(tmp_path / "audit.db")
    store = Store(where)
    writer = StoreWriter(where)
    daemon = server.Daemon(store, writer=writer)
    events = stale_reads("p5", 30)
    for i in range(0, len(events), 7):
        ingest(daemon, "p5", events[i : i + 7], lambda _: None)
    daemon.close()
    writer.close()
    assert writer._proc.exitcode == 0
    try:
        assert [pb.Event.FromString(body) for _, _, body in store.rows(kind="event")] == events
        assert store.count("finding") == 30 and store.verify()[0]
    finally:
        store.close()


def test_a_node_may_open_a_new_stream_once_its_last_one_ended(daemon: Service) -> None:
    # An agent whose stream broke (or that closed it) opens the next one for the same node.
    with grpc.insecure_channel(daemon.address) as channel:
        first = AgentStream(channel, "p3")
        assert first.send(stale_reads("p3", 1)).accepted == 4
        first.close()
        second = connect_again(channel, "p3")  # refused for good if p3's first stream held on
        assert second.durable_seq == 4
        second.close()


def test_a_new_stream_is_told_only_what_is_durable(tmp_path: Path, held_writer: type[InlineWriter]) -> None:
    # The hello's ack tells an agent what it may drop from its spool: what the store holds,
    # not what the ledger has applied. (A stream's own batches are durable before it lets its
    # node go, but a stream the server cancels does not wait for that.)
    store = Store(str(tmp_path / "audit.db"))
    writer = held_writer(store)
    daemon = server.Daemon(store, writer=writer)
    grpc_server = server.serve(daemon, "127.0.0.1:0")
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


def test_a_late_rdma_write_is_acted_on_where_the_pages_are(daemon: Service) -> None:
    # The prefill node's witness saw writes posted into memory that decode had registered, a
    # second after decode aborted the request and granted those pages to another tenant. The
    # finding is decode's, so its kill and quarantine go to decode's stream, not the witness's.
    second, base = 1_000_000_000, 0x7F00_0000_0000
    now = 5 * second
    log = EventLog(clock=lambda: now)
    log.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=16)
    log.add("p0", "bootstrap", req="a", prefill_node="p0", decode_node="d0", prompt_tokens=48, tenant="acme")
    log.add("p0", "xfer_send", req="a", xfer="x1", peer_node="d0", pool=0, status="failed")
    region = {"base": base, "stride": 4096}
    log.add("d0", "pool", pool=0, role="decode", page_size=16, num_pages=16, regions=[region])
    log.add("d0", "alloc", req="a", pool=0, pages=[4, 5, 6])
    log.add("d0", "abort", req="a", reason="client went away")
    log.add("d0", "free", req="a", pool=0, pages=[4, 5, 6])
    log.add("d0", "alloc", req="b", pool=0, pages=[4, 5, 6])
    now += second - 1_000_000  # 1 ms before the post: too close to judge page 9
    log.add("d0", "alloc", req="b", pool=0, pages=[9])
    now += 1_000_000
    writes = [{"addr": base + 4 * 4096, "bytes": 3 * 4096}, {"addr": base + 9 * 4096, "bytes": 64}]
    log.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:rdma", calls=2, writes=writes, first_write_ns=now)
    now += second
    log.add("d0", "heartbeat")
    streams = {}
    with grpc.insecure_channel(daemon.address) as channel:
        for event in log.events:
            stream = streams.get(event.node) or streams.setdefault(
                event.node, AgentStream(channel, event.node)
            )
            stream.send([event])
        for stream in streams.values():
            stream.close()
        counters = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters
    to_decode = [(c.WhichOneof("body"), c.kill.req, list(c.quarantine.pages)) for c in streams["d0"].commands]
    assert to_decode == [("kill", "a", []), ("quarantine", "", [4, 5, 6])]
    assert streams["p0"].commands == [] and streams["p0/ebpf"].commands == []
    (late,) = stored_findings(daemon.store)
    assert (late.finding, late.node, late.req, late.victim_req, late.details["witness"]) == (
        "late_write",
        "d0",
        "a",
        "b",
        "p0/ebpf#1",
    )
    assert counters["ledger_remote_unjudged"] == 1  # page 9


def fleet_counters(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        return dict(svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10).counters)


@pytest.mark.parametrize("snapshot_is", ["sound", "altered", "of other settings"])
def test_a_restart_loads_the_snapshot_and_replays_only_what_came_after(
    store_url: str, snapshot_is: str
) -> None:
    # A clean stop saves the ledger; the next start loads it and replays nothing before it.
    # A snapshot that does not match the chain, or was taken with other ledger settings, is
    # not used: the whole store is replayed. Either way the verdicts are those of one run.
    half = [line for line in INCIDENT if line.startswith("{")][:20]
    first = Daemon(store_url)
    assert send_capture(half, first.address).accepted == 20
    said = first.stop()
    store = Store(store_url)
    through = store.count()  # every record so far: the snapshot is after the last
    store.close()
    assert f"ledger snapshot saved after record {through}" in said
    args: tuple[str, ...] = ()
    if snapshot_is == "altered":  # one byte of the stored snapshot changed
        engine = create_engine(url_of(store_url))
        with engine.begin() as conn:
            body = conn.execute(text("SELECT body FROM snapshots ORDER BY id DESC LIMIT 1")).scalar_one()
            body = bytes(body[:-1]) + bytes([body[-1] ^ 1])
            conn.execute(text("UPDATE snapshots SET body = :b"), {"b": body})
        engine.dispose()
        verify = [sys.executable, "-m", "kvguard", "audit", "verify", "--store", store_url]
        said = subprocess.run(verify, capture_output=True, text=True, check=True).stdout
        assert f"ledger snapshot: the snapshot taken after record {through} does not match the chain" in said
    elif snapshot_is == "of other settings":
        args = ("--clock-skew-ms", "3")
    second = start_daemon(store_url, 0, *args)
    try:
        counters = fleet_counters(second.address)
        used = snapshot_is == "sound"
        assert (counters["snapshot_through"], counters["rebuilt_events"]) == (
            (through, 0) if used else (0, 20)
        )
        again = send_capture(INCIDENT, second.address)  # the agent resends from the start
        assert (again.accepted, again.repeats, again.rejected) == (19, 20, [])
    finally:
        said = second.stop()
    assert ("replaying the whole store" in said) == (snapshot_is != "sound")
    assert facts(stored_findings(store_url)) == facts(local_findings())


def test_a_restarted_daemon_rebuilds_the_ledger_it_had_to_the_byte(tmp_path: Path) -> None:
    # The rebuild applies the stored events' bytes as the daemon applied them when they came
    # (clean runs in C, the rest one at a time, here runs cut at findings): the same state.
    store = Store(str(tmp_path / "audit.db"))
    daemon = server.Daemon(store, snapshot_every=0)
    batches = [
        ("c1", clean_requests("c1", 40)),
        ("s1", stale_reads("s1", 5)),
        ("c2", clean_requests("c2", 3)),
    ]
    try:
        for node, events in batches:
            ingest(daemon, node, events, lambda msg: None)
        wait_for(lambda: daemon.counters["events"] == sum(len(e) for _, e in batches))
        daemon.close()
        before = snapshot.dump(daemon.ledger)
        assert daemon.counters["findings"] == 5
        again = server.Daemon(store, snapshot_every=0)
        try:
            assert again.counters["rebuilt_events"] == sum(len(e) for _, e in batches)
            assert snapshot.dump(again.ledger) == before
        finally:
            again.close()
    finally:
        store.close()


def test_a_crash_replays_only_what_came_after_the_last_periodic_snapshot(store_url: str) -> None:
    # With --snapshot-every 4 the daemon snapshots the ledger every few events while batches
    # keep coming (a forked copy dumps it; nothing waits for an idle moment); killed (no
    # clean stop), it restarts from the newest snapshot, not from the start.
    first = start_daemon(store_url, 0, "--snapshot-every", "4")
    half = [line for line in INCIDENT if line.startswith("{")][:20]
    during_load = 0
    for i in range(0, len(half), 2):  # a send every ~0.25 s: never idle for a second
        assert send_capture(half[i : i + 2], first.address).accepted == 2
        time.sleep(0.2)
        during_load = fleet_counters(first.address).get("snapshots", 0)
    assert during_load >= 1, "no snapshot while batches kept coming"
    time.sleep(1)  # the last forked snapshot stored
    store = Store(store_url)
    newest = store.latest_snapshot()
    assert not isinstance(newest, str), newest
    through = newest[0]
    after = sum(1 for _ in store.events(after=through))
    assert 0 < through <= store.count()
    store.close()
    first.kill()  # SIGKILL: no clean stop, no snapshot of its own
    second = start_daemon(store_url)
    try:
        counters = fleet_counters(second.address)
        assert (counters["snapshot_through"], counters["rebuilt_events"]) == (through, after)
        again = send_capture(INCIDENT, second.address)
        assert (again.accepted, again.repeats, again.rejected) == (19, 20, [])
    finally:
        second.stop()
    assert facts(stored_findings(store_url)) == facts(local_findings())


def test_a_large_batch_is_applied_in_slices_and_acks_go_out_between_them(held: Held) -> None:
    # A batch larger than APPLY_SLICE is applied a slice per step of the loop: an ack that
    # became due meanwhile goes out between two slices, not after the whole batch. The large
    # batch's runs continue across slices: it is stored, judged and acknowledged as if it had
    # been applied at once. Its slices that raised alerts go to the writer as they are applied
    # (no step ends at an alert here: one is always committing); the clean rest waits for its
    # last slice.
    store, writer, daemon = held.store, held.writer, held.daemon
    small: list[svc.DaemonMessage] = []
    big: list[svc.DaemonMessage] = []
    applied_at_small_ack: list[int] = []
    log = EventLog()
    log.add("b1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    for i in range(120):  # findings among the first slices (runs cut short), then one long run
        req, page = f"b1-r{i}", [i % 64]
        log.add("b1", "alloc", req=req, pool=0, pages=page)
        log.add("b1", "read", reads=[{"req": req, "pool": 0, "pages": page, "tokens": 16}])
        log.add("b1", "free", req=req, pool=0, pages=page)
    for i in range(400):
        log.add("b1", "alloc", req=f"b1-c{i}", pool=0, pages=[i % 64])
        log.add("b1", "free", req=f"b1-c{i}", pool=0, pages=[i % 64])
    events = log.lines
    assert len(events) > 3 * server.APPLY_SLICE

    def on_small(msg: svc.DaemonMessage) -> None:
        if msg.WhichOneof("body") == "ack":
            applied_at_small_ack.append(daemon.ledger.nodes["b1"].last_seq)
        small.append(msg)

    assert daemon.connect("s1", small.append) and daemon.connect("b1", big.append)
    ingest(daemon, "s1", stale_reads("s1", 1), on_small)
    deadline = time.monotonic() + 10
    while not small and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.held is not None and len(writer.held) == 1  # s1's group, held

    def big_then_release() -> None:  # in one step: the commit is reported mid-batch
        daemon.ingest(batch_of("b1", events, big.append))
        writer.release()

    daemon.loop.call_soon_threadsafe(big_then_release)
    while (not big or big[-1].WhichOneof("body") != "ack") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert applied_at_small_ack and 0 < applied_at_small_ack[0] < len(events)
    assert [m.ack.accepted for m in big if m.WhichOneof("body") == "ack"] == [len(events)]
    assert [m.command.kill.req for m in big if m.WhichOneof("body") == "command"] == [
        f"b1-r{i}" for i in range(120)
    ]
    # s1 through its alert; the rest of s1 and b1's first slice; its second (alerts); the rest
    assert [len(batches) for batches in writer.committed] == [1, 2, 1, 1]
    stored = [e for e in store.events() if e.node == "b1"]
    assert stored == events
    assert store.count("finding") == 121 and store.verify()[0]


def test_a_bug_while_applying_stops_the_daemon_before_anything_is_acknowledged(tmp_path: Path) -> None:
    # Fail safe: an exception out of a batch's apply (here the ruleset's) leaves the ledger
    # ahead of what its group holds. The daemon stops (exit 70, as on a store failure) so
    # that its restart rebuilds from the store; nothing of the batch was acknowledged.
    script = """
import sys, time
from kvguard.daemon import server
from kvguard.daemon.store import Store
from kvguard.proto.builder import EventLog
from kvguard.proto import wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc

class Broken:
    def evaluate(self, finding):
        raise RuntimeError("a bug in the ruleset")

log = EventLog()
log.add("n1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
log.add("n1", "alloc", req="r1", pool=0, pages=[3])
log.add("n1", "read", reads=[{"req": "r1", "pool": 0, "pages": [3], "tokens": 16}])
daemon = server.Daemon(Store(sys.argv[1]), ruleset=Broken())
data = svc.AgentMessage(batch=svc.EventBatch(events=log.lines)).SerializeToString()
acked = []
batch = server.Batch("n1", wire.decode_batch(data), acked.append)
daemon.loop.call_soon_threadsafe(daemon.ingest, batch)
time.sleep(20)
print("still running; acked:", acked)
"""
    where = str(tmp_path / "audit.db")
    done = subprocess.run([sys.executable, "-c", script, where], capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stdout + done.stderr
    assert "a bug in the ruleset" in done.stderr and "stopping" in done.stderr
    store = Store(where)
    try:
        assert store.count() == 0 and store.verify()[0]
    finally:
        store.close()
