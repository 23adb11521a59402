"""The session table: which sessions are open or closing, what each has in flight.

Pure: no I/O, no asyncio; time is passed in as a monotonic ``now``. The asyncio
shell (:mod:`kvproxy.sessions.lifecycle`) owns one table and turns its answers into
actions.

A session is *live* (open or closing) or *closed* (a tombstone remembered for
``closed_ttl_s`` so that a repeated close is a no-op). A request that arrives for a
closed session starts a new session with the same id.

Every request holds a *token*, an integer unique for the table's lifetime, so that
a request that outlives its session (its close gave up waiting, and a new session
with the same id started) can never touch the new session's state.

Bounds: at most ``max_sessions`` live sessions, enforced by forgetting (not closing)
the least recently active *idle* open sessions; sessions with requests in flight or
a close in progress are never forgotten, so the cap can be exceeded by those. At most
``max_closed`` tombstones, each for at most ``closed_ttl_s``.

Parent links (docs/sessions.md, "Parent sessions"): a session may name its parent; the
table keeps the tree (:class:`~kvproxy.sessions.family.Family`: bounded links,
``max_children`` per parent, no self link, no cycle) for the close of a lead's children
and the ``/kvproxy/sessions`` listing. A link outlives neither end's close.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from kvproxy.record import Record
from kvproxy.sessions.family import Family, Link

# Most live entries one insert looks at when making room under the cap.
_SCAN_LIMIT = 256


class SessionState(StrEnum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(slots=True)
class SessionEntry:
    session_id: str
    state: SessionState
    created_at: float
    last_active: float
    # Tokens of requests admitted to the proxy but not yet sent upstream.
    queued: set[int] = field(default_factory=set)
    # Tokens of requests sent upstream -> the rids an abort must name.
    forwarded: dict[int, tuple[str, ...]] = field(default_factory=dict)
    requests: int = 0
    # The keyed hash of the data-plane credential of the session's first request
    # (kvproxy.credentials.fingerprint), when bound; never logged.
    owner: bytes | None = None

    @property
    def in_flight(self) -> int:
        return len(self.queued) + len(self.forwarded)

    @property
    def idle(self) -> bool:
        return self.state is SessionState.OPEN and not self.queued and not self.forwarded


class Begin(Record):
    """Result of :meth:`SessionTable.begin`."""

    __slots__ = ("created", "evicted", "forbidden", "reopened", "token")

    def __init__(
        self,
        token: int | None,
        created: bool = False,
        reopened: bool = False,
        evicted: tuple[str, ...] = (),
        forbidden: bool = False,
    ) -> None:
        # The request's token; None when the session is closing (reject the request).
        self.token: Final = token
        self.created: Final = created  # a new session started (including a re-open)
        self.reopened: Final = reopened  # ... with the id of a session closed earlier
        self.evicted: Final = evicted  # idle sessions forgotten to stay under the cap
        # The session is bound to another credential (token None: reject the request).
        self.forbidden: Final = forbidden


class CloseStatus(StrEnum):
    STARTED = "started"  # the caller owns the close now
    CLOSING = "closing"  # a close is already in progress
    CLOSED = "closed"  # closed earlier (tombstone): nothing to do


@dataclass(frozen=True, slots=True)
class CloseStart:
    """Result of :meth:`SessionTable.start_close`: what the close has to deal with."""

    status: CloseStatus
    queued: tuple[int, ...] = ()
    forwarded: tuple[tuple[int, tuple[str, ...]], ...] = ()
    known: bool = False  # the proxy had seen the session before the close


class SessionTable:
    __slots__ = (
        "_closed",
        "_closed_ttl_s",
        "_family",
        "_idle_timeout_s",
        "_live",
        "_max_closed",
        "_max_sessions",
        "_n_closing",
        "_n_forwarded",
        "_n_queued",
        "_next_token",
    )

    def __init__(
        self,
        *,
        max_sessions: int,
        closed_ttl_s: float,
        idle_timeout_s: float | None = None,
        max_closed: int | None = None,
        max_children: int = 256,
    ) -> None:
        self._family = Family(max_links=max(1, max_sessions), max_children=max_children)
        # Live sessions, least recently active first (idle open ones stay sorted by
        # last_active; busy and closing ones may sit anywhere).
        self._live: OrderedDict[str, SessionEntry] = OrderedDict()
        # Tombstones: session id -> closed_at, oldest first.
        self._closed: OrderedDict[str, float] = OrderedDict()
        self._next_token = 0
        self._n_closing = 0
        self._n_queued = 0
        self._n_forwarded = 0
        self._max_sessions = 1
        self._max_closed = 1
        self._closed_ttl_s = 0.0
        self._idle_timeout_s: float | None = None
        self.configure(
            max_sessions=max_sessions,
            closed_ttl_s=closed_ttl_s,
            idle_timeout_s=idle_timeout_s,
            max_closed=max_closed,
        )

    def configure(
        self,
        *,
        max_sessions: int,
        closed_ttl_s: float,
        idle_timeout_s: float | None,
        max_closed: int | None = None,
    ) -> None:
        """Change the bounds; takes effect at the next insert / prune / expiry check."""
        self._max_sessions = max(1, max_sessions)
        self._max_closed = max(1, max_closed if max_closed is not None else max_sessions)
        self._closed_ttl_s = max(0.0, closed_ttl_s)
        self._idle_timeout_s = idle_timeout_s

    # -- queries ---------------------------------------------------------------

    def get(self, session_id: str) -> SessionEntry | None:
        return self._live.get(session_id)

    def owner(self, session_id: str) -> bytes | None:
        """The live session's credential fingerprint; None: unbound, closed or unknown."""
        entry = self._live.get(session_id)
        return entry.owner if entry is not None else None

    def state(self, session_id: str) -> SessionState | None:
        entry = self._live.get(session_id)
        if entry is not None:
            return entry.state
        return SessionState.CLOSED if session_id in self._closed else None

    @property
    def open_count(self) -> int:
        return len(self._live) - self._n_closing

    @property
    def closing_count(self) -> int:
        return self._n_closing

    @property
    def closed_count(self) -> int:
        return len(self._closed)

    @property
    def queued_count(self) -> int:
        return self._n_queued

    @property
    def forwarded_count(self) -> int:
        return self._n_forwarded

    def __len__(self) -> int:
        return len(self._live)

    def parent(self, session_id: str) -> str | None:
        return self._family.parent(session_id)

    def children(self, session_id: str) -> frozenset[str]:
        return self._family.children(session_id)

    def entries(self, after: str | None, limit: int) -> list[SessionEntry]:
        """Live sessions in table order (least recently active first), at most
        ``limit``, starting after session ``after`` (None: from the start; an id no
        longer live: from the start too). One page of the ``/kvproxy/sessions`` listing."""
        out: list[SessionEntry] = []
        started = after is None or after not in self._live
        for sid, entry in self._live.items():
            if not started:
                started = sid == after
                continue
            if len(out) >= limit:
                break
            out.append(entry)
        return out

    def recent(self, limit: int) -> list[SessionEntry]:
        """At most ``limit`` live sessions, the most recently active first."""
        out: list[SessionEntry] = []
        for sid in reversed(self._live):
            if len(out) >= limit:
                break
            out.append(self._live[sid])
        return out

    def live(self) -> Iterator[SessionEntry]:
        """The live sessions, least recently active first (do not change the table
        while iterating)."""
        return iter(self._live.values())

    # -- parent links ------------------------------------------------------------

    def link(self, session_id: str, parent: str) -> Link:
        """``session_id`` names ``parent`` (kept while both are known; see the module
        docstring). A closing or closed parent is linked all the same: its children
        may outlive it."""
        return self._family.link(session_id, parent)

    # -- requests --------------------------------------------------------------

    def begin(
        self,
        session_id: str,
        now: float,
        forwarded: tuple[str, ...] | None = None,
        owner: bytes | None = None,
    ) -> Begin:
        """Register a request of ``session_id`` as queued in the proxy, or with
        ``forwarded`` (its abort rids) as forwarded at once (:meth:`forwarded` then).

        ``owner``: the request's credential fingerprint, when sessions are bound to
        one. A new session takes it; a session bound to another refuses the request
        (``forbidden``)."""
        if self._closed:
            self.prune(now)
        entry = self._live.get(session_id)
        created = reopened = False
        evicted: tuple[str, ...] = ()
        if entry is None:
            reopened = self._closed.pop(session_id, None) is not None
            evicted = self._make_room()
            entry = SessionEntry(session_id, SessionState.OPEN, created_at=now, last_active=now)
            entry.owner = owner
            self._live[session_id] = entry
            created = True
        elif entry.state is SessionState.CLOSING:
            return Begin(token=None)
        elif entry.owner is not None and entry.owner != owner:
            return Begin(None, forbidden=True)
        else:
            self._live.move_to_end(session_id)
        self._next_token += 1
        token = self._next_token
        if forwarded is None:
            entry.queued.add(token)
            self._n_queued += 1
        else:
            entry.forwarded[token] = forwarded
            self._n_forwarded += 1
        entry.requests += 1
        entry.last_active = now
        return Begin(token, created, reopened, evicted)  # positional: per request

    def forwarded(self, session_id: str, token: int, rids: tuple[str, ...], now: float) -> bool:
        """Move a queued request to forwarded. False if the token is not queued."""
        entry = self._live.get(session_id)
        if entry is None or token not in entry.queued:
            return False
        entry.queued.discard(token)
        entry.forwarded[token] = rids
        entry.last_active = now
        self._n_queued -= 1
        self._n_forwarded += 1
        return True

    def end(self, session_id: str, token: int, now: float) -> bool:
        """The request left the proxy (any outcome). False if the token is unknown."""
        entry = self._live.get(session_id)
        if entry is None:
            return False
        if token in entry.queued:
            entry.queued.discard(token)
            self._n_queued -= 1
        elif entry.forwarded.pop(token, None) is not None:
            self._n_forwarded -= 1
        else:
            return False
        entry.last_active = now
        if entry.state is SessionState.OPEN:
            self._live.move_to_end(session_id)
        return True

    # -- close -----------------------------------------------------------------

    def start_close(self, session_id: str, now: float) -> CloseStart:
        """Begin closing ``session_id``; only a STARTED answer makes the caller the owner.

        A session the proxy never saw (or forgot) is closed all the same: the engines
        may still hold its KV.
        """
        self.prune(now)
        entry = self._live.get(session_id)
        if entry is None:
            if session_id in self._closed:
                return CloseStart(CloseStatus.CLOSED)
            self._live[session_id] = SessionEntry(
                session_id, SessionState.CLOSING, created_at=now, last_active=now
            )
            self._n_closing += 1
            return CloseStart(CloseStatus.STARTED, known=False)
        if entry.state is SessionState.CLOSING:
            return CloseStart(CloseStatus.CLOSING, known=True)
        entry.state = SessionState.CLOSING
        self._n_closing += 1
        return CloseStart(
            CloseStatus.STARTED,
            queued=tuple(sorted(entry.queued)),
            forwarded=tuple(sorted(entry.forwarded.items())),
            known=True,
        )

    def finish_close(self, session_id: str, now: float) -> None:
        """The close is over: forget the session and remember it as closed."""
        entry = self._live.pop(session_id, None)
        self._family.forget(session_id)
        if entry is not None:
            if entry.state is SessionState.CLOSING:
                self._n_closing -= 1
            self._n_queued -= len(entry.queued)
            self._n_forwarded -= len(entry.forwarded)
        self._closed.pop(session_id, None)
        self._closed[session_id] = now
        self.prune(now)

    # -- bounds ----------------------------------------------------------------

    def expired(self, now: float) -> list[str]:
        """Open sessions with nothing in flight whose last activity is idle_timeout_s old."""
        if self._idle_timeout_s is None:
            return []
        limit = self._idle_timeout_s
        out: list[str] = []
        for sid, entry in self._live.items():
            if not entry.idle:
                continue
            if now - entry.last_active < limit:
                break
            out.append(sid)
        return out

    def prune(self, now: float) -> int:
        """Drop tombstones past closed_ttl_s or past the cap; returns how many."""
        dropped = 0
        closed = self._closed
        while closed:
            sid, closed_at = next(iter(closed.items()))
            if len(closed) > self._max_closed or now - closed_at > self._closed_ttl_s:
                del closed[sid]
                dropped += 1
            else:
                break
        return dropped

    def _make_room(self) -> tuple[str, ...]:
        """Forget least recently active idle sessions until one more fits.

        The scan is bounded (``_SCAN_LIMIT`` entries); when only busy or closing
        sessions are found the table grows past the cap for now.
        """
        if len(self._live) < self._max_sessions:
            return ()
        evicted: list[str] = []
        busy: list[str] = []
        for sid, entry in self._live.items():
            if len(self._live) - len(evicted) < self._max_sessions:
                break
            if len(evicted) + len(busy) >= _SCAN_LIMIT:
                break
            if entry.idle:
                evicted.append(sid)
            else:
                busy.append(sid)
        for sid in evicted:
            del self._live[sid]
            self._family.forget(sid)
        # Busy and closing sessions scanned past are moved back so that the next scan
        # does not walk over them again (their idle clock restarts when they end).
        for sid in busy:
            self._live.move_to_end(sid)
        return tuple(evicted)
