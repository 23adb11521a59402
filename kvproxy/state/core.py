"""The shared session state's protocol: its operations as data, and the memory store
that defines what each one does. Pure: no I/O; every operation carries its ``now``
(wall seconds, the same clock on every replica).

The state several replicas share (``state.backend: redis``) is, per session:

- its last activity (``last``) and, per replica, how many of its requests that replica
  has in flight (a replica's counts stop counting once its heartbeat has expired);
- whether a final turn has been seen or a close claimed (``owed``: the replica that
  owes the close);
- its close: a *claim* (the replica that is closing it, expiring with that replica's
  heartbeat unless renewed) and then a *tombstone* (``closed``) for ``closed_ttl_s``.

plus each replica's heartbeat, a lease for the shared idle sweep, and per replica the
rids of the requests it has in flight (so that, once it is gone, one survivor aborts
them on the engines: :class:`Orphans`). Every key expires: sessions and in-flight rids
``session_ttl_s`` after their last write, claims and heartbeats ``replica_ttl_s`` after
their last renewal, tombstones after ``closed_ttl_s``.

:class:`MemoryStore` runs the operations in Python; the Redis backend
(:mod:`kvproxy.state.redis_store`) runs the same ones as Lua scripts, and
tests/integration/test_state_conformance.py runs a table of them against both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

# The tombstone a close claim becomes once the close is done.
CLOSED = "closed"
# Most sessions one sweep returns.
SWEEP_LIMIT = 256
# Most rids one sweep takes from the replicas gone (the rest: the next sweeps).
ORPHAN_LIMIT = 512
# Most in-flight rids recorded per replica (more are not recorded: not abortable).
MAX_RIDS = 65_536
# Most replicas with in-flight rids one sweep looks at.
ORPHAN_REPLICAS = 64


@dataclass(frozen=True, slots=True)
class Begin:
    """A request of ``session_id`` entered ``replica``. Answers ``open``, ``reopened``
    (the session had been closed: it starts again) or ``closing`` (a close is
    claimed). Its ``rids`` (what an abort of it names) are recorded as ``replica``'s in
    flight (whatever the answer) until its :class:`End`."""

    session_id: str
    replica: str
    now: float
    ttl_s: float
    final: bool = False
    rids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class End:
    """A request of ``session_id`` left ``replica``; its ``rids`` are no longer in
    flight. Answers whether the session was known (a closed session is not brought
    back)."""

    session_id: str
    replica: str
    now: float
    ttl_s: float
    rids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Restore:
    """``replica`` has ``in_flight`` requests of an open session last active at ``last``
    (after the store came back). Answers whether it was written (not if closed or
    claimed)."""

    session_id: str
    replica: str
    last: float
    in_flight: int
    now: float
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Claim:
    """``replica`` wants to close ``session_id``. Answers True when it now owns the
    close (exactly one caller does until the claim expires or becomes a tombstone),
    and then owes it: should it die before finishing, the sweep finds the session due
    once the claim has expired with it."""

    session_id: str
    replica: str
    now: float
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Finish:
    """The close ``replica`` claimed is done: the session's record goes, a tombstone
    stays for ``closed_ttl_s``. Answers None."""

    session_id: str
    replica: str
    now: float
    closed_ttl_s: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``replica`` is alive for ``ttl_s`` more; its claims on ``closing`` are renewed.
    Answers how many claims were renewed."""

    replica: str
    now: float
    ttl_s: float
    closing: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Lease:
    """``replica`` takes (or keeps) the lease ``name`` for ``ttl_s``. Answers True when
    it holds it."""

    name: str
    replica: str
    now: float
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Due:
    """The sessions whose close is due and unclaimed: open, nothing in flight on a live
    replica, and idle for ``idle_timeout_s`` (None: never idle), or owing a close
    whose replica is gone. Answers at most ``limit`` ids, oldest first; records that
    expired are dropped from the index on the way."""

    now: float
    idle_timeout_s: float | None
    limit: int = SWEEP_LIMIT


@dataclass(frozen=True, slots=True)
class Orphans:
    """Take the in-flight rids of the replicas gone: those whose heartbeat has been
    missing at two sweeps at least ``grace_s`` apart (the first marks it gone, so that
    a replica only slow to beat, or rejoining after the store came back, has
    ``grace_s`` to beat again before its requests are aborted). Answers at most
    ``limit`` rids (each one once: they are removed), by replica then rid; a replica
    that beats again is unmarked. The caller aborts them on every engine."""

    now: float
    grace_s: float
    limit: int = ORPHAN_LIMIT


