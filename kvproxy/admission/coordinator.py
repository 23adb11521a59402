"""The admission controller: both modes' shells on the event loop (asyncio shell).

One :class:`AdmissionController` lives in the proxy process and is its only writer:
every decision, release, cancellation and poll runs on the event loop without
awaiting in between, so the ledgers and the queues need no lock. What it decides
with is pure and time-injected:

* ledger (request) mode: :class:`~kvproxy.admission.fleet_queue.FleetAdmission`, two
  FIFOs in front of the fleet-wide :class:`~kvproxy.admission.ledger.Ledger`, on the
  loop through :class:`~kvproxy.admission.fleet_gate.FleetGate` (futures, aging timer);
* program mode (docs/admission.md#program-mode):
  :class:`~kvproxy.admission.program.ProgramCore`, per-engine ledgers and queues, on
  the loop through :class:`~kvproxy.admission.program_gate.ProgramGate` (futures,
  deadline timer, ring mirror, engines' server info).

What is left here: the order below, the mode each request goes to, tickets
cancelled before they asked (tombstones), the config's reload, and the wiring of
:mod:`kvproxy.admission.learning` (sizing, calibration from what engines report),
:mod:`kvproxy.admission.poller` (what is read from the fleet, the background loops)
and :mod:`kvproxy.admission.report` (stats, health, /metrics).

Decision order for one request (:meth:`AdmissionController.admit`):

1. feature off -> ``pass``/``disabled``; out of scope (eval traffic with
   ``scope: train``) -> ``pass``/``out_of_scope``. Forwarded untouched, not counted.
2. a ticket cancelled before it asked -> ``bypass``/``cancelled`` (not counted; the
   caller should not forward it).
3. protected work -> ``bypass``/``protected``; the ledgers are untouched.
4. program mode active (mode ``program``, ledger ``engine``, a router policy kvproxy
   can mirror) -> program admission decides; otherwise ledger mode: a ticket that
   already holds a lease -> ``admit`` with that lease (idempotent); a body the sizer
   cannot read -> ``bypass``/``degraded``; else the fleet FIFOs decide (a lease, a
   bypass, or a wait that ends in one of them, ``bypass``/``aged`` after
   ``max_wait_s``).

A granted lease is held until the ``async with`` block exits and released exactly
once, whatever the exit path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric

from kvproxy.admission import catalogue, classify, report
from kvproxy.admission.catalogue import (
    C_BYPASS,
    C_BYPASS_PROTECTED,
    C_POLL_ERROR,
    C_SESSION_ENDED,
    COUNTERS,
)
from kvproxy.admission.decisions import Outcome
from kvproxy.admission.fleet_gate import FleetGate
from kvproxy.admission.fleet_queue import FLEET, FleetAdmission
from kvproxy.admission.learning import Learning
from kvproxy.admission.ledger import Ledger
from kvproxy.admission.params import ProgramParams
from kvproxy.admission.poller import Poller, poll_loop, tick_loop
from kvproxy.admission.prefetcher import Prefetcher
from kvproxy.admission.program import ProgramCore
from kvproxy.admission.program_gate import LEASE_PREFIX, ProgramGate
from kvproxy.admission.records import (
    BYPASS_CANCELLED,
    BYPASS_PROTECTED,
    PASS_DISABLED,
    PASS_OUT_OF_SCOPE,
    AdmissionRequest,
    Decision,
    Reason,
)
from kvproxy.admission.report import AdmissionHealth, WaitHistogram, Waiting
from kvproxy.admission.reservation import ReservationSizer
from kvproxy.admission.scaling import residency_of, time_scaled, token_scaled
from kvproxy.admission.waiters import Admission, Waiter
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.client import EngineHttp
from kvproxy.fleet.placement import Placement
from kvproxy.observability import RateLimitedLog, WindowedCounters

log = logging.getLogger(__name__)

# Cancel-before-acquire tombstones: bounded, and forgotten after the lease TTL.
_MAX_TOMBSTONES = 100_000
# Minimum seconds between two log lines of the same kind.
_LOG_INTERVAL_S = 30.0


class AdmissionController:
    """Program-aware admission in front of the router. See the module docstring."""

    def __init__(
        self,
        cfg: AdmissionConfig,
        *,
        healthy_engines: Callable[[], Sequence[str]],
        http: EngineHttp | None,
        clock: Callable[[], float] | None = None,
        fetch_metrics: Callable[[str], Awaitable[str]] | None = None,
        router_policy: str | None = None,
        workers: Callable[[], tuple[Sequence[str], Sequence[str]]] | None = None,
        server_info: Mapping[str, Mapping[str, Any]] | None = None,
        time_scale: float = 1.0,
        token_scale: int = 1,
        router_metrics_url: str | None = None,
        router_url: str | None = None,
    ) -> None:
        """``healthy_engines``: engine base URLs to poll. Program mode (docs/admission.md):
        ``router_policy`` is the router's policy as deployed (None: unknown, fleet-wide
        accounting); ``workers`` returns (the worker URLs exactly as the router registered
        them, the available ones) for the ring mirror (default: the healthy engines);
        ``server_info`` seeds the engines' ``/server_info`` documents (else they are
        read over ``http``); ``time_scale`` multiplies every duration of ``cfg`` and
        ``token_scale`` divides its token counts (``server.token_scale``). Time
        is the running loop's (``loop.time()``) unless ``clock`` is given."""
        self._log = RateLimitedLog(log, _LOG_INTERVAL_S)
        self._counters = WindowedCounters(COUNTERS)
        self._waits = WaitHistogram()
        self._poller = Poller(
            http, fetch_metrics, self._metrics_timeout_s, self._counters, self._log
        )
        self._time_scale = time_scale
        self._token_scale = token_scale
        self._raw_cfg = token_scaled(cfg, token_scale)
        self._cfg = cfg = time_scaled(self._raw_cfg, time_scale)
        self._healthy_engines = healthy_engines
        self._clock = clock or _loop_time
        self._router_metrics_url = router_metrics_url
        self.program = ProgramCore(ProgramParams.from_config(self._raw_cfg, time_scale))
        self._sizer = ReservationSizer(cfg)
        self._learning = learning = Learning(self._sizer, self.program, self._log)
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self.ledger = Ledger(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=residency_of(cfg),
        )
        self._fleet = FleetAdmission(
            self.ledger,
            self._counters,
            self._waits,
            max_wait_s=cfg.max_wait_s,
            max_queue=cfg.max_queue,
        )
        self._fleet_gate = FleetGate(
            self._fleet,
            residency=residency_of(cfg),
            clock=self._clock,
            log=self._log,
            size=learning.size,
            first_turn=learning.first_turn,
        )
        self._program_gate = ProgramGate(
            self.program,
            cfg,
            router_policy=router_policy,
            workers=workers,
            counters=self._counters,
            waits=self._waits,
            clock=self._clock,
            log=self._log,
            size=learning.sized,
            first_turn=learning.first_turn,
        )
        self._program_gate.prefetcher = self.prefetcher = Prefetcher(
            self.program, http, router_url, self._counters, cfg.prefetch_max_bytes
        )
        for url, info in (server_info or {}).items():
            self.set_server_info(url, info)
        self._poll_task: asyncio.Task[None] | None = None
        self._tick_task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def config(self) -> AdmissionConfig:
        return self._raw_cfg

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    def _metrics_timeout_s(self) -> float:
        return self._cfg.metrics_timeout_s

    async def start(self) -> None:
        """If enabled: one poll, then the background poll task. Safe when disabled."""
        if not self._cfg.enabled or self._poll_task is not None:
            return
        await self.poll_once()
        c, lg = self._counters, self._log
        self._poll_task = asyncio.create_task(
            poll_loop(lambda: self._cfg.poll_interval_s, self.poll_once, c, lg),
            name="kvproxy-admission-poll",
        )
        self._tick_task = asyncio.create_task(
            tick_loop(lambda: self.program.p.tick_s, self._program_gate.tick_if_busy, c, lg),
            name="kvproxy-admission-tick",
        )
        self._program_gate.say_fallback()

    async def stop(self) -> None:
        """Stop polling and the aging timer; every waiter leaves as bypass/degraded."""
        await self._stop_polling()
        await self.prefetcher.stop()
        self._fleet_gate.release_all(Reason.DEGRADED)
        self._program_gate.release_all(Outcome.BYPASS_NO_METRICS)
        self.ledger.clear_engines()
        self.ledger.clear_residency()

    async def reconfigure(self, cfg: AdmissionConfig) -> None:
        """Hot reload. Thresholds apply to the next decision; toggling starts or stops."""
        was_enabled = self._cfg.enabled
        self._raw_cfg = token_scaled(cfg, self._token_scale)
        self.program.configure(ProgramParams.from_config(self._raw_cfg, self._time_scale))
        self._cfg = cfg = time_scaled(self._raw_cfg, self._time_scale)
        self.ledger.configure(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=residency_of(cfg),
        )
        self._sizer.configure(cfg)
        self._fleet.configure(max_wait_s=cfg.max_wait_s, max_queue=cfg.max_queue)
        self._fleet_gate.residency = residency_of(cfg)
        self._program_gate.cfg = cfg
        self.prefetcher.prompts.max_bytes = cfg.prefetch_max_bytes
        if not (cfg.enabled and cfg.prefetch):
            self.prefetcher.prompts.clear()
        if was_enabled and not cfg.enabled:
            await self._stop_polling()
            self._fleet_gate.release_all(Reason.DISABLED)
            self._program_gate.release_all(Outcome.BYPASS_NO_METRICS)
            self.program.clear()
            self.ledger.clear_engines()
            self.ledger.clear_residency()
        elif cfg.enabled and not was_enabled:
            await self.start()
        elif cfg.enabled:
            self._fleet_gate.rearm()  # max_wait_s may have changed
            self._program_gate.check_active()

    async def _stop_polling(self) -> None:
        for name in ("_poll_task", "_tick_task"):
            task = getattr(self, name)
            setattr(self, name, None)
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise

    # -- decisions ---------------------------------------------------------------------

    def admit(self, req: AdmissionRequest) -> Admission:
        """Decide for one upstream attempt; see the module docstring for the order.

        The decision is made when the ``async with`` block is entered. If the task is
        cancelled while waiting, the ticket is cancelled atomically (the waiter leaves
        its queue and is counted ``cancelled``, or a lease granted in the race is
        released) and CancelledError propagates. A granted lease is released exactly
        once when the block exits, on every path.
        """
        return Admission(self, req)

    def _decide(self, req: AdmissionRequest) -> Decision | tuple[Waiter, bool]:
        cfg = self._cfg
        if not cfg.enabled:
            return PASS_DISABLED
        if not classify.in_scope(cfg, req.path, req.headers):
            return PASS_OUT_OF_SCOPE
        if self._tombstones and self._tombstones.pop(req.ticket_id, None) is not None:
            return BYPASS_CANCELLED
        if classify.is_protected(cfg, req.headers, req.body):
            self._counters.inc(C_BYPASS)
            self._counters.inc(C_BYPASS_PROTECTED)
            return BYPASS_PROTECTED
        if self._program_gate.active:
            return self._program_gate.decide(req)
        return self._fleet_gate.decide(req)

    def _cancel_waiter(self, w: Waiter) -> None:
        """The awaiting task was cancelled: remove the waiter or release a raced lease."""
        gate = self._program_gate if w.program else self._fleet_gate
        gate.cancel(w, self._clock())

    def cancel(self, ticket_id: str) -> None:
        """Cancel a ticket from outside its task (e.g. its session closed).

        A waiting ticket leaves its queue and its ``admit`` returns
        ``bypass``/``cancelled`` (counted ``cancelled``); a held lease is released;
        an unknown ticket is remembered, so a later ``admit`` of it returns
        ``bypass``/``cancelled`` at once. A caller that sees reason ``cancelled``
        must not forward the request.
        """
        now = self._clock()
        w = self._fleet_gate.waiters.get(ticket_id)
        if w is not None:
            self._fleet_gate.cancel(w, now)
        elif not self._fleet_gate.release_ticket(ticket_id, now):
            self._tombstones[ticket_id] = now
            if len(self._tombstones) > _MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)

    def _release(self, lease_id: str) -> None:
        now = self._clock()
        if lease_id.startswith(LEASE_PREFIX):
            self._program_gate.turn_ended(lease_id[len(LEASE_PREFIX) :], now)
        else:
            self._fleet_gate.release(lease_id, now)

    def _aged_turn_ended(self, req: AdmissionRequest, tokens: int) -> None:
        """An aged (lease-less) turn of a session ended: the session is resident now."""
        if self._cfg.enabled and self._residency and req.session_id is not None:
            self.ledger.note_unleased_turn(req.session_id, tokens, self._clock())

    def end_session(self, session_id: str) -> None:
        """The session closed: drop its residency (idempotent), freeing room for new ones.

        Its waiting requests are not touched (the caller cancels tickets it owns); a
        lease of it still live is released normally but adds no residency.
        """
        self.prefetcher.forget(session_id)
        if self.program.end_session(session_id, self._clock()):
            self._counters.inc(C_SESSION_ENDED)
            self._program_gate.drain(self._clock())
        if self.ledger.end_session(session_id):
            self._counters.inc(C_SESSION_ENDED)
            if self._fleet_gate.waiters:
                self._fleet_gate.drain(self._clock())

    def drain_program(self) -> None:
        """Release the waiting turns that may go now (another replica's records changed
        the ledger: kvproxy.replication.sync)."""
        self._program_gate.drain(self._clock())

    @property
    def prefetching(self) -> bool:
        """Program admission is on and active, with prefetch on."""
        return self._cfg.prefetch and self._program_gate.active

    def expect_tool_end(self, session_id: str, in_s: float) -> bool:
        """A client says the session's tool returns in ``in_s`` seconds (of the client's
        time: scaled like every duration): its prefetch is planned
        (docs/admission.md#prefetch-before-the-tool-returns). False when prefetch is off
        or the session is unknown, has no answer yet, or has a turn in flight."""
        if not self.prefetching:
            return False
        now = self._clock()
        program = self.program
        return program.prefetch.expect(program.ledger.get(session_id), in_s * self._time_scale, now)

    def learns_from(self, req: AdmissionRequest) -> bool:
        """Whether the engine's usage report for ``req`` (decided) would teach
        :meth:`observe_usage` anything: a session's first turn (the shared prefix), a
        turn program admission let run (the session's context), a text prompt (the
        chars-per-token calibration). A token-id request of a later turn in ledger mode
        teaches nothing, and the proxy does not read its response for usage."""
        return self._cfg.enabled and self._learning.learns_from(req)

    def observe_usage(
        self,
        req: AdmissionRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None = None,
    ) -> None:
        """Learn from what an engine reported for a finished request: the prompt size of
        a text prompt, (for a session's first request) the shared cached prefix, and in
        program mode the session's context (prompt + completion) and residency."""
        self._learning.observe(
            req,
            self._clock(),
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            enabled=self._cfg.enabled,
        )

    # -- program mode (docs/admission.md#program-mode): kvproxy.admission.program_gate --

    @property
    def _residency(self) -> bool:
        return residency_of(self._cfg)

    def engine_usage(self, url: str) -> float | None:
        """One engine's fresh KV usage (``sglang:token_usage``); None when unknown."""
        return self.ledger.usage_of(url.rstrip("/"), self._clock())

    @property
    def placement(self) -> Placement:
        """The mirror of the router's consistent-hashing ring."""
        return self._program_gate.placement

    @property
    def program_active(self) -> bool:
        """Program admission with per-engine ledgers: mode program, ledger engine, and a
        router policy kvproxy can mirror. Otherwise the fleet-wide path decides."""
        return self._program_gate.active

    @property
    def fallback_reason(self) -> str | None:
        """Why program mode uses fleet-wide accounting (None when it does not)."""
        return self._program_gate.fallback_reason

    @property
    def priority_steering(self) -> bool:
        """Inject priorities: configured, and every known engine evicts by priority."""
        return self._program_gate.priority_steering

    def set_router_policy(self, policy: str) -> None:
        """Tell the controller the router's policy (lab / tests: no config reload)."""
        self._program_gate.set_router_policy(policy)

    def set_workers(self, workers: Sequence[str], available: Sequence[str] | None = None) -> None:
        """Fix the ring's worker URLs (as the router registered them) and the available
        ones (default: all); replaces the ``workers`` source given at construction."""
        self._program_gate.set_workers(workers, available)

    def set_server_info(self, url: str, info: Mapping[str, Any]) -> None:
        """An engine's ``/server_info`` document (lab / tests: no HTTP)."""
        self._program_gate.set_server_info(url, info)

    def refresh_placement(self, polled: Sequence[str] | None = None) -> int:
        """Re-read the worker set; on a change re-attribute sessions (returns moves)."""
        return self._program_gate.refresh_placement(polled)

    def tick(self) -> None:
        """One program-admission tick now (the tick loop calls it every ``tick_s``)."""
        self._program_gate.tick()

    def program_snapshot(self, now: float | None = None) -> catalogue.ProgramSnapshot:
        """Program admission now: the one snapshot stats, /metrics and health render."""
        return self._program_gate.snapshot(self._clock() if now is None else now)

    # -- ledger mode's aging timer (kvproxy.admission.fleet_gate) ----------------------

    @property
    def _timer(self) -> asyncio.TimerHandle | None:
        return self._fleet_gate.aging.handle

    @property
    def _timer_deadline(self) -> float:
        return self._fleet_gate.aging.at

    def _on_timer(self) -> None:
        self._fleet_gate.on_timer()

    # -- polling (kvproxy.admission.poller) --------------------------------------------

    async def poll_once(self) -> None:
        """Scrape every healthy engine once and reconcile the ledgers; never raises."""
        try:
            urls = list(dict.fromkeys(self._healthy_engines()))
            gate = self._program_gate
            gate.refresh_placement(urls)
            cfg = self._cfg
            if cfg.priority_steering or cfg.growth_reservation:
                for mode in await self._poller.probe(urls, gate.modes):
                    gate.note_mode(mode)
            results = await self._poller.scrape(urls)
            now = self._clock()
            self._poller.observe(urls, results, now, self.ledger, self.program.ledger)
            if self._router_metrics_url is not None and gate.active:
                await self._poller.check_diversion(self._router_metrics_url)
            self._fleet.housekeep(now, self._cfg.session_idle_s)
            ttl = self._cfg.lease_ttl_s
            tomb = self._tombstones
            while tomb and now - next(iter(tomb.values())) > ttl:
                tomb.popitem(last=False)
            self._fleet_gate.drain(now)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._counters.inc(C_POLL_ERROR)
            self._log.warning("poll", "admission: poll iteration failed", exc_info=True)

    # -- metrics (kvproxy.admission.report) --------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._fleet_gate.waiters) + len(self._program_gate.waiters)

    @property
    def waiting_continuing(self) -> int:
        return self._fleet.queues.live_continuing

    @property
    def waiting_new(self) -> int:
        return self._fleet.queues.waiting(FLEET)[1] + self.program_waiting_new

    @property
    def program_waiting_new(self) -> int:
        return self._program_gate.waiting_new

    def _waiting(self, snap: catalogue.ProgramSnapshot) -> Waiting:
        continuing, new = self._fleet.queues.waiting(FLEET)
        return Waiting(self.waiting, continuing, new + snap.waiting_new)

    def totals(self) -> Mapping[str, float]:
        """Cumulative counters since start (never reset by the stats window)."""
        self._fleet.sync_evicted()
        return self._counters.total_items()

    def oldest_wait_s(self) -> float:
        """How long the longest-waiting request has been held so far (0 when none)."""
        first = math.inf
        for entry in (self._fleet.queues.oldest(), self.program.queues.oldest()):
            if entry is not None:
                first = min(first, entry.enqueued_at)
        return 0.0 if first == math.inf else max(0.0, self._clock() - first)

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """``agentic_kv/admission/*`` and ``agentic_kv/budget/*`` over the current window.

        Counters count events since the last reset. As in the Relax V2 design,
        ``defer_rate`` / ``degraded_rate`` appear only when there was a decision,
        ``wait_seconds_mean`` only when a request was admitted after waiting,
        ``reserved_utilization`` only when the ceiling is positive and
        ``lease_expired`` only when non-zero. ``reset=True`` then closes the window:
        counters restart and the usage window restarts at the current level.
        """
        self._fleet.sync_evicted()
        self._program_gate.sync_events()
        snap = self.program_snapshot()
        out = report.stats(
            self._counters.window_items(),
            enabled=self._cfg.enabled,
            waiting=self._waiting(snap),
            program=snap,
            ledger=self.ledger.snapshot(self._clock(), reset_usage_window=reset),
        )
        if reset:
            self._counters.reset_window()
        return out

    def health(self) -> AdmissionHealth:
        now = self._clock()
        snap = self.program_snapshot(now)
        return report.health(
            self.ledger,
            now,
            enabled=self._cfg.enabled,
            session_residency=self._residency,
            program=snap,
            waiting=self._waiting(snap),
        )

    def collect(self) -> Iterable[Metric]:
        """prometheus-client custom collector: counters, gauges, wait histogram."""
        self._fleet.sync_evicted()
        self._program_gate.sync_events()
        totals = self._counters.total_items()
        now = self._clock()
        snap = self.program_snapshot(now)
        yield from report.families(
            totals,
            enabled=self._cfg.enabled,
            waiting=self._waiting(snap),
            program=snap,
            ledger=self.ledger,
            now=now,
            waits=self._waits,
        )


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
