"""Every (state, event) pair of admission's two state machines, driven through the
code that owns each: a program session through its engine ledger's methods, a waiter
through its own. An allowed pair lands in the state the module's table names, with
the side effects the ledger attaches to it; any other pair raises
InvalidTransition and changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvproxy.admission.program.ledger import EngineLedger
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.session import (
    SESSION_TRANSITIONS,
    Session,
    SessionEvent,
    SessionState,
)
from kvproxy.admission.records import Mode
from kvproxy.admission.transitions import InvalidTransition
from kvproxy.admission.waiters import WAITER_TRANSITIONS, Waiter, WaiterEvent, WaiterState

URL = "http://e:1"


def session_in(state: SessionState) -> tuple[EngineLedger, Session]:
    """A ledger holding session "s" in ``state``, reached by the ledger's own methods,
    with one turn running (so that a turn may end)."""
    led = EngineLedger(ProgramParams())
    s = led.open("s", URL, 0.0, 100)
    led.turn_started(s, 0.0, 100)
    if state is not SessionState.NEW:
        led.activate(s)
    if state is SessionState.PAUSED:
        led.pause(s, 0.0)
    if state is SessionState.CLOSED:
        led.drop("s")
    assert s.state is state
    return led, s


APPLY: dict[SessionEvent, Callable[[EngineLedger, Session], object]] = {
    SessionEvent.ACTIVATE: lambda led, s: led.activate(s),
    SessionEvent.TURN_START: lambda led, s: led.turn_started(s, 1.0, 50),
    SessionEvent.TURN_END: lambda led, s: led.turn_ended(s, 1.0),
    SessionEvent.MARK_PAUSE: lambda led, s: led.mark_pause(s, True),
    SessionEvent.UNMARK: lambda led, s: led.mark_pause(s, False),
    SessionEvent.PAUSE: lambda led, s: led.pause(s, 1.0),
    SessionEvent.CLOSE: lambda led, s: (
        led.drop(s.sid) if s.sid in led.sessions else s.on(SessionEvent.CLOSE)
    ),
}
# What each allowed event does beside the state, seen from the ledger.
EFFECT: dict[SessionEvent, Callable[[EngineLedger, Session, int], bool]] = {
    SessionEvent.ACTIVATE: lambda led, s, ran: "s" in led.engine(URL).sessions,
    SessionEvent.TURN_START: lambda led, s, ran: s.running == ran + 1,
    SessionEvent.TURN_END: lambda led, s, ran: s.running == ran - 1,
    SessionEvent.MARK_PAUSE: lambda led, s, ran: s.pause_pending,
    SessionEvent.UNMARK: lambda led, s, ran: not s.pause_pending,
    SessionEvent.PAUSE: lambda led, s, ran: (
        "s" not in led.engine(URL).sessions and not s.pause_pending
    ),
    SessionEvent.CLOSE: lambda led, s, ran: "s" not in led.sessions,
}


def test_both_tables_cover_every_state() -> None:
    assert set(SESSION_TRANSITIONS) == set(SessionState)
    assert set(WAITER_TRANSITIONS) == set(WaiterState)


@pytest.mark.parametrize("event", list(SessionEvent))
@pytest.mark.parametrize("state", list(SessionState))
def test_every_session_state_and_event(state: SessionState, event: SessionEvent) -> None:
    led, s = session_in(state)
    ran = s.running
    allowed = SESSION_TRANSITIONS[state].get(event)
    if allowed is None:
        with pytest.raises(InvalidTransition):
            APPLY[event](led, s)
        assert s.state is state and s.running == ran
        return
    APPLY[event](led, s)
    assert s.state is allowed
    assert EFFECT[event](led, s, ran)
    # The engine counts exactly its ACTIVE sessions, whatever happened.
    assert ("s" in led.engine(URL).sessions) == (s.state is SessionState.ACTIVE)


def test_closed_and_new_sessions_are_never_paused_nor_marked() -> None:
    for state in (SessionState.NEW, SessionState.PAUSED, SessionState.CLOSED):
        assert SessionEvent.PAUSE not in SESSION_TRANSITIONS[state]
        assert SessionEvent.MARK_PAUSE not in SESSION_TRANSITIONS[state]
    assert SESSION_TRANSITIONS[SessionState.CLOSED] == {}


@pytest.mark.parametrize("event", list(WaiterEvent))
@pytest.mark.parametrize("state", list(WaiterState))
async def test_every_waiter_state_and_event(state: WaiterState, event: WaiterEvent) -> None:
    w = Waiter("t", 10, 0.0, asyncio.get_running_loop().create_future(), None, Mode.FLEET)
    if state is WaiterState.RESOLVED:
        w.on(WaiterEvent.RESOLVE)
    elif state is WaiterState.CANCELLED:
        w.on(WaiterEvent.CANCEL)
    assert w.state is state
    allowed = WAITER_TRANSITIONS[state].get(event)
    if allowed is None:
        with pytest.raises(InvalidTransition):
            w.on(event)
        assert w.state is state
    else:
        w.on(event)
        assert w.state is allowed
    # A waiter is decided or withdrawn once: from WAITING only.
    assert (allowed is not None) == (state is WaiterState.WAITING)
