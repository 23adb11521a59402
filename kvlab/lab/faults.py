"""Signal faults of the lab: what a busy host or a flaky engine does to kvproxy's
``/metrics`` scrapes, as a pure function of simulated time. Pure.

``none``      every scrape answers at once;
``windows``   every scrape fails during two 8 s windows (at 120 s and 300 s);
``periodic``  every scrape fails 8 s of every 60 s;
``quarter``   every scrape fails a quarter of the time (5 s of every 20 s);
``lag``       a proxy lagging its engines: every scrape answers late, by a seeded
              exponential delay (mean 2 s, capped at 12 s), with what the engine showed
              when the scrape began (a busy core delaying the poller).

A failed scrape raises :class:`ScrapeFailed` (what a timeout or a refused connection is
to the poller); a late one is awaited by the caller for ``delay_s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


class ScrapeFailed(ConnectionError):
    """The lab's injected scrape failure."""


@dataclass(frozen=True, slots=True)
class SignalFault:
    name: str
    # Failing windows: (start, length) repeated every ``period_s`` (0: once each).
    windows: tuple[tuple[float, float], ...] = ()
    period_s: float = 0.0
    lag_mean_s: float = 0.0
    lag_cap_s: float = 0.0

    def failing(self, t: float) -> bool:
        """Whether a scrape at simulated time ``t`` fails."""
        x = t % self.period_s if self.period_s > 0 else t
        return any(start <= x < start + length for start, length in self.windows)

    def delay_s(self, rng: random.Random) -> float:
        """How late a scrape answers (0 without lag)."""
        if self.lag_mean_s <= 0:
            return 0.0
        return min(self.lag_cap_s, rng.expovariate(1.0 / self.lag_mean_s))


FAULTS: dict[str, SignalFault] = {
    f.name: f
    for f in (
        SignalFault("none"),
        SignalFault("windows", windows=((120.0, 8.0), (300.0, 8.0))),
        SignalFault("periodic", windows=((52.0, 8.0),), period_s=60.0),
        SignalFault("quarter", windows=((15.0, 5.0),), period_s=20.0),
        SignalFault("lag", lag_mean_s=2.0, lag_cap_s=12.0),
    )
}


def signal_fault(name: str) -> SignalFault:
    try:
        return FAULTS[name]
    except KeyError:
        raise ValueError(f"signal fault must be one of {', '.join(FAULTS)}, got {name!r}") from None
