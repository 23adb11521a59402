"""Admission as its three outputs show it: ``/kvproxy/stats`` keys, the health document
and the Prometheus families of ``/metrics``. Pure rendering.

Each function renders plain inputs (counter values, the fleet ledger, program
admission's :class:`~kvproxy.admission.catalogue.ProgramSnapshot`, the waiting
counts, the wait histogram) taken by the controller at one moment; nothing here reads
a clock or the network. Names and help are :mod:`kvproxy.admission.catalogue`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvproxy.admission import catalogue
from kvproxy.admission.catalogue import (
    _B,
    _PROGRAM_COUNTERS,
    C_ADMIT,
    C_BYPASS,
    C_BYPASS_DEGRADED,
    C_LEASE_EXPIRED,
    C_WAIT,
    C_WAIT_GRANTED,
    C_WAIT_SECONDS_SUM,
    ENGINE_FRESH,
    ENGINE_MAX_TOKENS,
    ENGINE_TOKEN_USAGE,
    G_DEFER_RATE,
    G_DEGRADED_RATE,
    G_ENABLED,
    G_WAIT_SECONDS_MEAN,
    G_WAITING,
    G_WAITING_CONTINUING,
    G_WAITING_NEW,
    G_WAITING_PAUSED,
    HELP,
    STATS_COUNTERS,
    WAIT_BUCKETS,
    WAIT_HISTOGRAM,
    ProgramSnapshot,
)
from kvproxy.admission.fleet.ledger import EngineView, Ledger
from kvproxy.observability import WindowedCounters, counter_families, gauge_families


class WaitHistogram:
    """Seconds each request spent waiting in either mode's queues (any outcome)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(WAIT_BUCKETS) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.sum += seconds
        for i, bound in enumerate(WAIT_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def family(self) -> Metric:
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(WAIT_BUCKETS, self.counts, strict=False):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        cumulative += self.counts[-1]
        buckets.append(("+Inf", float(cumulative)))
        hist = HistogramMetricFamily(
            WAIT_HISTOGRAM,
            "Seconds each request spent in the admission FIFO (any outcome).",
        )
        hist.add_metric([], buckets, self.sum)
        return hist


@dataclass(frozen=True, slots=True)
class Waiting:
    """Requests waiting now, over both modes."""

    total: int  # every waiter: ledger mode's FIFOs and program mode's queues
    continuing: int  # ledger mode's continuing FIFO
    new: int  # ledger mode's new FIFO and program mode's new-session queues


@dataclass(frozen=True, slots=True)
class AdmissionHealth:
    """Admission at one moment, as ``GET /kvproxy/health`` shows it (``admission``)."""

    enabled: bool
    degraded: bool
    epoch: int
    ceiling: int
    reserved: int
    resident: int
    resident_sessions: int
    committed: int
    session_residency: bool
    program: ProgramSnapshot
    pressure: float | None
    lease_count: int
    waiting: int
    waiting_continuing: int
    waiting_new: int
    engines: tuple[EngineView, ...]

    @property
    def engines_fresh(self) -> int:
        return sum(1 for e in self.engines if e.fresh)

    def to_json(self) -> dict[str, Any]:
        engines = [
            {
                "url": e.url,
                "fresh": e.fresh,
                "token_usage": e.token_usage,
                "max_total_num_tokens": e.max_total_num_tokens,
                "age_s": None if e.age_s is None else round(e.age_s, 3),
            }
            for e in self.engines
        ]
        return {
            "enabled": self.enabled,
            "degraded": self.degraded,
            "epoch": self.epoch,
            "ceiling": self.ceiling,
            "reserved": self.reserved,
            "resident": self.resident,
            "resident_sessions": self.resident_sessions,
            "committed": self.committed,
            "session_residency": self.session_residency,
            **catalogue.health(self.program),
            "pressure": self.pressure,
            "lease_count": self.lease_count,
            "waiting": self.waiting,
            "waiting_continuing": self.waiting_continuing,
            "waiting_new": self.waiting_new,
            "engines_fresh": self.engines_fresh,
            "engines_stale": len(self.engines) - self.engines_fresh,
            "engines": engines,
        }


def health(
    ledger: Ledger,
    now: float,
    *,
    enabled: bool,
    session_residency: bool,
    program: ProgramSnapshot,
    waiting: Waiting,
) -> AdmissionHealth:
    return AdmissionHealth(
        enabled=enabled,
        degraded=ledger.is_degraded(now),
        epoch=ledger.epoch,
        ceiling=ledger.ceiling,
        reserved=ledger.reserved,
        resident=ledger.resident_total,
        resident_sessions=ledger.resident_sessions,
        committed=ledger.committed,
        session_residency=session_residency,
        program=program,
        pressure=ledger.pressure,
        lease_count=ledger.lease_count,
        waiting=waiting.total,
        waiting_continuing=waiting.continuing,
        waiting_new=waiting.new,
        engines=tuple(ledger.engines(now)),
    )


def waiting_gauges(waiting: Waiting, snap: ProgramSnapshot) -> dict[str, float]:
    return {
        G_WAITING: float(waiting.total),
        G_WAITING_CONTINUING: float(waiting.continuing),
        G_WAITING_NEW: float(waiting.new),
        G_WAITING_PAUSED: float(snap.waiting_paused),
    }


def rates(values: Mapping[str, float]) -> dict[str, float]:
    """``defer_rate`` / ``degraded_rate`` when there was a decision, and
    ``wait_seconds_mean`` when a request was admitted after waiting."""
    out: dict[str, float] = {}
    events = values[C_ADMIT] + values[C_WAIT] + values[C_BYPASS]
    if events > 0:
        out[G_DEFER_RATE] = values[C_WAIT] / events
        out[G_DEGRADED_RATE] = values[C_BYPASS_DEGRADED] / events
    if values[C_WAIT_GRANTED] > 0:
        out[G_WAIT_SECONDS_MEAN] = values[C_WAIT_SECONDS_SUM] / values[C_WAIT_GRANTED]
    return out


def stats(
    window: Mapping[str, float],
    *,
    enabled: bool,
    waiting: Waiting,
    program: ProgramSnapshot,
    ledger: Mapping[str, float],
) -> dict[str, float]:
    """The ``/kvproxy/stats`` keys of admission: the window's counters (``lease_expired``
    only when non-zero), the gauges, the rates and the ledger's ``snapshot``."""
    out: dict[str, float] = {G_ENABLED: 1.0 if enabled else 0.0}
    for name in STATS_COUNTERS:
        if name == C_LEASE_EXPIRED and not window[name]:
            continue
        out[name] = window[name]
    for name in _PROGRAM_COUNTERS:
        out[name] = window.get(name, 0.0)
    out.update(waiting_gauges(waiting, program))
    out.update(catalogue.gauges(program))
    out.update(rates(window))
    out.update(ledger)
    return out


def ledger_gauges(ledger: Ledger, now: float) -> dict[str, float]:
    """The fleet ledger's ``agentic_kv/budget/*`` gauges as /metrics exports them."""
    return {
        _B + "ceiling": float(ledger.ceiling),
        _B + "reserved": float(ledger.reserved),
        _B + "resident": float(ledger.resident_total),
        _B + "resident_sessions": float(ledger.resident_sessions),
        _B + "committed": float(ledger.committed),
        _B + "available_tokens": float(max(0, ledger.ceiling - ledger.committed)),
        _B + "reserved_utilization": ledger.committed / ledger.ceiling
        if ledger.ceiling > 0
        else 0.0,
        _B + "lease_count": float(ledger.lease_count),
        _B + "kv_token_usage_mean": ledger.mean_usage,
        _B + "kv_token_usage_max": ledger.pressure,
        _B + "epoch": float(ledger.epoch),
        _B + "degraded": 1.0 if ledger.is_degraded(now) else 0.0,
        _B + "engines_fresh": float(ledger.fresh_count),
        _B + "engines_stale": float(sum(1 for e in ledger.engines(now) if not e.fresh)),
    }


def families(
    totals: Mapping[str, float],
    *,
    enabled: bool,
    waiting: Waiting,
    program: ProgramSnapshot,
    ledger: Ledger,
    now: float,
    waits: WaitHistogram,
) -> Iterator[Metric]:
    """Admission's Prometheus families: counters (cumulative), gauges, per-engine
    gauges of both ledgers, and the wait histogram."""
    exported = WindowedCounters()
    for name in STATS_COUNTERS:
        exported.inc(name, totals[name])
    for name in _PROGRAM_COUNTERS:
        exported.inc(name, totals.get(name, 0.0))
    yield from counter_families(exported, HELP)
    gauges: dict[str, float] = {
        G_ENABLED: 1.0 if enabled else 0.0,
        **waiting_gauges(waiting, program),
        **catalogue.gauges(program),
        **rates(totals),
        **ledger_gauges(ledger, now),
    }
    yield from gauge_families(gauges, HELP)
    yield from engine_families(ledger.engines(now))
    yield from catalogue.engine_families(program)
    yield waits.family()


def engine_families(engines: Iterable[EngineView]) -> Iterator[Metric]:
    """Per-engine gauges labelled by engine base URL (one series per engine the
    ledger tracks, so cardinality is the fleet size)."""
    usage = GaugeMetricFamily(
        ENGINE_TOKEN_USAGE,
        "The engine's last sglang:token_usage as the ledger read it (KV pool fraction in use).",
        labels=["engine"],
    )
    capacity = GaugeMetricFamily(
        ENGINE_MAX_TOKENS,
        "The engine's KV pool size in tokens (max_total_num_tokens).",
        labels=["engine"],
    )
    fresh = GaugeMetricFamily(
        ENGINE_FRESH,
        "1 if the engine's metrics snapshot is fresh enough to count, else 0.",
        labels=["engine"],
    )
    for e in engines:
        if e.token_usage is not None:
            usage.add_metric([e.url], e.token_usage)
        if e.max_total_num_tokens is not None:
            capacity.add_metric([e.url], float(e.max_total_num_tokens))
        fresh.add_metric([e.url], 1.0 if e.fresh else 0.0)
    yield usage
    yield capacity
    yield fresh
