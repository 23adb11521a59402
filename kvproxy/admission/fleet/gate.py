"""Ledger (request) mode on the event loop (asyncio shell).

:class:`FleetGate` wraps the pure :class:`~kvproxy.admission.fleet.queue.FleetAdmission`
(two FIFOs in front of the fleet-wide ledger, time injected) with what needs the
loop: the future of each waiting request and the aging timer, armed for the earlier
head's ``enqueued_at + max_wait_s`` so that a waiter leaves within a few milliseconds
of ``max_wait_s`` even when nothing else happens. Everything runs on the loop without
awaiting in between: no lock.

It is the :class:`~kvproxy.admission.gate.Gate` of
:attr:`~kvproxy.admission.records.Mode.FLEET`: the controller
(:mod:`kvproxy.admission.coordinator`) routes to it whenever program admission is not
active.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from kvproxy.admission.fleet.queue import FleetAdmission, Resolved
from kvproxy.admission.records import (
    BYPASS_CANCELLED,
    Action,
    AdmissionRequest,
    Decision,
    Mode,
    Outcome,
)
from kvproxy.admission.scaling import residency_of
from kvproxy.admission.waiters import Waiter, WaiterEvent, WaiterState, Wakeup
from kvproxy.config import AdmissionConfig
from kvproxy.observability import RateLimitedLog


class FleetGate:
    """Ledger mode's waiters and aging timer around :class:`FleetAdmission`."""

    mode = Mode.FLEET

    def __init__(
        self,
        fleet: FleetAdmission,
        *,
        residency: bool,
        clock: Callable[[], float],
        log: RateLimitedLog,
        size: Callable[[AdmissionRequest], int | None],
        first_turn: Callable[[str], None],
    ) -> None:
        """``residency``: session residency is on (replaced on a reload); ``size``: a
        request's reservation (None: unreadable); ``first_turn``: note a session's
        first turn's ticket."""
        self.fleet = fleet
        self.ledger = fleet.ledger
        self.residency = residency
        self.waiters: dict[str, Waiter] = {}
        self.aging = Wakeup(self.on_timer)
        self._clock = clock
        self._log = log
        self._size = size
        self._first_turn = first_turn

    def decide(self, req: AdmissionRequest) -> Decision | tuple[Waiter, bool]:
        """Ledger mode's decision for an in-scope, unprotected request, or its waiter
        (and whether it is another attempt's, shared)."""
        ticket = req.ticket_id
        ledger = self.ledger
        lease = ledger.lease_for_ticket(ticket)
        if lease is not None:  # idempotent: the lease it holds
            return Decision(
                Action.ADMIT,
                Outcome.CAPACITY_AVAILABLE,
                lease.lease_id,
                lease.full_tokens,
                0.0,
                mode=Mode.FLEET,
            )
        existing = self.waiters.get(ticket)
        if existing is not None:
            return existing, True
        tokens = self._size(req)
        if tokens is None:
            return self.fleet.bypass(Outcome.DEGRADED, 0)
        now = self._clock()
        sid = req.session_id if self.residency else None
        continuing = ledger.is_resident(sid)
        if req.session_id is not None and not continuing:
            self._first_turn(ticket)
        if self.waiters:
            self.drain(now)
        outcome = self.fleet.offer(ticket, tokens, now, sid, continuing)
        if isinstance(outcome, Decision):
            return outcome
        future = asyncio.get_running_loop().create_future()
        waiter = self.waiters[ticket] = Waiter(ticket, tokens, now, future, sid, Mode.FLEET)
        self.drain(now)  # ages it at once when max_wait_s == 0; arms the timer
        return waiter, False

    def drain(self, now: float) -> None:
        """Resolve waiters while the ledger admits them; re-arm the aging timer."""
        fleet = self.fleet
        if fleet.queues:
            self._settle(fleet.drain(now, self._abandoned))
        self.aging.arm(fleet.next_deadline(), now)

    def _abandoned(self, ticket: str) -> bool:
        # Its task was cancelled (the future with it); the handler has not run yet.
        w = self.waiters.get(ticket)
        return w is None or w.future.done()

    def _settle(self, resolved: Iterable[Resolved]) -> None:
        for entry, decision in resolved:
            w = self.waiters.pop(entry.ticket, None)
            if w is None:
                continue
            if decision is None:
                w.on(WaiterEvent.CANCEL)
                continue
            w.on(WaiterEvent.RESOLVE)
            if not w.future.done():
                w.future.set_result(decision)

    def cancel(self, w: Waiter, now: float) -> None:
        """The awaiting task was cancelled: the waiter leaves its FIFO, or a lease
        granted in the race is released."""
        if w.state == WaiterState.WAITING:
            was_head = self.fleet.cancel(w.ticket, now)
            w.on(WaiterEvent.CANCEL)
            if self.waiters.get(w.ticket) is w:
                del self.waiters[w.ticket]
            if not w.future.done():
                w.future.set_result(BYPASS_CANCELLED)
            if was_head:
                self.drain(now)
        elif self.ledger.release_ticket(w.ticket, now, ran=False) is not None:
            self.drain(now)

    def release(self, lease_id: str, ticket: str, now: float) -> None:
        """A lease's attempt ended: release it; the next waiters may fit now."""
        if self.ledger.release(lease_id, now) is not None and self.waiters:
            self.drain(now)

    def end_session(self, session_id: str, now: float) -> bool:
        """The session closed: its residency goes (idempotent), freeing room."""
        if not self.ledger.end_session(session_id):
            return False
        if self.waiters:
            self.drain(now)
        return True

    def release_all(self, outcome: Outcome) -> None:
        """Every waiter leaves now as ``bypass``/``outcome`` (stop, or disabled)."""
        self.aging.cancel()
        self._settle(self.fleet.release_all(outcome, self._clock()))

    def configure(self, cfg: AdmissionConfig) -> None:
        """A reloaded (scaled) config: the ledger's thresholds, the FIFOs' bounds."""
        self.ledger.configure(
            headroom=cfg.headroom,
            pressure_threshold=cfg.pressure_threshold,
            lease_ttl_s=cfg.lease_ttl_s,
            staleness_s=cfg.effective_staleness_s,
            session_residency=residency_of(cfg),
        )
        self.fleet.configure(max_wait_s=cfg.max_wait_s, max_queue=cfg.max_queue)
        self.residency = residency_of(cfg)

    def oldest(self) -> float | None:
        entry = self.fleet.queues.oldest()
        return None if entry is None else entry.enqueued_at

    def rearm(self) -> None:
        """Drain and arm the aging timer from scratch (``max_wait_s`` may have changed)."""
        self.aging.cancel()
        self.drain(self._clock())

    def on_timer(self) -> None:
        self.aging.fired()
        try:
            self.drain(self._clock())
        except Exception:
            self._log.warning("timer", "admission: aging timer failed", exc_info=True)
