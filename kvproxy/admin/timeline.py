"""The dashboard's recent history: a bounded ring of samples, one per tick.

Pure Python, no I/O, time passed in. The shell reads the runtime once per tick into
a :class:`Reading` (cumulative counters, instantaneous gauges, per-engine KV usage)
and :meth:`Timeline.record` turns it into a sample: gauges as read, counters as
per-second rates since the previous sample, and ratios of two counters' increases
(the mean admission wait of the requests granted in that interval). Rates are thus
independent of how often a browser polls, and a page opened mid-rollout shows the
last minutes at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Sample = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Reading:
    """What the shell read off the runtime at one instant."""

    counters: Mapping[str, float]  # cumulative since start; never decrease
    gauges: Mapping[str, float]
    engines: Mapping[str, float | None]  # engine URL -> KV token usage (None: unknown)


class Timeline:
    """The last ``capacity`` samples, each numbered by a strictly increasing ``seq``.

    ``rates`` maps a series name to the counter whose per-second increase it shows;
    ``ratios`` maps a series name to ``(numerator, denominator)`` counters: the
    series is the ratio of their increases, ``None`` when the denominator did not
    move. The first sample, and any sample whose clock did not advance, has ``None``
    rates (nothing to difference against).
    """

    def __init__(
        self,
        capacity: int,
        *,
        rates: Mapping[str, str],
        ratios: Mapping[str, tuple[str, str]] | None = None,
        origin: str = "",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._samples: deque[Sample] = deque(maxlen=capacity)
        self._rates = dict(rates)
        self._ratios = dict(ratios or {})
        self.origin = origin  # tells readers apart timelines whose seq restarted
        self._prev: tuple[float, Mapping[str, float]] | None = None
        self._seq = 0

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the newest sample (0 before the first)."""
        return self._seq

    def __len__(self) -> int:
        return len(self._samples)

    def record(self, now: float, wall: float, reading: Reading) -> Sample:
        """Append the sample for ``reading`` taken at monotonic ``now`` (wall-clock
        ``wall``, unix seconds, for display) and return it."""
        counters = dict(reading.counters)
        rates: dict[str, float | None] = dict.fromkeys(self._rates)
        ratios: dict[str, float | None] = dict.fromkeys(self._ratios)
        prev = self._prev
        if prev is not None and now > prev[0]:
            dt = now - prev[0]
            before = prev[1]
            for name, counter in self._rates.items():
                rates[name] = _increase(counters, before, counter) / dt
            for name, (num, den) in self._ratios.items():
                d = _increase(counters, before, den)
                ratios[name] = _increase(counters, before, num) / d if d > 0 else None
        self._prev = (now, counters)
        self._seq += 1
        sample: Sample = {
            "seq": self._seq,
            "t": wall,
            "gauges": dict(reading.gauges),
            "rates": {**rates, **ratios},
            "engines": dict(reading.engines),
        }
        self._samples.append(sample)
        return sample

    def since(self, seq: int) -> list[Sample]:
        """Samples newer than ``seq``, oldest first (all of them for ``seq <= 0``)."""
        if seq >= self._seq:
            return []
        # Samples are contiguous in seq: skip straight to the first one wanted.
        first = self._samples[0]["seq"] if self._samples else self._seq + 1
        start = max(0, seq + 1 - first)
        return [self._samples[i] for i in range(start, len(self._samples))]


def _increase(now: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    # A counter never decreases; if one ever appears to (a feature rebuilt its
    # counters), count the interval as no increase rather than a negative rate.
    return max(0.0, now.get(name, 0.0) - before.get(name, 0.0))
