"""Events applied to a ledger at a test's own clock: the scenarios of the ledger's timed tests."""

from __future__ import annotations

from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto.builder import EventLog

MS = 1_000_000


class Clocked:
    """A ledger fed events stamped with `now` (ns), which a test moves; `found` keeps every
    finding in order."""

    def __init__(self, now: int, ledger: Ledger | None = None) -> None:
        self.now = now
        self.log = EventLog(clock=lambda: self.now)
        self.ledger = ledger or Ledger()
        self.found: list[Finding] = []

    def add(self, node: str, payload: str, at_ms: float | None = None, **fields: object) -> list[Finding]:
        """Apply one event of `node` (at `at_ms` ms when given); its findings."""
        if at_ms is not None:
            self.now = int(at_ms * MS)
        found = list(self.ledger.apply(self.log.add(node, payload, **fields)))
        self.found += found
        return found
