"""The gaps in a node's stream of sequence numbers (`Gaps`): which numbers below the highest
applied were never applied, so that de-duplication is exact.

Invariants:
- a node's `last_seq` is the highest number applied in its epoch; every number below it is
  either applied or in one of the node's gaps (inclusive ranges, sorted, disjoint, at most
  MAX_GAPS of them);
- an event whose number is at most `last_seq` and in no gap is a repeat; one in a gap fills
  it (applied late); one above `last_seq` opens the gap between, once it is applied;
- the durable prefix a node's agent is told (`durable`) ends before the first gap: a number
  far ahead of the rest (a corrupt event, an impostor) cannot make the events before it look
  stored;
- past MAX_GAPS, the lowest gap is given up (its numbers are then repeats) and counted.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

MAX_GAPS = 1024  # gaps kept a node: each is an engine's burst of dropped events, or a fault


class Gaps:
    __slots__ = ("his", "los")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self.los: list[int] = []
        self.his: list[int] = []
        for lo, hi in ranges:
            self.los.append(lo)
            self.his.append(hi)

    def __bool__(self) -> bool:
        return bool(self.los)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.los, self.his, strict=True))

    def holds(self, seq: int) -> bool:
        """Whether `seq` was never applied (it lies in a gap)."""
        i = bisect_right(self.los, seq) - 1
        return i >= 0 and seq <= self.his[i]

    def open(self, lo: int, hi: int) -> int:
        """A gap [lo, hi] above every other (the node's numbers jumped past it); how many
        numbers were given up to keep the gaps at MAX_GAPS."""
        self.los.append(lo)
        self.his.append(hi)
        if len(self.los) <= MAX_GAPS:
            return 0
        return self.his.pop(0) - self.los.pop(0) + 1

    def fill(self, seq: int) -> None:
        """`seq`, in a gap, is applied: the gap shrinks (or splits in two)."""
        i = bisect_right(self.los, seq) - 1
        lo, hi = self.los[i], self.his[i]
        if lo == hi:
            del self.los[i], self.his[i]
        elif seq == lo:
            self.los[i] = seq + 1
        elif seq == hi:
            self.his[i] = seq - 1
        else:
            self.his[i] = seq - 1
            self.los.insert(i + 1, seq + 1)
            self.his.insert(i + 1, hi)
            if len(self.los) > MAX_GAPS:
                del self.los[0], self.his[0]

    def durable(self, last_seq: int) -> int:
        """The highest number up to which every number was applied."""
        return self.los[0] - 1 if self.los else last_seq

    def clear(self) -> None:
        self.los.clear()
        self.his.clear()
