"""What became of the requests the daemon's findings ordered stopped (`Outcomes`): a finding
whose action ends its request says only what was ordered; how the request then ended is
learned from its node's events and said as an alert of its own, an update of that finding's
(its `details.outcome`; `details.update_of`, the finding's cursor). Outcomes is the only writer
of the watches.

Invariants: a finding whose action ends its request (KILL_ACTIONS) opens one watch on the
request, unless one is open; the watch is decided once, by the first of the request's events:
a kill on any node (outcome `stopped` when the guard of the finding's node killed it, before
the read; else `killed`), a finish on a node that answers its client (`reached_client`: its
response had left before any kill reached it; a prefill node's finish hands it on), an abort
(`aborted`); a kill its guard records as `late` decides nothing (the finish came first). Two
nodes' streams are not ordered, and a kill on one node makes its engine abort the request on
another (a prefill stopped, the router aborts its decode): an abort is held ABORT_HOLD_S before
it is said, and a kill stamped no later than it, heard meanwhile, decides the watch instead. A
finding of a request whose fate is known when it is judged (it had finished, or a watch on it
was said) opens no watch: it carries that outcome itself. A decided watch
is said once its finding's cursor is known (its group durable); at most MAX_WATCHES are open
(the oldest then said `unknown`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from kvguard.ledger import Finding
from kvguard.ledger.findings import KILL_ACTIONS
from kvguard.proto import pb

MAX_WATCHES = 1 << 16
ABORT_HOLD_S = 1.0  # how long an abort waits for a kill that came before it on another node
SINCE_READ = "what it generated before the kill may have reached the client"
WORDS = {
    "stopped": "was stopped by its guard at its check, before its attention read the pages: nothing "
    "computed from them left the node",
    "killed": f"was killed on the daemon's (or an operator's) order before it finished: {SINCE_READ}",
    "reached_client": "finished before any kill reached it: its response, computed from the pages, "
    "reached the client",
    "aborted": f"was aborted by its engine before any kill reached it: {SINCE_READ}",
    "unknown": "was not heard of again: whether it was stopped is not known",
}
OUTCOMES = tuple(WORDS)


@dataclass(slots=True)
class Watch:
    finding: Finding
    judged_ns: int  # when the daemon judged the finding (its wall clock)
    cursor: Future[int]  # the finding's group's first record id, once durable
    row: int  # the finding's place in its group
    outcome: str = ""  # decided; "" while the request runs
    learned_ns: int = 0  # when the daemon learned the outcome (its wall clock)
    ended_ns: int = 0  # the node's time of the event that decided it
    held_until: float = 0.0  # an abort: said from then (monotonic), unless a kill comes first


class Outcomes:
    def __init__(
        self,
        say: Callable[[Finding], object],
        responds: Callable[[str], bool],
        later: Callable[[float, Callable[[], None]], object],
    ) -> None:
        self._say = say  # an alert of the daemon's own (Ingest.alert)
        self._responds = responds  # whether a node answers its requests' clients (not prefill)
        self._later = later  # run a call after a delay, on the daemon's loop (loop.call_later)
        self._watches: dict[str, Watch] = {}  # by request, in the order they were opened
        self._said: OrderedDict[str, str] = OrderedDict()  # request -> its outcome, once said

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, finding: Finding, judged_ns: int, cursor: Future[int], row: int, finished: bool) -> str:
        """A finding (judged at `judged_ns`, at `row` of the group whose first id `cursor`
        will be) ordered its request ended: follow it until it is known how it ended. The
        outcome if it is known already (`finished`: it had; or a watch on it was said), for the
        finding to carry; "" when it is watched, or needs no watch."""
        if finding.action not in KILL_ACTIONS or not finding.req:
            return ""
        key = finding.req
        if finished:
            return "reached_client"
        if key in self._said:
            return self._said[key]
        if key in self._watches:
            return ""
        if len(self._watches) >= MAX_WATCHES:
            oldest = next(iter(self._watches.values()))
            if not oldest.outcome:
                self._decided(oldest, "unknown", 0)
        self._watches[key] = Watch(finding, judged_ns, cursor, row)
        return ""

    def saw(self, node: str, event: pb.Event) -> None:
        """An applied event of `node`: a kill, finish or abort of a watched request decides it."""
        kind = event.WhichOneof("payload")
        if kind not in ("kill", "finish", "abort"):
            return
        payload = getattr(event, kind)
        w = self._watches.get(payload.req)
        if w is None:
            return
        if w.outcome:
            # An abort held for a kill stamped before it: that kill caused it.
            if kind == "kill" and not payload.late and w.held_until and event.ts_ns <= w.ended_ns:
                w.held_until = 0.0
                self._killed(w, node, payload.by, event.ts_ns)
            return
        if kind == "kill":
            if payload.late:  # the finish came first: that decided it
                return
            self._killed(w, node, payload.by, event.ts_ns)
        elif kind == "abort":
            self._decided(w, "aborted", event.ts_ns)
            w.held_until = time.monotonic() + ABORT_HOLD_S
            self._later(ABORT_HOLD_S, self.due)
        elif self._responds(node):
            self._decided(w, "reached_client", event.ts_ns)

    def due(self) -> None:
        """Say the decided watches whose finding's cursor is known (on the daemon's loop, after
        each step of applying and each commit)."""
        if self._watches:
            now = time.monotonic()
            due = [
                k for k, w in self._watches.items() if w.outcome and w.cursor.done() and w.held_until <= now
            ]
            for key in due:
                w = self._watches.pop(key)
                self._said[key] = w.outcome
                if len(self._said) > MAX_WATCHES:
                    self._said.popitem(last=False)
                self._say(self._update(w))

    def _killed(self, w: Watch, node: str, by: str, ended_ns: int) -> None:
        stopped = node == w.finding.node and by == f"guard@{node}"
        self._decided(w, "stopped" if stopped else "killed", ended_ns)

    def _decided(self, w: Watch, outcome: str, ended_ns: int) -> None:
        w.outcome, w.learned_ns, w.ended_ns = outcome, time.time_ns(), ended_ns

    def _update(self, w: Watch) -> Finding:
        f = w.finding
        cursor = w.cursor.result() + w.row
        late = (w.judged_ns - f.ts_ns) / 1e9 if f.ts_ns and w.judged_ns > f.ts_ns else 0.0
        words = f"request {f.req} ({f.finding}, cursor {cursor}) {WORDS[w.outcome]}"
        if w.outcome == "reached_client":
            words += f"; kvguard judged it {late:.1f} s after its event"
        details = {
            **f.details,
            "outcome": w.outcome,
            "update_of": str(cursor),
            "judged_ns": str(w.judged_ns),
            "learned_ns": str(w.learned_ns),
        }
        return replace(
            f, ts_ns=w.ended_ns or f.ts_ns, message=words, details=details, tags=(*f.tags, "outcome")
        )
