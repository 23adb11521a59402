"""A session of program admission: its record and its state machine, stated as a
table (:data:`SESSION_TRANSITIONS`). Pure.

Its state: NEW before its first turn is admitted, ACTIVE while it counts on its engine,
PAUSED while paused under growth pressure, CLOSED once it left the ledger. Its flags:
``running`` (turns in flight) and ``pause_pending`` (pause at its next response). Every
change of them goes through :meth:`Session.on` with a :class:`SessionEvent`, called by
the ledger that owns it (:mod:`kvproxy.admission.program.ledger`); an event its state
does not allow raises :class:`~kvproxy.admission.transitions.InvalidTransition`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvproxy.admission.transitions import step


class SessionState(StrEnum):
    NEW = "new"  # its first turn not admitted yet: counts nowhere
    ACTIVE = "active"  # counts on its engine
    PAUSED = "paused"  # paused under growth pressure: counts nowhere until it resumes
    CLOSED = "closed"  # left the ledger (closed, expired, evicted by the bound)


class SessionEvent(StrEnum):
    ACTIVATE = "activate"  # a turn of it goes (first turn, continuing, resumed)
    TURN_START = "turn_start"  # a turn of it starts (running + 1)
    TURN_END = "turn_end"  # a turn of it ends (running - 1)
    MARK_PAUSE = "mark_pause"  # no idle session to pause: it pauses at its response
    UNMARK = "unmark"  # its engine went permissive: it no longer pauses
    PAUSE = "pause"  # it stops counting (pause_pending cleared)
    CLOSE = "close"  # it leaves the ledger


_KEEPS = (SessionEvent.TURN_START, SessionEvent.TURN_END, SessionEvent.UNMARK)
# A session's allowed transitions (Session.on): a turn may start or end in any state
# but CLOSED (a turn that fails open starts on a NEW or PAUSED session too); only an
# ACTIVE session is marked to pause or paused; nothing follows CLOSED.
SESSION_TRANSITIONS: dict[SessionState, dict[SessionEvent, SessionState]] = {
    SessionState.NEW: {
        **dict.fromkeys(_KEEPS, SessionState.NEW),
        SessionEvent.ACTIVATE: SessionState.ACTIVE,
        SessionEvent.CLOSE: SessionState.CLOSED,
    },
    SessionState.ACTIVE: {
        **dict.fromkeys(_KEEPS, SessionState.ACTIVE),
        SessionEvent.ACTIVATE: SessionState.ACTIVE,
        SessionEvent.MARK_PAUSE: SessionState.ACTIVE,
        SessionEvent.PAUSE: SessionState.PAUSED,
        SessionEvent.CLOSE: SessionState.CLOSED,
    },
    SessionState.PAUSED: {
        **dict.fromkeys(_KEEPS, SessionState.PAUSED),
        SessionEvent.ACTIVATE: SessionState.ACTIVE,
        SessionEvent.CLOSE: SessionState.CLOSED,
    },
    SessionState.CLOSED: {},
}


@dataclass(slots=True)
class Session:
    sid: str
    engine: str
    since: float  # when it last started or stopped running
    state: SessionState = SessionState.NEW
    ctx: int = 0  # context tokens after its last response
    growth: float = 0.0  # EMA of per-turn context growth
    est: int = 0  # size estimate of its running (or next) turn
    running: int = 0  # turns in flight
    turns: int = 0  # responses seen
    prio: int = 0  # last priority sent
    pause_pending: bool = False  # pause at its next response
    # Its last tool calls' lengths (request after an answer), newest last: with
    # prefetch on only (kvproxy.admission.program.prefetch).
    tool_s: tuple[float, ...] = ()
    # Child sessions (those naming this one as parent) running now (kvproxy.sessions.family).
    children_running: int = 0
    # Its id had several turns in flight at once (a harness sharing one id across
    # subagents): its turns' contexts diverge (observe_response).
    shared: bool = False

    @property
    def in_flight(self) -> bool:
        """A turn of its own runs (of a replicated session: on any replica)."""
        return bool(self.running)

    @property
    def busy(self) -> bool:
        """A turn of its own runs, or a child runs (a lead waiting for its subagents)."""
        return self.in_flight or bool(self.children_running)

    def footprint(self, buffer: int) -> int:
        return int(max(self.ctx + self.growth, self.est)) + buffer

    def idle_s(self, now: float) -> float:
        return 0.0 if self.running else max(0.0, now - self.since)

    def on(self, event: SessionEvent) -> None:
        """Apply ``event`` (SESSION_TRANSITIONS); an event its state does not allow raises."""
        self.state = step(SESSION_TRANSITIONS, self.state, event, self.sid)
