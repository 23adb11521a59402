"""The admission controller: both modes' shells on the event loop (asyncio shell).

One :class:`AdmissionController` lives in the proxy process and is its only writer:
every decision, release, cancellation and poll runs on the event loop without
awaiting in between, so the ledgers and the queues need no lock. What it decides
with is pure and time-injected:

* ledger (request) mode: :class:`~kvproxy.admission.fleet_queue.FleetAdmission`, two
  FIFOs in front of the fleet-wide :class:`~kvproxy.admission.ledger.Ledger`;
* program mode (docs/admission.md#program-mode):
  :class:`~kvproxy.admission.program.ProgramCore`, per-engine ledgers and queues.

What is left here: the futures of waiting requests and the timers that wake them,
the order below, tickets cancelled before they asked (tombstones), calibration from
what the engines report, and the wiring of :mod:`kvproxy.admission.poller` (what is
read from the fleet) and :mod:`kvproxy.admission.report` (stats, health, /metrics).

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
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import aiohttp
from prometheus_client.core import Metric

from kvproxy.admission import catalogue, classify, report
from kvproxy.admission.catalogue import (
    _C_DECISION,
    _C_EVENT,
    C_ADMIT,
    C_BYPASS,
    C_BYPASS_PROTECTED,
    C_CANCELLED,
    C_DIVERTED,
    C_LEASE_EXPIRED,
    C_PAUSED_WAIT_COUNT,
    C_PAUSED_WAIT_SUM,
    C_POLL_ERROR,
    C_RESIDENCY_EVICTED,
    C_RESIDENCY_EXPIRED,
    C_SESSION_ENDED,
    C_WAIT,
    C_WAIT_GRANTED,
    C_WAIT_NEW_SESSION,
    C_WAIT_SECONDS_SUM,
    COUNTERS,
)
from kvproxy.admission.decisions import Event, Outcome
from kvproxy.admission.fleet_queue import FLEET, FleetAdmission, Resolved
from kvproxy.admission.ledger import Ledger
from kvproxy.admission.params import ProgramParams
from kvproxy.admission.poller import Poller, poll_loop, tick_loop
from kvproxy.admission.program import ProgramCore, Release
from kvproxy.admission.records import (
    BYPASS_CANCELLED,
    BYPASS_PROTECTED,
    PASS_DISABLED,
    PASS_OUT_OF_SCOPE,
    Action,
    AdmissionRequest,
    Decision,
    Reason,
)
from kvproxy.admission.report import AdmissionHealth, WaitHistogram, Waiting
from kvproxy.admission.reservation import ReservationSizer, expected_output
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.engine_info import EngineSessionMode, parse_server_info
from kvproxy.fleet.placement import Placement
from kvproxy.observability import RateLimitedLog, WindowedCounters
from kvproxy.urls import base_url

log = logging.getLogger(__name__)

# Bound on remembered first-request tickets (a request that never reports is dropped).
_FIRST_TURNS_MAX = 10_000
# Cancel-before-acquire tombstones: bounded, and forgotten after the lease TTL.
_MAX_TOMBSTONES = 100_000
# Minimum seconds between two log lines of the same kind.
_LOG_INTERVAL_S = 30.0
# Program mode's lease ids: this prefix and the ticket (the turn it started).
_PROGRAM_LEASE = "p:"

_WAITING, _RESOLVED, _CANCELLED = 0, 1, 2


class _Waiter:
    """A request waiting for its decision, in either mode: its future."""

    __slots__ = ("enqueued_at", "future", "program", "session", "state", "ticket", "tokens")

    def __init__(
        self,
        ticket: str,
        tokens: int,
        enqueued_at: float,
        future: asyncio.Future[Decision],
        session: str | None,
        program: bool,
    ) -> None:
        self.ticket = ticket
        self.tokens = tokens
        self.enqueued_at = enqueued_at
        self.future = future
        self.session = session
        self.program = program  # waits in program admission's per-engine queues
        self.state = _WAITING


class _Wakeup:
    """One loop timer for the earliest deadline, re-armed only when that moves."""

    __slots__ = ("at", "fire", "handle")

    def __init__(self, fire: Callable[[], None]) -> None:
        self.fire = fire
        self.handle: asyncio.TimerHandle | None = None
        self.at = math.inf

    def arm(self, deadline: float | None, now: float) -> None:
        if deadline is None:
            self.cancel()
            return
        if deadline == self.at and self.handle is not None:
            return
        self.cancel()
        self.at = deadline
        loop = asyncio.get_running_loop()
        self.handle = loop.call_later(max(0.0, deadline - now), self.fire)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.fired()

    def fired(self) -> None:
        self.handle = None
        self.at = math.inf


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
        try:
            if waiter.future.done():
                decision = waiter.future.result()
            elif shared:
                decision = await asyncio.shield(waiter.future)
            else:
                decision = await waiter.future
        except asyncio.CancelledError:
            if not shared:  # a duplicate never cancels the original's ticket
                self._ctl._cancel_waiter(waiter)
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            # The shared future was cancelled by its first holder, not us.
            decision = BYPASS_CANCELLED
        return self._entered(decision)

    def _entered(self, decision: Decision) -> Decision:
        self._lease_id = decision.lease_id
        if decision.reason == Reason.AGED and self._req.session_id is not None:
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


class AdmissionController:
    """Program-aware admission in front of the router. See the module docstring."""

    def __init__(
        self,
        cfg: AdmissionConfig,
        *,
        healthy_engines: Callable[[], Sequence[str]],
        http: aiohttp.ClientSession | None,
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
        self._log = RateLimitedLog(log, _LOG_INTERVAL_S)
        self._poller = Poller(http, fetch_metrics, lambda: self._cfg.metrics_timeout_s, self._log)
        cfg = token_scaled(cfg, token_scale)
        self._raw_cfg = cfg
        self._time_scale = time_scale
        self._token_scale = token_scale
        cfg = _scaled(cfg, time_scale)
        self._cfg = cfg
        self._healthy_engines = healthy_engines
        self._clock = clock or _loop_time
        self._workers = workers  # None: the healthy engines polled
        self._router_metrics_url = router_metrics_url
        self.placement = Placement(router_policy or "unknown")
        self.program = ProgramCore(ProgramParams.from_config(self._raw_cfg, time_scale))
        self._modes: dict[str, EngineSessionMode] = {}
        for url, info in (server_info or {}).items():
            self.set_server_info(url, info)
        self._pwaiters: dict[str, _Waiter] = {}  # program-mode waiters by ticket
        self._pwake = _Wakeup(self._on_program_timer)
        self._fallback_logged = False
        self._events_seen: dict[str, int] = {}
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
        self._counters = WindowedCounters(COUNTERS)
        self._waits = WaitHistogram()
        self._fleet = FleetAdmission(
            self.ledger,
            self._counters,
            self._waits,
            max_wait_s=cfg.max_wait_s,
            max_queue=cfg.max_queue,
        )
        self._waiters: dict[str, _Waiter] = {}  # ledger-mode waiters by ticket
        self._aging = _Wakeup(self._on_timer)
        self._evicted_seen = 0  # ledger.residency_evicted already counted
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self._poll_task: asyncio.Task[None] | None = None
        self._tick_task: asyncio.Task[None] | None = None

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
        c, lg = self._counters, self._log
        self._poll_task = asyncio.create_task(
            poll_loop(lambda: self._cfg.poll_interval_s, self.poll_once, c, lg),
            name="kvproxy-admission-poll",
        )
        self._tick_task = asyncio.create_task(
            tick_loop(lambda: self.program.p.tick_s, self._tick_if_busy, c, lg),
            name="kvproxy-admission-tick",
        )
        self._say_fallback()

    async def stop(self) -> None:
        """Stop polling and the aging timer; every waiter leaves as bypass/degraded."""
        await self._stop_polling()
        self._aging.cancel()
        self._settle(self._fleet.release_all(Reason.DEGRADED, self._clock()))
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
        self._fleet.configure(max_wait_s=cfg.max_wait_s, max_queue=cfg.max_queue)
        if was_enabled and not cfg.enabled:
            await self._stop_polling()
            self._aging.cancel()
            self._settle(self._fleet.release_all(Reason.DISABLED, self._clock()))
            self._program_release_all(Outcome.BYPASS_NO_METRICS)
            self.program.clear()
            self.ledger.clear_engines()
            self.ledger.clear_residency()
        elif cfg.enabled and not was_enabled:
            await self.start()
        elif cfg.enabled:
            self._aging.cancel()  # max_wait_s may have changed: re-arm from scratch
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

    def _decide(self, req: AdmissionRequest) -> Decision | tuple[_Waiter, bool]:
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
        if self.program_active:
            return self._decide_program(req)
        return self._decide_ledger(req)

    def _size(self, req: AdmissionRequest) -> int | None:
        """The request's reservation in tokens; None when the body cannot be sized."""
        try:
            return self._sizer.size(req.path, req.body, req.session_id).tokens
        except Exception:  # fail open on a body the sizer cannot read
            self._log.warning(
                "size", "admission: cannot size request %s", req.ticket_id, exc_info=True
            )
            return None

    def _decide_ledger(self, req: AdmissionRequest) -> Decision | tuple[_Waiter, bool]:
        """Ledger mode's decision for an in-scope, unprotected request."""
        ticket = req.ticket_id
        ledger = self.ledger
        lease = ledger.lease_for_ticket(ticket)
        if lease is not None:
            return Decision(
                Action.ADMIT, Reason.CAPACITY_AVAILABLE, lease.lease_id, lease.full_tokens, 0.0
            )
        existing = self._waiters.get(ticket)
        if existing is not None:
            return existing, True
        tokens = self._size(req)
        if tokens is None:
            return self._fleet.bypass(Reason.DEGRADED, 0)
        now = self._clock()
        sid = req.session_id if self._residency else None
        continuing = ledger.is_resident(sid)
        if req.session_id is not None and not continuing:
            self._note_first_turn(ticket)
        if self._waiters:
            self._drain(now)
        outcome = self._fleet.offer(ticket, tokens, now, sid, continuing)
        if isinstance(outcome, Decision):
            return outcome
        future = asyncio.get_running_loop().create_future()
        waiter = self._waiters[ticket] = _Waiter(ticket, tokens, now, future, sid, False)
        self._drain(now)  # ages it at once when max_wait_s == 0; arms the timer
        return waiter, False

    def _note_first_turn(self, ticket: str) -> None:
        """A session's first request: what it finds cached is the shared prefix."""
        first_turns = self._first_turns
        first_turns[ticket] = True
        if len(first_turns) > _FIRST_TURNS_MAX:
            del first_turns[next(iter(first_turns))]

    def _drain(self, now: float) -> None:
        """Resolve ledger-mode waiters while the ledger admits them; re-arm the timer."""
        fleet = self._fleet
        if fleet.queues:
            self._settle(fleet.drain(now, self._abandoned))
        self._aging.arm(fleet.next_deadline(), now)

    def _abandoned(self, ticket: str) -> bool:
        # Its task was cancelled (the future with it); the handler has not run yet.
        w = self._waiters.get(ticket)
        return w is None or w.future.done()

    def _settle(self, resolved: Iterable[Resolved]) -> None:
        for entry, decision in resolved:
            w = self._waiters.pop(entry.ticket, None)
            if w is None:
                continue
            if decision is None:
                w.state = _CANCELLED
                continue
            w.state = _RESOLVED
            if not w.future.done():
                w.future.set_result(decision)

    def _cancel_waiter(self, w: _Waiter) -> None:
        """The awaiting task was cancelled: remove the waiter or release a raced lease."""
        now = self._clock()
        if w.program:
            self._program_cancel(w, now)
        elif w.state == _WAITING:
            was_head = self._fleet.cancel(w.ticket, now)
            w.state = _CANCELLED
            if self._waiters.get(w.ticket) is w:
                del self._waiters[w.ticket]
            if not w.future.done():
                w.future.set_result(BYPASS_CANCELLED)
            if was_head:
                self._drain(now)
        elif self.ledger.release_ticket(w.ticket, now, ran=False) is not None:
            self._drain(now)

    def cancel(self, ticket_id: str) -> None:
        """Cancel a ticket from outside its task (e.g. its session closed).

        A waiting ticket leaves its queue and its ``admit`` returns
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
        self._note_mode(parse_server_info(base_url(url), info))

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

    def _decide_program(self, req: AdmissionRequest) -> Decision | tuple[_Waiter, bool]:
        ticket = req.ticket_id
        existing = self._pwaiters.get(ticket)
        if existing is not None:
            return existing, True
        now = self._clock()
        core = self.program
        sid = req.session_id
        tokens = self._size(req)
        if tokens is None:
            tokens = 0
        owner = None if sid is None else self.placement.owner(req.routing_key or sid)
        if sid is not None and core.ledger.get(sid) is None:
            self._note_first_turn(ticket)
        verdict = core.request(ticket, sid, owner, tokens, now)
        # Dynamo's agent_hints.osl: the session grows by at least that much per turn.
        core.hint_growth(sid, expected_output(req.body))
        if verdict.outcome is not None:
            self._program_drain(now)
            return self._program_decision(ticket, sid, verdict.outcome, tokens, 0.0)
        future = asyncio.get_running_loop().create_future()
        waiter = self._pwaiters[ticket] = _Waiter(ticket, tokens, now, future, sid, True)
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
            action = Action.BYPASS
        else:
            c.inc(C_ADMIT)
            action = Action.ADMIT
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
            self._waits.observe(r.wait_s)
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
            self._waits.observe(now - w.enqueued_at)
            if not w.future.done():
                w.future.set_result(BYPASS_CANCELLED)
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
        self._pwake.cancel()

    def _program_arm(self, now: float) -> None:
        """Arm the deadline timer for the earliest waiting deadline (nothing overstays)."""
        self._pwake.arm(self.program.next_deadline(now) if self._pwaiters else None, now)

    def _on_program_timer(self) -> None:
        self._pwake.fired()
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

    def _tick_if_busy(self) -> None:
        if self.program_active or self.program.ledger.sessions:
            self.tick()

    def _sync_events(self) -> None:
        """Carry the core's event counts into the counters (deltas since last time)."""
        seen = self._events_seen
        for name, value in self.program.events.items():
            delta = value - seen.get(name, 0)
            if delta > 0:
                self._counters.inc(_C_EVENT[Event(name)], delta)
            seen[name] = value

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

    # -- ledger mode's aging timer -----------------------------------------------------

    @property
    def _timer(self) -> asyncio.TimerHandle | None:
        return self._aging.handle

    @property
    def _timer_deadline(self) -> float:
        return self._aging.at

    def _on_timer(self) -> None:
        self._aging.fired()
        try:
            self._drain(self._clock())
        except Exception:
            self._log.warning("timer", "admission: aging timer failed", exc_info=True)

    # -- polling -----------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Scrape every healthy engine once and reconcile the ledger; never raises."""
        try:
            urls = list(dict.fromkeys(self._healthy_engines()))
            self.refresh_placement(urls)
            cfg = self._cfg
            if cfg.priority_steering or cfg.growth_reservation:
                for mode in await self._poller.probe(urls, self._modes):
                    self._note_mode(mode)
            results = await self._poller.scrape(urls)
            now = self._clock()
            self._poller.observe(
                urls, results, now, self.ledger, self.program.ledger, self._counters
            )
            await self._check_router_diversion()
            self._housekeep(now)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._counters.inc(C_POLL_ERROR)
            self._log.warning("poll", "admission: poll iteration failed", exc_info=True)

    async def _check_router_diversion(self) -> None:
        """Count requests smg's own counters show routed off the ring (and warn)."""
        url = self._router_metrics_url
        if url is None or not self.program_active:
            return
        diverted = await self._poller.diverted(url)
        if diverted > 0:
            self._counters.inc(C_DIVERTED, diverted)
            self._log.warning(
                "diverted",
                "admission: smg routed %d request(s) off the consistent-hashing ring "
                "(no healthy owner or random fallback): per-engine accounting is off for them",
                int(diverted),
            )

    def _housekeep(self, now: float) -> None:
        """After a poll: leases past their TTL, idle residency, tombstones; then drain."""
        ledger = self.ledger
        ledger.reconcile(now)
        expired = ledger.expire(now)
        if expired:
            self._counters.inc(C_LEASE_EXPIRED, len(expired))
        idle = ledger.expire_sessions(now, self._cfg.session_idle_s)
        if idle:
            self._counters.inc(C_RESIDENCY_EXPIRED, len(idle))
        self._sync_evicted()
        ttl = self._cfg.lease_ttl_s
        tomb = self._tombstones
        while tomb:
            ticket, at = next(iter(tomb.items()))
            if now - at <= ttl:
                break
            del tomb[ticket]
        self._drain(now)

    # -- metrics -----------------------------------------------------------------------

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
        return self._fleet.queues.live_continuing

    @property
    def waiting_new(self) -> int:
        return self._fleet.queues.waiting(FLEET)[1] + self.program_waiting_new

    @property
    def program_waiting_new(self) -> int:
        return sum(q.live_new for q in self.program.queues.by_engine.values())

    def _waiting(self, snap: catalogue.ProgramSnapshot) -> Waiting:
        continuing, new = self._fleet.queues.waiting(FLEET)
        return Waiting(self.waiting, continuing, new + snap.waiting_new)

    def totals(self) -> Mapping[str, float]:
        """Cumulative counters since start (never reset by the stats window)."""
        self._sync_evicted()
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
        self._sync_evicted()
        self._sync_events()
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
        self._sync_evicted()
        self._sync_events()
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
