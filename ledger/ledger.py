"""The page-ownership ledger: applies kvguard.v1 events and detects what must not happen.

One implementation, used by the in-engine guard (one node) and by the daemon (all nodes).
`Ledger.apply(event)` validates an event completely before it changes any page or request
state (a bad event raises BadEvent and changes nothing); `apply_serialized(bytes)` does the
same for an event as an agent sent it, reading the common ones straight from their bytes
(_hot.c) into the same handlers. An event's page list is applied as one C loop (the
updates every request makes) or a few vectorised NumPy operations (pages.py, _hot.c); apply
returns the findings it caused: findings are always made here, from the state as the event
found it. The daemon applies a batch with `apply_clean` first: the runs of clean common
events (no finding, no error) entirely in C, stopping before any event that needs more,
which then comes here. Findings carry facts only; the ruleset gives them severity and
action.

Invariants kept here:
- per node, events are applied in sequence order; a repeated sequence number is refused
  (idempotent redelivery), a gap is reported and the event applied, and a malformed event
  does not advance the sequence;
- a request that was rejected, aborted or killed may only drain (free, release, the end
  of a transfer already in flight into pages it still holds): anything else is
  rejected_progress;
- a transfer is reconciled from every side that reports it: bootstrap (what decode
  expects), the decode reservation, the sender, the receiver and the wire probes;
- memory is bounded by what is in use, not by history: a request no event has named for
  `retire_idle` applied events and that holds nothing (no grant, share, pending wire verdict
  or posted writes) is retired, which changes no verdict (what a later event of it may be
  judged by stays); one idle for `forget_idle` events that no page tag names any more is forgotten
  (its index reused): an event naming it later starts a new request. Sweeps run at fixed
  counts of applied events, so a rebuild from the same events does the same;
- an RDMA write a probe saw posted is judged against the receiver's pages only where their
  state has not changed since before it was posted (allowing clock_skew_ns between the
  nodes' clocks), and only once the receiver's own events have passed that time: what
  cannot be decided is counted (stats.remote_unjudged), never guessed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from kvguard.ledger import _hot
from kvguard.ledger.findings import Finding
from kvguard.ledger.pages import (
    HOLDER_INDEX,
    HOLDERS,
    MAX_PAGE_SIZE,
    MAX_PAGES,
    NOBODY,
    PoolPages,
    check_tags,
    live_grants,
)
from kvguard.proto import pb

ROLES = ("prefill", "decode", "colocated")
STAGES = ("prefill", "decode")
STATUSES = ("done", "failed", "refused")  # refused: the receiver kept the KV out of its pages
ENDED = ("rejected", "aborted", "killed")
_ENDED_STATES = frozenset(ENDED)
_STATE = attrgetter("state")
# Compared for config drift: not where the pages lie (a restarted engine registers new memory).
_POOL_FIELDS = tuple(
    f.name for f in pb.PoolReport.DESCRIPTOR.fields if f.name not in ("pool", "source", "regions")
)
_NO_FINDINGS: tuple[Finding, ...] = ()
# The events apply_serialized reads from their bytes, by their payload's field number.
_HOT_KINDS = {pb.Event.DESCRIPTOR.fields_by_name[k].number: k for k in ("alloc", "write", "free", "read")}
_HOT_PAGES = 3  # the field number of `pages` in Alloc, Write, Free and ReadEntry (event_head's shape)
GRANT_RUNS = 16  # a request's grants in one pool kept as separate arrays before they are merged
MAX_REGIONS = 1 << 16  # KvRegions of one pool
MAX_RUNS = 1 << 16  # remote write ranges of one wire event
RETIRE_IDLE = 1 << 16  # applied events without news of a request before it may be retired
FORGET_IDLE = 1 << 20  # ... before it may be forgotten (~30 s at 31K events/s; hours when quieter)
SWEEP_EVERY = 1024  # applied events between retirement sweeps: each is short
CLOCK_SKEW_NS = 10_000_000  # how far two nodes' clocks may disagree (NTP in one data centre: < 1 ms)
_U64 = 1 << 64
RECV_HOLD = HOLDER_INDEX["transfer_recv"]
# The field number of `pages` in each payload that lists pages (read from it serialized).
_PAGES_FIELD = {
    d: d.fields_by_name["pages"].number
    for d in pb.DESCRIPTOR.message_types_by_name.values()
    if "pages" in d.fields_by_name
}


class BadEvent(ValueError):
    """An event that cannot be applied. `kind` is a short counter name, the text says why."""

    def __init__(self, reason: str, kind: str = "malformed") -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(slots=True)
class Pool:
    """One (node, pool): the reported configuration, its history and the page state."""

    node: str
    pool: int
    report: pb.PoolReport
    pages: PoolPages
    history: list[tuple[int, int, pb.PoolReport]] = field(default_factory=list)  # (seq, ts_ns, report)
    live: dict[int, int] = field(default_factory=dict)  # request index -> pages it holds a grant on now
    # Registered for RDMA: [n, 3] uint64 rows (base, stride, page bytes) of report.regions.
    # Only then is pages.since kept: no other pool's pages can be judged by remote address.
    regions: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return self.pages.page_size * self.pages.num_pages


@dataclass(slots=True)
class Node:
    name: str
    last_seq: int = 0
    last_ts_ns: int = 0
    pools: dict[int, Pool] = field(default_factory=dict)
    agent_version: str = ""
    dropped: int = 0


@dataclass(slots=True)
class Shared:
    """Prefix pages a request reads but does not own, with what it was promised: sorted
    pages and, aligned with them, the page's alloc_gen and its KV's writer and alloc_gen at
    share time. A page re-granted since (gen changed) is no longer shared."""

    pages: np.ndarray
    gen: np.ndarray
    writer: np.ndarray
    wgen: np.ndarray

    def without(self, pages: np.ndarray) -> Shared:
        keep = ~np.isin(self.pages, pages)
        return Shared(self.pages[keep], self.gen[keep], self.writer[keep], self.wgen[keep])

    def merged(self, other: Shared) -> Shared:
        rest = self.without(other.pages)
        pages = np.concatenate([rest.pages, other.pages])
        order = np.argsort(pages, kind="stable")
        return Shared(
            pages[order],
            np.concatenate([rest.gen, other.gen])[order],
            np.concatenate([rest.writer, other.writer])[order],
            np.concatenate([rest.wgen, other.wgen])[order],
        )

    def lookup(self, pages: np.ndarray, current_gen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of `pages` are shared and still the same grant, index into self per page)."""
        if not len(self.pages):
            return np.zeros(len(pages), bool), np.zeros(len(pages), np.intp)
        at = np.minimum(np.searchsorted(self.pages, pages), len(self.pages) - 1)
        return (self.pages[at] == pages) & (self.gen[at] == current_gen), at


@dataclass(slots=True)
class Side:
    """What one end of a transfer reported."""

    node: str
    pool: int
    pages: np.ndarray
    tokens: int
    bytes: int
    checksums: np.ndarray
    status: str
    seq: int
    peer: str = ""  # the other end's node, as this side named it

    @property
    def done(self) -> bool:
        return self.status == "done"


@dataclass(slots=True)
class Seen:
    """What one probe saw of a transfer, its reports added up."""

    bytes: int = 0
    calls: int = 0
    complete: bool = False  # the probe saw the transfer end: `bytes` is all it carried


@dataclass(slots=True)
class Posted:
    """RDMA writes of one transfer that a probe saw the sender post: remote ranges [addr,
    end) and the time the first was posted (sender's wall clock), to be judged against the
    receiver's pages."""

    probe: str
    addr: np.ndarray  # uint64
    end: np.ndarray  # uint64
    first_ns: int
    seen_by: str  # "node#seq" of the wire event


@dataclass(slots=True)
class Transfer:
    """Both ends of one prefill->decode KV transfer, and what each wire probe saw (probes
    are independent witnesses of the same bytes: each is compared with the claim alone)."""

    xfer: str
    req: str
    send: Side | None = None
    recv: Side | None = None
    wire: dict[str, Seen] = field(default_factory=dict)  # by probe
    posted: list[Posted] = field(default_factory=list)  # until its request and receiver are known


