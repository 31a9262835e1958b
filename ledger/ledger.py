"""The page-ownership ledger (`Ledger`): applies kvguard.v1 events and returns what must not
have happened. One implementation, used by the in-engine guard (one node) and by the daemon
(all nodes). A thin facade over one module per concept: pools (nodes, reports, drift),
pages (page state), requests, ownership (page events), transfers, lifecycle, findings.

Invariants kept here:
- per node and epoch, events are applied in sequence order; a repeated sequence number is
  refused (BadEvent "repeat"), a gap is counted and the event applied, and an event that
  cannot be applied raises BadEvent, changes nothing, and does not advance its node's
  sequence; the first event of a new epoch (incarnation.py) ends the node's previous
  incarnation, even if its payload is then refused: its header alone says the process is new;
- an event arrives as an object (`apply`), as its bytes (`apply_serialized`) or in a batch
  (`apply_clean`: runs of the clean common events in C, runs.c); every path judges with the
  same handlers and leaves the same state, to the byte (tests/ledger/test_property.py);
- memory follows what is in use: every SWEEP_EVERY applied events, requests idle for
  retire_idle events that hold nothing are retired; every forget_idle / 4, retired ones idle
  for forget_idle that no page tag names are forgotten. Sweeps run at fixed counts of applied
  events, so a rebuild from the same events does the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from kvguard.ledger import _pages
from kvguard.ledger.access import Access
from kvguard.ledger.findings import BadEvent, Finding, Findings
from kvguard.ledger.incarnation import Incarnations
from kvguard.ledger.lifecycle import Lifecycle
from kvguard.ledger.limits import Limits
from kvguard.ledger.ownership import Ownership
from kvguard.ledger.pages import Verified
from kvguard.ledger.pools import GRANT_RUNS, Node, Pools
from kvguard.ledger.requests import Request, Requests
from kvguard.ledger.transfers import Transfers
from kvguard.ledger.witness import CudaWitness
from kvguard.proto import pb, wire
from kvguard.proto.limits import NODE_BYTES, SEQ_JUMP_MAX, SEQ_MAX, unstorable

RETIRE_IDLE = 1 << 16  # applied events without news of a request before it may be retired
FORGET_IDLE = 1 << 20  # ... before it may be forgotten
SWEEP_EVERY = 1024  # applied events between retirement sweeps: each is short
CLOCK_SKEW_NS = 10_000_000  # how far two nodes' clocks may disagree (NTP in one data centre: < 1 ms)
_NO_FINDINGS: tuple[Finding, ...] = ()


@dataclass(slots=True)
class LedgerStats:
    """Counters only: each part adds to its own."""

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
    restarts: int = 0  # nodes whose engine began a new incarnation (epoch) after a first one
    gaps_given_up: int = 0  # missing sequence numbers no longer waited for (sequence.MAX_GAPS)
    untenanted: int = 0  # admissions with no tenant: never judged across tenants

    def totals(self) -> dict[str, int]:
        """The plain counts (not the per-kind counters), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}


