"""What admission shows, over both modes at one moment: the waiting counts, the
``/kvproxy/stats`` keys, the health document and the ``/metrics`` families.

:class:`AdmissionView` is the base of the controller
(:class:`~kvproxy.admission.coordinator.AdmissionController`, through
:class:`~kvproxy.admission.controls.ProgramControls`): it reads the parts the
controller wired (:mod:`kvproxy.admission.wiring`) at a time the controller's clock
gives and hands them to the pure rendering of :mod:`kvproxy.admission.report`. It
changes nothing but the counters' window (a stats reset) and the counts it carries
over from the parts first (fleet evictions, program events).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import Metric

from kvproxy.admission import catalogue, report
from kvproxy.admission.fleet.queue import FLEET
from kvproxy.admission.report import AdmissionHealth, Waiting
from kvproxy.admission.scaling import residency_of
from kvproxy.admission.wiring import Parts
from kvproxy.config import AdmissionConfig


class AdmissionView:
    """Admission's outputs, read from the controller's parts."""

    _p: Parts
    _raw_cfg: AdmissionConfig  # the config as given (token-scaled)
    _cfg: AdmissionConfig  # the config as applied (token- and time-scaled)
    _clock: Callable[[], float]

    @property
    def config(self) -> AdmissionConfig:
        return self._raw_cfg

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    def engine_usage(self, url: str) -> float | None:
        """One engine's fresh KV usage (``sglang:token_usage``); None when unknown."""
        return self._p.ledger.usage_of(url.rstrip("/"), self._clock())

    def program_snapshot(self, now: float | None = None) -> catalogue.ProgramSnapshot:
        """Program admission now: the one snapshot stats, /metrics and health render."""
        return self._p.program.snapshot(self._clock() if now is None else now)

    # -- waiting -----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return sum(len(g.waiters) for g in self._p.gates.values())

    @property
    def waiting_continuing(self) -> int:
        return self._p.fleet.queues.live_continuing

    @property
    def waiting_new(self) -> int:
        return self._p.fleet.queues.waiting(FLEET)[1] + self._p.program.waiting_new

    def _waiting(self, snap: catalogue.ProgramSnapshot) -> Waiting:
        continuing, new = self._p.fleet.queues.waiting(FLEET)
        return Waiting(self.waiting, continuing, new + snap.waiting_new)

    def oldest_wait_s(self) -> float:
        """How long the longest-waiting request has been held so far (0 when none)."""
        first = math.inf
        for gate in self._p.gates.values():
            at = gate.oldest()
            if at is not None:
                first = min(first, at)
        return 0.0 if first == math.inf else max(0.0, self._clock() - first)

    # -- counters, stats, health, /metrics ---------------------------------------------

    def _sync(self) -> None:
        self._p.fleet.sync_evicted()
        self._p.program.sync_events()

    def totals(self) -> Mapping[str, float]:
        """Cumulative counters since start (never reset by the stats window)."""
        self._p.fleet.sync_evicted()
        return self._p.counters.total_items()

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """``agentic_kv/admission/*`` and ``agentic_kv/budget/*`` over the current window.

        Counters count events since the last reset. As in the Relax V2 design,
        ``defer_rate`` / ``degraded_rate`` appear only when there was a decision,
        ``wait_seconds_mean`` only when a request was admitted after waiting,
        ``reserved_utilization`` only when the ceiling is positive and
        ``lease_expired`` only when non-zero. ``reset=True`` then closes the window:
        counters restart and the usage window restarts at the current level.
        """
        self._sync()
        snap = self.program_snapshot()
        p = self._p
        out = report.stats(
            p.counters.window_items(),
            enabled=self._cfg.enabled,
            waiting=self._waiting(snap),
            program=snap,
            ledger=p.ledger.snapshot(self._clock(), reset_usage_window=reset),
        )
        if reset:
            p.counters.reset_window()
        return out

    def health(self) -> AdmissionHealth:
        now = self._clock()
        snap = self.program_snapshot(now)
        return report.health(
            self._p.ledger,
            now,
            enabled=self._cfg.enabled,
            session_residency=residency_of(self._cfg),
            program=snap,
            waiting=self._waiting(snap),
        )

    def collect(self) -> Iterable[Metric]:
        """prometheus-client custom collector: counters, gauges, wait histogram."""
        self._sync()
        totals = self._p.counters.total_items()
        now = self._clock()
        snap = self.program_snapshot(now)
        yield from report.families(
            totals,
            enabled=self._cfg.enabled,
            waiting=self._waiting(snap),
            program=snap,
            ledger=self._p.ledger,
            now=now,
            waits=self._p.waits,
        )