class Request:
    """Per request (global id; the same request crosses prefill and decode nodes).

    A plain class with class-level defaults: a request is created on the hot path (its
    first event), and only what changes is stored on the instance."""

    tenant = ""
    state = "new"  # new, admitted, rejected, aborted, killed, finished
    reason = ""
    prompt_tokens = 0
    bootstrap: tuple[str, str, int] | None = None  # prefill node, decode node, prompt tokens
    output_tokens = 0
    reserved_pages = 0  # granted on its decode node before its KV arrived
    granted_pages = 0
    written_pages = 0
    freed_pages = 0
    shared_pages = 0
    sent_pages = 0
    sent_tokens = 0
    sent_bytes = 0
    received_pages = 0
    received_tokens = 0
    received_bytes = 0
    reads = 0

    last = 0  # the ledger's applied-event count when an event last named it
    queued = 0  # ... when it was (re)queued among the requests in use
    retired = False

    def __init__(self, id: str, idx: int) -> None:
        self.id = id
        self.idx = idx
        self.xfers: list[str] = []  # its transfers' ids
        self.shared: dict[tuple[str, int], Shared] = {}  # (node, pool) -> prefix pages it reads
        # (node, pool) -> every page ever granted, as arrays (merged into one past GRANT_RUNS)
        self.history: dict[tuple[str, int], list[np.ndarray]] = {}

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def ever_granted(self, key: tuple[str, int], pages: np.ndarray) -> np.ndarray:
        """Which of `pages` this request was ever granted in pool `key` (slow path only)."""
        grants = self.history.get(key)
        if not grants:
            return np.zeros(len(pages), bool)
        return np.isin(pages, np.concatenate(grants))


@dataclass(slots=True)
class LedgerStats:
    events: Counter[str] = field(default_factory=Counter)  # by payload
    bad: Counter[str] = field(default_factory=Counter)  # by BadEvent kind
    findings: Counter[str] = field(default_factory=Counter)  # by finding kind
    page_transitions: int = 0
    missing: int = 0  # sequence numbers never seen (gaps)
    suppressed: int = 0  # repeats of an already reported finding
    remote_unjudged: int = 0  # pages an RDMA write hit whose state changed since: not decidable
    remote_unmapped: int = 0  # RDMA write ranges into a node that registered no pool memory
    orphan_wire: int = 0  # transfers a probe reported that no side claimed within forget_idle events
    retired: int = 0  # requests whose history was dropped (idle, holding nothing)
    forgotten: int = 0  # retired requests no page tag named any more: gone, their index reused

    def totals(self) -> dict[str, int]:
        """The plain counts (not the per-kind counters), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}


def _pages(values: Iterable[int]) -> np.ndarray:
    return np.array(values, dtype=np.intp)


def _pages_written(regions: np.ndarray, num_pages: int, addr: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The pages of a pool (its regions: rows of base, stride, page bytes) that any of the
    address ranges [addr, end) overlaps, sorted. Bounded by the pool's size whatever the
    ranges: each (range, region) pair marks an interval of pages."""
    base, stride, size = (regions[:, i][None, :] for i in range(3))
    lo, hi = addr[:, None], end[:, None]
    top = base + stride * np.uint64(num_pages)
    hit = (hi > base) & (lo < top)
    start = np.maximum(lo, base) - base  # offsets into the region, no wrap: both >= base
    stop = np.minimum(hi, top) - base
    first = start // stride
    first += (start - first * stride >= size).astype(np.uint64)  # began in the gap after a page
    last = (stop - np.uint64(1)) // stride
    hit &= first <= last
    marks = np.zeros(num_pages + 1, np.int64)
    np.add.at(marks, first[hit].astype(np.intp), 1)
    np.add.at(marks, last[hit].astype(np.intp) + 1, -1)
    return np.flatnonzero(np.cumsum(marks[:-1]) > 0)


