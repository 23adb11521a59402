"""Latency histograms the simulated engine keeps: SGLang's buckets, cumulative counts.

Pure. The scheduler observes into them; :mod:`kvlab.sim.metrics` renders them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

TTFT_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0, 800.0,
)  # fmt: skip


class Histogram:
    """Cumulative-bucket histogram (pure)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def merged(self, others: Iterable[Histogram]) -> Histogram:
        out = Histogram(self.bounds)
        for h in (self, *others):
            for i, c in enumerate(h.counts):
                out.counts[i] += c
            out.count += h.count
            out.sum += h.sum
        return out
