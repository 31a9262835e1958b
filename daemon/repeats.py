"""One alert per thing that happened (`Repeats`): a request that keeps doing what a rule found
(a rejected request that goes on making events, a read repeated every step) raises one alert,
its first finding; the findings that repeat it (same request, node, kind, rule and victim
tenant: another tenant's data read is another thing that happened) are stored
like any other, marked `details.repeat` (their ordinal), and not sent. When the run ends, one
alert of the daemon's own says how many repeats there were and when the first and the last
happened, and the victim requests it saw: an update of the first (`details.update_of`,
`repeats`, `first_ns`, `last_ns`, `victim_reqs`).
Repeats is the only writer of the runs.

Invariants: a run opens with a finding that names a request and no open run of its key; it ends
when its request ends (a kill, an abort, a finish where it answers its client; on a prefill
node, its finish there), when no finding repeated it for
QUIET_S, at the daemon's stop, or when MAX_RUNS are open (the oldest); a run with repeats is
said exactly once, after its first finding's cursor is known; a finding after a run ended opens
a new one (a new alert). The audit log keeps every finding either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from kvguard.ledger import Finding

QUIET_S = 60.0  # a run no finding repeated for this long is over
MAX_RUNS = 1 << 16
MAX_VICTIMS = 16  # victim requests an update names (the audit log has them all)

Key = tuple[str, str, str, str, str]  # request, node, finding kind, rule, victim tenant


@dataclass(slots=True)
class Run:
    first: Finding
    cursor: Future[int]  # the first finding's group's first record id, once durable
    row: int  # the first finding's place in its group
    last_seen: float  # monotonic: when the daemon judged the last finding of the run
    repeats: int = 0
    last_ns: int = 0  # the node's time of the last repeat
    victims: dict[str, None] = field(default_factory=dict)  # the victim requests named, in order


def key_of(finding: Finding) -> Key:
    return (finding.req, finding.node, finding.finding, finding.rule, finding.victim_tenant)


class Repeats:
    def __init__(
        self, say: Callable[[Finding], object], later: Callable[[float, Callable[[], None]], object]
    ):
        self._say = say  # an alert of the daemon's own (Ingest.alert)
        self._later = later  # loop.call_later: the quiet check runs with no event to trigger it
        self._runs: dict[Key, Run] = {}  # the open ones, in the order they opened
        self._of_req: dict[str, dict[Key, None]] = {}  # the open runs of each request, in order
        self._ended: list[Run] = []  # ended, said once their first cursor is known
        self._armed = False

    def __len__(self) -> int:
        """The open runs (those a request's end may end)."""
        return len(self._runs)

    def judged(self, finding: Finding, cursor: Future[int], row: int) -> int:
        """A finding about to be stored (at `row` of the group whose first id `cursor` will
        be): 0 when it is to be alerted (the first of its run, or one that names no request),
        else its ordinal in its run (1 for the first repeat), for its record to carry."""
        if not finding.req:
            return 0
        key = key_of(finding)
        run = self._runs.get(key)
        now = time.monotonic()
        if run is None:
            if len(self._runs) >= MAX_RUNS:
                self._end(next(iter(self._runs)))
            run = self._runs[key] = Run(finding, cursor, row, now)
            self._of_req.setdefault(finding.req, {})[key] = None
            if finding.victim_req:
                run.victims[finding.victim_req] = None
            if not self._armed:
                self._arm(QUIET_S)
            return 0
        run.repeats += 1
        run.last_seen, run.last_ns = now, finding.ts_ns
        if finding.victim_req and len(run.victims) < MAX_VICTIMS:
            run.victims[finding.victim_req] = None
        return run.repeats

    def request_ended(self, req: str, node: str | None = None) -> None:
        """Request `req` ended: its runs on `node` end (its prefill node handed it on), or on
        every node (None: it finished where it answers its client, was killed or aborted)."""
        for key in [k for k in self._of_req.get(req, ()) if node is None or k[1] == node]:
            self._end(key)

    def due(self, *, stopping: bool = False) -> None:
        """Say the ended runs whose first cursor is known (all runs end when `stopping`). On
        the daemon's loop, after each step of applying and each commit: the work is the ended
        runs' only; the quiet ones are ended by their timer."""
        if stopping:
            for key in list(self._runs):
                self._end(key)
        if not self._ended:
            return
        waiting = []
        for run in self._ended:
            if run.repeats and not run.cursor.done():
                waiting.append(run)
            elif run.repeats:
                self._say(self._update(run))
        self._ended = waiting

    def _end(self, key: Key) -> None:
        """Run `key` ends: no finding joins it any more (the next one opens a new run)."""
        run = self._runs.pop(key)
        keys = self._of_req[key[0]]
        del keys[key]
        if not keys:
            del self._of_req[key[0]]
        self._ended.append(run)

    def _arm(self, after: float) -> None:
        self._armed = True
        self._later(after, self._quiet_check)

    def _quiet_check(self) -> None:
        """End the runs no finding joined for QUIET_S, say what is due, and come back for the
        next to fall quiet."""
        self._armed = False
        now = time.monotonic()
        for key in [k for k, run in self._runs.items() if now - run.last_seen >= QUIET_S]:
            self._end(key)
        self.due()
        if self._runs:
            first = min(run.last_seen for run in self._runs.values())
            self._arm(max(0.1, first + QUIET_S - now))

    @staticmethod
    def _update(run: Run) -> Finding:
        f = run.first
        cursor = run.cursor.result() + run.row
        seconds = (run.last_ns - f.ts_ns) / 1e9 if run.last_ns > f.ts_ns else 0.0
        words = (
            f"request {f.req} raised {f.finding} ({f.rule}, cursor {cursor}) {run.repeats} more "
            f"time(s) on {f.node} within {seconds:.1f} s after it; each is in the audit log"
        )
        details = {
            **{k: v for k, v in f.details.items() if k != "outcome"},
            "update_of": str(cursor),
            "repeats": str(run.repeats),
            "first_ns": str(f.ts_ns),
            "last_ns": str(run.last_ns),
        }
        if run.victims:
            details["victim_reqs"] = ",".join(run.victims)
        return replace(
            f,
            victim_req="",  # a run may name several: details victim_reqs
            ts_ns=run.last_ns or f.ts_ns,
            message=words,
            details=details,
            tags=(*f.tags, "repeats"),
        )