class Ledger:
    """The global (or node-local) ownership ledger."""

    def __init__(
        self,
        *,
        dedupe: bool = True,
        clock_skew_ns: int = CLOCK_SKEW_NS,
        retire_idle: int = RETIRE_IDLE,
        forget_idle: int = FORGET_IDLE,
    ) -> None:
        self.nodes: dict[str, Node] = {}
        self.requests: list[Request | None] = [Request(id="", idx=NOBODY)]  # None: forgotten
        self._req_index: dict[str, int] = {}
        # Retirement (0: never) and forgetting (0: never). Requests in use, least recently
        # named first; retired ones, least recently named first; indices to reuse.
        self.retire_idle = retire_idle
        self.forget_idle = max(forget_idle, retire_idle) if forget_idle and retire_idle else 0
        self._applied = 0
        self._sweep_every = min(SWEEP_EVERY, max(1, retire_idle // 4))
        self._next_sweep = self._sweep_every if retire_idle else 0
        self._next_scan = self.forget_idle
        self._recent: OrderedDict[int, Request] = OrderedDict()
        self._retired: dict[int, Request] = {}
        self._free: list[int] = []
        self.transfers: dict[str, Transfer] = {}
        # Transfers only a probe has named so far -> when one last did, oldest first: bounded,
        # like requests, or a stream of wire reports no engine claims would grow it forever.
        self._orphans: dict[str, int] = {}
        self.stats = LedgerStats()
        self.dedupe = dedupe
        self._reported: set[tuple[Any, ...]] = set()
        self._drift_pairs: set[tuple[str, str, str]] = set()
        self._wire_pending: dict[int, Transfer] = {}  # request -> transfer the probe saw short so far
        self.clock_skew_ns = clock_skew_ns
        # receiver node -> RDMA writes waiting for its events to pass the time they were posted
        self._posted: dict[str, list[tuple[Transfer, Posted]]] = {}
        self.last_missing = 0
        # Context of the event being applied, for the findings it raises.
        self._node = ""
        self._seq = 0
        self._ts = 0
        self._found: list[Finding] = []
        self._handlers: dict[str, Callable[[Node, Any], None]] = {
            "pool": self._on_pool,
            "admit": self._on_admit,
            "reject": self._on_reject,
            "abort": self._on_abort,
            "finish": self._on_finish,
            "bootstrap": self._on_bootstrap,
            "alloc": self._on_alloc,
            "write": self._on_write,
            "free": self._on_free,
            "hold": self._on_hold,
            "release": self._on_release,
            "share": self._on_share,
            "read": self._on_read,
            "xfer_send": self._on_xfer_send,
            "xfer_recv": self._on_xfer_recv,
            "wire": self._on_wire,
            "kill": self._on_kill,
            "heartbeat": self._on_heartbeat,
            "scrub": self._on_scrub,
        }

    # ------------------------------------------------------------------ entry point

    def apply(self, event: pb.Event) -> Sequence[Finding]:
        """Apply one event and return the findings it caused; raise BadEvent (page and
        request state unchanged) if it cannot be applied. Afterwards `last_missing` tells how
        many sequence numbers of its node were skipped right before it (a gap)."""
        kind = event.WhichOneof("payload")
        if kind is None:
            raise self._bad("event has no payload")
        node = self._event_begin(kind, event.node, event.seq, event.ts_ns)
        self._handlers[kind](node, getattr(event, kind))
        return self._event_end(node, kind)

    def apply_serialized(self, body: bytes, node: str | None = None) -> Sequence[Finding]:
        """apply() of an event as serialized (as agents send it), and, with `node`, only if it
        is that node's (BadEvent "identity" otherwise). The events every request makes are
        read straight from their bytes (_hot.event_head): protobuf's objects for them would
        cost more than applying them. Any other event, or one with anything unusual in its
        bytes, is parsed by protobuf and applied as apply() does: the same handlers judge
        both, so the verdicts and errors are the same either way."""
        head = _hot.event_head(body)
        if head is None:
            event = self._parse(body)
            if node is not None and event.node != node:
                raise self._bad(f"event of node {event.node!r} on the stream of {node!r}", "identity")
            return self.apply(event)
        number, name, seq, ts, req, pool_id, tokens, start, end = head
        if node is not None and name != node:
            raise self._bad(f"event of node {name!r} on the stream of {node!r}", "identity")
        kind = _HOT_KINDS[number]
        at = self._event_begin(kind, name, seq, ts)
        pool = at.pools.get(pool_id)
        try:
            distinct = kind != "read"  # a block table may name a page twice
            pages = (
                None
                if pool is None
                else pool.pages.page_list(body, _HOT_PAGES, distinct=distinct, within=(start, end))
            )
        except (IndexError, ValueError, TypeError):  # out of range, listed twice, malformed
            pages = None
        if pages is None:  # the handler of the parsed event words the error
            self._handlers[kind](at, getattr(self._parse(body), kind))
        elif kind == "alloc":
            self._apply_alloc(at, pool, pages, req)
        elif kind == "write":
            self._apply_write(at, pool, pages, None, req)
        elif kind == "free":
            self._apply_free(at, pool, pages, req)
        else:
            pages, tokens = self._pages_read(pool, pages, tokens)
            self._apply_read(at, [(self._request(req, "read"), pool, pages, tokens)])
        return self._event_end(at, kind)

    def apply_clean(self, bodies: Sequence[bytes], start: int, stop: int, node: str) -> int:
        """apply_serialized(body, node) of bodies[start], bodies[start + 1], ... for as long as
        each is the clean common case (an alloc, write, free or read of `node` by a request in
        use, or a new one's first alloc, which _request makes; no judgment needed: no finding,
        no error), all in C (`_hot.apply_clean`: 2.4-2.9 µs an event against 5-6.5 one at a
        time, bench/ledger.py); returns the index of the first one it did not apply (`stop`
        when it applied them all), which is apply_serialized's. The ledger ends as applying
        them one by one leaves it, to the byte (a property test): the C side does what
        _event_begin, the four handlers' clean path and _event_end do, on the attributes they
        use, in the same order."""
        return _hot.apply_clean(self, bodies, start, stop, node, ENDED, GRANT_RUNS)

    def replay(self, bodies: Sequence[bytes], node: str) -> None:
        """Apply events of `node` that were accepted before, in order (the store's, when the
        daemon restarts): as the daemon applied them, the clean runs in C and the rest one at a
        time. Their findings were stored when they were first made; none is returned. A
        BadEvent here means the store does not hold what was applied."""
        at, stop = 0, len(bodies)
        while at < stop:
            at = self.apply_clean(bodies, at, stop, node)
            if at < stop:
                self.apply_serialized(bodies[at], node)
                at += 1

    def _parse(self, body: bytes) -> pb.Event:
        try:
            return pb.Event.FromString(body)
        except DecodeError as exc:
            raise self._bad(f"the bytes are not a kvguard.v1.Event: {exc}") from None

    def _event_begin(self, kind: str, name: str, seq: int, ts: int) -> Node:
        """An event's node, once its header is valid; the event becomes the context of the
        findings it raises."""
        if not name:
            raise self._bad(f"{kind} event has no node")
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Node(name)
        if seq == 0:
            raise self._bad(f"{kind} event of node {name} has no sequence number (they start at 1)")
        if seq <= node.last_seq:
            raise self._bad(
                f"sequence number {seq} of node {name} repeats (last applied: {node.last_seq})", "repeat"
            )
        self._node, self._seq, self._ts = name, seq, ts
        self._found = []
        return node

    def _event_end(self, node: Node, kind: str) -> Sequence[Finding]:
        """The event was applied: its node's sequence moves on; its findings."""
        seq = self._seq
        missing = seq - node.last_seq - 1
        # Only an applied event advances its node's sequence: a malformed one, whose number
        # may be as wrong as the rest of it, must not make later valid events look repeated.
        node.last_seq, node.last_ts_ns = seq, self._ts
        if self._posted and node.name in self._posted:
            self._judge_posted(node)
        self.stats.events[kind] += 1
        self._applied += 1
        if self._applied == self._next_sweep:
            self._sweep()
        self.last_missing = missing
        if missing:
            self.stats.missing += missing
        return self._found or _NO_FINDINGS

    # ------------------------------------------------------------------ lookups

    def request(self, req: str) -> Request | None:
        idx = self._req_index.get(req)
        return None if idx is None else self.requests[idx]

    def _request(self, req: str, payload: str) -> Request:
        """The request an event names (created on its first event); it was just named."""
        if not req:
            raise self._bad(f"{payload} event has no req")
        idx = self._req_index.get(req)
        if idx is not None:
            r = self.requests[idx]
            assert r is not None  # the index of a forgotten request is not in _req_index
            r.last = self._applied  # the queue of requests in use is reordered lazily, by _sweep
            if r.retired:  # back in use
                r.retired = False
                del self._retired[idx]
                r.queued = self._applied
                self._recent[idx] = r
            return r
        if self._free:
            r = Request(id=req, idx=self._free.pop())
            self.requests[r.idx] = r
        else:
            r = Request(id=req, idx=len(self.requests))
            self.requests.append(r)
        self._req_index[req] = r.idx
        if self.retire_idle:
            r.last = r.queued = self._applied
            self._recent[r.idx] = r
        return r

    @property
    def known_requests(self) -> int:
        """Requests the ledger holds now (in use or retired; forgotten ones are not)."""
        return len(self._req_index)

    # ------------------------------------------------------------------ retirement

    def _sweep(self) -> None:
        """Retire the requests idle for retire_idle applied events that hold nothing; every
        forget_idle events, forget the retired ones idle that long that no page tag names."""
        self._next_sweep = self._applied + self._sweep_every
        idle_before = self._applied - self.retire_idle
        # Second chance: in the order they were queued, the requests queued a window ago; one
        # named since goes to the back, one that still holds something is looked at again
        # a window later, the rest are retired.
        due = []
        for r in self._recent.values():
            if r.queued > idle_before:
                break
            due.append(r)
        for r in due:
            if r.last > idle_before or self._holds_something(r):
                r.queued = self._applied
                self._recent.move_to_end(r.idx)
            else:
                del self._recent[r.idx]
                self._retire(r)
        if self.forget_idle and self._applied >= self._next_scan:
            self._next_scan = self._applied + self.forget_idle // 4  # memory: ~1.25 windows
            self._forget(self._applied - self.forget_idle)
            self._forget_orphans(self._applied - self.forget_idle)

    def _holds_something(self, r: Request) -> bool:
        if r.idx in self._wire_pending:
            return True
        for (node, pool_id), _ in r.history.items():
            pool = self.nodes[node].pools.get(pool_id)
            if pool is not None and pool.live.get(r.idx):
                return True
        if any(len(shared.pages) for shared in r.shared.values()):
            return True
        return any(t.req == r.id for waiting in self._posted.values() for t, _ in waiting)

    def _retire(self, r: Request) -> None:
        """A request that holds nothing waits to be forgotten. Everything a later event of it
        may be judged by stays (its grant history, its transfers: the other side of one may
        still report); what can no longer matter goes."""
        for node, pool_id in r.history:
            pool = self.nodes[node].pools.get(pool_id)
            if pool is not None:
                pool.live.pop(r.idx, None)
        r.shared = {}
        r.retired = True
        self._retired[r.idx] = r
        self.stats.retired += 1

    def _forget(self, idle_before: int) -> None:
        """Forget the retired requests idle since before `idle_before` that no page tag, nor
        any share, names."""
        named = np.zeros(len(self.requests), bool)
        for node in self.nodes.values():
            for pool in node.pools.values():
                pool.pages.mark_named(named)
        shares = [s.writer for r in self._recent.values() if r.shared for s in r.shared.values()]
        if shares:
            named[np.concatenate(shares)] = True
        idle = []  # retired in the order they were last named: the first newer ends the idle ones
        for idx, r in self._retired.items():
            if r.last > idle_before:
                break
            idle.append((idx, r))
        gone = set()
        for idx, r in idle:
            if named[idx] or self._holds_something(r):  # a late wire report may be pending on it
                continue
            del self._retired[idx]
            del self._req_index[r.id]
            for xfer in r.xfers:
                self.transfers.pop(xfer, None)
            self.requests[idx] = None
            self._free.append(idx)
            gone.add(idx)
        if gone:  # a reused index must not inherit an old finding's de-duplication
            self._reported = {f for f in self._reported if f[2] not in gone and f[3] not in gone}
            self.stats.forgotten += len(gone)

    def _forget_orphans(self, idle_before: int) -> None:
        """Drop the transfers only a probe reported, last named before `idle_before`: a side
        that claims one later finds no wire report to compare with (counted: orphan_wire)."""
        while self._orphans:
            xfer, last = next(iter(self._orphans.items()))
            if last >= idle_before:
                return
            del self._orphans[xfer]
            del self.transfers[xfer]
            self.stats.orphan_wire += 1

    def _pool(self, node: Node, pool: int, payload: str) -> Pool:
        found = node.pools.get(pool)
        if found is None:
            raise self._bad(f"{payload}: pool {pool} of node {node.name} was never reported (no pool event)")
        return found

    def _page_array(self, pool: Pool, message: Any, payload: str, *, distinct: bool = True) -> np.ndarray:
        """The page list of an event's payload (`message`) as an index array, checked against
        the pool's size and, with `distinct` (every event that changes pages), for a page
        listed twice: which would count one page as two."""
        try:
            return pool.pages.page_list(
                message.SerializeToString(), _PAGES_FIELD[message.DESCRIPTOR], distinct=distinct
            )
        except IndexError:
            raise self._out_of_range(pool, _pages(message.pages), payload) from None
        except ValueError as exc:
            raise self._bad(
                f"{payload}: page {exc.args[0]} is listed twice (pool {pool.pool} of node {pool.node})"
            ) from None

    def _out_of_range(self, pool: Pool, pages: np.ndarray, payload: str) -> BadEvent:
        bad = pages[pages >= pool.pages.num_pages]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return self._bad(
            f"{payload}: page {int(bad[0])} out of range for pool {pool.pool} of node {pool.node} "
            f"({pool.pages.num_pages} pages){more}"
        )

    def _bad(self, reason: str, kind: str = "malformed") -> BadEvent:
        self.stats.bad[kind] += 1
        return BadEvent(reason, kind)

    def _name(self, idx: int) -> str:
        r = self.requests[idx] if idx > NOBODY else None
        return r.id if r is not None else ""

    def _tenant(self, idx: int) -> str:
        r = self.requests[idx] if idx > NOBODY else None
        return r.tenant if r is not None else ""

    # ------------------------------------------------------------------ findings

    def _report(
        self,
        kind: str,
        message: str,
        *,
        req: Request | None = None,
        victim: int = NOBODY,
        pool: Pool | None = None,
        pages: np.ndarray | None = None,
        details: dict[str, Any] | None = None,
        key: tuple[Any, ...] | None = None,
    ) -> None:
        """Record a finding. `key` identifies the fact for de-duplication: a fact already
        reported (the same stale pages read again at the next decode step) is counted, not
        repeated."""
        if self.dedupe:
            fact = (kind, self._node, req.idx if req else 0, victim, *(key or ()))
            if fact in self._reported:
                self.stats.suppressed += 1
                return
            self._reported.add(fact)
        self.stats.findings[kind] += 1
        self._found.append(
            Finding(
                finding=kind,
                node=self._node,
                req=req.id if req else "",
                tenant=req.tenant if req else "",
                victim_req=self._name(victim),
                victim_tenant=self._tenant(victim),
                pool=pool.pool if pool else None,
                pages=tuple(pages.tolist()) if pages is not None else (),
                seq=self._seq,
                ts_ns=self._ts,
                message=message,
                details={k: str(v) for k, v in (details or {}).items()},
            )
        )

    def _progress(self, r: Request, what: str) -> None:
        """A request that must only drain made progress."""
        self._report(
            "rejected_progress",
            f"request {r.id} was {r.state}{f' ({r.reason})' if r.reason else ''} but made progress: {what}",
            req=r,
            details={"state": r.state, "event": what.split()[0]},
            key=(what.split()[0],),
        )

    def _by_victim(
        self,
        kind: str,
        r: Request,
        pool: Pool,
        pages: np.ndarray,
        victims: np.ndarray,
        text: Callable[[int], str],
        details: dict[str, Any] | None = None,
    ) -> None:
        """One finding per distinct victim among `pages` (victims[i] is pages[i]'s victim)."""
        distinct = sorted(set(victims.tolist()))  # usually one (np.unique costs ~20 µs)
        for victim in distinct:
            sel = pages if len(distinct) == 1 else pages[victims == victim]
            self._report(
                kind,
                text(victim) + f" (pool {pool.pool} on {pool.node}, {len(sel)} page(s))",
                req=r,
                victim=victim,
                pool=pool,
                pages=sel,
                details=details,
                key=(pool.pool,),
            )

    # ------------------------------------------------------------------ config

    def _on_pool(self, node: Node, rep: pb.PoolReport) -> None:
        if rep.role not in ROLES:
            raise self._bad(f"pool: role {rep.role!r} is not one of {', '.join(ROLES)}")
        if not 1 <= rep.page_size <= MAX_PAGE_SIZE:
            raise self._bad(f"pool: page_size {rep.page_size} is not in 1..{MAX_PAGE_SIZE}")
        if not 1 <= rep.num_pages <= MAX_PAGES:
            raise self._bad(f"pool: num_pages {rep.num_pages} is not in 1..{MAX_PAGES}")
        regions = self._regions(rep)
        report = pb.PoolReport()
        report.CopyFrom(rep)
        old = node.pools.get(rep.pool)
        if old is None:
            pool = node.pools[rep.pool] = Pool(
                node.name, rep.pool, report, PoolPages(rep.num_pages, rep.page_size)
            )
        else:
            changed = {
                name: (getattr(old.report, name), getattr(rep, name))
                for name in _POOL_FIELDS
                if getattr(old.report, name) != getattr(rep, name)
            }
            pool = old
            if changed:
                text = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
                self._report(
                    "config_drift",
                    f"pool {rep.pool} on {node.name} changed since it was last reported: {text}",
                    pool=pool,
                    details={
                        "changed": ",".join(changed),
                        **{k: f"{a}->{b}" for k, (a, b) in changed.items()},
                    },
                    key=("changed", rep.pool, text),
                )
                if rep.num_pages != old.pages.num_pages or rep.page_size != old.pages.page_size:
                    pool.pages = PoolPages(rep.num_pages, rep.page_size)  # a new engine, a new pool
                    pool.regions = None
            pool.report = report
        if regions is not None and pool.regions is None:
            # From now on changes are timed; before now, nothing is known of them.
            pool.pages.since[:] = self._ts
        pool.regions = regions
        pool.history.append((self._seq, self._ts, report))
        tokens = rep.page_size * rep.num_pages
        for limit, what in (
            (rep.context_len, "context length"),
            (rep.max_prompt_tokens, "maximum prompt length"),
        ):
            if limit > tokens:
                self._report(
                    "config_drift",
                    f"KV pool {rep.pool} on {node.name} holds {tokens} tokens ({rep.num_pages} pages of "
                    f"{rep.page_size}), less than the advertised {what} of {limit}: a prompt that does not "
                    "fit must be rejected and must go no further",
                    pool=pool,
                    details={"pool_tokens": tokens, "limit": limit, "what": what},
                    key=("undersized", rep.pool, what, tokens, limit),
                )

    def _regions(self, rep: pb.PoolReport) -> np.ndarray | None:
        """A pool report's KvRegions as [n, 3] uint64 rows (base, stride, page bytes), checked."""
        if not rep.regions:
            return None
        if len(rep.regions) > MAX_REGIONS:
            raise self._bad(f"pool: {len(rep.regions)} regions (at most {MAX_REGIONS})")
        rows = []
        for i, g in enumerate(rep.regions):
            size = g.page_bytes or g.stride
            if not g.stride or size > g.stride:
                raise self._bad(f"pool: region {i} has stride {g.stride} and page_bytes {g.page_bytes}")
            if g.base + g.stride * rep.num_pages >= _U64:
                raise self._bad(
                    f"pool: region {i} ({rep.num_pages} pages of {g.stride} at {g.base:#x}) wraps"
                )
            rows.append((g.base, g.stride, size))
        return np.array(rows, dtype=np.uint64)

    def _capacity(self, node: Node) -> tuple[int, int]:
        """(largest pool in tokens, smallest advertised context length) of a node; 0 if unknown."""
        if not node.pools:
            return 0, 0
        tokens = max(p.tokens for p in node.pools.values())
        contexts = [p.report.context_len for p in node.pools.values() if p.report.context_len]
        return tokens, min(contexts) if contexts else 0

    # ------------------------------------------------------------------ lifecycle

    def _on_admit(self, node: Node, a: pb.Admit) -> None:
        if a.stage not in STAGES:
            raise self._bad(f"admit: stage {a.stage!r} is not one of {', '.join(STAGES)}")
        r = self._request(a.req, "admit")
        if r.ended:
            self._progress(r, f"admit to {a.stage} on {node.name}")
        if not r.tenant:
            r.tenant = a.tenant
        r.prompt_tokens = max(r.prompt_tokens, a.prompt_tokens)
        if r.state == "new":
            r.state = "admitted"
        tokens, context = self._capacity(node)
        limits = [
            (limit, what)
            for limit, what in ((tokens, "KV pool holds only"), (context, "context length is"))
            if limit
        ]
        if limits:
            limit, what = min(limits)
            if a.prompt_tokens > limit:
                self._report(
                    "config_drift",
                    f"request {r.id} with a prompt of {a.prompt_tokens} tokens was admitted to {a.stage} on "
                    f"{node.name}, whose {what} {limit} tokens: it cannot fit and must be rejected",
                    req=r,
                    details={"prompt_tokens": a.prompt_tokens, "limit": limit},
                    key=("admit",),
                )

    def _end(self, r: Request, state: str, reason: str) -> None:
        if not r.ended:
            r.state, r.reason = state, reason

    def _on_reject(self, node: Node, x: pb.Reject) -> None:
        self._end(self._request(x.req, "reject"), "rejected", x.reason)

    def _on_abort(self, node: Node, x: pb.Abort) -> None:
        self._end(self._request(x.req, "abort"), "aborted", x.reason)

    def _on_kill(self, node: Node, x: pb.Kill) -> None:
        self._end(self._request(x.req, "kill"), "killed", f"{x.finding} by {x.by}".strip())

    def _settle_wire(self, r: Request) -> None:
        t = self._wire_pending.pop(r.idx, None)
        if t is not None:
            self._wire_verdict(r, t)

    def _on_finish(self, node: Node, x: pb.Finish) -> None:
        r = self._request(x.req, "finish")
        if self._wire_pending:
            self._settle_wire(r)
        r.output_tokens += x.output_tokens
        if not r.ended:
            r.state = "finished"

    def _on_heartbeat(self, node: Node, x: pb.Heartbeat) -> None:
        node.agent_version, node.dropped = x.agent_version, x.dropped

    def _on_bootstrap(self, node: Node, b: pb.Bootstrap) -> None:
        if not b.prefill_node or not b.decode_node:
            raise self._bad("bootstrap: prefill_node and decode_node are required")
        r = self._request(b.req, "bootstrap")
        if r.ended:
            self._progress(r, f"bootstrap {b.prefill_node}->{b.decode_node}")
        r.bootstrap = (b.prefill_node, b.decode_node, b.prompt_tokens)
        if b.tenant and not r.tenant:
            r.tenant = b.tenant
        prefill, decode = self.nodes.get(b.prefill_node), self.nodes.get(b.decode_node)
        if prefill is None or decode is None:
            return
        for p in prefill.pools.values():
            d = decode.pools.get(p.pool)
            if d is None:
                continue
            for name in ("page_size", "kv_dtype"):
                a, c = getattr(p.report, name), getattr(d.report, name)
                pair = (b.prefill_node, b.decode_node, f"{p.pool}:{name}")
                if a != c and pair not in self._drift_pairs:
                    self._drift_pairs.add(pair)
                    self._report(
                        "config_drift",
                        f"prefill {b.prefill_node} and decode {b.decode_node} disagree on {name} of pool "
                        f"{p.pool}: {a!r} vs {c!r}; KV sent between them would be misread (first seen "
                        f"with request {r.id})",
                        pool=p,
                        details={"field": name, "prefill": a, "decode": c, "first_req": r.id},
                        key=pair,
                    )

    # ------------------------------------------------------------------ pages

    def _on_alloc(self, node: Node, a: pb.Alloc) -> None:
        pool = self._pool(node, a.pool, "alloc")
        self._apply_alloc(node, pool, self._page_array(pool, a, "alloc"), a.req)

    def _apply_alloc(self, node: Node, pool: Pool, pages: np.ndarray, req: str) -> None:
        pp = pool.pages
        r = self._request(req, "alloc")
        if r.ended:
            self._progress(r, f"alloc of {len(pages)} page(s) on {node.name}")
        since = self._ts if pool.regions is not None else None
        if pp.grant(pages, r.idx, since):  # some still in use: judged, then granted
            self._early_release(r, pool, pages, pp.use[pages])
            pp.grant(pages, r.idx, since, judged=True)
        grants = r.history.get(key := (node.name, pool.pool))
        if grants is None:
            r.history[key] = [pages]
        else:
            grants.append(pages)
            if len(grants) > GRANT_RUNS:
                # Decode grants a page at a time: hundreds of one-page arrays per request, kept
                # for as long as the ledger keeps the request. One int32 array is 30x smaller.
                r.history[key] = [np.concatenate(grants).astype(np.int32)]
        pool.live[r.idx] = pool.live.get(r.idx, 0) + len(pages)
        r.granted_pages += len(pages)
        if r.bootstrap is not None and r.bootstrap[1] == node.name and not r.received_tokens:
            r.reserved_pages += len(pages)
        self.stats.page_transitions += len(pages)

    def _early_release(self, r: Request, pool: Pool, pages: np.ndarray, busy: np.ndarray) -> None:
        """Pages handed out while still in use: by a live grant (the previous grantee, or
        prefix sharers) or by a holder (offload, transfer, abort path)."""
        pp = pool.pages
        sel = pages[busy > 0]
        refs, owner = pp.refs(sel), pp.owner[sel]
        kind = np.argmax(pp.holds[:, sel] > 0, axis=0)  # the first kind of hold still on each page
        holder = pp.holder_req[kind, sel]
        victims = np.where(refs > 0, np.where(owner >= 0, owner, ~owner), holder)
        for victim in np.unique(victims):
            mask = victims == victim
            held = pp.holds[:, sel[mask]].any(axis=1)
            users = (["live grant"] if (refs[mask] > 0).any() else []) + [
                f"{HOLDERS[k]} hold" for k in np.flatnonzero(held)
            ]
            self._report(
                "early_release",
                f"{int(mask.sum())} page(s) of pool {pool.pool} on {pool.node} were handed to {r.id} while "
                f"{self._name(int(victim)) or 'another user'} still used them ({', '.join(users)})",
                req=r,
                victim=int(victim),
                pool=pool,
                pages=sel[mask],
                details={"users": ",".join(users)},
                key=(pool.pool, self._seq),
            )
        # Grants of the previous holders end here; their shares now point at foreign content.
        prev = pp.owner[sel]
        for victim in np.unique(prev[prev >= 0]).tolist():
            pool.live[victim] -= int(np.count_nonzero(prev == victim))

    def _on_write(self, node: Node, w: pb.Write) -> None:
        pool = self._pool(node, w.pool, "write")
        pages = self._page_array(pool, w, "write")
        slots = None
        if w.slots:
            if len(w.slots) != len(pages):
                raise self._bad(
                    f"write: {len(w.slots)} slots for {len(pages)} pages (must match, or be empty)"
                )
            slots = np.array(w.slots, dtype=np.uint32)
            if int(slots.max()) > pool.pages.page_size:
                raise self._bad(f"write: {int(slots.max())} valid slots in a page of {pool.pages.page_size}")
        self._apply_write(node, pool, pages, slots, w.req)

    def _apply_write(
        self, node: Node, pool: Pool, pages: np.ndarray, slots: np.ndarray | None, req: str
    ) -> None:
        r = self._request(req, "write")
        if r.ended:
            self._progress(r, f"write of {len(pages)} page(s) on {node.name}")
        self._write(r, pool, pages, slots, drain=False)
        r.written_pages += len(pages)

    def _write(
        self,
        r: Request,
        pool: Pool,
        pages: np.ndarray,
        slots: np.ndarray | None,
        *,
        drain: bool,
        land: bool = True,
        via: tuple[str, str, str] | None = None,
    ) -> None:
        """KV of request r lands in `pages` (`slots` valid in each; None: full pages). Pages r
        does not own are a late write (another request owns them now) or a use after free
        (nobody does), except, when `drain`, pages kept alive by a transfer_recv hold: the end
        of a transfer already in flight. With land=False the write was attempted but refused:
        it is judged, the pages keep their KV. `via`: (probe, its event, xfer) when a probe
        saw the write, not the engine."""
        pp = pool.pages
        # The content changes wherever the bytes landed, owned or not: whoever reads these
        # pages next reads r's KV.
        if land and not pp.land(pages, r.idx, slots):
            self.stats.page_transitions += len(pages)
            return
        owner = pp.owner[pages]
        foreign = owner != r.idx
        sel = pages[foreign]
        other = owner[foreign]
        bad = ~pp.draining(r.idx, sel, other) if drain else np.ones(len(sel), bool)
        late = bad & (other >= 0)
        details = None
        how = ""
        if via is not None:
            probe, event, xfer = via
            details = {"probe": probe, "witness": event, "xfer": xfer}
            how = f" by RDMA (transfer {xfer}, seen posted by {probe}, {event})"
        if late.any():
            self._by_victim(
                "late_write",
                r,
                pool,
                sel[late],
                other[late],
                lambda v: f"{r.id} wrote KV{how} into pages now granted to {self._name(v)}",
                details,
            )
        freed = bad & (other < 0)
        if freed.any():
            self._report(
                "use_after_free",
                f"{r.id} wrote KV{how} into {int(freed.sum())} page(s) of pool {pool.pool} on "
                f"{pool.node} that it no longer holds",
                req=r,
                pool=pool,
                pages=sel[freed],
                details=details,
                key=(pool.pool, "write"),
            )
        if land:
            pp.land(pages, r.idx, slots, judged=True)
            self.stats.page_transitions += len(pages)

    def _on_free(self, node: Node, f: pb.Free) -> None:
        pool = self._pool(node, f.pool, "free")
        self._apply_free(node, pool, self._page_array(pool, f, "free"), f.req)

    def _apply_free(self, node: Node, pool: Pool, pages: np.ndarray, req: str) -> None:
        pp = pool.pages
        r = self._request(req, "free")
        if self._wire_pending:
            self._settle_wire(r)
        since = self._ts if pool.regions is not None else None
        n_mine = len(pages)
        if others := pp.end_grant(pages, r.idx, since):  # shares ending, or a double free
            n_mine -= others
            self._free_other(r, pool, pages[pp.owner[pages] != r.idx])
            pp.end_grant(pages, r.idx, since, judged=True)
        if n_mine:
            pool.live[r.idx] -= n_mine
        r.freed_pages += n_mine
        self.stats.page_transitions += n_mine

    def _free_other(self, r: Request, pool: Pool, pages: np.ndarray) -> None:
        """Free of pages r does not own: the end of a prefix share, or a double free."""
        pp = pool.pages
        key = (pool.node, pool.pool)
        shared = r.shared.get(key)
        ended = np.zeros(len(pages), bool)
        if shared is not None and len(shared.pages):
            ended = np.isin(pages, shared.pages)
            current, _ = shared.lookup(pages, pp.gen[pages])
            done = pages[current]  # shares of pages re-granted since ended then (early_release)
            r.shared[key] = shared.without(pages[ended])
            pp.use[done] -= 1
            r.freed_pages += len(done)
        bad = pages[~ended]
        if len(bad):
            owner = pp.owner[bad]
            victims = np.where(owner >= 0, owner, NOBODY)
            self._by_victim(
                "double_free",
                r,
                pool,
                bad,
                victims,
                lambda v: (
                    f"{r.id} freed page(s) it does not hold"
                    + (f": they are granted to {self._name(v)}" if v else ": they are already free")
                ),
            )
        self.stats.page_transitions += len(pages)

    def _on_hold(self, node: Node, h: pb.Hold) -> None:
        pool = self._pool(node, h.pool, "hold")
        pages = self._page_array(pool, h, "hold")
        k = HOLDER_INDEX.get(h.holder)
        if k is None:
            raise self._bad(f"hold: holder {h.holder!r} is not one of {', '.join(HOLDERS)}")
        r = self._request(h.req, "hold")
        pp = pool.pages
        pp.holds[k, pages] += 1
        pp.use[pages] += 1
        pp.holder_req[k, pages] = r.idx
        if k == RECV_HOLD and pool.regions is not None:  # where a draining transfer may land
            pp.since[pages] = self._ts
        self.stats.page_transitions += len(pages)

    def _on_release(self, node: Node, h: pb.Release) -> None:
        pool = self._pool(node, h.pool, "release")
        pages = self._page_array(pool, h, "release")
        k = HOLDER_INDEX.get(h.holder)
        if k is None:
            raise self._bad(f"release: holder {h.holder!r} is not one of {', '.join(HOLDERS)}")
        pp = pool.pages
        held = pp.holds[k, pages] > 0
        r = self._request(h.req, "release")
        if self._wire_pending:
            self._settle_wire(r)
        if not held.all():
            self._report(
                "double_free",
                f"{r.id} released a {h.holder} hold on {int((~held).sum())} page(s) of pool {pool.pool} on "
                f"{pool.node} that were not held",
                req=r,
                pool=pool,
                pages=pages[~held],
                details={"holder": h.holder},
                key=(pool.pool, h.holder),
            )
            pages = pages[held]
        pp.holds[k, pages] -= 1
        pp.use[pages] -= 1
        if k == RECV_HOLD and pool.regions is not None:
            pp.since[pages] = self._ts
        self.stats.page_transitions += len(pages)

    def _on_share(self, node: Node, s: pb.Share) -> None:
        pool = self._pool(node, s.pool, "share")
        pages = self._page_array(pool, s, "share")
        r = self._request(s.req, "share")
        origin = self._request(s.origin_req, "share (origin_req)")
        if r.ended:
            self._progress(r, f"share of {len(pages)} prefix page(s) on {node.name}")
        pp = pool.pages
        live = pp.refs(pages) > 0
        if not live.all():
            self._report(
                "use_after_free",
                f"{r.id} was given {int((~live).sum())} prefix page(s) of {origin.id} that are no longer "
                f"granted to anyone (pool {pool.pool} on {pool.node})",
                req=r,
                victim=origin.idx,
                pool=pool,
                pages=pages[~live],
                key=(pool.pool, "share"),
            )
            pages = pages[live]
        if origin.tenant and r.tenant and origin.tenant != r.tenant:
            self._report(
                "cross_tenant_share",
                f"prefix cache shared {len(pages)} page(s) written by {origin.tenant} request {origin.id} "
                f"with {r.tenant} request {r.id}",
                req=r,
                victim=origin.idx,
                pool=pool,
                pages=pages,
                key=(pool.pool,),
            )
        pp.use[pages] += 1
        key = (node.name, s.pool)
        # What the sharer is promised: the origin's own KV, written under the page's current
        # grant. If the page holds anyone else's, the sharer's first read of it is a stale read.
        gen = pp.gen[pages]
        new = Shared(pages, gen, np.full(len(pages), origin.idx, np.int32), gen)
        old = r.shared.get(key)
        r.shared[key] = old.merged(new) if old is not None else new.merged(Shared(*(pages[:0],) * 4))
        r.shared_pages += len(pages)
        self.stats.page_transitions += len(pages)

    def _on_scrub(self, node: Node, s: pb.Scrub) -> None:
        pool = self._pool(node, s.pool, "scrub")
        pages = self._page_array(pool, s, "scrub")
        pp = pool.pages
        pp.writer[pages] = NOBODY
        pp.valid[pages] = 0
        pp.own[pages] = NOBODY
        pp.prior[pages] = NOBODY
        self.stats.page_transitions += len(pages)

    # ------------------------------------------------------------------ attention

    def _on_read(self, node: Node, rd: pb.Read) -> None:
        checked = []
        for entry in rd.reads:  # validate the whole launch before reporting anything
            pool = self._pool(node, entry.pool, "read")
            # A block table may name a page twice (engines pad with a null page): a read changes nothing.
            pages = self._page_array(pool, entry, "read", distinct=False)
            pages, tokens = self._pages_read(pool, pages, entry.tokens)
            checked.append((self._request(entry.req, "read"), pool, pages, tokens))
        self._apply_read(node, checked)

    def _apply_read(self, node: Node, checked: list[tuple[Request, Pool, np.ndarray, int]]) -> None:
        """An attention launch whose every entry is valid: (reader, pool, pages it covers, tokens)."""
        for r, pool, pages, tokens in checked:
            if self._wire_pending:
                self._settle_wire(r)
            if r.ended:
                self._progress(r, f"read (attention) on {node.name}")
            r.reads += 1
            self._check_read(r, pool, pages, tokens)

    def batch_clean(
        self, node: str, pool: int, reqs: Sequence[str], block_tables: np.ndarray, context_lens: np.ndarray
    ) -> np.ndarray:
        """The check before attention for a whole decode batch, as one set of array
        operations: True for each request whose every slot to be read holds its own KV,
        written under its current grant (and that may still make progress). Changes nothing
        and reports nothing: the guard sends only the requests that fail it through
        `apply()` as a `read` event, which names the finding and the victim (prefix-shared
        pages also take that path, which accepts them).

        block_tables: [B, P] page ids (entries beyond a request's context are ignored, may be
        any value); context_lens: [B] tokens each request attends to."""
        pp = self.nodes[node].pools[pool].pages
        readers = self.reader_indices(reqs)
        tags_clean = check_tags(pp.own, pp.valid, block_tables, context_lens, readers, pp.page_size)
        return self.clean_given_tags(readers, tags_clean, np.asarray(context_lens) == 0)

    def reader_indices(self, reqs: Sequence[str]) -> np.ndarray:
        """The ledger's index of each request (NOBODY for one it does not know): what the
        page tags name."""
        # map() over dict.get: the per-request loop runs in C (a decode batch, every step)
        return np.fromiter(map(self._req_index.get, reqs, repeat(NOBODY)), np.int32, len(reqs))

    def clean_given_tags(
        self, readers: np.ndarray, tags_clean: np.ndarray, reads_nothing: np.ndarray
    ) -> np.ndarray:
        """batch_clean's answer from the tag check's (on the host or the GPU): a request that
        was rejected, aborted or killed may not attend, whatever its pages hold; one that
        reads nothing is clean."""
        # A reader's index is a known request's, or NOBODY's stand-in; the loop runs in C.
        states = map(_STATE, map(self.requests.__getitem__, readers.tolist()))
        ended = np.fromiter(map(_ENDED_STATES.__contains__, states), bool, len(readers))
        return (tags_clean & ~ended) | reads_nothing

    def writable(self, node: str, pool: int, req: str, pages: Sequence[int]) -> bool:
        """Whether KV of `req` may land in `pages` now: each is granted to it, or kept for it
        by a transfer_recv hold after its grant ended (a transfer draining). A query only."""
        pp = self.nodes[node].pools[pool].pages
        idx = np.asarray(pages, dtype=np.intp)
        if len(idx) and (idx.min() < 0 or idx.max() >= pp.num_pages):
            return False
        r = self._req_index.get(req, NOBODY)
        owner = pp.owner[idx]
        return bool(r != NOBODY and ((owner == r) | pp.draining(r, idx, owner)).all())

    def _pages_read(self, pool: Pool, pages: np.ndarray, tokens: int) -> tuple[np.ndarray, int]:
        """The pages a context of `tokens` tokens actually covers (a block table may be longer)."""
        ps = pool.pages.page_size
        need = -(-tokens // ps)
        if need > len(pages):
            raise self._bad(
                f"read of {tokens} tokens needs {need} pages of {ps} but lists {len(pages)} "
                f"(pool {pool.pool} on {pool.node})"
            )
        return (pages[:need] if need < len(pages) else pages), tokens

    def _check_read(self, r: Request, pool: Pool, pages: np.ndarray, tokens: int) -> None:
        """The check before attention: every slot read must hold the reader's own KV, written
        under its current grant, or prefix KV it was legitimately given. Clean at once when
        every page is its own and full but the last, which holds what is read of it (a short
        page before the last is read in full: its slots beyond `valid` hold whoever wrote
        there before)."""
        n = len(pages)
        if n == 0:
            return
        pp = pool.pages
        self.stats.page_transitions += n
        if not pp.read_clean(pages, r.idx, tokens):
            self._read_slow(r, pool, pages, tokens)

    def _read_slow(self, r: Request, pool: Pool, pages: np.ndarray, tokens: int) -> None:
        """The findings of a read that is not clean at once: its stale pages (granted to the
        reader, or given to it as prefix, without the KV it may read there) and its foreign
        ones (neither), each with the request whose data was there (the victim)."""
        key = (pool.node, pool.pool)
        shared = r.shared.get(key)
        if shared is None:  # the common case, in one C pass over the pages (~100 µs less a finding)
            stale, stale_victims, foreign, foreign_victims = pool.pages.read_victims(pages, r.idx, tokens)
        else:
            stale, stale_victims, foreign, foreign_victims = self._shared_read_victims(
                r, pool, pages, tokens, shared
            )
        if len(stale):
            self._by_victim(
                "stale_read",
                r,
                pool,
                stale,
                stale_victims,
                lambda v: (
                    f"{r.id} attended to KV it did not write under its grant"
                    + (f": it holds {self._name(v)}'s data" if v else " (unwritten or its own stale data)")
                ),
            )
        if len(foreign):
            had = r.ever_granted(key, foreign)
            if had.any():
                self._by_victim(
                    "use_after_free",
                    r,
                    pool,
                    foreign[had],
                    foreign_victims[had],
                    lambda v: (
                        f"{r.id} attended to pages after its grant on them ended"
                        + (f"; they hold {self._name(v)}'s data" if v else "")
                    ),
                )
            if (~had).any():
                self._by_victim(
                    "foreign_read",
                    r,
                    pool,
                    foreign[~had],
                    foreign_victims[~had],
                    lambda v: (
                        f"{r.id} attended to pages never granted to it"
                        + (f"; they hold {self._name(v)}'s data" if v else "")
                    ),
                )

    def _shared_read_victims(
        self, r: Request, pool: Pool, pages: np.ndarray, tokens: int, shared: Shared
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """read_victims (pages.py) for a reader given prefix pages in the pool: a page shared
        with it (current, still granted to someone) is granted to it too, and its content is
        sound while it is the KV that was shared, as far as the slots read."""
        slots = pool.pages.slots_read(len(pages), tokens)
        state = pool.pages.state[pages]  # the pages' records, gathered once
        owner, writer, valid, own = state["owner"], state["writer"], state["valid"], state["own"]
        mine = owner == r.idx
        content_ok = (own == r.idx) & (valid >= slots)
        current, at = shared.lookup(pages, state["gen"])
        is_shared = current & ~mine & (live_grants(state) > 0)
        if is_shared.any():
            intact = (writer == shared.writer[at]) & (state["wgen"] == shared.wgen[at]) & (valid >= slots)
            content_ok |= is_shared & intact
        granted = mine | is_shared
        stale = granted & ~content_ok
        # Whose KV was read: the page's writer, or, for slots beyond what the reader wrote
        # itself, whoever's data was in the page when it was handed out.
        own_short = (own == r.idx) & (valid < slots)
        stale_victims = np.where(own_short, state["prior"], writer)[stale]
        foreign = ~granted
        written = writer[foreign]
        foreign_victims = np.where(written != NOBODY, written, np.maximum(owner[foreign], NOBODY))
        return (
            pages[stale],
            np.where(stale_victims == r.idx, NOBODY, stale_victims),
            pages[foreign],
            np.where(foreign_victims == r.idx, NOBODY, foreign_victims),
        )

    # ------------------------------------------------------------------ transfers

    def _xfer_fields(self, node: Node, x: pb.XferSend | pb.XferRecv, payload: str) -> tuple[Pool, np.ndarray]:
        if not x.xfer:
            raise self._bad(f"{payload}: xfer (the transfer id) is required")
        if x.status not in STATUSES:
            raise self._bad(f"{payload}: status {x.status!r} is not one of {', '.join(STATUSES)}")
        pool = self._pool(node, x.pool, payload)
        pages = self._page_array(pool, x, payload)
        if x.checksums and len(x.checksums) != len(pages):
            raise self._bad(f"{payload}: {len(x.checksums)} checksums for {len(pages)} pages")
        return pool, pages

    def _transfer(self, xfer: str, r: Request | None) -> Transfer:
        """The transfer `xfer`; `r`: the request a side of it names (None: a probe's report)."""
        req = r.id if r is not None else ""
        t = self.transfers.get(xfer)
        if t is None:
            t = self.transfers[xfer] = Transfer(xfer, req)
            if r is not None:
                r.xfers.append(xfer)
        elif r is not None and not t.req:
            t.req = req
            r.xfers.append(xfer)
        if not t.req:  # an orphan until a side claims it: named just now
            self._orphans.pop(xfer, None)
            self._orphans[xfer] = self._applied
        elif r is not None and self._orphans:
            self._orphans.pop(xfer, None)
        return t

    def _on_xfer_send(self, node: Node, x: pb.XferSend) -> None:
        pool, pages = self._xfer_fields(node, x, "xfer_send")
        pages, tokens = self._pages_read(pool, pages, x.tokens) if x.status == "done" else (pages, x.tokens)
        r = self._request(x.req, "xfer_send")
        t = self._transfer(x.xfer, r)
        if t.req != r.id:
            raise self._bad(f"xfer_send: transfer {x.xfer} belongs to request {t.req}, not {r.id}")
        pp = pool.pages
        if r.ended and not (pp.holds[HOLDER_INDEX["transfer_send"], pages] > 0).all():
            self._progress(r, f"xfer_send {x.xfer} to {x.peer_node}")
        if x.status == "done":
            # What leaves the node must be the sender's own KV, like what attention reads.
            self._check_read(r, pool, pages, tokens)
        checksums = np.array(x.checksums, np.uint64)
        t.send = Side(
            node.name, x.pool, pages, x.tokens, x.bytes, checksums, x.status, self._seq, x.peer_node
        )
        r.sent_pages += len(x.pages)
        r.sent_tokens += x.tokens
        r.sent_bytes += x.bytes
        if x.status == "done" and r.bootstrap and x.tokens < r.bootstrap[2]:
            self._mismatch(
                r,
                t,
                "tokens",
                f"sender {node.name} reported transfer {t.xfer} done after sending {x.tokens} of the "
                f"{r.bootstrap[2]} prompt tokens that decode {r.bootstrap[1]} expects",
                expected=r.bootstrap[2],
                observed=x.tokens,
            )
        self._reconcile(r, t)

    def _on_xfer_recv(self, node: Node, x: pb.XferRecv) -> None:
        pool, pages = self._xfer_fields(node, x, "xfer_recv")
        ps = pool.pages.page_size
        need = -(-x.tokens // ps)
        if x.status != "failed" and need > len(pages):
            raise self._bad(
                f"xfer_recv: {x.tokens} tokens need {need} pages of {ps} but {len(pages)} are listed"
            )
        if x.claimed_checksums and len(x.claimed_checksums) != len(pages):
            raise self._bad(f"xfer_recv: {len(x.claimed_checksums)} claimed checksums for {len(pages)} pages")
        r = self._request(x.req, "xfer_recv")
        t = self._transfer(x.xfer, r)
        if t.req != r.id:
            raise self._bad(f"xfer_recv: transfer {x.xfer} belongs to request {t.req}, not {r.id}")
        if x.status in ("done", "refused") and need:
            slots = pool.pages.slots_read(need, x.tokens)
            self._write(r, pool, pages[:need], slots, drain=True, land=x.status == "done")
        checksums = np.array(x.checksums, np.uint64)
        t.recv = Side(
            node.name, x.pool, pages, x.tokens, x.bytes, checksums, x.status, self._seq, x.peer_node
        )
        r.received_pages += len(x.pages)
        r.received_tokens += x.tokens
        r.received_bytes += x.bytes
        if x.status == "done":
            expected_tokens = r.bootstrap[2] if r.bootstrap else 0
            reserved = pool.live.get(r.idx, 0)
            if expected_tokens and x.tokens < expected_tokens:
                self._mismatch(
                    r,
                    t,
                    "tokens",
                    f"decode {node.name} expected {expected_tokens} prompt tokens ({reserved} page(s) "
                    f"reserved) for {r.id} but transfer {t.xfer} delivered {x.tokens} ({need} page(s))",
                    expected=expected_tokens,
                    observed=x.tokens,
                    pool=pool,
                )
            elif reserved and need < reserved and need < -(-expected_tokens // ps):
                self._mismatch(
                    r,
                    t,
                    "pages",
                    f"decode {node.name} reserved {reserved} page(s) for {r.id} but transfer {t.xfer} "
                    f"filled {need}",
                    expected=reserved,
                    observed=need,
                    pool=pool,
                )
        if x.status == "done" and (x.claimed_tokens or x.claimed_bytes or x.claimed_checksums):
            # What the sender claimed, as the transfer itself carried it: checkable here and now.
            claim = Side(
                x.peer_node or "sender",
                x.pool,
                pages,
                x.claimed_tokens,
                x.claimed_bytes,
                np.array(x.claimed_checksums, np.uint64),
                "done",
                self._seq,
            )
            self._compare(r, t, claim, t.recv)
        self._reconcile(r, t)

    def _on_wire(self, node: Node, w: pb.Wire) -> None:
        if not w.xfer:
            raise self._bad("wire: xfer (the transfer id) is required")
        t = self._transfer(w.xfer, None)
        seen = t.wire.get(w.probe)
        if seen is None:
            seen = t.wire[w.probe] = Seen()
        posted = self._posted_writes(w)
        seen.bytes += w.bytes
        seen.calls += w.calls
        seen.complete |= w.complete
        if posted is not None:
            t.posted.append(posted)
        r = self.request(t.req) if t.req else None
        if r is not None:
            self._reconcile(r, t)

    def _posted_writes(self, w: pb.Wire) -> Posted | None:
        """A wire event's RDMA write ranges, checked; None when it has none, or no time to
        judge them by (counted: those pages cannot be judged)."""
        if not w.writes:
            return None
        if len(w.writes) > MAX_RUNS:
            raise self._bad(f"wire: {len(w.writes)} write ranges (at most {MAX_RUNS})")
        addr = np.fromiter((run.addr for run in w.writes), np.uint64, len(w.writes))
        size = np.fromiter((run.bytes for run in w.writes), np.uint64, len(w.writes))
        if not size.all():
            raise self._bad(f"wire: write range {int(np.argmin(size))} of transfer {w.xfer} has no bytes")
        if (addr > np.uint64(_U64 - 1) - size).any():
            raise self._bad(
                f"wire: a write range of transfer {w.xfer} runs past the end of the address space"
            )
        if w.first_write_ns <= 0:
            self.stats.remote_unjudged += len(w.writes)
            return None
        return Posted(w.probe, addr, addr + size, w.first_write_ns, f"{self._node}#{self._seq}")

    def _route_posted(self, r: Request, t: Transfer) -> None:
        """A transfer's posted writes wait, under its receiver, for the receiver's events."""
        # Who received it, as the receiver, the sender or the bootstrap says (in that order).
        receiver = (t.recv.node if t.recv else "") or (t.send.peer if t.send else "")
        receiver = receiver or (r.bootstrap[1] if r.bootstrap else "")
        if receiver:
            self._posted.setdefault(receiver, []).extend((t, p) for p in t.posted)
            t.posted = []

    def _judge_posted(self, node: Node) -> None:
        """The RDMA writes posted into this node's memory whose time its events have passed:
        each page they hit whose state has not changed since (by more than the clock skew)
        before the first was posted was in that state when they landed; a page not granted to
        the transfer's request, nor kept for it by a transfer_recv hold, was written by
        someone else's transfer."""
        waiting = []
        for t, posted in self._posted.pop(node.name):
            before = posted.first_ns - self.clock_skew_ns
            if node.last_ts_ns < before:  # its events may not have reached that time yet
                waiting.append((t, posted))
                continue
            r = self.request(t.req)
            if r is None or all(pool.regions is None for pool in node.pools.values()):
                self.stats.remote_unmapped += len(posted.addr)
                continue
            for pool in node.pools.values():
                if pool.regions is None:
                    continue
                pages = _pages_written(pool.regions, pool.pages.num_pages, posted.addr, posted.end)
                since = pool.pages.since[pages]
                known = (since > 0) & (since < before)
                self.stats.remote_unjudged += len(pages) - int(np.count_nonzero(known))
                self._write(
                    r,
                    pool,
                    pages[known],
                    None,
                    drain=True,
                    land=False,
                    via=(posted.probe, posted.seen_by, t.xfer),
                )
        if waiting:
            self._posted[node.name] = waiting

    def _mismatch(
        self,
        r: Request,
        t: Transfer,
        what: str,
        message: str,
        *,
        expected: Any,
        observed: Any,
        pool: Pool | None = None,
        pages: np.ndarray | None = None,
    ) -> None:
        self._report(
            "transfer_mismatch",
            message,
            req=r,
            pool=pool,
            pages=pages,
            details={"xfer": t.xfer, "what": what, "expected": expected, "observed": observed},
            key=(t.xfer, what),
        )

    def _compare(self, r: Request, t: Transfer, send: Side, recv: Side) -> None:
        """Sender's and receiver's account of one transfer: tokens, bytes, per-page checksums."""
        for what in ("tokens", "bytes"):
            sent, got = getattr(send, what), getattr(recv, what)
            if sent and sent != got:
                self._mismatch(
                    r,
                    t,
                    what,
                    f"transfer {t.xfer} of {r.id}: sender {send.node} reported {sent} {what}, "
                    f"receiver {recv.node} reported {got}",
                    expected=sent,
                    observed=got,
                )
        if len(send.checksums) and len(recv.checksums):
            n = min(len(send.checksums), len(recv.checksums))
            differ = np.flatnonzero(send.checksums[:n] != recv.checksums[:n])
            if len(differ):
                self._mismatch(
                    r,
                    t,
                    "checksums",
                    f"transfer {t.xfer} of {r.id}: {len(differ)} page(s) arrived on {recv.node} with a "
                    f"checksum other than the one {send.node} sent",
                    expected=0,
                    observed=len(differ),
                    pool=self.nodes[recv.node].pools[recv.pool],
                    pages=recv.pages[differ[differ < len(recv.pages)]],
                )

    def _reconcile(self, r: Request, t: Transfer) -> None:
        """Compare what each side reported of transfer t, as soon as two sides have spoken."""
        if t.posted:
            self._route_posted(r, t)
        send, recv = t.send, t.recv
        if send and recv and send.done and recv.done:
            self._compare(r, t, send, recv)
        # Bytes beyond the claim are wrong at once, and so is a shortfall once a probe saw the
        # transfer end. Otherwise a shortfall is only suspected at receipt: the rest of the
        # probe's report may still be on its way from the sender's node. It is judged at the
        # request's next attention, release, free or finish, i.e. before its KV is used.
        if not (t.wire and send and send.done):
            return
        waiting = False
        for probe, seen in t.wire.items():
            if seen.bytes < send.bytes and not seen.complete:
                waiting = True
            elif seen.bytes != send.bytes:
                self._wire_verdict(r, t, probe)
        if waiting and recv is not None:
            self._wire_pending[r.idx] = t
        else:
            self._wire_pending.pop(r.idx, None)

    def _wire_verdict(self, r: Request, t: Transfer, probe: str | None = None) -> None:
        """Each probe (or the one named) whose bytes differ from the sender's claim."""
        send = t.send
        if send is None:
            return
        for name, seen in t.wire.items():
            if (probe is None or name == probe) and seen.bytes != send.bytes:
                self._report(
                    "transfer_mismatch",
                    f"transfer {t.xfer} of {r.id}: sender reported {send.bytes} bytes, the wire probe "
                    f"({name or 'probe'}) saw {seen.bytes} in {seen.calls} call(s)",
                    req=r,
                    details={
                        "xfer": t.xfer,
                        "what": "wire_bytes",
                        "expected": send.bytes,
                        "observed": seen.bytes,
                        "probe": name,
                    },
                    key=(t.xfer, "wire_bytes", name),
                )
