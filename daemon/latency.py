"""The daemon's own latency, by stage: how long it took from receiving a batch to each step of
its way (a verdict, a durable alert, the alert written to a subscriber, an ack), kept as
log-spaced histograms so that the operator (FleetService.State, the dashboard) sees
p50/p99/max without running a benchmark.

Invariant: recording is O(log buckets) with no allocation, on the daemon's loop only; a
quantile is the upper bound of the bucket that holds it (4 buckets an octave: within 19 %),
never more than the exact maximum.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

PER_OCTAVE = 4
SMALLEST_S = 1e-6
BOUNDS_S = [SMALLEST_S * 2 ** (k / PER_OCTAVE) for k in range(28 * PER_OCTAVE)]  # 1 µs .. ~2 min


@dataclass(frozen=True)
class Summary:
    stage: str
    count: int
    p50_s: float
    p99_s: float
    max_s: float


class Histogram:
    """Durations of one stage; counts per bucket, the last bucket for anything longer."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_S) + 1)
        self.count = 0
        self.sum_s = 0.0  # for the Prometheus histogram's _sum
        self.max_s = 0.0

    def record(self, seconds: float) -> None:
        self.counts[bisect_left(BOUNDS_S, seconds)] += 1
        self.count += 1
        self.sum_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def quantile(self, q: float) -> float:
        """The q-quantile, as its bucket's upper bound (at most the maximum); 0 when empty."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for bucket, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                bound = BOUNDS_S[bucket] if bucket < len(BOUNDS_S) else math.inf
                return min(bound, self.max_s)
        return self.max_s


class Latencies:
    """One histogram per stage, in the order the stages were first recorded."""

    def __init__(self) -> None:
        self.stages: dict[str, Histogram] = {}

    def record(self, stage: str, seconds: float) -> None:
        histogram = self.stages.get(stage)
        if histogram is None:
            histogram = self.stages[stage] = Histogram()
        histogram.record(seconds)

    def summaries(self) -> list[Summary]:
        """Each stage's count, p50, p99 and max (read from another thread: a histogram may be
        one record ahead of its count, which a quantile tolerates)."""
        return [
            Summary(stage, h.count, h.quantile(0.5), h.quantile(0.99), h.max_s)
            for stage, h in list(self.stages.items())
        ]
