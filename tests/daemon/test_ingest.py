"""How applied batches become durable and acknowledged: group commit behind a slow disk, alerts
committed ahead of the rest of their batch, batches applied in slices with acks and alert delivery
between them, kills that do not wait for the disk, and a bug while applying that stops the daemon."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import batch_of, clean_requests, ingest, stale_reads, wait_for

from kvguard.daemon import fanout
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.ingest import APPLY_SLICE, DELIVERING_SLICE
from kvguard.daemon.store import EventRun, Store
from kvguard.daemon.writer import InlineWriter
from kvguard.ledger import Finding
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc


@dataclass
class Held:
    """A daemon whose store writer holds its commits until `writer.release()` (a slow disk)."""

    store: Store
    writer: Any  # conftest's HeldWriter (tests cannot import conftest)
    daemon: Daemon


@pytest.fixture
def held(tmp_path: Path, held_writer: type[InlineWriter]) -> Iterator[Held]:
    store = Store(str(tmp_path / "audit.db"))
    writer = held_writer(store)
    daemon = Daemon(store, writer=writer)
    try:
        yield Held(store, writer, daemon)
    finally:
        writer.release()
        daemon.close()  # done with the store before it closes
        store.close()


def test_batches_that_arrive_while_a_group_commits_are_committed_together_next(
    held: Held,
) -> None:
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
    alerts: list[tuple[int, Finding]] = []
    sub = fanout.Subscriber(Filter())
    daemon.loop.call_soon_threadsafe(daemon.fanout.subscribers.append, sub)
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
    assert APPLY_SLICE < alert_at < len(events) - APPLY_SLICE
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


def test_batches_are_applied_in_small_steps_while_alerts_are_being_written(
    tmp_path: Path,
) -> None:
    # A subscriber's stream writes one alert at a time, each write waiting for a turn of the
    # loop: while one has alerts to write, a batch is applied DELIVERING_SLICE events a step
    # (that write waits behind one small step), and APPLY_SLICE once every stream is written out.
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, mode="monitor")
    sub = fanout.Subscriber(Filter())
    applied: list[int] = []

    def batch_then_look(node: str) -> None:  # in one step: a batch, then a delivery's turn
        daemon.ingest(batch_of(node, clean_requests(node, 50), lambda msg: None))
        daemon.loop.call_soon(lambda: applied.append(daemon.ledger.nodes[node].last_seq))

    try:
        daemon.loop.call_soon_threadsafe(daemon.fanout.subscribers.append, sub)
        ingest(daemon, "d0", stale_reads("d0", 1), lambda msg: None)
        wait_for(lambda: not sub.live.empty())  # an alert to write: the stream is delivering
        daemon.loop.call_soon_threadsafe(batch_then_look, "d1")
        wait_for(lambda: len(applied) == 1)
        assert 0 < applied[0] <= DELIVERING_SLICE
        # The rest of d1's batch goes on in small steps; once it is in, the stream is written out
        # (otherwise d2's look could run before d2's first step, queued behind d1's last).
        wait_for(lambda: daemon.ledger.nodes["d1"].last_seq == 201)
        daemon.loop.call_soon_threadsafe(daemon.fanout.delivered, sub)  # written out, as its stream says
        daemon.loop.call_soon_threadsafe(batch_then_look, "d2")
        wait_for(lambda: len(applied) == 2)
        assert applied[1] == 201  # the whole batch in one step (< APPLY_SLICE events)
        assert daemon.fanout.delivering == 0
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


def test_a_large_batch_is_applied_in_slices_and_acks_go_out_between_them(
    held: Held,
) -> None:
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
    assert len(events) > 3 * APPLY_SLICE

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
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.ingest import Batch
from kvguard.daemon.store import Store
from kvguard.proto.builder import EventLog
from kvguard.proto import wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc

class Broken:
    def judge(self, finding):
        raise RuntimeError("a bug in the ruleset")

log = EventLog()
log.add("n1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
log.add("n1", "alloc", req="r1", pool=0, pages=[3])
log.add("n1", "read", reads=[{"req": "r1", "pool": 0, "pages": [3], "tokens": 16}])
daemon = Daemon(Store(sys.argv[1]), ruleset=Broken())
data = svc.AgentMessage(batch=svc.EventBatch(events=log.lines)).SerializeToString()
acked = []
batch = Batch("n1", wire.decode_batch(data), acked.append)
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
