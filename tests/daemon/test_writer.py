"""The store writer in its own process: it commits what it was given and exits when closed, stops
a daemon from starting on a store it cannot open, keeps queued groups in order with their ids,
and commits everything a closing daemon was sent."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_helpers import ingest, stale_reads

from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import EventRun, Store, StoreError
from kvguard.daemon.writer import StoreWriter
from kvguard.proto import pb, wire
from kvguard.proto.capture import read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
EVENTS = [e for _, e in read_capture(INCIDENT)]


def run_until(loop: asyncio.AbstractEventLoop, done: Callable[[], bool], timeout: float = 10) -> None:
    """Run `loop` (not running elsewhere) until `done()`."""

    async def wait() -> None:
        while not done():
            await asyncio.sleep(0.005)

    loop.run_until_complete(asyncio.wait_for(wait(), timeout))


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
    daemon = Daemon(store, writer=writer)
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


def test_a_writer_whose_daemon_dies_before_it_is_ready_ends_quietly(tmp_path: Path) -> None:
    # The daemon SIGKILLed (here: gone by os._exit) while its writer still opens the store: the
    # writer finds no one to tell it is ready and ends, without a traceback on the journal.
    script = textwrap.dedent(
        f"""
        import os
        from kvguard.daemon.writer import StoreWriter
        writer = StoreWriter({str(tmp_path / "audit.db")!r})
        print(writer._proc.pid, flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run(  # returns once every holder of stderr (the writer too) has closed it
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    pid = int(done.stdout.split()[0])
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
