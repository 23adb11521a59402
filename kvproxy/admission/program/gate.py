"""Program admission on the event loop (asyncio shell; docs/admission.md#program-mode).

:class:`ProgramGate` wraps the pure :class:`~kvproxy.admission.program.core.ProgramCore`
(per-engine ledgers and queues, time injected) with what needs the loop: the futures
of turns waiting in the core's queues, the timer armed for their next deadline, the
mirror of the router's consistent-hashing ring (:class:`~kvproxy.fleet.placement.Placement`)
and the engines' ``/server_info`` (eviction policy, context length). Its decisions
are counted in the controller's counters (``agentic_kv/admission/decision_<outcome>``
and the counters both modes share) and its events carried over from the core
(``event_<event>``).

It is the :class:`~kvproxy.admission.gate.Gate` of
:attr:`~kvproxy.admission.records.Mode.PROGRAM`: the controller
(:mod:`kvproxy.admission.coordinator`) routes to it when program admission is active
(mode ``program``, ledger ``engine`` and a router policy kvproxy can mirror);
otherwise the fleet-wide ledger decides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvproxy.admission import catalogue
from kvproxy.admission.catalogue import (
    _C_DECISION,
    _C_EVENT,
    C_ADMIT,
    C_BYPASS,
    C_CANCELLED,
    C_PAUSED_WAIT_COUNT,
    C_PAUSED_WAIT_SUM,
    C_WAIT,
    C_WAIT_GRANTED,
    C_WAIT_NEW_SESSION,
    C_WAIT_SECONDS_SUM,
)
from kvproxy.admission.program.core import ProgramCore, Release
from kvproxy.admission.program.events import Event
from kvproxy.admission.program.prefetch_sender import Prefetcher
from kvproxy.admission.records import BYPASS_CANCELLED, AdmissionRequest, Decision, Mode, Outcome
from kvproxy.admission.report import WaitHistogram
from kvproxy.admission.reservation import expected_output
from kvproxy.admission.waiters import Waiter, WaiterEvent, WaiterState, Wakeup
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.engine_info import EngineSessionMode, parse_server_info
from kvproxy.fleet.placement import Placement
from kvproxy.observability import RateLimitedLog, WindowedCounters
from kvproxy.urls import base_url

# Its lines keep the logger they always had: operators filter on it.
log = logging.getLogger("kvproxy.admission.coordinator")

# Program mode's lease ids, as shown: this prefix and the ticket (the turn it started).
# A lease is routed back by its Decision's mode, never by this prefix.
LEASE_PREFIX = "p:"

Workers = Callable[[], tuple[Sequence[str], Sequence[str]]]


class ProgramGate:
    """Program admission's waiters, timer, ring mirror and engine modes."""

    mode = Mode.PROGRAM

    def __init__(
        self,
        core: ProgramCore,
        cfg: AdmissionConfig,
        *,
        router_policy: str | None,
        workers: Workers | None,
        counters: WindowedCounters,
        waits: WaitHistogram,
        clock: Callable[[], float],
        log: RateLimitedLog,
        size: Callable[[AdmissionRequest], tuple[int, int] | None],
        first_turn: Callable[[str], None],
    ) -> None:
        """``cfg``: the controller's (time-scaled) config, replaced on a reload;
        ``workers``: the ring's worker URLs and the available ones (None: the polled
        engines); ``size``: a request's reservation and its completion part (None:
        unreadable);
        ``first_turn``: note a session's first turn's ticket."""
        self.core = core
        self.cfg = cfg
        self.placement = Placement(router_policy or "unknown")
        self.modes: dict[str, EngineSessionMode] = {}
        self.waiters: dict[str, Waiter] = {}
        self._workers = workers
        self._counters = counters
        self._waits = waits
        self._clock = clock
        self._log = log
        self._size = size
        self._first_turn = first_turn
        self._wake = Wakeup(self._on_timer)
        self._fallback_logged = False
        self._events_seen: dict[str, int] = {}
        # The prefetches' shell (kvproxy.admission.program.prefetch_sender), set by the controller.
        self.prefetcher: Prefetcher | None = None

    # -- when it decides ---------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Program admission with per-engine ledgers: mode program, ledger engine, and a
        router policy kvproxy can mirror. Otherwise the fleet-wide path decides."""
        cfg = self.cfg
        return (
            cfg.enabled
            and cfg.mode == "program"
            and cfg.ledger == "engine"
            and self.placement.mirrored
        )

    @property
    def fallback_reason(self) -> str | None:
        """Why program mode uses fleet-wide accounting (None when it does not)."""
        cfg = self.cfg
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

    def say_fallback(self) -> None:
        reason = self.fallback_reason
        if reason and not self._fallback_logged:
            self._fallback_logged = True
            log.warning("admission: %s", reason)

    def set_router_policy(self, policy: str) -> None:
        workers, available = self.placement.workers, self.placement.available
        self.placement = Placement(policy)
        self.placement.update(workers, available)
        self._fallback_logged = False
        self.say_fallback()
        self.check_active()

    def check_active(self) -> None:
        """Program mode switched off (reload, policy change): its waiters go (fail open)."""
        if not self.active and self.waiters:
            self.release_all(Outcome.BYPASS_NO_PLACEMENT)
        elif self.active:
            self.drain(self._clock())

    def set_workers(self, workers: Sequence[str], available: Sequence[str] | None) -> None:
        snapshot = (tuple(workers), tuple(workers if available is None else available))
        self._workers = lambda: snapshot
        self.refresh_placement()

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
        core = self.core
        owner = self.placement.owner
        moved = core.reattribute({sid: owner(sid) for sid in core.ledger.sessions}, self._clock())
        if moved:
            log.info("admission: %d session(s) moved to another engine", moved)
        return moved

    def set_server_info(self, url: str, info: Mapping[str, Any]) -> None:
        self.note_mode(parse_server_info(base_url(url), info))

    def note_mode(self, mode: EngineSessionMode) -> None:
        self.modes[mode.url] = mode
        self.core.ledger.set_context_length(mode.url, mode.context_length)
        self.core.ledger.set_host_write_policy(mode.url, mode.hicache_write_policy)

    @property
    def priority_steering(self) -> bool:
        """Inject priorities: configured, and every known engine evicts by priority."""
        if not (self.cfg.priority_steering and self.modes):
            return False
        return all(m.eviction_policy == "priority" for m in self.modes.values())

    # -- decisions ---------------------------------------------------------------------

    def decide(self, req: AdmissionRequest) -> Decision | tuple[Waiter, bool]:
        """Program admission's decision for an in-scope, unprotected request, or its
        waiter (and whether it is another attempt's, shared)."""
        ticket = req.ticket_id
        existing = self.waiters.get(ticket)
        if existing is not None:
            return existing, True
        now = self._clock()
        core = self.core
        sid = req.session_id
        sized = self._size(req)
        tokens, decode = (0, None) if sized is None else sized
        owner = None if sid is None else self.placement.owner(req.routing_key or sid)
        if sid is not None and core.ledger.get(sid) is None:
            self._first_turn(ticket)
        if sid is not None and req.parent_id is not None:
            core.ledger.link(sid, req.parent_id)  # a lead counts while its child runs
        verdict = core.request(ticket, sid, owner, tokens, now, decode=decode)
        if core.p.prefetch and sid is not None and self.prefetcher is not None:
            self.prefetcher.keep(req)
        # Dynamo's agent_hints.osl: the session grows by at least that much per turn.
        core.hint_growth(sid, expected_output(req.body))
        if verdict.outcome is not None:
            self.drain(now)
            return self._decision(ticket, sid, verdict.outcome, tokens, 0.0)
        future = asyncio.get_running_loop().create_future()
        waiter = self.waiters[ticket] = Waiter(ticket, tokens, now, future, sid, Mode.PROGRAM)
        self._counters.inc(C_WAIT)
        if sid is not None and verdict.held is not None and verdict.held.value.startswith("new"):
            self._counters.inc(C_WAIT_NEW_SESSION)
        self._arm(now)
        return waiter, False

    def _decision(
        self, ticket: str, sid: str | None, outcome: Outcome, tokens: int, wait_s: float
    ) -> Decision:
        c = self._counters
        c.inc(_C_DECISION[outcome])
        started = outcome not in (Outcome.BYPASS_NO_SESSION, Outcome.CANCELLED) and (
            ticket in self.core._inflight
        )
        if outcome.fail_open:
            c.inc(C_BYPASS)
        else:
            c.inc(C_ADMIT)
            if outcome.waited:
                c.inc(C_WAIT_GRANTED)
                c.inc(C_WAIT_SECONDS_SUM, wait_s)
        prio = self.core.priority(sid) if self.priority_steering else None
        if not started:
            return Decision(outcome.action, outcome, None, tokens, wait_s, prio)
        lease = LEASE_PREFIX + ticket
        return Decision(outcome.action, outcome, lease, tokens, wait_s, prio, Mode.PROGRAM)

    def _apply(self, releases: Sequence[Release]) -> None:
        for r in releases:
            w = self.waiters.pop(r.ticket, None)
            if w is None:
                # Nobody awaits it (cancelled in a race): end the turn it started.
                self.core.turn_ended(r.ticket, self._clock())
                continue
            w.on(WaiterEvent.RESOLVE)
            self._waits.observe(r.wait_s)
            if r.outcome in (Outcome.RESUMED_WAITED, Outcome.PAUSED_AGED):
                self._counters.inc(C_PAUSED_WAIT_SUM, r.wait_s)
                self._counters.inc(C_PAUSED_WAIT_COUNT)
            decision = self._decision(r.ticket, w.session, r.outcome, w.tokens, r.wait_s)
            if not w.future.done():
                w.future.set_result(decision)
            else:
                self.core.turn_ended(r.ticket, self._clock())

    def drain(self, now: float) -> None:
        if self.waiters:
            self._apply(self.core.drain(now))
        self._arm(now)

    def release(self, lease_id: str, ticket: str, now: float) -> None:
        """The turn that holds the lease (the request ``ticket`` started) ended."""
        self.turn_ended(ticket, now)

    def end_session(self, session_id: str, now: float) -> bool:
        """The session closed: it leaves its engine's ledger at once (its waiting
        turns stay queued) and its prefetch is forgotten; the next may fit now."""
        if self.prefetcher is not None:
            self.prefetcher.forget(session_id)
        if not self.core.end_session(session_id, now):
            return False
        self.drain(now)
        return True

    def configure(self, cfg: AdmissionConfig) -> None:
        """A reloaded (scaled) config; the prompts kept for prefetch follow its bounds."""
        self.cfg = cfg
        if self.prefetcher is not None:
            self.prefetcher.prompts.max_bytes = cfg.prefetch_max_bytes
            if not (cfg.enabled and cfg.prefetch):
                self.prefetcher.prompts.clear()

    def rearm(self) -> None:
        self.check_active()

    def oldest(self) -> float | None:
        entry = self.core.queues.oldest()
        return None if entry is None else entry.enqueued_at

    def turn_ended(self, ticket: str, now: float) -> None:
        self.core.turn_ended(ticket, now)
        if self.waiters:
            self.drain(now)

    def cancel(self, w: Waiter, now: float) -> None:
        """The awaiting task was cancelled: the turn leaves its queue, or (granted in
        the race) the turn it started ends unforwarded."""
        if w.state == WaiterState.WAITING:
            w.on(WaiterEvent.CANCEL)
            self.waiters.pop(w.ticket, None)
            self.core.cancel(w.ticket)
            self._counters.inc(C_CANCELLED)
            self._counters.inc(_C_DECISION[Outcome.CANCELLED])
            self._waits.observe(now - w.enqueued_at)
            if not w.future.done():
                w.future.set_result(BYPASS_CANCELLED)
            self.drain(now)
        else:
            self.turn_ended(w.ticket, now)

    def release_all(self, outcome: Outcome) -> None:
        """Every waiter leaves now with ``outcome`` (stop, reload, mode switched off)."""
        now = self._clock()
        waiters = list(self.waiters.values())
        self.waiters.clear()
        for w in waiters:
            self.core.cancel(w.ticket)
            w.on(WaiterEvent.RESOLVE)
            decision = self._decision(w.ticket, w.session, outcome, w.tokens, now - w.enqueued_at)
            if not w.future.done():
                w.future.set_result(decision)
        self._wake.cancel()

    def _arm(self, now: float) -> None:
        """Arm the deadline timer for the earliest waiting deadline (nothing overstays)."""
        self._wake.arm(self.core.next_deadline(now) if self.waiters else None, now)

    def _on_timer(self) -> None:
        self._wake.fired()
        try:
            self.drain(self._clock())
        except Exception:
            self._log.warning("ptimer", "admission: program timer failed", exc_info=True)

    def tick(self) -> None:
        now = self._clock()
        self._apply(self.core.tick(now))
        if self.core.p.prefetch and self.prefetcher is not None:
            self.prefetcher.send_due(now)
        self.sync_events()
        self._arm(now)

    def tick_if_busy(self) -> None:
        if self.active or self.core.ledger.sessions:
            self.tick()

    def sync_events(self) -> None:
        """Carry the core's event counts into the counters (deltas since last time)."""
        seen = self._events_seen
        for name, value in self.core.events.items():
            delta = value - seen.get(name, 0)
            if delta > 0:
                self._counters.inc(_C_EVENT[Event(name)], delta)
            seen[name] = value

    # -- what it shows -----------------------------------------------------------------

    @property
    def waiting_new(self) -> int:
        return sum(q.live_new for q in self.core.queues.by_engine.values())

    def snapshot(self, now: float) -> catalogue.ProgramSnapshot:
        """Program admission now: the one snapshot stats, /metrics and health render."""
        return catalogue.take(
            self.core,
            self.placement,
            now,
            active=self.active,
            mode=self.cfg.mode,
            fallback=self.fallback_reason,
            priority_steering=self.priority_steering,
        )