@dataclass(frozen=True, slots=True)
class Peek:
    """What the store holds about ``session_id`` (tests, doctor): a dict with
    ``last``, ``in_flight`` (replica -> count), ``owed``, ``close`` (claim or tombstone);
    empty when nothing."""

    session_id: str
    now: float


Op = Begin | End | Restore | Claim | Finish | Heartbeat | Lease | Due | Orphans | Peek


V = TypeVar("V")


def _unexpired(table: dict[str, tuple[V, float]], key: str, now: float) -> V | None:
    """``key``'s value in a table of (value, expires at), as a Redis key with a TTL reads:
    None once expired (and then forgotten)."""
    got = table.get(key)
    if got is None:
        return None
    if got[1] <= now:
        del table[key]
        return None
    return got[0]


@dataclass(slots=True)
class _Session:
    last: float
    expires: float
    in_flight: dict[str, int] = field(default_factory=dict)
    owed: str = ""


class MemoryStore:
    """The operations applied to Python dicts (the reference the Redis scripts match).

    Expiry is checked lazily against each operation's ``now``.
    """

    __slots__ = ("_close", "_gone", "_leases", "_owed", "_replicas", "_rids", "_sessions")

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        self._close: dict[str, tuple[str, float]] = {}  # sid -> (claim or CLOSED, expires)
        self._replicas: dict[str, float] = {}  # replica -> heartbeat expires
        self._leases: dict[str, tuple[str, float]] = {}
        self._owed: set[str] = set()
        # replica -> (its in-flight rids -> session, expires)
        self._rids: dict[str, tuple[dict[str, str], float]] = {}
        self._gone: dict[str, tuple[float, float]] = {}  # replica -> (marked gone at, expires)

    def apply(self, op: Op) -> Any:
        handler = _HANDLERS[type(op)]
        return handler(self, op)

    # -- helpers ---------------------------------------------------------------

    def _session(self, sid: str, now: float) -> _Session | None:
        sess = self._sessions.get(sid)
        if sess is not None and sess.expires <= now:
            del self._sessions[sid]
            self._owed.discard(sid)
            return None
        return sess

    def _close_of(self, sid: str, now: float) -> str | None:
        return _unexpired(self._close, sid, now)

    def _alive(self, replica: str, now: float) -> bool:
        return self._replicas.get(replica, 0.0) > now

    def _live_in_flight(self, sess: _Session, now: float) -> int:
        return sum(n for r, n in sess.in_flight.items() if n > 0 and self._alive(r, now))

    def _rids_of(self, replica: str, now: float) -> dict[str, str] | None:
        rids = _unexpired(self._rids, replica, now)
        if rids is not None and not rids:  # (a hash with no fields is no key in Redis)
            del self._rids[replica]
            return None
        return rids

    def _gone_at(self, replica: str, now: float) -> float | None:
        return _unexpired(self._gone, replica, now)

    # -- operations ------------------------------------------------------------

    def begin(self, op: Begin) -> str:
        now, sid = op.now, op.session_id
        if op.rids:
            rids = self._rids_of(op.replica, now) or {}
            for rid in op.rids:
                if len(rids) < MAX_RIDS:
                    rids[rid] = sid
            self._rids[op.replica] = (rids, now + op.ttl_s)
        close = self._close_of(sid, now)
        if close is not None and close != CLOSED:
            return "closing"
        answer = "open"
        if close == CLOSED:
            del self._close[sid]
            answer = "reopened"
        sess = self._session(sid, now)
        if sess is None:
            sess = self._sessions[sid] = _Session(last=now, expires=now + op.ttl_s)
        sess.in_flight[op.replica] = sess.in_flight.get(op.replica, 0) + 1
        sess.last = max(sess.last, now)
        sess.expires = now + op.ttl_s
        if op.final:
            sess.owed = op.replica
            self._owed.add(sid)
        return answer

    def end(self, op: End) -> bool:
        rids = self._rids_of(op.replica, op.now)
        if rids is not None and op.rids:
            for rid in op.rids:
                rids.pop(rid, None)
            self._rids[op.replica] = (rids, op.now + op.ttl_s)
        sess = self._session(op.session_id, op.now)
        if sess is None:
            return False
        left = sess.in_flight.get(op.replica, 0) - 1
        if left > 0:
            sess.in_flight[op.replica] = left
        else:
            sess.in_flight.pop(op.replica, None)
        sess.last = max(sess.last, op.now)
        sess.expires = op.now + op.ttl_s
        return True

    def restore(self, op: Restore) -> bool:
        if self._close_of(op.session_id, op.now) is not None:
            return False
        sess = self._session(op.session_id, op.now)
        if sess is None:
            sess = self._sessions[op.session_id] = _Session(last=op.last, expires=op.now + op.ttl_s)
        if op.in_flight > 0:
            sess.in_flight[op.replica] = op.in_flight
        else:
            sess.in_flight.pop(op.replica, None)
        sess.last = max(sess.last, op.last)
        sess.expires = op.now + op.ttl_s
        return True

    def claim(self, op: Claim) -> bool:
        if self._close_of(op.session_id, op.now) is not None:
            return False
        self._close[op.session_id] = (op.replica, op.now + op.ttl_s)
        sess = self._session(op.session_id, op.now)
        if sess is not None:  # the claimer owes the close (due if it dies unfinished)
            sess.owed = op.replica
            self._owed.add(op.session_id)
        return True

    def finish(self, op: Finish) -> None:
        self._sessions.pop(op.session_id, None)
        self._owed.discard(op.session_id)
        self._close[op.session_id] = (CLOSED, op.now + op.closed_ttl_s)

    def heartbeat(self, op: Heartbeat) -> int:
        self._replicas[op.replica] = op.now + op.ttl_s
        renewed = 0
        for sid in op.closing:
            if self._close_of(sid, op.now) == op.replica:
                self._close[sid] = (op.replica, op.now + op.ttl_s)
                renewed += 1
        return renewed

    def lease(self, op: Lease) -> bool:
        held = self._leases.get(op.name)
        if held is not None and held[1] > op.now and held[0] != op.replica:
            return False
        self._leases[op.name] = (op.replica, op.now + op.ttl_s)
        return True

    def due(self, op: Due) -> list[str]:
        now = op.now
        out: list[tuple[float, str]] = []
        for sid in list(self._sessions):
            sess = self._session(sid, now)
            if sess is None or self._close_of(sid, now) is not None:
                continue
            if self._live_in_flight(sess, now):
                continue
            idle = op.idle_timeout_s is not None and now - sess.last >= op.idle_timeout_s
            orphan = bool(sess.owed) and not self._alive(sess.owed, now)
            if idle or orphan:
                out.append((sess.last, sid))
        out.sort()
        return [sid for _, sid in out[: op.limit]]

    def orphans(self, op: Orphans) -> list[str]:
        now, out = op.now, list[str]()
        for replica in sorted(self._rids)[:ORPHAN_REPLICAS]:
            if len(out) >= op.limit:
                break
            if self._alive(replica, now):
                self._gone.pop(replica, None)
                continue
            rids = self._rids_of(replica, now)
            if rids is None:
                self._gone.pop(replica, None)
                continue
            marked = self._gone_at(replica, now)
            if marked is None:
                self._gone[replica] = (now, now + gone_ttl_s(op.grace_s))
                continue
            if now - marked < op.grace_s:
                continue
            for rid in sorted(rids)[: op.limit - len(out)]:
                del rids[rid]
                out.append(rid)
            if not rids:
                del self._rids[replica]
                self._gone.pop(replica, None)
        return out

    def in_flight_rids(self, replica: str, now: float) -> dict[str, str]:
        """``replica``'s in-flight rids (tests)."""
        return dict(self._rids_of(replica, now) or {})

    def peek(self, op: Peek) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sess = self._session(op.session_id, op.now)
        if sess is not None:
            out["last"] = sess.last
            out["in_flight"] = {r: n for r, n in sess.in_flight.items() if n > 0}
            out["owed"] = sess.owed
        close = self._close_of(op.session_id, op.now)
        if close is not None:
            out["close"] = close
        return out

    def key_count(self, now: float) -> int:
        """Live keys, as the Redis backend would hold them (tests of expiry)."""
        sessions = sum(1 for sid in list(self._sessions) if self._session(sid, now))
        closes = sum(1 for sid in list(self._close) if self._close_of(sid, now))
        rids = sum(1 for r in list(self._rids) if self._rids_of(r, now) is not None)
        return sessions + closes + rids


def gone_ttl_s(grace_s: float) -> float:
    """How long a replica stays marked gone without a sweep looking at it again."""
    return max(4.0 * grace_s, 1.0)


_HANDLERS: dict[type, Any] = {
    Begin: MemoryStore.begin,
    End: MemoryStore.end,
    Restore: MemoryStore.restore,
    Claim: MemoryStore.claim,
    Finish: MemoryStore.finish,
    Heartbeat: MemoryStore.heartbeat,
    Lease: MemoryStore.lease,
    Due: MemoryStore.due,
    Orphans: MemoryStore.orphans,
    Peek: MemoryStore.peek,
}
