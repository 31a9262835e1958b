"""Verdicts on transfers that wait (`Verdicts`), and when each is settled (docs/integrator.md: "Nothing
is left pending silently").

A transfer's verdict waits while the sender has reported it done and a wire probe's count is
short of the claim without the probe having seen the transfer end: the rest of the probe's
report may still be on its way. It is settled, the probes still short reported as
transfer_mismatch (details: what=wire_bytes, settled=why), at the earliest of:
- the request's next read, free, release or finish once the receiver has reported the
  transfer (`pending`, by request). The sender's own free or release before that settles
  nothing: its probe's report may trail the sender's events (the transfer_mismatch-near-miss
  fixture);
- the clock-skew allowance passing by the events' own time: an event of a node involved (the
  sender's, the receiver's, a reporting probe's) stamped later than the verdict's deadline,
  the time of the last word about the transfer plus clock_skew_ns. Events of other nodes
  settle nothing;
- the end of a capture, or the end of a node's incarnation for the verdicts it is involved in
  (Transfers.settle_all).

Invariants:
- every verdict that waits is in `waits` (by transfer id) and under each node involved in
  `due`: a heap of (deadline, xfer) per node, so an event looks at the head of its own node's
  heap only (O(1) when nothing is due). An entry of a verdict settled or re-armed since is
  stale and dropped when it comes up; `due` holds a node only while its heap is non-empty;
- a probe's shortfall is settled once (Seen.judged): a later report of that probe about the
  transfer changes nothing, and no verdict is given twice;
- what is reported depends only on the events and their order, never on how they were
  applied (one by one, or in C runs: Ledger._clean stops a run before the event that makes a
  verdict due, `due_by`) nor on a snapshot (the heaps are rebuilt from `waits`).

Cost: `pending` (which makes C runs leave frees and reads to Python) is as before, non-empty
only between a receipt and the settling. A node's heap is non-empty from a short report of a
transfer it is involved in until its clock passes the last deadline (about clock_skew_ns of
its events): meanwhile its C runs stop once per deadline passed, and its single events
(apply_serialized) take the Python path. Stale entries of a node that stops speaking stay
until it speaks again or its incarnation ends.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvguard.ledger.findings import Finding, Findings
from kvguard.ledger.pools import Pools
from kvguard.ledger.requests import Request, Requests

if TYPE_CHECKING:
    from kvguard.ledger.transfers import Transfer


@dataclass(slots=True)
class Wait:
    """A verdict that waits on transfer `t`: settled by the clock once an event of one of
    `nodes` is stamped after `deadline`."""

    t: Transfer
    deadline: int
    nodes: tuple[str, ...]


class Verdicts:
    def __init__(self, pools: Pools, requests: Requests, findings: Findings, clock_skew_ns: int) -> None:
        self.waits: dict[str, Wait] = {}  # transfer id -> its verdict that waits, oldest first
        self.pending: dict[int, Transfer] = {}  # request -> a waiting transfer its receiver reported
        self.due: dict[str, list[tuple[int, str]]] = {}  # node -> heap of (deadline, xfer)
        self.clock_skew_ns = clock_skew_ns
        self.pools = pools
        self.requests = requests
        self._found = findings

    def wait(self, r: Request, t: Transfer, nodes: tuple[str, ...]) -> None:
        """t's verdict waits (again): the event being applied is the latest word about it."""
        deadline = self._found.ts + self.clock_skew_ns
        w = self.waits.get(t.xfer)
        if w is None:
            w = self.waits[t.xfer] = Wait(t, deadline, nodes)
        elif deadline > w.deadline or nodes != w.nodes:
            w.deadline, w.nodes = max(deadline, w.deadline), nodes
        else:
            deadline = 0  # nothing changed: its heap entries stand
        if deadline:
            for node in nodes:
                heapq.heappush(self.due.setdefault(node, []), (w.deadline, t.xfer))
        if t.recv is not None:
            self.pending[r.idx] = t

    def drop(self, r: Request, t: Transfer) -> None:
        """t's verdict no longer waits (the probes' counts add up, or were judged)."""
        self.waits.pop(t.xfer, None)
        if self.pending.get(r.idx) is t:
            del self.pending[r.idx]

    def restore(self, waits: list[tuple[Transfer, int, tuple[str, ...]]]) -> None:
        """The verdicts that waited (a snapshot's, in order); their heaps rebuilt."""
        self.waits.clear()
        self.due.clear()
        for t, deadline, nodes in waits:
            self.waits[t.xfer] = Wait(t, deadline, nodes)
            for node in nodes:
                heapq.heappush(self.due.setdefault(node, []), (deadline, t.xfer))

    # ------------------------------------------------------------------ settling

    def settle(self, r: Request, why: str) -> None:
        """r reads, frees, releases or finishes (`why`): its transfer's verdict is due if the
        receiver has reported it."""
        t = self.pending.pop(r.idx, None)
        if t is not None:
            self.close(r, t, f"the request {why}")

    def settle_due(self, name: str, now: int) -> None:
        """An event of node `name` stamped `now` was applied: the verdicts it is involved in
        whose deadline that passes."""
        heap = self.due[name]
        while heap and heap[0][0] < now:
            deadline, xfer = heapq.heappop(heap)
            w = self.waits.get(xfer)
            if w is None or w.deadline != deadline or name not in w.nodes:
                continue  # settled or re-armed since
            r = self.requests.get(w.t.req)
            if r is None:  # cannot be: a request a verdict waits on is kept (Transfers.holds)
                del self.waits[xfer]
            else:
                skew = f"{self.clock_skew_ns / 1e6:g} ms"
                self.close(r, w.t, f"no word for {skew} by the nodes' clocks ({name}'s clock at {now} ns)")
        if not heap:
            del self.due[name]

    def due_by(self, name: str, heads: np.ndarray | None, start: int, stop: int) -> int:
        """Where a run of node `name`'s events [start, stop) (their heads; None: one event not
        read yet) must stop for Python, so that the event that makes a verdict due is applied
        there: its first event stamped after the earliest deadline in its heap."""
        heap = self.due.get(name)
        if not heap:
            return stop
        if heads is None:
            return start
        late = np.flatnonzero(heads["ts"][start:stop] > heap[0][0])
        return start + int(late[0]) if len(late) else stop

    def settle_all(
        self,
        transfers: dict[str, Transfer],
        receiver_of: Callable[[Request, Transfer], str],
        node: str | None,
        why: str,
        unconfirmed: bool = True,
    ) -> list[Finding]:
        """Settle every verdict that waits (node None: the end of a capture) or those `node`
        is involved in (its incarnation ended: call it while applying the event that says so,
        which stamps the findings; `why` says what happened). Of `transfers`, a send reported
        done that its receiver (receiver_of), a node that reported events, never confirmed is
        reported too (with `node`: those to `node`), or, not `unconfirmed`, closed unreported
        (the receiver restarted: what was sent to it is gone with its memory). Returns the
        findings; with node None each is stamped with the node it concerns (the sender for a
        probe's count, the receiver for a missing receipt) at its last time, with no sequence
        number: no event raised it."""
        found: list[Finding] = []
        if node is None:
            self._found.at("", 0, 0)  # the last event's findings were returned with it

        def at(name: str) -> None:
            if node is None:  # no event is being applied
                found.extend(self._found.found)
                known = self.pools.nodes.get(name)
                self._found.at(name, 0, known.last_ts_ns if known is not None else 0)

        for w in list(self.waits.values()):
            r = self.requests.get(w.t.req)
            if r is not None and w.t.send is not None and (node is None or node in w.nodes):
                at(w.t.send.node)
                self.close(r, w.t, why)
        if node is None:  # nothing waits any more: every heap entry left is stale
            self.due.clear()
        else:
            self.due.pop(node, None)
        for t in transfers.values():
            send = t.send
            if send is None or not send.done or t.recv is not None or t.closed:
                continue
            r = self.requests.get(t.req)
            receiver = receiver_of(r, t) if r is not None else ""
            if r is not None and receiver in self.pools.nodes and node in (None, receiver):
                if not unconfirmed:
                    t.closed = True
                    continue
                at(receiver)
                self.unconfirmed(r, t, receiver, why)
        if node is not None:
            return list(self._found.found)
        found.extend(self._found.found)
        self._found.found = []
        return found

    def close(self, r: Request, t: Transfer, why: str) -> None:
        """Settle t's verdict now (`why`): each probe still short of the claim is reported."""
        self.drop(r, t)
        send = t.send
        if send is None:
            return
        for name, seen in t.wire.items():
            if not seen.judged and seen.bytes < send.bytes and not seen.complete:
                seen.judged = True
                self.report(r, t, name, why)

    def report(self, r: Request, t: Transfer, probe: str, why: str = "") -> None:
        """Probe `probe`'s count of t against the sender's claim (they differ)."""
        send, seen = t.send, t.wire[probe]
        assert send is not None
        details: dict[str, Any] = {
            "xfer": t.xfer,
            "what": "wire_bytes",
            "expected": send.bytes,
            "observed": seen.bytes,
            "probe": probe,
        }
        message = (
            f"transfer {t.xfer} of {r.id}: sender reported {send.bytes} bytes, the wire probe "
            f"({probe or 'probe'}) saw {seen.bytes} in {seen.calls} call(s)"
        )
        if why:
            details["settled"] = why
            message += f"; settled as short now: {why}"
        key = (t.xfer, "wire_bytes", probe)
        self._found.report("transfer_mismatch", message, req=r, details=details, key=key)

    def unconfirmed(self, r: Request, t: Transfer, receiver: str, why: str) -> None:
        """The sender reported t done; its receiver, a node that reports, never confirmed it."""
        send = t.send
        assert send is not None
        t.closed = True
        self._found.report(
            "transfer_mismatch",
            f"transfer {t.xfer} of {r.id}: sender {send.node} reported {send.tokens} tokens "
            f"({send.bytes} bytes) sent to {receiver}, which never reported receiving them ({why})",
            req=r,
            details={
                "xfer": t.xfer,
                "what": "unconfirmed",
                "expected": send.tokens,
                "observed": 0,
                "receiver": receiver,
                "settled": why,
            },
            key=(t.xfer, "unconfirmed"),
        )
