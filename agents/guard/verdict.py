"""What a guard call tells the engine (`Verdict`), and the clock its events are stamped with.

Invariant: a verdict kills, quarantines or denies only what an enforced finding asked for;
CLEAN (no finding) is shared and never changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvguard.ledger.findings import SEVERITIES, Finding


class WallClock:
    """Event timestamps: wall-clock nanoseconds (comparable across nodes, as the daemon's
    judgment of RDMA writes one node saw posted into another's pages needs), never less than
    the last one given (a clock stepped back does not reorder this node's events)."""

    def __init__(self) -> None:
        self._last = 0

    def __call__(self) -> int:
        self._last = max(self._last, time.time_ns())  # called under the guard's lock
        return self._last


@dataclass(slots=True)
class Verdict:
    """What the engine must do after a guard call: terminate the requests in `kill` (each
    with the finding that condemned it, or None for a call the guard could not check), keep
    the pages in `quarantine` out of circulation, and refuse the prefix share when `deny`.
    Each is set only by findings whose rule is enforced (the guard's mode, or the rule's)."""

    findings: list[Finding] = field(default_factory=list)
    kill: dict[str, Finding | None] = field(default_factory=dict)
    quarantine: set[int] = field(default_factory=set)
    deny: bool = False

    @property
    def ok(self) -> bool:
        return not self.kill

    def reason(self, req: str) -> str:
        finding = self.kill.get(req)
        if finding is None:
            return "kvguard could not verify this request"
        return f"{finding.finding} ({finding.rule}): {finding.message}"


CLEAN = Verdict()
RANK = {severity: i for i, severity in enumerate(SEVERITIES)}


def merged(verdict: Verdict, other: Verdict) -> Verdict:
    """Both verdicts as one (the first's reason for a request it already kills is kept); the
    first is extended in place unless it is CLEAN, which is never changed."""
    if other is CLEAN:
        return verdict
    if verdict is CLEAN:
        return other
    verdict.findings += other.findings
    for req, finding in other.kill.items():
        verdict.kill.setdefault(req, finding)
    verdict.quarantine |= other.quarantine
    verdict.deny |= other.deny
    return verdict
