"""The daemon's latency histograms: quantiles within a bucket of the exact ones, never above
the maximum, and sound at the edges (empty, beyond the last bucket)."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.daemon.latency import BOUNDS_S, PER_OCTAVE, Histogram, Latencies

WITHIN = 2 ** (1 / PER_OCTAVE)  # a bucket's width: the most a quantile may exceed the exact one


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99, 1.0])
def test_a_quantile_is_the_exact_one_rounded_up_to_its_bucket(q: float) -> None:
    durations = np.random.default_rng(7).lognormal(mean=np.log(2e-3), sigma=1.0, size=5000)
    h = Histogram()
    for d in durations:
        h.record(float(d))
    exact = float(np.quantile(durations, q, method="inverted_cdf"))
    assert exact <= h.quantile(q) <= min(exact * WITHIN, durations.max())
    assert h.count == len(durations)
    assert h.max_s == durations.max()


def test_empty_and_out_of_range() -> None:
    h = Histogram()
    assert (h.quantile(0.5), h.quantile(0.99), h.max_s) == (0.0, 0.0, 0.0)
    h.record(BOUNDS_S[-1] * 10)  # beyond the last bucket: reported as the exact maximum
    h.record(0.0)
    assert h.quantile(1.0) == BOUNDS_S[-1] * 10
    assert h.quantile(0.5) == BOUNDS_S[0]  # anything under the first bound reads as that bound


def test_stages_are_summarised_in_the_order_first_seen() -> None:
    latencies = Latencies()
    for stage, seconds in [("verdict", 1e-3), ("alert", 3e-3), ("verdict", 2e-3)]:
        latencies.record(stage, seconds)
    summaries = latencies.summaries()
    assert [(s.stage, s.count, s.max_s) for s in summaries] == [("verdict", 2, 2e-3), ("alert", 1, 3e-3)]
    assert summaries[0].p50_s == pytest.approx(1e-3, rel=WITHIN - 1)
