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
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvproxy.admission import classify
from kvproxy.admission.ledger import (
    CAPACITY_AVAILABLE,
    DEGRADED,
    OVERSIZED,
    EngineView,
    Ledger,
)
from kvproxy.admission.reservation import ReservationSizer
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.engine_metrics import parse_engine_metrics
from kvproxy.observability import WindowedCounters, counter_families, gauge_families

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


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    ticket_id: str  # unique per forwarded attempt (the rid)
    path: str  # "/generate", "/v1/chat/completions", "/v1/completions"
    headers: Mapping[str, str]  # case-insensitive mapping (aiohttp CIMultiDictProxy)
    body: Mapping[str, Any]  # parsed JSON object
    session_id: str | None


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "admit" | "bypass" | "pass"
    # capacity_available | protected | degraded | aged | oversized | queue_full |
    # cancelled | disabled | out_of_scope
    reason: str
    lease_id: str | None
    tokens: int
    wait_s: float


_PASS_DISABLED = Decision(PASS, R_DISABLED, None, 0, 0.0)
_PASS_OUT_OF_SCOPE = Decision(PASS, R_OUT_OF_SCOPE, None, 0, 0.0)
_BYPASS_CANCELLED = Decision(BYPASS, R_CANCELLED, None, 0, 0.0)
_BYPASS_PROTECTED = Decision(BYPASS, R_PROTECTED, None, 0, 0.0)

_WAITING, _RESOLVED, _CANCELLED = 0, 1, 2


class _Waiter:
    __slots__ = ("continuing", "enqueued_at", "future", "session", "state", "ticket", "tokens")

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
        self.state = _WAITING


class _RateLimitedLog:
    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) >= _LOG_INTERVAL_S:
            self._last[key] = now
            log.warning(msg, *args, exc_info=exc_info)


class _Admission(AbstractAsyncContextManager[Decision]):
    """The context manager returned by :meth:`AdmissionController.admit`."""

    __slots__ = ("_aged", "_ctl", "_lease_id", "_req")

    def __init__(self, ctl: AdmissionController, req: AdmissionRequest) -> None:
        self._ctl = ctl
        self._req = req
        self._lease_id: str | None = None
        # Tokens of an aged bypass of a session: noted as its residency at exit.
        self._aged: int | None = None

    async def __aenter__(self) -> Decision:
        ctl = self._ctl
        outcome = ctl._decide(self._req)
        if isinstance(outcome, Decision):
            decision = outcome
        else:
            waiter, shared = outcome
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
        self._lease_id = decision.lease_id
        if decision.reason == R_AGED and self._req.session_id is not None:
            self._aged = decision.tokens
        return decision

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            self._ctl._release(lease_id)
        elif self._aged is not None:
            tokens, self._aged = self._aged, None
            self._ctl._aged_turn_ended(self._req, tokens)