class Ledger:
    """The global (or node-local) ownership ledger."""

    def __init__(
        self,
        *,
        dedupe: bool = True,
        clock_skew_ns: int = CLOCK_SKEW_NS,
        retire_idle: int = RETIRE_IDLE,
        forget_idle: int = FORGET_IDLE,
        limits: Limits | None = None,
    ) -> None:
        self.dedupe = dedupe
        self.clock_skew_ns = clock_skew_ns
        self.retire_idle = retire_idle  # 0: never
        self.forget_idle = max(forget_idle, retire_idle) if forget_idle and retire_idle else 0
        self.stats = LedgerStats()
        self.requests = Requests(retire_idle)
        self.findings = Findings(dedupe, self.requests.name_of, self.stats)
        self.pools = Pools(self.findings, limits if limits is not None else Limits())
        access = Access(self.findings, self.stats)
        self.transfers = Transfers(self.pools, self.requests, access, self.findings, clock_skew_ns)
        self.ownership = Ownership(self.pools, self.requests, self.transfers, access, self.findings)
        self.lifecycle = Lifecycle(self.pools, self.requests, self.transfers, self.findings)
        self.incarnations = Incarnations(self.pools, self.requests, self.transfers, self.findings, self.stats)
        self.access = access
        self.sweep_every = min(SWEEP_EVERY, max(1, retire_idle // 4))
        self.next_sweep = self.sweep_every if retire_idle else 0
        self.next_scan = self.forget_idle
        self.last_missing = 0  # sequence numbers of its node skipped right before the last event
        self._run = np.zeros(1, _pages.RUN)  # apply_clean's record of a run (pages.h: RunCounts)
        self._run["grant_runs"] = GRANT_RUNS
        own, life, xfers = self.ownership, self.lifecycle, self.transfers
        cuda = CudaWitness(self.pools, self.findings)
        self._handlers: dict[str, Callable[[Node, Any], None]] = {
            "pool": self.pools.on_pool,
            "admit": life.on_admit,
            "reject": life.on_reject,
            "abort": life.on_abort,
            "finish": life.on_finish,
            "bootstrap": life.on_bootstrap,
            "kill": life.on_kill,
            "heartbeat": life.on_heartbeat,
            "alloc": own.on_alloc,
            "write": own.on_write,
            "step": own.on_step,
            "free": own.on_free,
            "hold": own.on_hold,
            "release": own.on_release,
            "share": own.on_share,
            "scrub": own.on_scrub,
            "read": own.on_read,
            "xfer_send": xfers.on_send,
            "xfer_recv": xfers.on_recv,
            "wire": xfers.on_wire,
            "launches": cuda.on_launches,
            "pool_memory": cuda.on_pool_memory,
        }

    @property
    def nodes(self) -> dict[str, Node]:
        return self.pools.nodes

    @property
    def limits(self) -> Limits:
        """What a node may make the ledger hold, and an event make it do (limits.py). Not part
        of its state: a ledger restored or replayed under other limits takes them from then on."""
        return self.pools.limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        self.pools.limits = limits

    @property
    def known_requests(self) -> int:
        """Requests the ledger holds now (in use or retired; forgotten ones are not)."""
        return len(self.requests)

    def request(self, req: str) -> Request | None:
        return self.requests.get(req)

    # ------------------------------------------------------------------ entry points

    def apply(self, event: pb.Event) -> Sequence[Finding]:
        """Apply one event and return the findings it caused; raise BadEvent (page and
        request state unchanged) if it cannot be applied. Afterwards `last_missing` tells how
        many sequence numbers of its node were skipped right before it (a gap)."""
        try:
            kind = event.WhichOneof("payload")
            if kind is None:
                raise BadEvent("event has no payload")
            node = self._begin(kind, event.node, event.seq, event.ts_ns, event.epoch)
            self._handlers[kind](node, getattr(event, kind))
        except BadEvent as exc:
            self.stats.bad[exc.kind] += 1
            raise
        return self._end(node, kind)

    def apply_serialized(self, body: bytes, node: str | None = None) -> Sequence[Finding]:
        """apply() of an event as serialized (as agents send it), and, with `node`, only if it
        is that node's (BadEvent "identity" otherwise). The clean common events go through
        the C clean path (apply_clean); the events every request makes are read straight from
        their bytes; any other event, or one with anything unusual in its bytes, is parsed by
        protobuf. The same handlers judge all of them."""
        if node is not None and self._clean(body, None, 0, 1, node):
            return _NO_FINDINGS
        try:
            return self._serialized(body, node)
        except BadEvent as exc:
            self.stats.bad[exc.kind] += 1
            raise

    def _serialized(self, body: bytes, node: str | None) -> Sequence[Finding]:
        head = wire.event_head(body)
        if head is None:
            event = self._parse(body)
            if node is not None and event.node != node:
                raise BadEvent(f"event of node {event.node!r} on the stream of {node!r}", "identity")
            kind = event.WhichOneof("payload")
            if kind is None:
                raise BadEvent("event has no payload")
            at = self._begin(kind, event.node, event.seq, event.ts_ns, event.epoch)
            self._handlers[kind](at, getattr(event, kind))
            return self._end(at, kind)
        number, name, seq, ts, req, pool_id, tokens, start, end, epoch = head
        if node is not None and name != node:
            raise BadEvent(f"event of node {name!r} on the stream of {node!r}", "identity")
        kind = wire.KIND_OF[number]
        at = self._begin(kind, name, seq, ts, epoch)
        pool = at.pools.get(pool_id)
        try:
            distinct = kind != "read"  # a block table may name a page twice
            pages = (
                None
                if pool is None
                else pool.pages.page_list(body, wire.PAGES, distinct=distinct, within=(start, end))
            )
        except (IndexError, ValueError, TypeError):  # out of range, listed twice, malformed
            pages = None
        own = self.ownership
        if pool is None or pages is None:  # the handler of the parsed event words the error
            self._handlers[kind](at, getattr(self._parse(body), kind))
        elif kind == "alloc":
            own.alloc(at, pool, pages, req)
        elif kind == "write":
            own.write(at, pool, pages, None, req)
        elif kind == "free":
            own.free(at, pool, pages, req)
        else:
            pages = self.access.pages_read(pool, pages, tokens)
            own.read(at, [(self.requests.of_event(req, "read"), pool, pages, tokens)])
        return self._end(at, kind)

    def apply_clean(self, batch: wire.Batch, start: int, stop: int, node: str) -> int:
        """Apply the events batch[start], batch[start + 1], ... of `node` for as long as each
        is the clean common case (an alloc, write, free or read of `node` by a request in use,
        or a new one's first alloc; no finding, no error), all in C (_pages.apply_clean);
        returns the index of the first one it did not apply (`stop` when it applied them
        all), which apply_serialized then takes. The ledger ends as applying them one by one
        leaves it, to the byte."""
        return self._clean(batch.data, batch.heads, start, stop, node)

    def _clean(self, data: bytes, heads: np.ndarray | None, start: int, stop: int, node: str) -> int:
        """apply_clean of events [start, stop) of `data` by their heads (None: `data` is one event)."""
        at = self.pools.nodes.get(node)
        if at is None or node in self.transfers.posted:  # its first event; a verdict waits on it
            return start
        stop = self.transfers.due_by(node, heads, start, stop)  # before its clock settles a verdict
        requests = self.requests
        run = self._run
        while start < stop:
            joined: list[tuple[int, int]] = []
            run["last_seq"], run["epoch"], run["applied"] = at.last_seq, at.epoch, requests.applied
            run["next_sweep"], run["wire"] = self.next_sweep, bool(self.transfers.pending)
            error = _pages.apply_clean(
                data,
                heads,
                start,
                stop,
                run,
                (node, at.views, at.handles.table),
                # a new request's first alloc: made (make_at), then applied in C
                (requests.index, requests.table, requests.make_at, joined),
            )
            done = int(run["at"][0])
            if done > start:  # what the applied events did to their node and the counts
                at.last_seq, at.last_ts_ns = int(run["last_seq"][0]), int(run["last_ts"][0])
                requests.applied = int(run["applied"][0])
                self.last_missing = int(run["last_missing"][0])
                self.stats.page_transitions += int(run["transitions"][0])
                self.stats.missing += int(run["missing"][0])
                events = self.stats.events
                for kind, n in zip(wire.PLAIN, run["kinds"][0].tolist(), strict=True):
                    if n:
                        events[kind] += n
            for idx, pool_id in joined:  # the pools its requests were first granted pages in
                r = requests[idx]
                assert r is not None
                r.pools.append((node, pool_id))
            if error is not None:
                raise error
            if done == start or requests.applied != self.next_sweep:
                return done
            self._sweep()  # the run ended for it; then it goes on
            start = done
        return start

    def replay(self, batch: wire.Batch, node: str, start: int = 0) -> list[tuple[int, BadEvent]]:
        """Apply events batch[start:] of `node`, accepted before, in order (the store's, when
        the daemon restarts): as the daemon applied them, the clean runs in C and the rest one
        at a time. Their findings were stored when they were first made; none is returned. An
        event refused now (the store does not hold what was applied: edited, or written by
        another version) is skipped: (its index, why) for each, for the caller to say."""
        refused: list[tuple[int, BadEvent]] = []
        at, stop = start, len(batch)
        while at < stop:
            at = self.apply_clean(batch, at, stop, node)
            if at < stop:
                try:
                    self.apply_serialized(batch.event(at), node)
                except BadEvent as exc:
                    refused.append((at, exc))
                at += 1
        return refused

    def end_capture(self) -> list[Finding]:
        """The capture ends (`kvguard replay`, rule fixtures): every verdict still waiting is
        settled (Transfers.settle_all); their findings, each naming its node, with no sequence
        number (no event raised them). The ledger may go on applying events afterwards."""
        return self.transfers.settle_all()

    def _parse(self, body: bytes) -> pb.Event:
        try:
            return pb.Event.FromString(body)
        except DecodeError as exc:
            raise BadEvent(f"the bytes are not a kvguard.v1.Event: {exc}") from None

    def _begin(self, kind: str, name: str, seq: int, ts: int, epoch: int) -> Node:
        """An event's node, once its header is valid (the first event of a new epoch begins
        the node's new incarnation); the event becomes the context of the findings it raises."""
        if not name:
            raise BadEvent(f"{kind} event has no node")
        if seq > SEQ_MAX or epoch > SEQ_MAX:
            raise BadEvent(
                f"{kind} event of node {name}: seq {seq} or epoch {epoch} is over {SEQ_MAX} (2^63 - 1)",
                "out_of_range",
            )
        node = self.pools.nodes.get(name)
        if node is None:  # a name is checked once, when its node is made
            why = unstorable(name, NODE_BYTES)
            if why:
                raise BadEvent(f"{kind} event's node name {name[:40]!r} {why}", "out_of_range")
            node = self.pools.node(name)
        if seq == 0:
            raise BadEvent(f"{kind} event of node {name} has no sequence number (they start at 1)")
        if self.incarnations.check(node, kind, epoch):
            self.findings.at(name, seq, ts)  # the verdicts the restart settles are this event's
            self.incarnations.begin(node, epoch)
            return node
        if seq <= node.last_seq and not node.gaps.holds(seq):
            raise BadEvent(
                f"sequence number {seq} of node {name} repeats (last applied: {node.last_seq})", "repeat"
            )
        if node.last_seq and seq - node.last_seq > SEQ_JUMP_MAX:  # refused before it moves any count
            raise BadEvent(
                f"{kind} event of node {name}: seq {seq} is {seq - node.last_seq - 1} past the last applied "
                f"({node.last_seq}); numbers grow by one an event, at most {SEQ_JUMP_MAX} lost at once",
                "out_of_range",
            )
        self.findings.at(name, seq, ts)
        return node

    def _end(self, node: Node, kind: str) -> Sequence[Finding]:
        """The event was applied: its node's sequence moves on; its findings."""
        seq = self.findings.seq
        missing = seq - node.last_seq - 1
        # Only an applied event advances its node's sequence: a malformed one, whose number
        # may be as wrong as the rest of it, must not make later valid events look repeated.
        if missing < 0:  # it filled a gap (sequence.py): applied late, the sequence stays
            node.gaps.fill(seq)
            self.stats.missing -= 1
            missing = 0
        else:
            if missing:
                self.stats.gaps_given_up += node.gaps.open(node.last_seq + 1, seq - 1)
            node.last_seq, node.last_ts_ns = seq, self.findings.ts
        if node.name in self.transfers.posted:
            self.transfers.judge_posted(node)
        if node.name in self.transfers.due:
            self.transfers.settle_due(node)
        self.stats.events[kind] += 1
        self.requests.applied += 1
        if self.requests.applied == self.next_sweep:
            self._sweep()
        self.last_missing = missing
        if missing:
            self.stats.missing += missing
        return self.findings.found or _NO_FINDINGS

    # ------------------------------------------------------------------ memory

    def _sweep(self) -> None:
        """Retire the requests idle for retire_idle applied events that hold nothing; every
        forget_idle / 4 events, forget the retired ones idle for forget_idle that no page tag
        names."""
        applied = self.requests.applied
        self.next_sweep = applied + self.sweep_every
        idle_before = applied - self.retire_idle
        # Second chance: in the order they were queued, the requests queued a window ago; one
        # named since goes to the back, one that still holds something is looked at again a
        # window later, the rest are retired.
        due = self.requests.due(idle_before)
        named = self.requests.named_since(due, idle_before)  # one read of the table for all
        retired = []
        for r, named_since in zip(due, named, strict=True):
            if named_since or self._holds_something(r):
                self.requests.requeue(r)
            else:
                for node, pool_id in r.pools:
                    pool = self.pools.nodes[node].pools.get(pool_id)
                    if pool is not None:
                        pool.retire(r.idx)
                retired.append(r)
        self.requests.retire(retired)
        self.stats.retired += len(retired)
        if self.forget_idle and applied >= self.next_scan:
            self.next_scan = applied + self.forget_idle // 4  # memory: ~1.25 windows
            self._forget(applied - self.forget_idle)
            self.transfers.forget_orphans(applied - self.forget_idle)

    def _holds_something(self, r: Request) -> bool:
        for node, pool_id in r.pools:
            pool = self.pools.nodes[node].pools.get(pool_id)
            if pool is not None and pool.live.get(r.idx):
                return True
        if any(r.idx in node.handles.slot_of for node in self.pools.nodes.values()):
            return True  # a handle names it: its index may not name another
        return any(len(shared.pages) for shared in r.shared.values()) or self.transfers.holds(r)

    def _forget(self, idle_before: int) -> None:
        """Forget the retired requests idle since before `idle_before` that no page tag, nor
        any share, names."""
        named = np.zeros(len(self.requests.objects), bool)
        for node in self.pools.nodes.values():
            for pool in node.pools.values():
                pool.pages.mark_named(named)
        shares = [s.writer for r in self.requests.recent.values() if r.shared for s in r.shared.values()]
        if shares:
            named[np.concatenate(shares)] = True
        gone = set()
        for r in self.requests.idle_retired(idle_before):
            if named[r.idx] or self._holds_something(r):  # a late wire report may be pending on it
                continue
            self.requests.forget(r)
            self.transfers.forget(r)
            for name, pool_id in r.pools:
                granted = self.pools.nodes[name].pools.get(pool_id)
                if granted is not None:
                    granted.forget(r.idx)
            gone.add(r.idx)
        if gone:  # a reused index must not inherit an old finding's de-duplication, nor a handle
            self.findings.forget(gone)
            for node in self.pools.nodes.values():
                node.handles.forget(gone)
            self.stats.forgotten += len(gone)

    # ------------------------------------------------------------------ the guard's queries

    def batch_clean(
        self,
        node: str,
        pool: int,
        reqs: Sequence[str],
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        verified: Verified | None = None,
    ) -> np.ndarray:
        return self.ownership.batch_clean(node, pool, reqs, block_tables, context_lens, verified)

    def reader_indices(self, reqs: Sequence[str]) -> np.ndarray:
        return self.requests.readers(reqs)

    def clean_given_tags(
        self, readers: np.ndarray, tags_clean: np.ndarray, reads_nothing: np.ndarray
    ) -> np.ndarray:
        return self.ownership.clean_given_tags(readers, tags_clean, reads_nothing)

    def writable(self, node: str, pool: int, req: str, pages: Sequence[int]) -> bool:
        return self.ownership.writable(node, pool, req, pages)
