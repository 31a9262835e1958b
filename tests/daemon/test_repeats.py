"""One alert per thing that happened (daemon/repeats.py): a request that repeats a finding
raises one alert, and one update when its run ends that counts the rest, first and last time;
the audit log keeps every finding; a stream resumed from the store sees what a live one saw."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_helpers import stored_records, wait_for

from kvguard.agents.upstream import AgentStream
from kvguard.daemon import repeats, service
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Store
from kvguard.proto.builder import EventLog
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.sinks import cef, ocsf

# What a rejected request may not do, each a distinct fact (the ledger says each once).
PROGRESS = ("alloc", "write", "xfer_send")


def goes_on(node: str, *requests: tuple[str, int, bool]) -> list:
    """Each (req, times, finish): req is rejected, yet makes `times` kinds of progress (a
    rejected_progress each) on a page of its own, then finishes (or not)."""
    log = EventLog()
    log.add(node, "pool", pool=0, role="prefill", page_size=16, num_pages=64, context_len=1024)
    for page, (req, times, finish) in enumerate(requests):
        log.add(node, "admit", req=req, tenant="globex", prompt_tokens=16, stage="prefill")
        log.add(node, "reject", req=req, reason="prompt too long")
        for kind in PROGRESS[:times]:
            sent = {"xfer": f"x-{req}", "peer_node": "d9", "tokens": 16, "status": "done"}
            log.add(node, kind, req=req, pool=0, pages=[page], **(sent if kind == "xfer_send" else {}))
        if finish:
            log.add(node, "finish", req=req)
    return log.lines


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Daemon, str, str]]:
    path = str(tmp_path / "audit.db")
    store = Store(path)
    daemon = Daemon(store, mode="monitor")
    server = service.serve(daemon, "127.0.0.1:0")
    try:
        yield daemon, f"127.0.0.1:{server.port}", path
    finally:
        server.stop(grace=1)
        store.close()


def test_a_repeated_finding_is_one_alert_and_its_end_one_update_that_counts_the_rest(
    served: tuple[Daemon, str, str],
) -> None:
    daemon, address, path = served
    with grpc.insecure_channel(address) as channel:
        alerts = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter(), timeout=30)
        stream = AgentStream(channel, "n1")
        stream.send(goes_on("n1", ("r1", 3, True), ("r2", 1, True)))
        live = [next(alerts) for _ in range(3)]
        stream.close()
        alerts.cancel()
    first, update, other = sorted(live, key=lambda a: (a.finding.req, a.cursor))
    assert (first.finding.req, first.finding.finding, other.finding.req) == ("r1", "rejected_progress", "r2")
    assert "repeat" not in first.finding.details and "update_of" not in other.finding.details
    # The update names the first, and counts the 2 repeats, first to last.
    details = update.finding.details
    assert (update.finding.req, details["update_of"], details["repeats"]) == ("r1", str(first.cursor), "2")
    assert int(details["first_ns"]) == first.finding.ts_ns < int(details["last_ns"]) == update.finding.ts_ns
    assert "raised rejected_progress" in update.finding.message and "2 more time(s)" in update.finding.message
    assert "repeats" in update.finding.tags
    # SIEM formats: the same finding counted, with its span.
    event = ocsf.event(update)
    assert (event["activity_name"], event["count"], event["finding_info"]["uid"]) == (
        "Update",
        3,
        f"kvguard-{first.cursor}",
    )
    assert (event["start_time"], event["end_time"]) == (
        first.finding.ts_ns // 10**6,
        update.finding.ts_ns // 10**6,
    )
    assert "cnt=3 " in cef.line(update) and "cnt=" not in cef.line(first)
    # The audit log keeps every finding: r1's three (two marked repeats), r2's, the update.
    stored = [f for f in stored_records(path) if f.req == "r1" and "update_of" not in f.details]
    assert [f.details.get("repeat", "") for f in stored] == ["", "1", "2"]
    assert daemon.counters["findings_repeated"] == 2 and daemon.counters["findings"] == 4

    # A stream from the start, read back from the store, sees exactly what the live one saw.
    with grpc.insecure_channel(address) as channel:
        again = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter(), timeout=3)
        resumed = []
        with pytest.raises(grpc.RpcError):
            resumed.extend(again)
    assert [(a.cursor, a.finding) for a in resumed] == [(a.cursor, a.finding) for a in live]


def test_a_run_no_finding_repeats_for_a_while_is_said_without_the_request_ending(
    served: tuple[Daemon, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(repeats, "QUIET_S", 0.5)
    daemon, address, _ = served
    with grpc.insecure_channel(address) as channel:
        alerts = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter(), timeout=30)
        stream = AgentStream(channel, "n2")
        stream.send(goes_on("n2", ("q", 2, False)))
        first, update = next(alerts), next(alerts)  # the update comes with no event after it
        # A finding after the run ended starts a new one: a new alert.
        stream.send(goes_on("n2", ("q", 3, False))[5:])
        anew = next(alerts)
        stream.close()
        alerts.cancel()
    assert (update.finding.details["update_of"], update.finding.details["repeats"]) == (
        str(first.cursor),
        "1",
    )
    assert anew.finding.req == "q" and "update_of" not in anew.finding.details
    assert anew.cursor > update.cursor
    wait_for(lambda: len(daemon.pipeline.repeats) <= 1)


def test_at_its_stop_the_daemon_says_the_runs_still_open(tmp_path: Path) -> None:
    path = str(tmp_path / "audit.db")
    store = Store(path)
    daemon = Daemon(store, mode="monitor")
    server = service.serve(daemon, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stream = AgentStream(channel, "n3")
            stream.send(goes_on("n3", ("s", 3, False)))
            stream.close()
    finally:
        server.stop(grace=1)
        daemon.close()  # as at SIGTERM: what was received is committed
        store.close()
    updates = [f for f in stored_records(path) if "update_of" in f.details]
    assert [(f.req, f.details["repeats"]) for f in updates] == [("s", "2")]
    assert json.loads(json.dumps(dict(updates[0].details)))["first_ns"]
