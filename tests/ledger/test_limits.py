"""Bounded memory and work per event: a pool report beyond the node's limits (pages a pool,
pools a node, pages a node) and a read event of more entries than the limit are refused whole,
by name, counted as `limit`; a read event at the limit, however bad, is judged in milliseconds;
a guard splits a larger launch's reads into events within the limit."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from kvguard.agents.guard import Guard, NullSink
from kvguard.ledger.ledger import BadEvent, Ledger
from kvguard.ledger.limits import Limits
from kvguard.ledger.pages import MAX_PAGES
from kvguard.proto import pb
from kvguard.proto.builder import EventLog


def pool(log: EventLog, pool_id: int, pages: int, node: str = "n0"):
    return log.add(node, "pool", pool=pool_id, role="colocated", page_size=16, num_pages=pages)


def refused(ledger: Ledger, event) -> str:
    with pytest.raises(BadEvent) as err:
        ledger.apply(event)
    assert err.value.kind == "limit"
    return str(err.value)


def test_a_tiny_report_of_a_huge_pool_is_refused_before_it_costs_memory() -> None:
    ledger, log = Ledger(), EventLog()
    tracemalloc.start()
    try:
        reason = refused(ledger, pool(log, 3, MAX_PAGES))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reason == (
        f"pool: pool 3 of node n0 reports {MAX_PAGES} pages, above the limit of "
        f"{Limits().pages_per_pool} a pool"
    )
    assert peak < 1 << 20  # not the 1 GiB of page records it asked for
    assert ledger.nodes["n0"].pools == {} and ledger.stats.bad["limit"] == 1
    ledger.apply(pool(log, 3, 1024))  # the node's next valid report is taken
    assert ledger.nodes["n0"].pools[3].pages.num_pages == 1024


def test_pools_and_pages_a_node_are_bounded_and_a_resized_pool_counts_once() -> None:
    ledger, log = Ledger(limits=Limits(pages_per_pool=600, pools_per_node=2, pages_per_node=1000)), EventLog()
    ledger.apply(pool(log, 0, 600))
    ledger.apply(pool(log, 1, 400))
    assert refused(ledger, pool(log, 2, 1)) == (
        "pool: pool 2 of node n0 would be pool 3 of the node, above the limit of 2 pools a node"
    )
    assert refused(ledger, pool(log, 1, 401)) == (
        "pool: pool 1 of node n0 reports 401 pages, which would make 1001 on the node, above the limit of "
        "1000 pages a node"
    )
    ledger.apply(pool(log, 0, 500))  # pool 0 shrinks (a new engine): its 600 pages no longer count
    ledger.apply(pool(log, 1, 500))
    assert {p: q.pages.num_pages for p, q in ledger.nodes["n0"].pools.items()} == {0: 500, 1: 500}
    ledger.apply(pool(log, 0, 20, node="n1"))  # another node has limits of its own
    assert ledger.stats.bad["limit"] == 2


def reads(log: EventLog, n: int, node: str = "n0"):
    """A read event of n requests, each attending to 4 pages never granted to it (the worst
    case: every entry a finding)."""
    entries = [
        {"req": f"r{i}", "pool": 0, "pages": [4 * i + j for j in range(4)], "tokens": 64} for i in range(n)
    ]
    return log.add(node, "read", reads=entries)


def test_a_read_event_beyond_the_limit_is_refused_whole_and_one_at_it_is_judged_quickly() -> None:
    limit = Limits().read_entries
    ledger, log = Ledger(), EventLog()
    ledger.apply(pool(log, 0, 8 * limit))
    for i in range(limit):  # every page written by a request of its own: each read has a victim
        log_pages = [4 * i + j for j in range(4)]
        ledger.apply(log.add("n0", "alloc", req=f"w{i}", pool=0, pages=log_pages))
        ledger.apply(log.add("n0", "write", req=f"w{i}", pool=0, pages=log_pages))
    known = ledger.known_requests
    assert refused(ledger, reads(log, limit + 1)) == (
        f"read: {limit + 1} entries in one read event of node n0, above the limit of {limit} (a guard "
        "splits a larger launch's reads into several events)"
    )
    assert ledger.known_requests == known  # nothing of it was applied
    log = EventLog()  # the refused event's number is free again
    log._seq["n0"] = ledger.nodes["n0"].last_seq
    started = time.perf_counter()
    found = ledger.apply(reads(log, limit))
    took = time.perf_counter() - started
    assert len(found) == limit and {f.finding for f in found} == {"foreign_read"}
    assert {f.victim_req for f in found} == {f"w{i}" for i in range(limit)}
    assert took < 0.1, f"{limit} entries took {took * 1e3:.0f} ms"


def test_a_guard_sends_a_large_launchs_failing_reads_as_several_events_within_the_limit() -> None:
    sent: list[bytes] = []

    class Sink(NullSink):
        def put(self, body: bytes) -> None:
            sent.append(body)

    guard = Guard("n0", sink=Sink(), mode="monitor")
    limit = guard.ledger.limits.read_entries
    n = 2 * limit + 3
    guard.pool(0, "colocated", 16, n + 1)
    reqs = [f"r{i}" for i in range(n)]
    for i, req in enumerate(reqs):
        guard.admit(req, "acme", 16, "decode")
        guard.alloc(req, 0, [i + 1])  # granted, never written: every read of it is stale
    sent.clear()
    verdict = guard.check_attention(0, reqs, np.arange(1, n + 1).reshape(n, 1), np.full(n, 16))
    assert {f.req for f in verdict.findings} == set(reqs) and not guard.errors
    events = [pb.Event.FromString(body) for body in sent]
    assert [len(e.read.reads) for e in events] == [limit, limit, 3]
