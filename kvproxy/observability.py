"""Counters with two views: a cumulative one for Prometheus and a resettable window
for ``GET /kvproxy/stats?reset=true`` (a trainer reads and resets it once per step).

Pure Python, no I/O. Each feature owns one :class:`WindowedCounters` and exposes it
through a prometheus-client collector built by :func:`counter_families`.

:class:`RateLimitedLog` is the one rate-limited logger: a failure that repeats on
every tick or request is logged once per interval and key, not once per occurrence.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def prometheus_name(stats_key: str) -> str:
    """``agentic_kv/admission/admit`` -> ``agentic_kv_admission_admit``."""
    return stats_key.replace("/", "_").replace("-", "_")


class RateLimitedLog:
    """``logger.warning`` at most once per ``interval_s`` for each key (keys bounded)."""

    __slots__ = ("_clock", "_interval_s", "_last", "_logger", "_max_keys")

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 30.0,
        *,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless ``key`` was logged within the interval; True if logged."""
        now = self._clock()
        if now - self._last.get(key, -math.inf) < self._interval_s:
            return False
        if key not in self._last and len(self._last) >= self._max_keys:
            self._last.clear()
        self._last[key] = now
        self._logger.warning(msg, *args, exc_info=exc_info)
        return True


class WindowedCounters:
    """Named monotonically increasing counters, each with a resettable window copy."""

    __slots__ = ("_total", "_window")

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._total: dict[str, float] = dict.fromkeys(names, 0.0)
        self._window: dict[str, float] = dict.fromkeys(names, 0.0)

    def inc(self, name: str, amount: float = 1.0) -> None:
        self._total[name] = self._total.get(name, 0.0) + amount
        self._window[name] = self._window.get(name, 0.0) + amount

    def window(self, name: str) -> float:
        return self._window.get(name, 0.0)

    def total(self, name: str) -> float:
        return self._total.get(name, 0.0)

    def window_items(self) -> Mapping[str, float]:
        return self._window

    def total_items(self) -> Mapping[str, float]:
        return self._total

    def reset_window(self) -> None:
        for name in self._window:
            self._window[name] = 0.0


def counter_families(
    counters: WindowedCounters, help_text: Mapping[str, str] | None = None
) -> Iterator[Metric]:
    """Prometheus counter families for every cumulative counter (name gets ``_total``)."""
    help_text = help_text or {}
    for key, value in counters.total_items().items():
        name = prometheus_name(key)
        fam = CounterMetricFamily(name, help_text.get(key, key))
        fam.add_metric([], value)
        yield fam


def gauge_families(
    gauges: Mapping[str, float], help_text: Mapping[str, str] | None = None
) -> Iterator[Metric]:
    help_text = help_text or {}
    for key, value in gauges.items():
        fam = GaugeMetricFamily(prometheus_name(key), help_text.get(key, key))
        fam.add_metric([], float(value))
        yield fam
