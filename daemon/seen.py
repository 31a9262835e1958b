"""The events each node's stream delivered lately, by digest (`Seen`): a repeat is told from a
tampered copy.

Invariants: for each node, the digest (proto/wire.py digest(): SipHash of the event's bytes,
keyed per process) of each of its last WINDOW applied events, by (epoch, seq); an event whose
(node, epoch, seq) was applied and whose bytes digest differently is a tampered copy; one older
than the window cannot be told apart (counted as such). Filled as events are applied, and at
start from the store's events that are replayed.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from kvguard.proto import wire

WINDOW = 1 << 14  # events a node: more than an agent resends after a reconnect (its batches in flight)
_RING = np.dtype([("epoch", "<u8"), ("seq", "<u8"), ("digest", "<i8")])

Verdict = Literal["same", "differs", "unknown"]


class Seen:
    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._rings: dict[str, np.ndarray] = {}

    def record(self, node: str, events: wire.Batch, start: int, stop: int) -> None:
        """Events [start, stop) of `node`'s batch were applied."""
        if start >= stop:
            return
        ring = self._rings.get(node)
        if ring is None:
            ring = self._rings[node] = np.zeros(self.window, _RING)
        heads = events.heads[start:stop]
        epochs, seqs = heads["epoch"], heads["seq"]
        unusual = np.flatnonzero(heads["kind"] == 0)  # their envelopes were not read in C
        if len(unusual):
            epochs, seqs = epochs.copy(), seqs.copy()
            for j in unusual.tolist():
                epochs[j], seqs[j] = events.position(start + j)
        slots = seqs % self.window
        ring["epoch"][slots] = epochs
        ring["seq"][slots] = seqs
        ring["digest"][slots] = events.digests(start, stop)

    def verdict(self, node: str, epoch: int, seq: int, body: bytes) -> Verdict:
        """Whether a repeat of (node, epoch, seq) carries the bytes that were applied."""
        ring = self._rings.get(node)
        if ring is None:
            return "unknown"
        slot = ring[seq % self.window]
        if int(slot["seq"]) != seq or int(slot["epoch"]) != epoch:
            return "unknown"
        return "same" if int(slot["digest"]) == wire.digest(body) else "differs"
