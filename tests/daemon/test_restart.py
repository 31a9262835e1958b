"""Restart from the store: redelivery after a killed daemon, a store of an earlier schema
upgraded in place, and the ledger snapshot a restart loads (or refuses), the ledger rebuilt to
the byte, and periodic snapshots a crash restarts from."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from alembic import command
from daemon_helpers import (
    clean_requests,
    facts,
    ingest,
    local_findings,
    stale_reads,
    stored_findings,
    wait_for,
)
from sqlalchemy import create_engine, inspect, text

from kvguard.cli.process import start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Record, Store, migrations
from kvguard.daemon.store import store_url as url_of
from kvguard.ledger import snapshot
from kvguard.proto import pb
from kvguard.proto.capture import read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
EVENTS = [e for _, e in read_capture(INCIDENT)]


def test_redelivery_and_a_killed_daemon_lose_and_double_nothing(
    store_url: str,
) -> None:
    store = store_url
    first = start_daemon(store)
    half = [line for line in INCIDENT if line.startswith("{")][:20]
    assert send_capture(half, first.address).accepted == 20
    first.kill()  # SIGKILL: no shutdown, no flush
    second = start_daemon(store)
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
    engine = create_engine(url_of(store_url))
    with engine.begin() as conn:
        command.downgrade(migrations(conn), "0001")
    engine.dispose()
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


def fleet_counters(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        return dict(svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10).counters)


@pytest.mark.parametrize("snapshot_is", ["sound", "altered", "of other settings"])
def test_a_restart_loads_the_snapshot_and_replays_only_what_came_after(
    store_url: str,
    snapshot_is: str,
) -> None:
    # A clean stop saves the ledger; the next start loads it and replays nothing before it.
    # A snapshot that does not match the chain, or was taken with other ledger settings, is
    # not used: the whole store is replayed. Either way the verdicts are those of one run.
    half = [line for line in INCIDENT if line.startswith("{")][:20]
    first = start_daemon(store_url)
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
            newest = "snapshot_id = (SELECT max(id) FROM snapshots)"  # its body's last part
            query = f"SELECT part, body FROM snapshot_parts WHERE {newest} ORDER BY part DESC LIMIT 1"
            part, body = conn.execute(text(query)).one()
            body = bytes(body[:-1]) + bytes([body[-1] ^ 1])
            update = f"UPDATE snapshot_parts SET body = :b WHERE {newest} AND part = :p"
            conn.execute(text(update), {"b": body, "p": part})
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


def test_a_restarted_daemon_rebuilds_the_ledger_it_had_to_the_byte(
    tmp_path: Path,
) -> None:
    # The rebuild applies the stored events' bytes as the daemon applied them when they came
    # (clean runs in C, the rest one at a time, here runs cut at findings): the same state.
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, snapshot_every=0)
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
        again = Daemon(store, snapshot_every=0)
        try:
            assert again.counters["rebuilt_events"] == sum(len(e) for _, e in batches)
            assert snapshot.dump(again.ledger) == before
        finally:
            again.close()
    finally:
        store.close()


def test_a_crash_replays_only_what_came_after_the_last_periodic_snapshot(
    store_url: str,
) -> None:
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


def test_a_stored_event_the_ledger_refuses_at_start_is_said_and_skipped(store_url: str) -> None:
    # A store edited by hand (or written by another version) holds an event the ledger
    # refuses when the daemon rebuilds from it: the daemon says which and starts anyway, not
    # a traceback at every start.
    half = [line for line in INCIDENT if line.startswith("{")][:20]
    first = start_daemon(store_url)
    assert send_capture(half, first.address).accepted == 20
    first.kill()  # no snapshot: the next start replays the store
    engine = create_engine(url_of(store_url))
    with engine.begin() as conn:
        row_id, body = conn.execute(
            text("SELECT id, body FROM records WHERE kind = 'events' ORDER BY id")
        ).first()
        run = svc.RawEventBatch.FromString(bytes(body))
        edited = pb.Event.FromString(run.events[1])
        edited.ClearField(edited.WhichOneof("payload"))
        edited.admit.CopyFrom(pb.Admit(req="edited", stage="nowhere"))
        events = list(run.events)
        events[1] = edited.SerializeToString()
        conn.execute(
            text("UPDATE records SET body = :b WHERE id = :i"),
            {"b": svc.RawEventBatch(events=events).SerializeToString(), "i": row_id},
        )
    engine.dispose()
    second = start_daemon(store_url)
    try:
        counters = fleet_counters(second.address)
        assert (counters["replay_refused"], counters["rebuilt_events"]) == (1, 20)
    finally:
        said = second.stop()
    assert f"stored event seq {edited.seq} (epoch 0) of node {edited.node} cannot be applied again" in said
    assert "stage 'nowhere' is not one of" in said and "Traceback" not in said
