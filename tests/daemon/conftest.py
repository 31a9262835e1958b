"""Shared by the daemon's test files (test files cannot import one another): a daemon process
on each store backend (`daemon`), and the helpers several files drive the daemon with, each a
fixture of the same name that returns the plain function defined here."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvguard.cli.process import Service, start_daemon
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.ingest import Batch, Reply
from kvguard.daemon.store import Store
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb, wire
from kvguard.proto.builder import EventLog
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR
from kvguard.ruleset.replay import replay

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()


def daemon_process(store: str) -> Service:
    return start_daemon(store)


def batch_of(node: str, events: Sequence[pb.Event], reply: Reply) -> Batch:
    """A batch as a stream hands it to the daemon: the message's bytes, its events' bytes."""
    data = svc.AgentMessage(batch=svc.EventBatch(events=events)).SerializeToString()
    return Batch(node, wire.decode_batch(data), reply)


def ingest(daemon: Daemon, node: str, events: Sequence[pb.Event], reply: Reply) -> None:
    """A batch handed to the daemon's loop, as a stream hands it (from the test's thread)."""
    daemon.loop.call_soon_threadsafe(daemon.ingest, batch_of(node, events, reply))


@pytest.fixture
def daemon(store_url: str) -> Iterator[Service]:
    d = daemon_process(store_url)
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


def clean_requests(node: str, n: int) -> list[pb.Event]:
    """n requests that each write and read their own page (no finding)."""
    return one_page_requests(node, n, written=True)


def wait_for(done: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(name="daemon_process")
def _daemon_process() -> Callable[[str], Service]:
    """daemon_process(store) -> a daemon process started on `store`."""
    return daemon_process


@pytest.fixture(name="batch_of")
def _batch_of() -> Callable[..., Batch]:
    """batch_of(node, events, reply) -> a Batch as a stream hands it to the daemon."""
    return batch_of


@pytest.fixture(name="ingest")
def _ingest() -> Callable[..., None]:
    """ingest(daemon, node, events, reply): a batch handed to the daemon's loop."""
    return ingest


@pytest.fixture(name="facts")
def _facts() -> Callable[..., Counter]:
    """facts(findings) -> what the findings say, to compare without ids or times."""
    return facts


@pytest.fixture(name="local_findings")
def _local_findings() -> Callable[[], list]:
    """local_findings() -> the findings of a local replay of the incident capture."""
    return local_findings


@pytest.fixture(name="stored_findings")
def _stored_findings() -> Callable[[str], list[pb.Finding]]:
    """stored_findings(store) -> the findings the store holds."""
    return stored_findings


@pytest.fixture(name="stale_reads")
def _stale_reads() -> Callable[[str, int], list[pb.Event]]:
    """stale_reads(node, n) -> n requests that each read a page they never wrote."""
    return stale_reads


@pytest.fixture(name="clean_requests")
def _clean_requests() -> Callable[[str, int], list[pb.Event]]:
    """clean_requests(node, n) -> n requests that each write and read their own page."""
    return clean_requests


@pytest.fixture(name="wait_for")
def _wait_for() -> Callable[..., None]:
    """wait_for(done, timeout=10): wait until done(), failing the test after `timeout` s."""
    return wait_for
