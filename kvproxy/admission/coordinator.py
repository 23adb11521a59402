"""The admission coordinator: one global FIFO in front of the ledger (asyncio shell).

One :class:`AdmissionController` lives in the proxy process and is its only writer:
every decision, release, cancellation and poll runs on the event loop without
awaiting in between, so the ledger and the FIFO need no lock.

Decision order for one request (:meth:`AdmissionController.admit`):

1. feature off -> ``pass``/``disabled``; out of scope (eval traffic with
   ``scope: train``) -> ``pass``/``out_of_scope``. Forwarded untouched, not counted.
2. a ticket cancelled before it asked -> ``bypass``/``cancelled`` (not counted; the
   caller should not forward it).
3. protected work -> ``bypass``/``protected``; the ledger is untouched.
4. a ticket that already holds a lease -> ``admit`` with that lease (idempotent).
5. the ledger is degraded (no engine has a fresh reading) -> ``bypass``/``degraded``.
6. the reservation exceeds the whole ceiling -> ``bypass``/``oversized`` at once.
7. an earlier waiter exists, or the ledger refuses (``pressure_guard`` /
   ``capacity_exhausted``) -> the request waits in the FIFO, holding no connection
   to the router; if the FIFO already holds ``max_queue`` waiters it bypasses instead
   (``queue_full``, fail open).
8. a waiter still waiting after ``max_wait_s`` -> ``bypass``/``aged`` (no lease).
9. otherwise ``admit`` with a lease, held until the ``async with`` block exits and
   released exactly once, whatever the exit path.

Session residency (``session_residency: true``, the default; docs/admission.md):
the ledger counts each session's KV between its turns, so a request of a session
that is already resident (a *continuing* request) is never held for capacity, only
by the pressure guard, while a request of a new session (or one without a session
id) is held until ``committed + tokens`` fits the ceiling. There are two FIFOs:
``continuing`` and ``new``. Draining grants the continuing FIFO's head(s) first,
then the new FIFO's head(s), each in strict arrival order; a refused new head never
blocks a continuing request, and a continuing request never waits behind a new one.
``end_session`` (a session closed) and idle expiry (``session_idle_s``, applied by
the poll loop) end a session's residency and free room for new sessions.

Each FIFO is a deque of waiter records; a dict of live waiters by ticket covers
both. Cancelled entries are skipped lazily when they reach a head, and a deque is
compacted when dead entries dominate, so every operation is O(1) amortised.
Draining stops at the first waiter the ledger refuses (strict arrival order).

An aging timer is armed for the earlier of the two heads' deadlines, so a waiter
leaves within a few milliseconds of ``max_wait_s`` even when nothing else happens.

Polling: every ``poll_interval_s`` the coordinator scrapes ``{engine}/metrics`` for
each engine the fleet reports healthy, concurrently, with ``metrics_timeout_s``. A
failed or unparsable scrape keeps the engine's last reading, which goes stale after
``effective_staleness_s``; engines that left the fleet leave the ledger. Every
iteration is wrapped so that an exception never stops polling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import aiohttp
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvproxy.admission import catalogue, classify
from kvproxy.admission.catalogue import (
    _C_DECISION,
    _C_EVENT,
    _PROGRAM_COUNTERS,
    C_DIVERTED,
    C_PAUSED_WAIT_COUNT,
    C_PAUSED_WAIT_SUM,
    PROGRAM_HELP,
    PROGRAM_STATS_KEYS,  # noqa: F401 (re-exported: tests and users import it from here)
    ProgramSnapshot,
)
from kvproxy.admission.decisions import Event, Outcome
from kvproxy.admission.ledger import (
    CAPACITY_AVAILABLE,
    DEGRADED,
    OVERSIZED,
    EngineView,
    Ledger,
)
from kvproxy.admission.params import ProgramParams
from kvproxy.admission.program import ProgramCore, Release
from kvproxy.admission.reservation import ReservationSizer, expected_output
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.client import EngineHttp
from kvproxy.fleet.engine_info import EngineSessionMode, parse_server_info, probe
from kvproxy.fleet.engine_metrics import parse_engine_metrics
from kvproxy.fleet.placement import Placement
from kvproxy.observability import (
    RateLimitedLog,
    WindowedCounters,
    counter_families,
    gauge_families,
)
from kvproxy.record import Record
from kvproxy.urls import base_url, join

log = logging.getLogger(__name__)

ADMIT = "admit"
BYPASS = "bypass"
PASS = "pass"

# Decision reasons.
R_CAPACITY_AVAILABLE = CAPACITY_AVAILABLE
R_PROTECTED = "protected"
R_DEGRADED = "degraded"
R_AGED = "aged"
R_OVERSIZED = "oversized"
R_QUEUE_FULL = "queue_full"
R_CANCELLED = "cancelled"
R_DISABLED = "disabled"
R_OUT_OF_SCOPE = "out_of_scope"

# Bound on remembered first-request tickets (a request that never reports is dropped).
_FIRST_TURNS_MAX = 10_000
_A = "agentic_kv/admission/"
_B = "agentic_kv/budget/"

# Counters (cumulative on /metrics as *_total; windowed in /kvproxy/stats).
C_ADMIT = _A + "admit"
C_BYPASS = _A + "bypass"
C_BYPASS_PROTECTED = _A + "bypass_protected"
C_BYPASS_DEGRADED = _A + "bypass_degraded"
C_BYPASS_AGED = _A + "bypass_aged"
C_BYPASS_OVERSIZED = _A + "bypass_oversized"
C_BYPASS_QUEUE_FULL = _A + "bypass_queue_full"
C_BYPASS_DISABLED = _A + "bypass_disabled"
C_WAIT = _A + "wait"
C_CANCELLED = _A + "cancelled"
C_WAIT_NEW_SESSION = _A + "wait_new_session"
C_WAIT_CONTINUING = _A + "wait_continuing"
C_WAIT_GRANTED = _A + "wait_granted"  # internal: grants after a wait
C_WAIT_SECONDS_SUM = _A + "wait_seconds_sum"  # internal: their summed wait
C_LEASE_EXPIRED = _B + "lease_expired"
C_SCRAPE_FAILURE = _B + "scrape_failure"
C_POLL_ERROR = _B + "poll_error"
C_RESIDENCY_EXPIRED = _B + "residency_expired"
C_RESIDENCY_EVICTED = _B + "residency_evicted"
C_SESSION_ENDED = _B + "session_ended"

_BYPASS_REASON_COUNTER = {
    R_PROTECTED: C_BYPASS_PROTECTED,
    R_DEGRADED: C_BYPASS_DEGRADED,
    R_AGED: C_BYPASS_AGED,
    R_OVERSIZED: C_BYPASS_OVERSIZED,
    R_QUEUE_FULL: C_BYPASS_QUEUE_FULL,
    R_DISABLED: C_BYPASS_DISABLED,
}
_COUNTERS = (
    C_ADMIT,
    C_BYPASS,
    C_BYPASS_PROTECTED,
    C_BYPASS_DEGRADED,
    C_BYPASS_AGED,
    C_BYPASS_OVERSIZED,
    C_BYPASS_QUEUE_FULL,
    C_BYPASS_DISABLED,
    C_WAIT,
    C_CANCELLED,
    C_WAIT_NEW_SESSION,
    C_WAIT_CONTINUING,
    C_WAIT_GRANTED,
    C_WAIT_SECONDS_SUM,
    C_LEASE_EXPIRED,
    C_SCRAPE_FAILURE,
    C_POLL_ERROR,
    C_RESIDENCY_EXPIRED,
    C_RESIDENCY_EVICTED,
    C_SESSION_ENDED,
)
# Counters reported by stats() (the internal ones are folded into wait_seconds_mean).
_STATS_COUNTERS = tuple(c for c in _COUNTERS if c not in (C_WAIT_GRANTED, C_WAIT_SECONDS_SUM))

_HELP = {
    C_ADMIT: "Requests admitted with a lease (at once or after waiting).",
    C_BYPASS: "Requests forwarded without a lease by the coordinator, all reasons.",
    C_BYPASS_PROTECTED: "Bypasses of protected work.",
    C_BYPASS_DEGRADED: "Bypasses because no engine had a fresh capacity reading.",
    C_BYPASS_AGED: "Bypasses of waiters that waited max_wait_s.",
    C_BYPASS_OVERSIZED: "Bypasses of reservations larger than the whole ceiling.",
    C_BYPASS_QUEUE_FULL: "Bypasses because the FIFO was full.",
    C_BYPASS_DISABLED: "Waiters released when admission was disabled by a reload.",
    C_WAIT: "Requests that entered the FIFO.",
    C_CANCELLED: "Waiting requests cancelled (client gone) before a decision.",
    C_WAIT_NEW_SESSION: "Requests of new (not resident) sessions that entered the new FIFO.",
    C_WAIT_CONTINUING: "Requests of resident sessions that waited (pressure guard).",
    C_RESIDENCY_EXPIRED: "Sessions whose residency ended after session_idle_s without a request.",
    C_RESIDENCY_EVICTED: "Idle resident sessions dropped by the residency table bound.",
    C_SESSION_ENDED: "Resident sessions ended by end_session (session close).",
    C_LEASE_EXPIRED: "Leases reclaimed by the lease TTL.",
    C_SCRAPE_FAILURE: "Engine /metrics scrapes that failed or carried no usage.",
    C_POLL_ERROR: "Poll iterations that raised (polling continued).",
    _A + "waiting": "Requests waiting in the FIFOs now.",
    _A + "waiting_continuing": "Requests of resident sessions waiting now.",
    _A + "waiting_new": "Requests of new sessions (or without one) waiting now.",
    _A + "defer_rate": "wait / (admit + wait + bypass), over the process lifetime.",
    _A + "degraded_rate": "bypass_degraded / (admit + wait + bypass), over the process lifetime.",
    _A + "wait_seconds_mean": "Mean wait of requests admitted after waiting, process lifetime.",
    _A + "enabled": "1 when admission is enabled.",
    _B + "ceiling": "int(sum of fresh engines' max_total_num_tokens x headroom).",
    _B + "reserved": "Tokens held by live leases.",
    _B + "resident": "Tokens of resident sessions between their turns.",
    _B + "resident_sessions": "Resident sessions.",
    _B + "committed": "reserved + resident.",
    _B + "available_tokens": "max(0, ceiling - committed).",
    _B + "reserved_utilization": "committed / ceiling.",
    _B + "lease_count": "Live leases.",
    _B + "kv_token_usage_mean": "Mean token_usage over fresh engines, now.",
    _B + "kv_token_usage_max": "Max token_usage over fresh engines, now (the pressure signal).",
    _B + "epoch": "Generation of the fresh engine set.",
    _B + "degraded": "1 when no engine has a fresh reading (every request bypasses).",
    _B + "engines_fresh": "Engines with a fresh reading.",
    _B + "engines_stale": "Engines known to the fleet without a fresh reading.",
}

WAIT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
WAIT_HISTOGRAM = "agentic_kv_admission_wait_seconds"
ENGINE_TOKEN_USAGE = "agentic_kv_budget_engine_token_usage"
ENGINE_MAX_TOKENS = "agentic_kv_budget_engine_max_total_num_tokens"
ENGINE_FRESH = "agentic_kv_budget_engine_fresh"

# Cancel-before-acquire tombstones: bounded, and forgotten after the lease TTL.
_MAX_TOMBSTONES = 100_000
# Minimum seconds between two log lines of the same kind.
_LOG_INTERVAL_S = 30.0


class AdmissionRequest(Record):
    __slots__ = ("body", "headers", "path", "routing_key", "session_id", "ticket_id")

    def __init__(
        self,
        ticket_id: str,
        path: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        session_id: str | None,
        routing_key: str | None = None,
    ) -> None:
        self.ticket_id: Final = ticket_id  # unique per forwarded attempt (the rid)
        self.path: Final = path  # "/generate", "/v1/chat/completions", "/v1/completions"
        self.headers: Final = headers  # case-insensitive mapping (aiohttp CIMultiDictProxy)
        self.body: Final = body  # parsed JSON object
        self.session_id: Final = session_id
        # The X-SMG-Routing-Key the router will see (None: the session id).
        self.routing_key: Final = routing_key


class Decision(Record):
    __slots__ = ("action", "lease_id", "priority", "reason", "tokens", "wait_s")

    def __init__(
        self,
        action: str,
        reason: str,
        lease_id: str | None,
        tokens: int,
        wait_s: float,
        priority: int | None = None,
    ) -> None:
        self.action: Final = action  # "admit" | "bypass" | "pass"
        # capacity_available | protected | degraded | aged | oversized | queue_full |
        # cancelled | disabled | out_of_scope
        self.reason: Final = reason
        self.lease_id: Final = lease_id
        self.tokens: Final = tokens
        self.wait_s: Final = wait_s
        # Program mode: the priority to inject when the body carries none (None: nothing).
        self.priority: Final = priority


_PASS_DISABLED = Decision(PASS, R_DISABLED, None, 0, 0.0)
_PASS_OUT_OF_SCOPE = Decision(PASS, R_OUT_OF_SCOPE, None, 0, 0.0)
_BYPASS_CANCELLED = Decision(BYPASS, R_CANCELLED, None, 0, 0.0)
_BYPASS_PROTECTED = Decision(BYPASS, R_PROTECTED, None, 0, 0.0)

_WAITING, _RESOLVED, _CANCELLED = 0, 1, 2


class _Waiter:
    __slots__ = (
        "continuing",
        "enqueued_at",
        "future",
        "program",
        "session",
        "state",
        "ticket",
        "tokens",
    )

    def __init__(
        self,
        ticket: str,
        tokens: int,
        enqueued_at: float,
        future: asyncio.Future[Decision],
        session: str | None = None,
        continuing: bool = False,
    ) -> None:
        self.ticket = ticket
        self.tokens = tokens
        self.enqueued_at = enqueued_at
        self.future = future
        self.session = session  # passed to the ledger (None when residency is off)
        self.continuing = continuing  # in the continuing FIFO
        self.program = False  # waits in program admission's per-engine queues
        self.state = _WAITING


# Ledger refusals that bypass admission (every other refusal waits), by decision reason.
_LEDGER_BYPASS: dict[str | None, str] = {DEGRADED: R_DEGRADED, OVERSIZED: R_OVERSIZED}


class Admission(AbstractAsyncContextManager[Decision]):
    """The context manager returned by :meth:`AdmissionController.admit`.

    ``async with`` decides on entry. The request path splits that in two, so that the
    common case (decided at once) costs no task, future or loop round trip:
    :meth:`decide_now`, then :meth:`wait` only when it returned None, and
    :meth:`leave` once the attempt ends."""

    __slots__ = ("_aged", "_ctl", "_lease_id", "_pending", "_req")

    def __init__(self, ctl: AdmissionController, req: AdmissionRequest) -> None:
        self._ctl = ctl
        self._req = req
        self._lease_id: str | None = None
        # Tokens of an aged bypass of a session: noted as its residency at exit.
        self._aged: int | None = None
        self._pending: tuple[_Waiter, bool] | None = None

    def decide_now(self) -> Decision | None:
        """The decision when it is made without waiting (a lease, a pass or a bypass);
        None when the request waits in a queue: then :meth:`wait` gives the decision."""
        outcome = self._ctl._decide(self._req)
        if isinstance(outcome, Decision):
            return self._entered(outcome)
        self._pending = outcome
        return None

    async def wait(self) -> Decision:
        """Wait for the decision :meth:`decide_now` could not make at once. Cancelled,
        the ticket is cancelled atomically (see :meth:`AdmissionController.admit`)."""
        assert self._pending is not None, "wait() follows a decide_now() that returned None"
        (waiter, shared), self._pending = self._pending, None
        ctl = self._ctl
        try:
            if waiter.future.done():
                decision = waiter.future.result()
            elif shared:
                decision = await asyncio.shield(waiter.future)
            else:
                decision = await waiter.future
        except asyncio.CancelledError:
            if not shared:  # a duplicate never cancels the original's ticket
                ctl._cancel_waiter(waiter)
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            # The shared future was cancelled by its first holder, not us.
            decision = _BYPASS_CANCELLED
        return self._entered(decision)

    def _entered(self, decision: Decision) -> Decision:
        self._lease_id = decision.lease_id
        if decision.reason == R_AGED and self._req.session_id is not None:
            self._aged = decision.tokens
        return decision

    async def __aenter__(self) -> Decision:
        decision = self.decide_now()
        return decision if decision is not None else await self.wait()

    def leave(self) -> None:
        """The attempt ended (any outcome): release its lease (idempotent). What
        ``async with`` does on exit; the request path calls it directly."""
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            self._ctl._release(lease_id)
        elif self._aged is not None:
            tokens, self._aged = self._aged, None
            self._ctl._aged_turn_ended(self._req, tokens)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.leave()


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
    ) -> None:
        """``healthy_engines``: engine base URLs to poll. Program mode (docs/admission.md):
        ``router_policy`` is the router's policy as deployed (None: unknown, fleet-wide
        accounting); ``workers`` returns (the worker URLs exactly as the router registered
        them, the available ones) for the ring mirror (default: the healthy engines);
        ``server_info`` seeds the engines' ``/server_info`` documents (else they are
        read over ``http``); ``time_scale`` multiplies every duration of ``cfg`` and
        ``token_scale`` divides its token counts (``server.token_scale``). Time
        is the running loop's (``loop.time()``) unless ``clock`` is given."""
        if http is None and fetch_metrics is None:
            raise ValueError("AdmissionController needs http or fetch_metrics")
        cfg = token_scaled(cfg, token_scale)
        self._raw_cfg = cfg
        self._time_scale = time_scale
        self._token_scale = token_scale
        cfg = _scaled(cfg, time_scale)
        self._cfg = cfg
        self._healthy_engines = healthy_engines
        self._http = http
        self._clock = clock or _loop_time
        self._workers = workers  # None: the healthy engines polled
        self.placement = Placement(router_policy or "unknown")
        self.program = ProgramCore(ProgramParams.from_config(self._raw_cfg, time_scale))
        self._modes: dict[str, EngineSessionMode] = {}
        for url, info in (server_info or {}).items():
            self.set_server_info(url, info)
        self._pwaiters: dict[str, _Waiter] = {}  # program-mode waiters by ticket
        self._ptimer: asyncio.TimerHandle | None = None
        self._ptimer_at = math.inf
        self._tick_task: asyncio.Task[None] | None = None
        self._fallback_logged = False
        self._diverted_seen: float | None = None
        self._events_seen: dict[str, int] = {}
        self._router_metrics_url = router_metrics_url
        self._fetch = fetch_metrics or self._http_fetch
        self.ledger = Ledger(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=_residency_of(cfg),
        )
        self._sizer = ReservationSizer(cfg)
        # Tickets of sessions' first requests, until the engine reports their usage.
        self._first_turns: dict[str, bool] = {}
        self._counters = WindowedCounters(_COUNTERS)
        self._waiters: dict[str, _Waiter] = {}  # live waiters of both FIFOs
        self._cont: deque[_Waiter] = deque()  # requests of resident sessions
        self._new: deque[_Waiter] = deque()  # everything else
        self._n_cont = 0  # live waiters in the continuing FIFO
        self._evicted_seen = 0  # ledger.residency_evicted already counted
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self._hist_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self._hist_sum = 0.0
        self._poll_task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline = math.inf
        self._log = RateLimitedLog(log, _LOG_INTERVAL_S)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def config(self) -> AdmissionConfig:
        return self._raw_cfg

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    async def start(self) -> None:
        """If enabled: one poll, then the background poll task. Safe when disabled."""
        if not self._cfg.enabled or self._poll_task is not None:
            return
        await self.poll_once()
        self._poll_task = asyncio.create_task(self._poll_loop(), name="kvproxy-admission-poll")
        self._tick_task = asyncio.create_task(self._tick_loop(), name="kvproxy-admission-tick")
        self._say_fallback()

    async def stop(self) -> None:
        """Stop polling and the aging timer; every waiter leaves as bypass/degraded."""
        await self._stop_polling()
        self._cancel_timer()
        self._release_all_waiters(R_DEGRADED)
        self._program_release_all(Outcome.BYPASS_NO_METRICS)
        self.ledger.clear_engines()
        self.ledger.clear_residency()

    async def reconfigure(self, cfg: AdmissionConfig) -> None:
        """Hot reload. Thresholds apply to the next decision; toggling starts or stops."""
        was_enabled = self._cfg.enabled
        cfg = token_scaled(cfg, self._token_scale)
        self._raw_cfg = cfg
        self.program.configure(ProgramParams.from_config(cfg, self._time_scale))
        cfg = _scaled(cfg, self._time_scale)
        self._cfg = cfg
        self.ledger.configure(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=_residency_of(cfg),
        )
        self._sizer.configure(cfg)
        if was_enabled and not cfg.enabled:
            await self._stop_polling()
            self._cancel_timer()
            self._release_all_waiters(R_DISABLED)
            self._program_release_all(Outcome.BYPASS_NO_METRICS)
            self.program.clear()
            self.ledger.clear_engines()
            self.ledger.clear_residency()
        elif cfg.enabled and not was_enabled:
            await self.start()
        elif cfg.enabled:
            self._cancel_timer()  # max_wait_s may have changed: re-arm from scratch
            self._drain(self._clock())
            self._program_check_active()

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

    def _release_all_waiters(self, reason: str) -> None:
        now = self._clock()
        for order in (self._cont, self._new):
            for w in order:
                if w.state == _WAITING:
                    self._resolve(w, self._bypass(reason, w.tokens, now - w.enqueued_at))
            order.clear()
        self._waiters.clear()
        self._n_cont = 0

    # -- decisions ---------------------------------------------------------------------

    def admit(self, req: AdmissionRequest) -> Admission:
        """Decide for one upstream attempt; see the module docstring for the order.

        The decision is made when the ``async with`` block is entered. If the task is
        cancelled while waiting, the ticket is cancelled atomically (the waiter leaves
        the FIFO and is counted ``cancelled``, or a lease granted in the race is
        released) and CancelledError propagates. A granted lease is released exactly
        once when the block exits, on every path.
        """
        return Admission(self, req)

    def _bypass(self, reason: str, tokens: int, wait_s: float = 0.0) -> Decision:
        c = self._counters
        c.inc(C_BYPASS)
        c.inc(_BYPASS_REASON_COUNTER[reason])
        return Decision(BYPASS, reason, None, tokens, wait_s)

    def _decide(self, req: AdmissionRequest) -> Decision | tuple[_Waiter, bool]:
        cfg = self._cfg
        if not cfg.enabled:
            return _PASS_DISABLED
        if not classify.in_scope(cfg, req.path, req.headers):
            return _PASS_OUT_OF_SCOPE
        ticket = req.ticket_id
        if self._tombstones and self._tombstones.pop(ticket, None) is not None:
            return _BYPASS_CANCELLED
        if classify.is_protected(cfg, req.headers, req.body):
            self._counters.inc(C_BYPASS)
            self._counters.inc(C_BYPASS_PROTECTED)
            return _BYPASS_PROTECTED
        if self.program_active:
            return self._decide_program(req)
        return self._decide_ledger(req)

    def _decide_ledger(self, req: AdmissionRequest) -> Decision | tuple[_Waiter, bool]:
        """The ledger mode's decision for an in-scope, unprotected request."""
        ticket = req.ticket_id
        ledger = self.ledger
        lease = ledger.lease_for_ticket(ticket)
        if lease is not None:
            return Decision(ADMIT, R_CAPACITY_AVAILABLE, lease.lease_id, lease.full_tokens, 0.0)
        existing = self._waiters.get(ticket)
        if existing is not None:
            return existing, True
        try:
            tokens = self._sizer.size(req.path, req.body, req.session_id).tokens
        except Exception:  # fail open on a body the sizer cannot read
            self._log.warning("size", "admission: cannot size request %s", ticket, exc_info=True)
            return self._bypass(R_DEGRADED, 0)

        now = self._clock()
        sid = req.session_id if self._residency else None
        continuing = ledger.is_resident(sid)
        if req.session_id is not None and not continuing:
            self._note_first_turn(ticket)
        if continuing:
            assert sid is not None
            ledger.touch(sid, now)  # active: not idle-expired while it waits
        if self._waiters:
            self._drain(now)
        queued = self._n_cont if continuing else len(self._waiters) - self._n_cont
        if not queued:  # fast path: nobody ahead of it in its FIFO
            grant = ledger.reserve(ticket, tokens, now, sid, continuing=continuing)
            if grant.granted:
                self._counters.inc(C_ADMIT)
                return Decision(ADMIT, R_CAPACITY_AVAILABLE, grant.lease_id, grant.tokens, 0.0)
            reason = grant.reason
        else:
            reason = ledger.check(tokens, now, sid, continuing=continuing)
        refused = _LEDGER_BYPASS.get(reason)
        if refused is not None:  # degraded or oversized: forwarded without a lease
            return self._bypass(refused, tokens)
        if len(self._waiters) >= self._cfg.max_queue:
            return self._bypass(R_QUEUE_FULL, tokens)
        waiter = self._enqueue(ticket, tokens, now, sid, continuing)
        if not queued:
            self._drain(now)  # ages it at once when max_wait_s == 0; arms the timer
        return waiter, False

    def _note_first_turn(self, ticket: str) -> None:
        """A session's first request: what it finds cached is the shared prefix."""
        first_turns = self._first_turns
        first_turns[ticket] = True
        if len(first_turns) > _FIRST_TURNS_MAX:
            del first_turns[next(iter(first_turns))]

    def _enqueue(
        self, ticket: str, tokens: int, now: float, sid: str | None, continuing: bool
    ) -> _Waiter:
        """Wait in its FIFO (capacity_exhausted / pressure_guard, or an earlier waiter)."""
        waiter = _Waiter(
            ticket, tokens, now, asyncio.get_running_loop().create_future(), sid, continuing
        )
        self._waiters[ticket] = waiter
        c = self._counters
        c.inc(C_WAIT)
        if continuing:
            self._cont.append(waiter)
            self._n_cont += 1
            c.inc(C_WAIT_CONTINUING)
        else:
            self._new.append(waiter)
            if sid is not None:
                c.inc(C_WAIT_NEW_SESSION)
        return waiter

    def _resolve(self, w: _Waiter, decision: Decision) -> None:
        w.state = _RESOLVED
        del self._waiters[w.ticket]
        if w.continuing:
            self._n_cont -= 1
        self._observe_wait(decision.wait_s)
        if not w.future.done():
            w.future.set_result(decision)

    def _drain(self, now: float) -> None:
        """Resolve waiters from the heads while the ledger admits them.

        The continuing FIFO first, then the new FIFO; each in strict arrival order.
        """
        self._drain_fifo(self._cont, now)
        self._drain_fifo(self._new, now)
        live_cont = self._n_cont
        live_new = len(self._waiters) - live_cont
        if len(self._cont) > 64 and len(self._cont) > 2 * live_cont:
            self._cont = deque(w for w in self._cont if w.state == _WAITING)
        if len(self._new) > 64 and len(self._new) > 2 * live_new:
            self._new = deque(w for w in self._new if w.state == _WAITING)
        self._arm_timer(now)

    def _drain_fifo(self, order: deque[_Waiter], now: float) -> None:
        ledger = self.ledger
        max_wait = self._cfg.max_wait_s
        while order:
            w = order[0]
            if w.state != _WAITING:
                order.popleft()
                continue
            if w.future.done():  # its task was cancelled; the handler has not run yet
                order.popleft()
                self._drop_cancelled(w, now)
                continue
            waited = max(0.0, now - w.enqueued_at)
            grant = ledger.reserve(w.ticket, w.tokens, now, w.session, continuing=w.continuing)
            if grant.granted:
                order.popleft()
                c = self._counters
                c.inc(C_ADMIT)
                c.inc(C_WAIT_GRANTED)
                c.inc(C_WAIT_SECONDS_SUM, waited)
                self._resolve(
                    w, Decision(ADMIT, R_CAPACITY_AVAILABLE, grant.lease_id, grant.tokens, waited)
                )
            elif grant.reason == DEGRADED or grant.reason == OVERSIZED:
                order.popleft()
                reason = R_DEGRADED if grant.reason == DEGRADED else R_OVERSIZED
                self._resolve(w, self._bypass(reason, w.tokens, waited))
            elif now >= w.enqueued_at + max_wait:  # refused at its deadline: fail open
                # (the timer's own deadline sum: a timer firing at the deadline always
                # ages the head, never re-arms for ~0 s on a rounding difference)
                order.popleft()
                self._resolve(w, self._bypass(R_AGED, w.tokens, waited))
            else:
                break  # strict FIFO: nobody overtakes a refused head

    def _drop_cancelled(self, w: _Waiter, now: float) -> None:
        w.state = _CANCELLED
        if self._waiters.get(w.ticket) is w:
            del self._waiters[w.ticket]
            if w.continuing:
                self._n_cont -= 1
        self._counters.inc(C_CANCELLED)
        self._observe_wait(now - w.enqueued_at)

    def _cancel_waiter(self, w: _Waiter) -> None:
        """The awaiting task was cancelled: remove the waiter or release a raced lease."""
        now = self._clock()
        if w.program:
            self._program_cancel(w, now)
            return
        if w.state == _WAITING:
            order = self._cont if w.continuing else self._new
            was_head = bool(order) and order[0] is w
            self._drop_cancelled(w, now)
            if not w.future.done():
                w.future.set_result(_BYPASS_CANCELLED)
            if was_head:
                self._drain(now)
        elif self.ledger.release_ticket(w.ticket, now, ran=False) is not None:
            self._drain(now)

    def cancel(self, ticket_id: str) -> None:
        """Cancel a ticket from outside its task (e.g. its session closed).

        A waiting ticket leaves the FIFO and its ``admit`` returns
        ``bypass``/``cancelled`` (counted ``cancelled``); a held lease is released;
        an unknown ticket is remembered, so a later ``admit`` of it returns
        ``bypass``/``cancelled`` at once. A caller that sees reason ``cancelled``
        must not forward the request.
        """
        now = self._clock()
        w = self._waiters.get(ticket_id)
        if w is not None:
            self._cancel_waiter(w)
            return
        if self.ledger.release_ticket(ticket_id, now) is not None:
            self._drain(now)
            return
        self._tombstones[ticket_id] = now
        if len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _release(self, lease_id: str) -> None:
        now = self._clock()
        if lease_id.startswith(_PROGRAM_LEASE):
            self._program_turn_ended(lease_id[len(_PROGRAM_LEASE) :], now)
            return
        if self.ledger.release(lease_id, now) is not None and self._waiters:
            self._drain(now)

    def _aged_turn_ended(self, req: AdmissionRequest, tokens: int) -> None:
        """An aged (lease-less) turn of a session ended: the session is resident now."""
        if self._cfg.enabled and self._residency and req.session_id is not None:
            self.ledger.note_unleased_turn(req.session_id, tokens, self._clock())

    def end_session(self, session_id: str) -> None:
        """The session closed: drop its residency (idempotent), freeing room for new ones.

        Its waiting requests are not touched (the caller cancels tickets it owns); a
        lease of it still live is released normally but adds no residency.
        """
        if self.program.end_session(session_id, self._clock()):
            self._counters.inc(C_SESSION_ENDED)
            self._program_drain(self._clock())
        if self.ledger.end_session(session_id):
            self._counters.inc(C_SESSION_ENDED)
            if self._waiters:
                self._drain(self._clock())

    def learns_from(self, req: AdmissionRequest) -> bool:
        """Whether the engine's usage report for ``req`` (decided) would teach
        :meth:`observe_usage` anything: a session's first turn (the shared prefix), a
        turn program admission let run (the session's context), a text prompt (the
        chars-per-token calibration). A token-id request of a later turn in ledger mode
        teaches nothing, and the proxy does not read its response for usage."""
        if not self._cfg.enabled:
            return False
        ticket = req.ticket_id
        return (
            ticket in self._first_turns
            or self.program.running(ticket)
            or self._sizer.calibrates_from(req.body)
        )

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
        first_turn = self._first_turns.pop(req.ticket_id, False)
        if not self._cfg.enabled:
            return
        if prompt_tokens is not None and self.program.running(req.ticket_id):
            try:
                self.program.observe_response(
                    req.ticket_id,
                    self._clock(),
                    prompt_tokens=int(prompt_tokens),
                    completion_tokens=None if completion_tokens is None else int(completion_tokens),
                    cached_tokens=None if cached_tokens is None else int(cached_tokens),
                )
            except Exception:
                self._log.warning("observe", "admission: usage not recorded", exc_info=True)
        try:
            if prompt_tokens is not None:
                self._sizer.observe(req.body, req.session_id, int(prompt_tokens))
            if first_turn and cached_tokens is not None:
                self._sizer.observe_shared(int(cached_tokens))
        except Exception:
            self._log.warning("calibrate", "admission: calibration failed", exc_info=True)

    # -- program mode (per-engine ledgers; docs/admission.md#program-mode) --------------

    @property
    def _residency(self) -> bool:
        return _residency_of(self._cfg)

    def engine_usage(self, url: str) -> float | None:
        """One engine's fresh KV usage (``sglang:token_usage``); None when unknown."""
        return self.ledger.usage_of(url.rstrip("/"), self._clock())

    @property
    def program_active(self) -> bool:
        """Program admission with per-engine ledgers: mode program, ledger engine, and a
        router policy kvproxy can mirror. Otherwise the fleet-wide path decides."""
        cfg = self._cfg
        return (
            cfg.enabled
            and cfg.mode == "program"
            and cfg.ledger == "engine"
            and self.placement.mirrored
        )

    @property
    def fallback_reason(self) -> str | None:
        """Why program mode uses fleet-wide accounting (None when it does not)."""
        cfg = self._cfg
        if not cfg.enabled or cfg.mode != "program":
            return None
        if cfg.ledger != "engine":
            return "admission.ledger is fleet"
        if not self.placement.mirrored:
            return (
                f"router.policy {self.placement.policy!r} cannot be mirrored (only "
                "consistent_hashing): placement unknown, fleet-wide accounting"
            )
        return None

    def _say_fallback(self) -> None:
        reason = self.fallback_reason
        if reason and not self._fallback_logged:
            self._fallback_logged = True
            log.warning("admission: %s", reason)

    def set_router_policy(self, policy: str) -> None:
        """Tell the controller the router's policy (lab / tests: no config reload)."""
        workers, available = self.placement.workers, self.placement.available
        self.placement = Placement(policy)
        self.placement.update(workers, available)
        self._fallback_logged = False
        self._say_fallback()
        self._program_check_active()

    def _program_check_active(self) -> None:
        """Program mode switched off (reload, policy change): its waiters go (fail open)."""
        if not self.program_active and self._pwaiters:
            self._program_release_all(Outcome.BYPASS_NO_PLACEMENT)
        elif self.program_active:
            self._program_drain(self._clock())

    def set_workers(self, workers: Sequence[str], available: Sequence[str] | None = None) -> None:
        """Fix the ring's worker URLs (as the router registered them) and the available
        ones (default: all); replaces the ``workers`` source given at construction."""
        snapshot = (tuple(workers), tuple(workers if available is None else available))
        self._workers = lambda: snapshot
        self.refresh_placement()

    def set_server_info(self, url: str, info: Mapping[str, Any]) -> None:
        """An engine's ``/server_info`` document (lab / tests: no HTTP)."""
        base = base_url(url)
        self._note_mode(parse_server_info(base, info))

    def _note_mode(self, mode: EngineSessionMode) -> None:
        self._modes[mode.url] = mode
        self.program.ledger.set_context_length(mode.url, mode.context_length)

    @property
    def priority_steering(self) -> bool:
        """Inject priorities: configured, and every known engine evicts by priority."""
        if not (self._cfg.priority_steering and self._modes):
            return False
        return all(m.eviction_policy == "priority" for m in self._modes.values())

    def refresh_placement(self, polled: Sequence[str] | None = None) -> int:
        """Re-read the worker set; on a change re-attribute sessions (returns moves).

        Without a ``workers`` source the ring is the polled (healthy) engines."""
        if self._workers is None:
            if polled is None:
                return 0
            workers = available = polled
        else:
            try:
                workers, available = self._workers()
            except Exception:
                self._log.warning("workers", "admission: worker list unavailable", exc_info=True)
                return 0
        if not self.placement.update(workers, available):
            return 0
        core = self.program
        owner = self.placement.owner
        moved = core.reattribute({sid: owner(sid) for sid in core.ledger.sessions}, self._clock())
        if moved:
            log.info("admission: %d session(s) moved to another engine", moved)
        return moved

    async def _probe_engines(self, urls: Sequence[str]) -> None:
        if self._http is None or not (self._cfg.priority_steering or self._cfg.growth_reservation):
            return
        missing = [u for u in urls if base_url(u) not in self._modes]
        if not missing:
            return
        results = await asyncio.gather(
            *(probe(self._http, u, self._cfg.metrics_timeout_s) for u in missing),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, EngineSessionMode):
                self._note_mode(result)

    def _program_observe(
        self, urls: Sequence[str], results: Sequence[str | BaseException], now: float
    ) -> None:
        led = self.program.ledger
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                continue
            m = parse_engine_metrics(result)
            led.observe_engine(
                base_url(url),
                now,
                max_total_num_tokens=m.max_total_num_tokens,
                evicted_total=m.evicted_tokens_total,
                retracted_total=m.num_retracted_requests_total,
                streaming_held=m.streaming_session_held_tokens,
                streaming_sessions=m.num_streaming_sessions,
            )

    async def _check_router_diversion(self) -> None:
        """Count requests smg's own counters show routed off the ring (and warn)."""
        url = self._router_metrics_url
        if url is None or self._http is None or not self.program_active:
            return
        try:
            timeout = aiohttp.ClientTimeout(total=self._cfg.metrics_timeout_s)
            async with self._http.get(url, timeout=timeout) as resp:
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._log.warning("smg-metrics", "admission: %s unreadable: %r", url, exc)
            return
        total = diverted_requests(text)
        if total is None:
            return
        seen, self._diverted_seen = self._diverted_seen, total
        if seen is not None and total > seen:
            self._counters.inc(C_DIVERTED, total - seen)
            self._log.warning(
                "diverted",
                "admission: smg routed %d request(s) off the consistent-hashing ring "
                "(no healthy owner or random fallback): per-engine accounting is off for them",
                int(total - seen),
            )

    def _decide_program(self, req: AdmissionRequest) -> Decision | tuple[_Waiter, bool]:
        ticket = req.ticket_id
        existing = self._pwaiters.get(ticket)
        if existing is not None:
            return existing, True
        now = self._clock()
        core = self.program
        sid = req.session_id
        try:
            tokens = self._sizer.size(req.path, req.body, sid).tokens
        except Exception:  # fail open on a body the sizer cannot read
            self._log.warning("size", "admission: cannot size request %s", ticket, exc_info=True)
            tokens = 0
        owner = None if sid is None else self.placement.owner(req.routing_key or sid)
        if sid is not None and core.ledger.get(sid) is None:
            self._first_turns[ticket] = True
            if len(self._first_turns) > _FIRST_TURNS_MAX:
                del self._first_turns[next(iter(self._first_turns))]
        verdict = core.request(ticket, sid, owner, tokens, now)
        # Dynamo's agent_hints.osl: the session grows by at least that much per turn.
        core.hint_growth(sid, expected_output(req.body))
        if verdict.outcome is not None:
            self._program_drain(now)
            return self._program_decision(ticket, sid, verdict.outcome, tokens, 0.0)
        waiter = _Waiter(ticket, tokens, now, asyncio.get_running_loop().create_future(), sid)
        waiter.program = True
        self._pwaiters[ticket] = waiter
        self._counters.inc(C_WAIT)
        if sid is not None and verdict.held is not None and verdict.held.value.startswith("new"):
            self._counters.inc(C_WAIT_NEW_SESSION)
        self._program_arm(now)
        return waiter, False

    def _program_decision(
        self, ticket: str, sid: str | None, outcome: Outcome, tokens: int, wait_s: float
    ) -> Decision:
        c = self._counters
        c.inc(_C_DECISION[outcome])
        started = outcome not in (Outcome.BYPASS_NO_SESSION, Outcome.CANCELLED) and (
            ticket in self.program._inflight
        )
        if outcome.fail_open:
            c.inc(C_BYPASS)
            action = BYPASS
        else:
            c.inc(C_ADMIT)
            action = ADMIT
            if outcome.waited:
                c.inc(C_WAIT_GRANTED)
                c.inc(C_WAIT_SECONDS_SUM, wait_s)
        prio = self.program.priority(sid) if self.priority_steering else None
        lease = _PROGRAM_LEASE + ticket if started else None
        return Decision(action, outcome.value, lease, tokens, wait_s, prio)

    def _program_apply(self, releases: Sequence[Release]) -> None:
        for r in releases:
            w = self._pwaiters.pop(r.ticket, None)
            if w is None:
                # Nobody awaits it (cancelled in a race): end the turn it started.
                self.program.turn_ended(r.ticket, self._clock())
                continue
            w.state = _RESOLVED
            self._observe_wait(r.wait_s)
            if r.outcome in (Outcome.RESUMED_WAITED, Outcome.PAUSED_AGED):
                self._counters.inc(C_PAUSED_WAIT_SUM, r.wait_s)
                self._counters.inc(C_PAUSED_WAIT_COUNT)
            decision = self._program_decision(r.ticket, w.session, r.outcome, w.tokens, r.wait_s)
            if not w.future.done():
                w.future.set_result(decision)
            else:
                self.program.turn_ended(r.ticket, self._clock())

    def _program_drain(self, now: float) -> None:
        if self._pwaiters:
            self._program_apply(self.program.drain(now))
        self._program_arm(now)

    def _program_turn_ended(self, ticket: str, now: float) -> None:
        self.program.turn_ended(ticket, now)
        if self._pwaiters:
            self._program_drain(now)

    def _program_cancel(self, w: _Waiter, now: float) -> None:
        if w.state == _WAITING:
            w.state = _CANCELLED
            self._pwaiters.pop(w.ticket, None)
            self.program.cancel(w.ticket)
            self._counters.inc(C_CANCELLED)
            self._counters.inc(_C_DECISION[Outcome.CANCELLED])
            self._observe_wait(now - w.enqueued_at)
            if not w.future.done():
                w.future.set_result(_BYPASS_CANCELLED)
            self._program_drain(now)
        else:  # granted in the race: the turn it started ends unforwarded
            self._program_turn_ended(w.ticket, now)

    def _program_release_all(self, outcome: Outcome) -> None:
        now = self._clock()
        waiters = list(self._pwaiters.values())
        self._pwaiters.clear()
        for w in waiters:
            self.program.cancel(w.ticket)
            w.state = _RESOLVED
            decision = self._program_decision(
                w.ticket, w.session, outcome, w.tokens, now - w.enqueued_at
            )
            if not w.future.done():
                w.future.set_result(decision)
        if self._ptimer is not None:
            self._ptimer.cancel()
            self._ptimer = None
        self._ptimer_at = math.inf

    def _program_arm(self, now: float) -> None:
        """Arm the deadline timer for the earliest waiting deadline (nothing overstays)."""
        deadline = self.program.next_deadline(now) if self._pwaiters else None
        if deadline is None:
            if self._ptimer is not None:
                self._ptimer.cancel()
                self._ptimer = None
            self._ptimer_at = math.inf
            return
        if deadline == self._ptimer_at and self._ptimer is not None:
            return
        if self._ptimer is not None:
            self._ptimer.cancel()
        self._ptimer_at = deadline
        loop = asyncio.get_running_loop()
        self._ptimer = loop.call_later(max(0.0, deadline - now), self._on_program_timer)

    def _on_program_timer(self) -> None:
        self._ptimer = None
        self._ptimer_at = math.inf
        try:
            self._program_drain(self._clock())
        except Exception:
            self._log.warning("ptimer", "admission: program timer failed", exc_info=True)

    def tick(self) -> None:
        """One program-admission tick now (the tick loop calls it every ``tick_s``)."""
        now = self._clock()
        self._program_apply(self.program.tick(now))
        self._sync_events()
        self._program_arm(now)

    def _sync_events(self) -> None:
        """Carry the core's event counts into the counters (deltas since last time)."""
        seen = self._events_seen
        for name, value in self.program.events.items():
            delta = value - seen.get(name, 0)
            if delta > 0:
                self._counters.inc(_C_EVENT[Event(name)], delta)
            seen[name] = value

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.sleep(self.program.p.tick_s)
                if self.program_active or self.program.ledger.sessions:
                    self.tick()
                else:
                    loop.time()  # nothing to do
            except asyncio.CancelledError:
                raise
            except Exception:
                self._counters.inc(C_POLL_ERROR)
                self._log.warning("tick", "admission: tick failed", exc_info=True)

    def program_snapshot(self, now: float | None = None) -> catalogue.ProgramSnapshot:
        """Program admission now: the one snapshot stats, /metrics and health render."""
        return catalogue.take(
            self.program,
            self.placement,
            self._clock() if now is None else now,
            active=self.program_active,
            mode=self._cfg.mode,
            fallback=self.fallback_reason,
            priority_steering=self.priority_steering,
        )

    # -- aging timer -------------------------------------------------------------------

    def _arm_timer(self, now: float) -> None:
        # After a drain each head, if any, is a live waiter; arm for the earlier one.
        first = math.inf
        for order in (self._cont, self._new):
            if order and order[0].state == _WAITING and order[0].enqueued_at < first:
                first = order[0].enqueued_at
        if first == math.inf:
            self._cancel_timer()
            return
        deadline = first + self._cfg.max_wait_s
        if deadline == self._timer_deadline and self._timer is not None:
            return
        self._cancel_timer()
        self._timer_deadline = deadline
        delay = max(0.0, deadline - now)
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_deadline = math.inf

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline = math.inf
        try:
            self._drain(self._clock())
        except Exception:
            self._log.warning("timer", "admission: aging timer failed", exc_info=True)

    # -- polling -----------------------------------------------------------------------

    async def _http_fetch(self, url: str) -> str:
        assert self._http is not None
        timeout = aiohttp.ClientTimeout(total=self._cfg.metrics_timeout_s)
        async with self._http.get(join(url, "/metrics"), timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text(errors="replace")

    async def _scrape(self, url: str) -> str:
        return await asyncio.wait_for(self._fetch(url), self._cfg.metrics_timeout_s)

    async def poll_once(self) -> None:
        """Scrape every healthy engine once and reconcile the ledger; never raises."""
        try:
            urls = list(dict.fromkeys(self._healthy_engines()))
            self.refresh_placement(urls)
            await self._probe_engines(urls)
            results = await asyncio.gather(*(self._scrape(u) for u in urls), return_exceptions=True)
            now = self._clock()
            ledger = self.ledger
            ledger.retain(urls)
            for url, result in zip(urls, results, strict=True):
                if isinstance(result, BaseException):
                    self._counters.inc(C_SCRAPE_FAILURE)
                    self._log.warning(
                        "scrape:" + url, "admission: /metrics of %s failed: %r", url, result
                    )
                    continue
                m = parse_engine_metrics(result)
                fresh = ledger.observe(
                    url,
                    now=now,
                    max_total_num_tokens=m.max_total_num_tokens,
                    token_usage=m.token_usage,
                    num_used_tokens=m.num_used_tokens,
                )
                if not fresh:
                    self._counters.inc(C_SCRAPE_FAILURE)
                    self._log.warning(
                        "usage:" + url, "admission: /metrics of %s has no KV usage gauges", url
                    )
            self._program_observe(urls, results, now)
            await self._check_router_diversion()
            ledger.reconcile(now)
            expired = ledger.expire(now)
            if expired:
                self._counters.inc(C_LEASE_EXPIRED, len(expired))
            idle = ledger.expire_sessions(now, self._cfg.session_idle_s)
            if idle:
                self._counters.inc(C_RESIDENCY_EXPIRED, len(idle))
            self._sync_evicted()
            self._prune_tombstones(now)
            self._drain(now)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._counters.inc(C_POLL_ERROR)
            self._log.warning("poll", "admission: poll iteration failed", exc_info=True)

    def _prune_tombstones(self, now: float) -> None:
        ttl = self._cfg.lease_ttl_s
        tomb = self._tombstones
        while tomb:
            ticket, at = next(iter(tomb.items()))
            if now - at <= ttl:
                break
            del tomb[ticket]

    async def _poll_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self._cfg.poll_interval_s
        while True:
            try:
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                next_at = loop.time() + self._cfg.poll_interval_s
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # poll_once never raises; belt and braces
                self._counters.inc(C_POLL_ERROR)
                self._log.warning("loop", "admission: poll loop error", exc_info=True)

    # -- metrics -----------------------------------------------------------------------

    def _observe_wait(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self._hist_sum += seconds
        for i, bound in enumerate(WAIT_BUCKETS):
            if seconds <= bound:
                self._hist_counts[i] += 1
                return
        self._hist_counts[-1] += 1

    def _sync_evicted(self) -> None:
        evicted = self.ledger.residency_evicted
        if evicted > self._evicted_seen:
            self._counters.inc(C_RESIDENCY_EVICTED, evicted - self._evicted_seen)
        self._evicted_seen = evicted

    @property
    def waiting(self) -> int:
        return len(self._waiters) + len(self._pwaiters)

    @property
    def waiting_continuing(self) -> int:
        return self._n_cont

    @property
    def waiting_new(self) -> int:
        return len(self._waiters) - self._n_cont + self.program_waiting_new

    @property
    def program_waiting_new(self) -> int:
        return sum(q.live_new for q in self.program.queues.by_engine.values())

    def _waiting_gauges(self, snap: catalogue.ProgramSnapshot) -> dict[str, float]:
        return {
            _A + "waiting": float(len(self._waiters) + len(self._pwaiters)),
            _A + "waiting_continuing": float(self._n_cont),
            _A + "waiting_new": float(len(self._waiters) - self._n_cont + snap.waiting_new),
            _A + "waiting_paused": float(snap.waiting_paused),
        }

    @staticmethod
    def _rates(values: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        events = values[C_ADMIT] + values[C_WAIT] + values[C_BYPASS]
        if events > 0:
            out[_A + "defer_rate"] = values[C_WAIT] / events
            out[_A + "degraded_rate"] = values[C_BYPASS_DEGRADED] / events
        if values[C_WAIT_GRANTED] > 0:
            out[_A + "wait_seconds_mean"] = values[C_WAIT_SECONDS_SUM] / values[C_WAIT_GRANTED]
        return out

    def totals(self) -> Mapping[str, float]:
        """Cumulative counters since start (never reset by the stats window)."""
        self._sync_evicted()
        return self._counters.total_items()

    def oldest_wait_s(self) -> float:
        """How long the longest-waiting request has been held so far (0 when none)."""
        now = self._clock()
        oldest = next(iter(self._waiters.values()), None)
        first = math.inf if oldest is None else oldest.enqueued_at
        entry = self.program.queues.oldest()
        if entry is not None:
            first = min(first, entry.enqueued_at)
        return 0.0 if first == math.inf else max(0.0, now - first)

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """``agentic_kv/admission/*`` and ``agentic_kv/budget/*`` over the current window.

        Counters count events since the last reset. As in the Relax V2 design,
        ``defer_rate`` / ``degraded_rate`` appear only when there was a decision,
        ``wait_seconds_mean`` only when a request was admitted after waiting,
        ``reserved_utilization`` only when the ceiling is positive and
        ``lease_expired`` only when non-zero. ``reset=True`` then closes the window:
        counters restart and the usage window restarts at the current level.
        """
        self._sync_evicted()
        self._sync_events()
        window = self._counters.window_items()
        out: dict[str, float] = {_A + "enabled": 1.0 if self._cfg.enabled else 0.0}
        for name in _STATS_COUNTERS:
            if name == C_LEASE_EXPIRED and not window[name]:
                continue
            out[name] = window[name]
        for name in _PROGRAM_COUNTERS:
            out[name] = window.get(name, 0.0)
        snap = self.program_snapshot()
        out.update(self._waiting_gauges(snap))
        out.update(catalogue.gauges(snap))
        out.update(self._rates(window))
        out.update(self.ledger.snapshot(self._clock(), reset_usage_window=reset))
        if reset:
            self._counters.reset_window()
        return out

    def health(self) -> AdmissionHealth:
        now = self._clock()
        ledger = self.ledger
        return AdmissionHealth(
            enabled=self._cfg.enabled,
            degraded=ledger.is_degraded(now),
            epoch=ledger.epoch,
            ceiling=ledger.ceiling,
            reserved=ledger.reserved,
            resident=ledger.resident_total,
            resident_sessions=ledger.resident_sessions,
            committed=ledger.committed,
            session_residency=self._residency,
            program=self.program_snapshot(now),
            pressure=ledger.pressure,
            lease_count=ledger.lease_count,
            waiting=len(self._waiters) + len(self._pwaiters),
            waiting_continuing=self._n_cont,
            waiting_new=len(self._waiters) - self._n_cont + self.program_waiting_new,
            engines=tuple(ledger.engines(now)),
        )

    def collect(self) -> Iterable[Metric]:
        """prometheus-client custom collector: counters, gauges, wait histogram."""
        self._sync_evicted()
        self._sync_events()
        totals = self._counters.total_items()
        exported = WindowedCounters()
        for name in _STATS_COUNTERS:
            exported.inc(name, totals[name])
        for name in _PROGRAM_COUNTERS:
            exported.inc(name, totals.get(name, 0.0))
        yield from counter_families(exported, _HELP)

        now = self._clock()
        snap = self.program_snapshot(now)
        ledger = self.ledger
        degraded = ledger.is_degraded(now)
        gauges: dict[str, float] = {
            _A + "enabled": 1.0 if self._cfg.enabled else 0.0,
            **self._waiting_gauges(snap),
            **catalogue.gauges(snap),
            **self._rates(totals),
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
            _B + "degraded": 1.0 if degraded else 0.0,
            _B + "engines_fresh": float(ledger.fresh_count),
            _B + "engines_stale": float(sum(1 for e in ledger.engines(now) if not e.fresh)),
        }
        yield from gauge_families(gauges, _HELP)
        yield from _engine_families(ledger.engines(now))
        yield from catalogue.engine_families(snap)

        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(WAIT_BUCKETS, self._hist_counts, strict=False):
            cumulative += count
            buckets.append((_le(bound), float(cumulative)))
        cumulative += self._hist_counts[-1]
        buckets.append(("+Inf", float(cumulative)))
        hist = HistogramMetricFamily(
            WAIT_HISTOGRAM,
            "Seconds each request spent in the admission FIFO (any outcome).",
        )
        hist.add_metric([], buckets, self._hist_sum)
        yield hist


def _engine_families(engines: Iterable[EngineView]) -> Iterator[Metric]:
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


def _le(bound: float) -> str:
    return floatToGoString(bound)


# ---------------------------------------------------------------------- program mode

_PROGRAM_LEASE = "p:"
_HELP.update(PROGRAM_HELP)


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def _residency_of(cfg: AdmissionConfig) -> bool:
    return cfg.session_residency and cfg.mode != "request"


def token_scaled(cfg: AdmissionConfig, k: int) -> AdmissionConfig:
    """``cfg`` with its token counts divided by the engines' token scale ``k`` (1: as is)."""
    if k == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        default_completion_tokens=max(1, round(cfg.default_completion_tokens / k)),
        expected_decode_cap=(
            None if cfg.expected_decode_cap is None else max(1, round(cfg.expected_decode_cap / k))
        ),
        priority_unit_tokens=max(1, round(cfg.priority_unit_tokens / k)),
        session_buffer_tokens=max(0, round(cfg.session_buffer_tokens / k)),
    )


def _scaled(cfg: AdmissionConfig, k: float) -> AdmissionConfig:
    """``cfg`` with the fleet path's durations multiplied by the time scale ``k``."""
    if k == 1.0:
        return cfg
    return dataclasses.replace(
        cfg,
        max_wait_s=cfg.max_wait_s * k,
        poll_interval_s=cfg.poll_interval_s * k,
        staleness_s=None if cfg.staleness_s is None else cfg.staleness_s * k,
        lease_ttl_s=cfg.lease_ttl_s * k,
        session_idle_s=cfg.session_idle_s * k,
    )


_BRANCH_RE = re.compile(
    r'^smg_consistent_hashing_policy_branch_total\{[^}]*branch="([a-z_]+)"[^}]*\}\s+(\S+)', re.M
)
# Branches of smg's consistent_hashing policy that send a request somewhere other than
# its ring owner (policies/consistent_hashing.rs). Overload protection filters workers
# before the policy runs, so those diversions show as routing_key_hit: no smg counter
# tells them apart (hence --disable-worker-overload-protection in the contract).
_OFF_RING = frozenset({"random_fallback", "no_healthy_workers", "target_worker_miss"})


def diverted_requests(text: str) -> float | None:
    """Sum of smg's off-ring branch counters in its /metrics text; None when absent."""
    found = False
    total = 0.0
    for branch, value in _BRANCH_RE.findall(text):
        found = True
        if branch in _OFF_RING:
            try:
                total += float(value)
            except ValueError:
                continue
    return total if found else None