class AdmissionController:
    """Program-aware admission in front of the router. See the module docstring."""

    def __init__(
        self,
        cfg: AdmissionConfig,
        *,
        healthy_engines: Callable[[], Sequence[str]],
        http: aiohttp.ClientSession | None,
        clock: Callable[[], float] = time.monotonic,
        fetch_metrics: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        if http is None and fetch_metrics is None:
            raise ValueError("AdmissionController needs http or fetch_metrics")
        self._cfg = cfg
        self._healthy_engines = healthy_engines
        self._http = http
        self._clock = clock
        self._fetch = fetch_metrics or self._http_fetch
        self.ledger = Ledger(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=cfg.session_residency,
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
        self._log = _RateLimitedLog()

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def config(self) -> AdmissionConfig:
        return self._cfg

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    async def start(self) -> None:
        """If enabled: one poll, then the background poll task. Safe when disabled."""
        if not self._cfg.enabled or self._poll_task is not None:
            return
        await self.poll_once()
        self._poll_task = asyncio.create_task(self._poll_loop(), name="kvproxy-admission-poll")

    async def stop(self) -> None:
        """Stop polling and the aging timer; every waiter leaves as bypass/degraded."""
        await self._stop_polling()
        self._cancel_timer()
        self._release_all_waiters(R_DEGRADED)
        self.ledger.clear_engines()
        self.ledger.clear_residency()

    async def reconfigure(self, cfg: AdmissionConfig) -> None:
        """Hot reload. Thresholds apply to the next decision; toggling starts or stops."""
        was_enabled = self._cfg.enabled
        self._cfg = cfg
        self.ledger.configure(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=cfg.session_residency,
        )
        self._sizer.configure(cfg)
        if was_enabled and not cfg.enabled:
            await self._stop_polling()
            self._cancel_timer()
            self._release_all_waiters(R_DISABLED)
            self.ledger.clear_engines()
            self.ledger.clear_residency()
        elif cfg.enabled and not was_enabled:
            await self.start()
        elif cfg.enabled:
            self._cancel_timer()  # max_wait_s may have changed: re-arm from scratch
            self._drain(self._clock())

    async def _stop_polling(self) -> None:
        task, self._poll_task = self._poll_task, None
        if task is not None:
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

    def admit(self, req: AdmissionRequest) -> AbstractAsyncContextManager[Decision]:
        """Decide for one upstream attempt; see the module docstring for the order.

        The decision is made when the ``async with`` block is entered. If the task is
        cancelled while waiting, the ticket is cancelled atomically (the waiter leaves
        the FIFO and is counted ``cancelled``, or a lease granted in the race is
        released) and CancelledError propagates. A granted lease is released exactly
        once when the block exits, on every path.
        """
        return _Admission(self, req)

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
        sid = req.session_id if cfg.session_residency else None
        continuing = ledger.is_resident(sid)
        if req.session_id is not None and not continuing:
            # A session's first request: what it finds cached is the shared prefix.
            first_turns = self._first_turns
            first_turns[ticket] = True
            if len(first_turns) > _FIRST_TURNS_MAX:
                del first_turns[next(iter(first_turns))]
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
        if reason == DEGRADED:
            return self._bypass(R_DEGRADED, tokens)
        if reason == OVERSIZED:
            return self._bypass(R_OVERSIZED, tokens)
        if len(self._waiters) >= cfg.max_queue:
            return self._bypass(R_QUEUE_FULL, tokens)
        # Wait in its FIFO (capacity_exhausted / pressure_guard, or an earlier waiter).
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
        if not queued:
            self._drain(now)  # ages it at once when max_wait_s == 0; arms the timer
        return waiter, False

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
        if self.ledger.release(lease_id, now) is not None and self._waiters:
            self._drain(now)

    def _aged_turn_ended(self, req: AdmissionRequest, tokens: int) -> None:
        """An aged (lease-less) turn of a session ended: the session is resident now."""
        if self._cfg.enabled and self._cfg.session_residency and req.session_id is not None:
            self.ledger.note_unleased_turn(req.session_id, tokens, self._clock())

    def end_session(self, session_id: str) -> None:
        """The session closed: drop its residency (idempotent), freeing room for new ones.

        Its waiting requests are not touched (the caller cancels tickets it owns); a
        lease of it still live is released normally but adds no residency.
        """
        if self.ledger.end_session(session_id):
            self._counters.inc(C_SESSION_ENDED)
            if self._waiters:
                self._drain(self._clock())

    def observe_prompt_tokens(self, req: AdmissionRequest, prompt_tokens: int) -> None:
        """Calibrate the text-prompt estimate from an engine-reported ``prompt_tokens``."""
        self.observe_usage(req, prompt_tokens, None)

    def observe_usage(
        self, req: AdmissionRequest, prompt_tokens: int | None, cached_tokens: int | None
    ) -> None:
        """Learn from what an engine reported for a finished request: the prompt size of
        a text prompt, and (for a session's first request) the shared cached prefix."""
        first_turn = self._first_turns.pop(req.ticket_id, False)
        if not self._cfg.enabled:
            return
        try:
            if prompt_tokens is not None:
                self._sizer.observe(req.body, req.session_id, int(prompt_tokens))
            if first_turn and cached_tokens is not None:
                self._sizer.observe_shared(int(cached_tokens))
        except Exception:
            self._log.warning("calibrate", "admission: calibration failed", exc_info=True)

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
        async with self._http.get(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text(errors="replace")

    async def _scrape(self, url: str) -> str:
        return await asyncio.wait_for(self._fetch(url), self._cfg.metrics_timeout_s)

    async def poll_once(self) -> None:
        """Scrape every healthy engine once and reconcile the ledger; never raises."""
        try:
            urls = list(dict.fromkeys(self._healthy_engines()))
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
        return len(self._waiters)

    @property
    def waiting_continuing(self) -> int:
        return self._n_cont

    @property
    def waiting_new(self) -> int:
        return len(self._waiters) - self._n_cont

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
        oldest = next(iter(self._waiters.values()), None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest.enqueued_at)

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
        window = self._counters.window_items()
        out: dict[str, float] = {_A + "enabled": 1.0 if self._cfg.enabled else 0.0}
        for name in _STATS_COUNTERS:
            if name == C_LEASE_EXPIRED and not window[name]:
                continue
            out[name] = window[name]
        out[_A + "waiting"] = float(len(self._waiters))
        out[_A + "waiting_continuing"] = float(self._n_cont)
        out[_A + "waiting_new"] = float(len(self._waiters) - self._n_cont)
        out.update(self._rates(window))
        out.update(self.ledger.snapshot(self._clock(), reset_usage_window=reset))
        if reset:
            self._counters.reset_window()
        return out

    def health(self) -> dict[str, Any]:
        now = self._clock()
        ledger = self.ledger
        degraded = ledger.is_degraded(now)
        engines = [
            {
                "url": e.url,
                "fresh": e.fresh,
                "token_usage": e.token_usage,
                "max_total_num_tokens": e.max_total_num_tokens,
                "age_s": None if e.age_s is None else round(e.age_s, 3),
            }
            for e in ledger.engines(now)
        ]
        return {
            "enabled": self._cfg.enabled,
            "degraded": degraded,
            "epoch": ledger.epoch,
            "ceiling": ledger.ceiling,
            "reserved": ledger.reserved,
            "resident": ledger.resident_total,
            "resident_sessions": ledger.resident_sessions,
            "committed": ledger.committed,
            "session_residency": self._cfg.session_residency,
            "pressure": ledger.pressure,
            "lease_count": ledger.lease_count,
            "waiting": len(self._waiters),
            "waiting_continuing": self._n_cont,
            "waiting_new": len(self._waiters) - self._n_cont,
            "engines_fresh": sum(1 for e in engines if e["fresh"]),
            "engines_stale": sum(1 for e in engines if not e["fresh"]),
            "engines": engines,
        }

    def collect(self) -> Iterable[Metric]:
        """prometheus-client custom collector: counters, gauges, wait histogram."""
        self._sync_evicted()
        totals = self._counters.total_items()
        exported = WindowedCounters()
        for name in _STATS_COUNTERS:
            exported.inc(name, totals[name])
        yield from counter_families(exported, _HELP)

        now = self._clock()
        ledger = self.ledger
        degraded = ledger.is_degraded(now)
        gauges: dict[str, float] = {
            _A + "enabled": 1.0 if self._cfg.enabled else 0.0,
            _A + "waiting": float(len(self._waiters)),
            _A + "waiting_continuing": float(self._n_cont),
            _A + "waiting_new": float(len(self._waiters) - self._n_cont),
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
