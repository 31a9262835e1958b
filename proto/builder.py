"""Builds kvguard.v1 events with correct envelopes: per-node sequence numbers from 1 without
gaps, and increasing timestamps. Used by tests, benchmarks, fixtures and engine adapters.

Invariant: every event it returns carries the next sequence number of its node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvguard.proto import pb
from kvguard.proto.capture import event_to_json


class EventLog:
    """An ordered log of events from several nodes (and comment lines, for captures)."""

    def __init__(self, clock: Callable[[], int] | None = None, step_ns: int = 1000) -> None:
        self._seq: dict[str, int] = {}
        self._epoch: dict[str, int] = {}
        self._ts = 0
        self._step = step_ns
        self._clock = clock
        self.lines: list[pb.Event | str] = []

    def add(self, node: str, payload: str, **fields: Any) -> pb.Event:
        """Append one event: add("d0", "alloc", req="r1", pool=0, pages=[1, 2])."""
        seq = self._seq[node] = self._seq.get(node, 0) + 1
        if self._clock is not None:
            ts = self._clock()
        else:
            self._ts += self._step
            ts = self._ts
        event = pb.Event(node=node, seq=seq, ts_ns=ts, epoch=self._epoch.get(node, 0), **{payload: fields})
        self.lines.append(event)
        return event

    def restart(self, node: str, epoch: int) -> None:
        """The node's engine restarts: its next events are of `epoch`, numbered from 1 again."""
        self._epoch[node] = epoch
        self._seq[node] = 0

    def comment(self, text: str) -> None:
        self.lines.extend(f"# {line}".rstrip() for line in text.splitlines())

    @property
    def events(self) -> list[pb.Event]:
        return [line for line in self.lines if isinstance(line, pb.Event)]

    def to_jsonl(self) -> str:
        return "".join((line if isinstance(line, str) else event_to_json(line)) + "\n" for line in self.lines)
