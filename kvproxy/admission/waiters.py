"""What a request holds on the event loop while admission decides: its
:class:`Admission` (the ``async with`` the controller's ``admit`` returns), its
:class:`Waiter` (a future) while it waits, and the :class:`Wakeup` timer that wakes
the queues at their next deadline (asyncio shell).

Both admission modes' shells use them: ledger mode's in
:mod:`kvproxy.admission.coordinator`, program mode's in
:mod:`kvproxy.admission.program.gate`. The queues themselves are pure
(:mod:`kvproxy.admission.fleet.queue`, :mod:`kvproxy.admission.program.queues`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from enum import StrEnum
from types import TracebackType
from typing import Protocol

from kvproxy.admission.records import BYPASS_CANCELLED, AdmissionRequest, Decision, Mode, Outcome
from kvproxy.admission.transitions import step


class WaiterState(StrEnum):
    WAITING = "waiting"  # in its mode's queue, its future pending
    RESOLVED = "resolved"  # decided: its future holds (or held) the decision
    CANCELLED = "cancelled"  # withdrawn (its task was cancelled) before a decision


class WaiterEvent(StrEnum):
    RESOLVE = "resolve"  # its gate decided it (a lease, a bypass, or fail open)
    CANCEL = "cancel"  # its task was cancelled, or it was found abandoned at a head


# A waiter's allowed transitions: a decision or a withdrawal, once; nothing after.
WAITER_TRANSITIONS: dict[WaiterState, dict[WaiterEvent, WaiterState]] = {
    WaiterState.WAITING: {
        WaiterEvent.RESOLVE: WaiterState.RESOLVED,
        WaiterEvent.CANCEL: WaiterState.CANCELLED,
    },
    WaiterState.RESOLVED: {},
    WaiterState.CANCELLED: {},
}


class Waiter:
    """A request waiting for its decision, in either mode: its future."""

    __slots__ = ("enqueued_at", "future", "mode", "session", "state", "ticket", "tokens")

    def __init__(
        self,
        ticket: str,
        tokens: int,
        enqueued_at: float,
        future: asyncio.Future[Decision],
        session: str | None,
        mode: Mode,
    ) -> None:
        self.ticket = ticket
        self.tokens = tokens
        self.enqueued_at = enqueued_at
        self.future = future
        self.session = session
        self.mode = mode  # the gate it waits in
        self.state = WaiterState.WAITING

    def on(self, event: WaiterEvent) -> None:
        """Apply ``event`` (WAITER_TRANSITIONS); an event its state does not allow raises."""
        self.state = step(WAITER_TRANSITIONS, self.state, event, "waiter")


class Wakeup:
    """One loop timer for the earliest deadline, re-armed only when that moves."""

    __slots__ = ("at", "fire", "handle")

    def __init__(self, fire: Callable[[], None]) -> None:
        self.fire = fire  # calls fired() first, then drains
        self.handle: asyncio.TimerHandle | None = None
        self.at = math.inf

    def arm(self, deadline: float | None, now: float) -> None:
        """Fire at ``deadline`` (loop time ``now`` + what is left); None: disarm."""
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


class _Controller(Protocol):
    """What :class:`Admission` calls back (kvproxy.admission.coordinator)."""

    def _decide(self, req: AdmissionRequest) -> Decision | tuple[Waiter, bool]: ...

    def _cancel_waiter(self, w: Waiter) -> None: ...

    def _release(self, mode: Mode, lease_id: str, ticket: str) -> None: ...

    def _aged_turn_ended(self, req: AdmissionRequest, tokens: int) -> None: ...


class Admission(AbstractAsyncContextManager[Decision]):
    """The context manager returned by :meth:`~kvproxy.admission.coordinator.AdmissionController.admit`.

    ``async with`` decides on entry. The request path splits that in two, so that the
    common case (decided at once) costs no task, future or loop round trip:
    :meth:`decide_now`, then :meth:`wait` only when it returned None, and
    :meth:`leave` once the attempt ends."""

    __slots__ = ("_aged", "_ctl", "_lease_id", "_mode", "_pending", "_req")

    def __init__(self, ctl: _Controller, req: AdmissionRequest) -> None:
        self._ctl = ctl
        self._req = req
        self._lease_id: str | None = None
        self._mode: Mode | None = None  # the gate that holds the lease
        # Tokens of an aged bypass of a session: noted as its residency at exit.
        self._aged: int | None = None
        self._pending: tuple[Waiter, bool] | None = None

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
        the ticket is cancelled atomically (see :meth:`~kvproxy.admission.coordinator.AdmissionController.admit`)."""
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
        self._mode = decision.mode
        if decision.reason == Outcome.AGED and self._req.session_id is not None:
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
            assert self._mode is not None, "a lease is held by a gate"
            self._ctl._release(self._mode, lease_id, self._req.ticket_id)
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
