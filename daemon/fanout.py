"""Alerts to their subscribers (`Fanout`): each alert stream's bounded live queue, filled as
commits are reported and drained by its stream, both on the daemon's loop.

Invariants: an alert is queued only once its record is durable (the cursor names it); a
subscriber whose queue overflows takes no more live alerts and catches up from the store,
which holds everything published, so none is lost or repeated; the daemon knows how many
streams have alerts to write (it takes smaller steps while they do).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvguard.ledger.findings import Finding
from kvguard.proto.filter import Filter

SUBSCRIBER_QUEUE = 100_000  # alerts waiting for one slow subscriber before it reads from the store


@dataclass
class Subscriber:
    """One alert stream's live feed. When it overflows, later alerts are not queued: the
    stream catches up from the store instead."""

    filter: Filter
    # (record id, finding, when the daemon received the batch that raised it)
    live: asyncio.Queue[tuple[int, Finding, float]] = field(
        default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE)
    )
    overflowed: bool = False
    dropped: int = 0
    delivering: bool = False  # live alerts queued or being written

    def push(self, record_id: int, finding: Finding, received: float) -> bool:
        """Queue a live alert; True if the stream had nothing to deliver until now."""
        if self.overflowed:
            self.dropped += 1
            return False
        try:
            self.live.put_nowait((record_id, finding, received))
        except asyncio.QueueFull:
            self.overflowed = True
            self.dropped += 1
            return False
        started, self.delivering = not self.delivering, True
        return started


class Fanout:
    """The alert streams, and how many of them have alerts to write (`delivering`)."""

    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []
        self.delivering = 0

    def publish(self, record_id: int, finding: Finding, received: float) -> None:
        for sub in list(self.subscribers):
            if sub.filter.matches(finding) and sub.push(record_id, finding, received):
                self.delivering += 1

    def delivered(self, sub: Subscriber) -> None:
        """A subscriber's stream has written all its live alerts, or ended."""
        if sub.delivering:
            sub.delivering = False
            self.delivering -= 1
