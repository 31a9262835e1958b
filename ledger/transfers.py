"""KV transfers between nodes (`Transfers`): every side that reports one (the bootstrap, the
decode reservation, the sender, the receiver, each wire probe) reconciled, and the RDMA writes
a probe saw posted judged against the receiver's pages.

A transfer received by a request other than the one that sent it is KV another request stored
in an external tier and this one loaded: a share from the storing request, judged by tenant.

Invariants (Transfers is the only writer of transfers and of the verdicts that wait):
- a transfer is compared as soon as two sides have spoken; bytes a probe saw beyond the
  sender's claim are wrong at once, a shortfall once the probe saw the transfer end, else it
  waits (verdicts.py: settled at the request's next use after receipt, by the nodes' clocks,
  or at the end of a capture);
- at the end of a capture (`settle_all`), a send reported done that its receiver never
  confirmed is reported (transfer_mismatch, what=unconfirmed: low severity, rule
  transfer_unconfirmed) when the receiver is a node that reported events: a decode engine
  that reports learns of its transfers, so a receipt it never reported is worth a look, not
  proof of a leak. No clock settles this one: a receiver may report its receipt late (when
  its scheduler polls for it), and an unguarded receiver never does;
- a posted RDMA write is judged only where the receiver's page state has not changed since
  before it was posted (allowing clock_skew_ns), and only once the receiver's own events have
  passed that time; what cannot be decided is counted (remote_unjudged), never guessed;
- transfers only a probe has named (`orphans`) are bounded like requests: forgotten after
  forget_idle applied events, counted in orphan_wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvguard.ledger.access import Access
from kvguard.ledger.findings import BadEvent, Finding, Findings
from kvguard.ledger.pages import HOLDER_INDEX
from kvguard.ledger.pools import Node, Pool, Pools
from kvguard.ledger.requests import Request, Requests
from kvguard.ledger.verdicts import Verdicts
from kvguard.proto import pb

STATUSES = ("done", "failed", "refused")  # refused: the receiver kept the KV out of its pages
MAX_RUNS = 1 << 16  # remote write ranges of one wire event
SEND_HOLD = HOLDER_INDEX["transfer_send"]  # a sender's hold: an ended request's transfer may still go
_U64 = 1 << 64


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
    node: str = ""  # the node whose stream reported it (a node involved in the transfer)
    judged: bool = False  # its shortfall was settled (verdicts.py): it waits no more


@dataclass(slots=True)
class Posted:
    """RDMA writes of one transfer that a probe saw the sender post: remote ranges [addr, end)
    and the time the first was posted (sender's wall clock), to be judged against the
    receiver's pages."""

    probe: str
    addr: np.ndarray  # uint64
    end: np.ndarray  # uint64
    first_ns: int
    seen_by: str  # "node#seq" of the wire event


@dataclass(slots=True)
class Transfer:
    """Both ends of one prefill->decode KV transfer, and what each wire probe saw (probes are
    independent witnesses of the same bytes: each is compared with the claim alone)."""

    xfer: str
    req: str
    send: Side | None = None
    recv: Side | None = None
    wire: dict[str, Seen] = field(default_factory=dict)  # by probe
    posted: list[Posted] = field(default_factory=list)  # until its request and receiver are known
    closed: bool = False  # reported unconfirmed: no receiver's report is awaited any more


class Transfers:
    def __init__(
        self,
        pools: Pools,
        requests: Requests,
        access: Access,
        findings: Findings,
        clock_skew_ns: int,
    ) -> None:
        self.by_id: dict[str, Transfer] = {}
        # Transfers only a probe has named so far -> when one last did, oldest first.
        self.orphans: dict[str, int] = {}
        self.verdicts = Verdicts(pools, requests, findings, clock_skew_ns)  # the verdicts that wait
        self.pending = self.verdicts.pending  # request -> its transfer a probe saw short so far
        self.due = self.verdicts.due  # node -> deadlines of the verdicts that wait on it
        # receiver node -> RDMA writes waiting for its events to pass the time they were posted
        self.posted: dict[str, list[tuple[Transfer, Posted]]] = {}
        self.clock_skew_ns = clock_skew_ns
        self.pools = pools
        self.requests = requests
        self.access = access
        self.stats = access.stats
        self._found = findings

    def __len__(self) -> int:
        return len(self.by_id)

    # ------------------------------------------------------------------ what waits

    def settle(self, r: Request, why: str) -> None:
        """A verdict that waited on r's transfer is due: r `why` (read, freed, released its
        pages, finished), after the receiver reported the transfer."""
        if self.pending:
            self.verdicts.settle(r, why)

    def settle_due(self, node: Node) -> None:
        """The verdicts that wait on `node` whose deadline its event (just applied) passed."""
        self.verdicts.settle_due(node.name, node.last_ts_ns)

    def due_by(self, node: str, heads: np.ndarray | None, start: int, stop: int) -> int:
        """Where a C run of node's events [start, stop) must stop for a verdict to fall due."""
        return self.verdicts.due_by(node, heads, start, stop)

    def settle_all(
        self, node: str | None = None, why: str = "end of capture", *, unconfirmed: bool = True
    ) -> list[Finding]:
        """Settle every verdict that waits, or (`node`) those that node is involved in: see
        Verdicts.settle_all. The end of a capture, or of a node's incarnation."""
        return self.verdicts.settle_all(self.by_id, self._receiver, node, why, unconfirmed)

    def node_restarted(self, name: str) -> None:
        """Node `name`'s engine restarted: the verdicts that waited on it are settled now (a
        probe's short count is still the sender's word against the wire), a send to it that it
        never confirmed is closed unreported (its memory is gone: nothing of it can be read),
        and RDMA writes posted into its old memory can no longer be judged (counted)."""
        self.settle_all(name, f"the engine of {name} restarted", unconfirmed=False)
        for _, posted in self.posted.pop(name, ()):
            self.stats.remote_unjudged += len(posted.addr)

    def holds(self, r: Request) -> bool:
        """Whether a verdict still waits on one of r's transfers."""
        return (
            r.idx in self.pending
            or any(x in self.verdicts.waits for x in r.xfers)
            or any(t.req == r.id for w in self.posted.values() for t, _ in w)
        )

    def forget(self, r: Request) -> None:
        for xfer in r.xfers:
            self.by_id.pop(xfer, None)

    def forget_orphans(self, idle_before: int) -> None:
        """Drop the transfers only a probe reported, last named before `idle_before`: a side
        that claims one later finds no wire report to compare with (counted: orphan_wire)."""
        while self.orphans:
            xfer, last = next(iter(self.orphans.items()))
            if last >= idle_before:
                return
            del self.orphans[xfer]
            del self.by_id[xfer]
            self.stats.orphan_wire += 1

    # ------------------------------------------------------------------ the sides

    def _transfer(self, xfer: str, r: Request | None) -> Transfer:
        """The transfer `xfer`; `r`: the request a side of it names (None: a probe's report)."""
        req = r.id if r is not None else ""
        t = self.by_id.get(xfer)
        if t is None:
            t = self.by_id[xfer] = Transfer(xfer, req)
            if r is not None:
                r.xfers.append(xfer)
        elif r is not None and not t.req:
            t.req = req
            r.xfers.append(xfer)
        if not t.req:  # an orphan until a side claims it: named just now
            self.orphans.pop(xfer, None)
            self.orphans[xfer] = self.requests.applied
        elif r is not None and self.orphans:
            self.orphans.pop(xfer, None)
        return t

    def _fields(self, node: Node, x: pb.XferSend | pb.XferRecv, payload: str) -> tuple[Pool, np.ndarray]:
        if not x.xfer:
            raise BadEvent(f"{payload}: xfer (the transfer id) is required")
        if x.status not in STATUSES:
            raise BadEvent(f"{payload}: status {x.status!r} is not one of {', '.join(STATUSES)}")
        pool = self.pools.pool(node, x.pool, payload)
        pages = pool.page_array(x, payload)
        if x.checksums and len(x.checksums) != len(pages):
            raise BadEvent(f"{payload}: {len(x.checksums)} checksums for {len(pages)} pages")
        return pool, pages

    def on_send(self, node: Node, x: pb.XferSend) -> None:
        pool, pages = self._fields(node, x, "xfer_send")
        if x.status == "done":
            pages = self.access.pages_read(pool, pages, x.tokens)
        r = self.requests.of_event(x.req, "xfer_send")
        t = self._transfer(x.xfer, r)
        if t.req != r.id:  # the same KV stored again by another request (a content-addressed tier)
            t = self._transfer(f"{x.xfer}<{r.id}", r)
        if r.ended and not (pool.pages.holds[SEND_HOLD, pages] > 0).all():
            self._found.progress(r, f"xfer_send {x.xfer} to {x.peer_node}")
        if x.status == "done":
            # What leaves the node must be the sender's own KV, like what attention reads, or
            # kept for the sender by a hold once its grant ended (an asynchronous sender).
            self.access.read_held(r, pool, pages, x.tokens)
        checksums = np.array(x.checksums, np.uint64)
        t.send = Side(
            node.name, x.pool, pages, x.tokens, x.bytes, checksums, x.status, self._found.seq, x.peer_node
        )
        self.requests.add(r, "sent_pages", len(x.pages))
        self.requests.add(r, "sent_tokens", x.tokens)
        self.requests.add(r, "sent_bytes", x.bytes)
        boot = r.bootstrap
        if x.status == "done" and boot and x.tokens < boot[2]:
            self._mismatch(
                r,
                t,
                "tokens",
                f"sender {node.name} reported transfer {t.xfer} done after sending {x.tokens} of the "
                f"{boot[2]} prompt tokens that decode {boot[1]} expects",
                expected=boot[2],
                observed=x.tokens,
            )
        self._reconcile(r, t)

    def on_recv(self, node: Node, x: pb.XferRecv) -> None:
        pool, pages = self._fields(node, x, "xfer_recv")
        ps = pool.pages.page_size
        need = -(-x.tokens // ps)
        if x.status != "failed" and need > len(pages):
            raise BadEvent(
                f"xfer_recv: {x.tokens} tokens need {need} pages of {ps} but {len(pages)} are listed"
            )
        if x.claimed_checksums and len(x.claimed_checksums) != len(pages):
            raise BadEvent(f"xfer_recv: {len(x.claimed_checksums)} claimed checksums for {len(pages)} pages")
        r = self.requests.of_event(x.req, "xfer_recv")
        t = self._transfer(x.xfer, r)
        if t.req != r.id:
            # KV another request stored, loaded by this one (an external tier: LMCache, an
            # offloading connector, a Mooncake store): a share from the storing request, judged
            # by tenant like a prefix hit; the receipt is this request's own load of it.
            self._loaded_from(r, self.requests.get(t.req), t, pool, pages)
            t = self._transfer(f"{x.xfer}>{r.id}", r)
        if x.status in ("done", "refused") and need:
            slots = pool.pages.slots_read(need, x.tokens)
            self.access.write(r, pool, pages[:need], slots, drain=True, land=x.status == "done")
        checksums = np.array(x.checksums, np.uint64)
        t.recv = Side(
            node.name, x.pool, pages, x.tokens, x.bytes, checksums, x.status, self._found.seq, x.peer_node
        )
        self.requests.add(r, "received_pages", len(x.pages))
        self.requests.add(r, "received_tokens", x.tokens)
        self.requests.add(r, "received_bytes", x.bytes)
        if x.status == "done":
            boot = r.bootstrap
            expected_tokens = boot[2] if boot else 0
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
            claimed = np.array(x.claimed_checksums, np.uint64)
            sender = x.peer_node or "sender"
            claim = Side(
                sender, x.pool, pages, x.claimed_tokens, x.claimed_bytes, claimed, "done", self._found.seq
            )
            self._compare(r, t, claim, t.recv)
        self._reconcile(r, t)

    def _loaded_from(
        self, r: Request, origin: Request | None, t: Transfer, pool: Pool, pages: np.ndarray
    ) -> None:
        if origin is None or not (origin.tenant and r.tenant) or origin.tenant == r.tenant:
            return
        self._found.report(
            "cross_tenant_share",
            f"{r.tenant} request {r.id} loaded KV that {origin.tenant} request {origin.id} stored "
            f"(transfer {t.xfer}) into {len(pages)} page(s) of pool {pool.pool} on {pool.node}",
            req=r,
            victim=origin.idx,
            pool=pool.pool,
            pages=pages,
            key=(t.xfer, "tier"),
        )

    def on_wire(self, node: Node, w: pb.Wire) -> None:
        if not w.xfer:
            raise BadEvent("wire: xfer (the transfer id) is required")
        posted = self._posted_writes(w)
        t = self._transfer(w.xfer, None)
        seen = t.wire.get(w.probe)
        if seen is None:
            seen = t.wire[w.probe] = Seen()
        seen.bytes += w.bytes
        seen.calls += w.calls
        seen.complete |= w.complete
        seen.node = node.name
        if posted is not None:
            t.posted.append(posted)
        r = self.requests.get(t.req) if t.req else None
        if r is not None:
            self._reconcile(r, t)

    # ------------------------------------------------------------------ RDMA writes

    def _posted_writes(self, w: pb.Wire) -> Posted | None:
        """A wire event's RDMA write ranges, checked; None when it has none, or no time to
        judge them by (counted: those pages cannot be judged)."""
        if not w.writes:
            return None
        if len(w.writes) > MAX_RUNS:
            raise BadEvent(f"wire: {len(w.writes)} write ranges (at most {MAX_RUNS})")
        addr = np.fromiter((run.addr for run in w.writes), np.uint64, len(w.writes))
        size = np.fromiter((run.bytes for run in w.writes), np.uint64, len(w.writes))
        if not size.all():
            raise BadEvent(f"wire: write range {int(np.argmin(size))} of transfer {w.xfer} has no bytes")
        if (addr > np.uint64(_U64 - 1) - size).any():
            raise BadEvent(f"wire: a write range of transfer {w.xfer} runs past the end of the address space")
        if w.first_write_ns <= 0:
            self.stats.remote_unjudged += len(w.writes)
            return None
        return Posted(w.probe, addr, addr + size, w.first_write_ns, f"{self._found.node}#{self._found.seq}")

    def _receiver(self, r: Request, t: Transfer) -> str:
        """Who received t, as the receiver, the sender or the bootstrap says (in that order)."""
        receiver = (t.recv.node if t.recv else "") or (t.send.peer if t.send else "")
        boot = r.bootstrap
        return receiver or (boot[1] if boot else "")

    def _route(self, r: Request, t: Transfer) -> None:
        """A transfer's posted writes wait, under its receiver, for the receiver's events."""
        receiver = self._receiver(r, t)
        if receiver:
            self.posted.setdefault(receiver, []).extend((t, p) for p in t.posted)
            t.posted = []

    def judge_posted(self, node: Node) -> None:
        """The RDMA writes posted into this node's memory whose time its events have passed:
        each page they hit whose state has not changed since (by more than the clock skew)
        before the first was posted was in that state when they landed; a page not granted to
        the transfer's request, nor kept for it by a transfer_recv hold, was written by
        someone else's transfer."""
        waiting = []
        for t, posted in self.posted.pop(node.name, ()):
            before = posted.first_ns - self.clock_skew_ns
            if node.last_ts_ns < before:  # its events may not have reached that time yet
                waiting.append((t, posted))
                continue
            r = self.requests.get(t.req)
            if r is None or all(pool.regions is None for pool in node.pools.values()):
                self.stats.remote_unmapped += len(posted.addr)
                continue
            for pool in node.pools.values():
                if pool.regions is None:
                    continue
                pages = pages_written(pool.regions, pool.pages.num_pages, posted.addr, posted.end)
                since = pool.pages.since[pages]
                known = (since > 0) & (since < before)
                self.stats.remote_unjudged += len(pages) - int(np.count_nonzero(known))
                via = (posted.probe, posted.seen_by, t.xfer)
                self.access.write(r, pool, pages[known], None, drain=True, land=False, via=via)
        if waiting:
            self.posted[node.name] = waiting

    # ------------------------------------------------------------------ verdicts

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
        self._found.report(
            "transfer_mismatch",
            message,
            req=r,
            pool=pool.pool if pool else None,
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
                    pool=self.pools.nodes[recv.node].pools[recv.pool],
                    pages=recv.pages[differ[differ < len(recv.pages)]],
                )

    def _reconcile(self, r: Request, t: Transfer) -> None:
        """Compare what each side reported of transfer t, as soon as two sides have spoken."""
        if t.posted:
            self._route(r, t)
        send, recv = t.send, t.recv
        if send and recv and send.done and recv.done:
            self._compare(r, t, send, recv)
        # Bytes beyond the claim are wrong at once, and so is a shortfall once a probe saw the
        # transfer end. Otherwise a shortfall is only suspected: the rest of the probe's report
        # may still be on its way. It waits (verdicts.py), at the latest until the request's
        # next attention, release, free or finish after receipt, i.e. before its KV is used.
        if not (t.wire and send and send.done):
            return
        waiting = False
        for probe, seen in t.wire.items():
            if seen.judged:  # settled short already
                continue
            if seen.bytes < send.bytes and not seen.complete:
                waiting = True
            elif seen.bytes != send.bytes:
                self.verdicts.report(r, t, probe)
        if waiting:
            involved = {send.node, self._receiver(r, t), *(seen.node for seen in t.wire.values())}
            self.verdicts.wait(r, t, tuple(sorted(involved - {""})))
        else:
            self.verdicts.drop(r, t)


def pages_written(regions: np.ndarray, num_pages: int, addr: np.ndarray, end: np.ndarray) -> np.ndarray:
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
