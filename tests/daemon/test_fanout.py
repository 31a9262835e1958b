"""What the daemon sends back out: alerts to subscribers (live, resumed from a cursor, caught
up from the store, timed until written) and kill and quarantine commands to the node that holds
the request or its pages, also when that node is away or sending nothing."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import grpc
import pytest
from daemon_helpers import ingest, stale_reads, stored_findings, wait_for

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service
from kvguard.cli.send import send_capture
from kvguard.daemon import fanout, service
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Store
from kvguard.ledger.findings import Finding
from kvguard.proto.builder import EventLog
from kvguard.proto.capture import read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
EVENTS = [e for _, e in read_capture(INCIDENT)]


def test_the_daemon_times_each_live_alert_until_it_is_written_to_a_subscriber(daemon: Service) -> None:
    # "sent": receipt to the alert written to a live subscriber's stream (an alert read back
    # from the store by a subscriber catching up has no receipt to time from).
    with grpc.insecure_channel(daemon.address) as channel:
        stream = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter())
        send_capture(INCIDENT, daemon.address)
        # the incident's 7 alerts (4 findings repeat one of them: stored, not sent), the update of
        # g1's (it reached its client) and the ends of its 3 runs of repeats: live from here on
        assert len([next(stream) for _ in range(11)]) == 11
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
    assert 3 <= took.count <= 15
    assert 0 < took.p50_ms <= took.p99_ms <= took.max_ms


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
        # g1 read a1's pages and a2's: one alert, and the end of its run names both victims.
        only = alerts.Subscribe(svc.AlertFilter(findings=["stale_read"], tenant="acme"))
        leak, update = next(only), next(only)
        only.cancel()
        assert (leak.finding.victim_req, update.finding.details["update_of"]) == ("a1", str(leak.cursor))
        assert update.finding.details["victim_reqs"] == "a1,a2"


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


def test_a_subscriber_that_falls_behind_catches_up_from_the_store(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A live queue of 4 alerts: while the subscriber does not read, the daemon drops from it,
    # and the stream reads what it missed from the store; every alert arrives once, in order.
    monkeypatch.setattr(fanout, "SUBSCRIBER_QUEUE", 4)
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, mode="monitor")
    grpc_server = service.serve(daemon, "127.0.0.1:0")
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
        wait_for(lambda: daemon.fanout.delivering == 0)  # not left counting a stream that ended
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
    daemon = Daemon(store)
    grpc_server = service.serve(daemon, "127.0.0.1:0")
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


def test_a_command_reaches_an_agent_that_is_sending_nothing(tmp_path: Path) -> None:
    # Commands are not piggybacked on acks: an agent with nothing to send (its engine idle, or
    # its batch already acknowledged) gets a kill the moment the daemon orders it.
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store)
    grpc_server = service.serve(daemon, "127.0.0.1:0")
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


def test_a_short_wire_count_nothing_else_settles_is_alerted_once_the_clocks_pass_it(daemon: Service) -> None:
    # p0 claims 8192 bytes sent to d0, d0 reports the receipt, p0's probe saw 4096 of them and
    # no more; the request never uses the pages again. d0's later events (other requests'),
    # past the clock-skew allowance (10 ms) after the last word about the transfer, settle
    # it: the alert arrives with the event that passed the deadline. An unrelated node's
    # clock settles nothing.
    ms = 1_000_000
    now = 1000 * ms
    log = EventLog(clock=lambda: now)
    log.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=16)
    log.add("d0", "pool", pool=0, role="decode", page_size=16, num_pages=16)
    log.add("p0", "admit", req="a", tenant="acme", prompt_tokens=32, stage="prefill")
    log.add("p0", "alloc", req="a", pool=0, pages=[1, 2])
    log.add("p0", "write", req="a", pool=0, pages=[1, 2])
    log.add("d0", "alloc", req="a", pool=0, pages=[3, 4])
    send = {"req": "a", "xfer": "x1", "peer_node": "d0", "pool": 0, "pages": [1, 2], "tokens": 32}
    log.add("p0", "xfer_send", **send, bytes=8192, status="done")
    recv = {"req": "a", "xfer": "x1", "peer_node": "p0", "pool": 0, "pages": [3, 4], "tokens": 32}
    log.add("d0", "xfer_recv", **recv, bytes=8192, status="done")
    log.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:tcp", bytes=4096, calls=1)
    now += 50 * ms
    log.add("n9", "pool", pool=0, role="decode", page_size=16, num_pages=16)  # not involved
    for i in range(6):  # d0 goes on with other requests, 4 ms apart
        now += 4 * ms
        log.add("d0", "alloc", req=f"o{i}", pool=0, pages=[8 + i])
    with grpc.insecure_channel(daemon.address) as channel:
        alerts = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter())
        streams: dict[str, AgentStream] = {}
        for event in log.events:
            stream = streams.get(event.node) or streams.setdefault(
                event.node, AgentStream(channel, event.node)
            )
            stream.send([event])
        alert = next(alerts)
        alerts.cancel()
        for stream in streams.values():
            stream.close()
    f = alert.finding
    assert (f.finding, f.rule, f.severity, f.node, f.req, f.tenant) == (
        "transfer_mismatch",
        "transfer_mismatch",
        "critical",
        "d0",
        "a",
        "acme",
    )
    assert f.seq == 4  # d0's first event over 10 ms after the probe's report (1000 ms): at 1054 ms
    assert dict(f.details) == {
        "xfer": "x1",
        "what": "wire_bytes",
        "expected": "8192",
        "observed": "4096",
        "probe": "ebpf:tcp",
        "settled": f"no word for 10 ms by the nodes' clocks (d0's clock at {1054 * ms} ns)",
    }
    assert "the wire probe (ebpf:tcp) saw 4096 in 1 call(s); settled as short now: no word" in f.message
    assert [(s.finding, s.seq) for s in map(Finding.from_proto, stored_findings(daemon.store))] == [
        ("transfer_mismatch", 4)
    ]
