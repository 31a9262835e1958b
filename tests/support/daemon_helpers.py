"""What several of the daemon's test files drive it with: a daemon process on a store,
batches handed to its loop as a stream hands them, event logs that make findings or none,
and the findings a replay or a store holds, to compare."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

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


def batch_of(node: str, events: Sequence[pb.Event], reply: Reply) -> Batch:
    """A batch as a stream hands it to the daemon: the message's bytes, its events' bytes."""
    data = svc.AgentMessage(batch=svc.EventBatch(events=events)).SerializeToString()
    return Batch(node, wire.decode_batch(data), reply)


def ingest(daemon: Daemon, node: str, events: Sequence[pb.Event], reply: Reply) -> None:
    """A batch handed to the daemon's loop, as a stream hands it (from the test's thread)."""
    daemon.loop.call_soon_threadsafe(daemon.ingest, batch_of(node, events, reply))


def facts(findings: list[pb.Finding] | list) -> Counter:
    return Counter((f.finding, f.rule, f.node, f.req, f.victim_req, tuple(f.pages), f.seq) for f in findings)


def local_findings() -> list:
    found: list = []
    replay(INCIDENT, load_ruleset(), found.append, lambda e: None, Ledger())
    return found


def stored_findings(store: str) -> list[pb.Finding]:
    """The findings the daemon judged (not its updates of them: what became of a request,
    daemon/outcomes.py)."""
    return [f for f in stored_records(store) if not f.details.get("update_of")]


def stored_updates(store: str) -> list[pb.Finding]:
    """The daemon's updates of its findings: what became of each request one ordered stopped."""
    return [f for f in stored_records(store) if f.details.get("update_of")]


def stored_records(store: str) -> list[pb.Finding]:
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
