"""Program admission's ledger replicated between replicas: the records, their encoding,
and what applying another replica's record does to this replica's ledger. Pure: no
I/O; every call carries both clocks (``now``: the ledger's, ``wall``: shared by the
replicas), because the ledger runs on the loop's clock and the records on wall time.

Each replica keeps its own :class:`~kvproxy.admission.program.ledger.EngineLedger` and
decides alone, on its own event loop, exactly as one replica does. What it learns of
the others comes as *state records* (not an operation log), each naming the replica
that sent it and the wall time it was taken:

- ``S`` a session as its sender holds it: engine, state (active / paused / new),
  context, growth, turn-size estimate, responses seen, when it last started or
  stopped running, and how many of its turns run *on the sender*;
- ``X`` a session left the sender's ledger (closed, expired);
- ``W`` / ``D`` a new session's first turn started / stopped waiting on the sender
  (its engine, when it was queued, the latest it can still be waiting);
- ``E`` whether the sender's engagement holds work on an engine, and the largest prefix
  a first turn found cached there (its credit: every replica counts the largest);
- ``H`` hello (a replica joined or rejoined: the others send it their whole view) and
  ``B`` beat (alive; a replica not heard for ``replica_ttl_s`` is gone: its running
  turns and waiters stop counting, and an engine it held engaged, which no other
  replica holds, is engaged here: this replica takes it over rather than starting
  permissive and waiting for its own windows to show the thrash again).

A session's state, engine and idle time are last-writer-wins on (wall time of the
change, replica); its context and growth come from the record that saw the most
answers; a sender's running count and its waiters are its own and always applied (one
channel keeps a sender's order).
:class:`SyncedLedger` is the ledger with the others folded in: it tells its shell which
sessions changed here (``on_change``), folds the others' records in (:meth:`SyncedLedger.apply`),
counts their running turns as busy, holds an engine another replica engaged, and keeps
a new session's first turn behind the first turns the others queued earlier for its
engine (the fleet's waiting order). The decisions stay :class:`ProgramCore`'s. docs/design.md, "Shared admission state", says
how stale a replica's view may be and why the decisions stay correct.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from zlib import crc32

from kvproxy.admission.program.engagement import Load
from kvproxy.admission.program.ledger import Engine, EngineLedger
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.session import Session, SessionState
from kvproxy.replication.load import SyncedLoad

# Field separator and record separator of the wire format (ids never hold either:
# they are header values or URL path segments).
SEP = "\t"
EOL = "\n"


@dataclass(frozen=True, slots=True)
class SessionRec:
    replica: str
    at: float  # wall time the record was taken
    sid: str
    engine: str
    state: str  # SessionState value (never "closed": that is Gone)
    ctx: int
    growth: float
    est: int
    turns: int
    running: int  # its turns running on the sender
    since: float  # wall time it last started or stopped running


@dataclass(frozen=True, slots=True)
class Gone:
    replica: str
    at: float
    sid: str


@dataclass(frozen=True, slots=True)
class Waiting:
    replica: str
    at: float
    ticket: str
    engine: str
    enqueued: float  # wall
    bound: float  # wall: it has surely left its queue by then


@dataclass(frozen=True, slots=True)
class Left:
    replica: str
    at: float
    ticket: str


@dataclass(frozen=True, slots=True)
class Engaged:
    replica: str
    at: float
    engine: str
    engaged: bool
    shared_prefix: int = 0  # the largest prefix a first turn found cached there


@dataclass(frozen=True, slots=True)
class Hello:
    replica: str
    at: float
    beat: bool = False  # B (alive) rather than H (joined: send me your view)


Rec = SessionRec | Gone | Waiting | Left | Engaged | Hello


def _f(x: float) -> str:
    return f"{x:.6f}".rstrip("0").rstrip(".") or "0"


def encode(rec: Rec) -> str:
    """One record as one line."""
    head = (rec.replica, _f(rec.at))
    if isinstance(rec, SessionRec):
        rest: tuple[str, ...] = (
            "S",
            rec.sid,
            rec.engine,
            rec.state,
            str(rec.ctx),
            _f(rec.growth),
            str(rec.est),
            str(rec.turns),
            str(rec.running),
            _f(rec.since),
        )
    elif isinstance(rec, Gone):
        rest = ("X", rec.sid)
    elif isinstance(rec, Waiting):
        rest = ("W", rec.ticket, rec.engine, _f(rec.enqueued), _f(rec.bound))
    elif isinstance(rec, Left):
        rest = ("D", rec.ticket)
    elif isinstance(rec, Engaged):
        rest = ("E", rec.engine, "1" if rec.engaged else "0", str(rec.shared_prefix))
    else:
        rest = ("B" if rec.beat else "H",)
    return SEP.join((rest[0], *head, *rest[1:]))


def encode_batch(recs: Iterable[Rec]) -> str:
    return EOL.join(encode(r) for r in recs)


def decode(line: str) -> Rec | None:
    """A line back into its record; None for anything malformed (never raises)."""
    parts = line.split(SEP)
    if len(parts) < 3:
        return None
    kind, replica = parts[0], parts[1]
    try:
        at = float(parts[2])
        a = parts[3:]
        if kind == "S" and len(a) == 9 and a[2] in _STATES:
            return SessionRec(
                replica, at, a[0], a[1], a[2], int(a[3]), float(a[4]), int(a[5]), int(a[6]),
                int(a[7]), float(a[8]),
            )  # fmt: skip
        if kind == "X" and len(a) == 1:
            return Gone(replica, at, a[0])
        if kind == "W" and len(a) == 4:
            return Waiting(replica, at, a[0], a[1], float(a[2]), float(a[3]))
        if kind == "D" and len(a) == 1:
            return Left(replica, at, a[0])
        if kind == "E" and len(a) == 3:
            return Engaged(replica, at, a[0], a[1] == "1", int(a[2]))
        if kind in ("H", "B") and not a:
            return Hello(replica, at, beat=kind == "B")
    except ValueError:
        return None
    return None


def decode_batch(text: str) -> Iterator[Rec]:
    for line in text.split(EOL):
        rec = decode(line)
        if rec is not None:
            yield rec


_STATES = frozenset((SessionState.NEW.value, SessionState.ACTIVE.value, SessionState.PAUSED.value))


@dataclass(slots=True)
class SyncedSession(Session):
    """A session whose turns may also run on other replicas."""

    remote_running: int = 0  # its turns running on other replicas

    @property
    def in_flight(self) -> bool:
        return bool(self.running or self.remote_running)

    def idle_s(self, now: float) -> float:
        return 0.0 if self.in_flight else max(0.0, now - self.since)


@dataclass(slots=True)
class RemoteWaiter:
    replica: str
    engine: str
    enqueued: float  # this replica's clock
    bound: float  # this replica's clock


@dataclass(slots=True)
class Mirror:
    """What this replica knows of the others (its own clock throughout)."""

    replica: str
    # sid -> (wall time, replica) of the record its fields last came from
    versions: dict[str, tuple[float, str]] = field(default_factory=dict)
    # sid -> replica -> turns of it running there
    running: dict[str, dict[str, int]] = field(default_factory=dict)
    waiters: dict[str, RemoteWaiter] = field(default_factory=dict)  # ticket ->
    engaged: dict[str, set[str]] = field(default_factory=dict)  # engine -> replicas
    heard: dict[str, float] = field(default_factory=dict)  # replica -> last heard

    def ahead(self, engine: str, enqueued: float, now: float) -> bool:
        """Whether another replica has a first turn for ``engine`` waiting since before
        ``enqueued`` (ties: the smaller replica name first) that may still wait."""
        for w in self.waiters.values():
            if w.engine != engine or w.bound <= now:
                continue
            if w.enqueued < enqueued or (w.enqueued == enqueued and w.replica < self.replica):
                return True
        return False

    def remote_running(self, sid: str) -> int:
        return sum(self.running.get(sid, {}).values())

    def forget(self, replica: str | None = None) -> set[str]:
        """Drop what ``replica`` (None: every other replica) claims: its running turns,
        waiters and engagement. Returns the sessions whose running count changed."""
        if replica is None:
            self.heard.clear()
        else:
            self.heard.pop(replica, None)
        changed: set[str] = set()
        for sid, per in list(self.running.items()):
            if replica is None or replica in per:
                changed.add(sid)
                if replica is None:
                    per.clear()
                else:
                    per.pop(replica, None)
            if not per:
                del self.running[sid]
        for ticket in [t for t, w in self.waiters.items() if replica in (None, w.replica)]:
            del self.waiters[ticket]
        for reps in self.engaged.values():
            if replica is None:
                reps.clear()
            else:
                reps.discard(replica)
        return changed


def to_local(wall_t: float, now: float, wall: float) -> float:
    """A wall time on this replica's clock."""
    return now - (wall - wall_t)


def to_wall(local_t: float, now: float, wall: float) -> float:
    return wall - (now - local_t)


class SyncedLedger(EngineLedger):
    """The per-engine ledger of one replica, with the other replicas' records folded in.

    Every mutation of a session here calls ``on_change(sid)`` (not while a record of
    another replica is being applied); the shell turns the changed sessions into
    records. Reads are :class:`EngineLedger`'s, except three that count the others:
    ``busy`` / ``idle_s`` of a session (its turns running elsewhere), :meth:`engaged`
    (another replica's engagement holds too) and :meth:`fits_new` (a first turn queued
    after another replica's first turn for the same engine waits behind it).
    """

    def __init__(self, params: ProgramParams, replica: str) -> None:
        super().__init__(params)
        self.mirror = Mirror(replica)
        self.on_change: Callable[[str], None] | None = None
        self._muted = False
        self.taken_over: list[str] = []  # engines engaged here at the last expiry

    @classmethod
    def adopt(cls, old: EngineLedger, replica: str, mirror: Mirror | None = None) -> SyncedLedger:
        """``old``'s sessions, engines and what it learned, as a synced ledger."""
        new = cls(old.p, replica)
        if mirror is not None:
            new.mirror = mirror
        new.engines, new.family, new.peaks = old.engines, old.family, old.peaks
        for url, eng in new.engines.items():
            new._own_load(url, eng)
        names = [f.name for f in fields(Session)]
        for sid, s in old.sessions.items():
            new.sessions[sid] = (
                s
                if isinstance(s, SyncedSession)
                else SyncedSession(**{n: getattr(s, n) for n in names})
            )
        return new

    def engine(self, url: str, now: float = 0.0) -> Engine:
        eng = self.engines.get(url)
        if eng is None:
            eng = super().engine(url, now)
            self._own_load(url, eng)
        return eng

    def _own_load(self, url: str, eng: Engine) -> None:
        if not isinstance(eng.load, SyncedLoad):
            load = eng.load
            eng.load = SyncedLoad(
                **{f.name: getattr(load, f.name) for f in fields(Load)},
                pauser=lambda: self.leads(url),
            )

    def leads(self, url: str) -> bool:
        """Whether this replica pauses ``url``'s sessions for the fleet: the replica
        whose hash with the engine is highest among those heard within the TTL
        (every replica computes the same one from the same beats; alone, itself)."""
        me = self.mirror.replica
        if not self.mirror.heard:
            return True
        mine = crc32(f"{url}|{me}".encode())
        return all(crc32(f"{url}|{r}".encode()) < mine or r == me for r in self.mirror.heard)

    def _changed(self, sid: str) -> None:
        if self.on_change is not None and not self._muted:
            self.on_change(sid)

    # -- this replica's mutations -------------------------------------------------

    def new_session(self, sid: str, engine: str, now: float, est: int) -> Session:
        return SyncedSession(sid=sid, engine=engine, since=now, est=est)

    def open(self, sid: str, engine: str, now: float, est: int) -> Session:
        s = super().open(sid, engine, now, est)
        self._changed(sid)
        return s

    def activate(self, s: Session) -> None:
        was = s.state
        super().activate(s)
        if s.state is not was:
            self._changed(s.sid)

    def turn_started(self, s: Session, now: float, est: int) -> None:
        super().turn_started(s, now, est)
        self._changed(s.sid)

    def turn_ended(self, s: Session, now: float) -> None:
        super().turn_ended(s, now)
        self._changed(s.sid)

    def observe_response(
        self,
        s: Session,
        now: float,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        cached_tokens: int | None,
        continuing: bool,
    ) -> None:
        super().observe_response(
            s,
            now,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            continuing=continuing,
        )
        self._changed(s.sid)

    def pause(self, s: Session, now: float) -> int:
        freed = super().pause(s, now)
        self._changed(s.sid)
        return freed

    def move(self, s: Session, engine: str, now: float) -> None:
        super().move(s, engine, now)
        self._changed(s.sid)

    def drop(self, sid: str) -> Session | None:
        s = super().drop(sid)
        if s is not None:
            self._changed(sid)
        return s

    # -- reads that count the other replicas --------------------------------------

    def engaged(self, url: str) -> bool:
        if super().engaged(url):
            return True
        return self.p.engage_on_thrash and bool(self.mirror.engaged.get(url))

    def fits_new(self, url: str, s: Session, tokens: int, now: float) -> bool:
        if not super().fits_new(url, s, tokens, now):
            return False
        # A first turn not started yet has waited since its session opened (``since``).
        if s.state is SessionState.NEW and not s.running:
            return not self.mirror.ahead(url, s.since, now)
        return True

    def locally_engaged(self, url: str) -> bool:
        return EngineLedger.engaged(self, url)

    # -- records ------------------------------------------------------------------

    def record(
        self, sid: str, now: float, wall: float, at: float | None = None
    ) -> SessionRec | Gone:
        """The session as this replica holds it now (Gone: not here), stamped ``at``:
        the wall time of the change it carries (default ``wall``). Stamped with the
        change, not with the send, a record never outranks another replica's later
        change that had not arrived yet when it was sent."""
        me = self.mirror.replica
        at = wall if at is None else at
        seen = self.mirror.versions.get(sid)
        if seen is None or (at, me) > seen:
            self.mirror.versions[sid] = (at, me)
        s = self.sessions.get(sid)
        if s is None or s.state is SessionState.CLOSED:
            return Gone(me, at, sid)
        return SessionRec(
            me, at, sid, s.engine, s.state.value, s.ctx, s.growth, s.est, s.turns,
            s.running, to_wall(s.since, now, wall),
        )  # fmt: skip

    def apply(self, rec: Rec, now: float, wall: float) -> bool:
        """Fold another replica's record in; True when what a waiting turn depends on
        may have changed (the caller drains its queues)."""
        m = self.mirror
        if rec.replica == m.replica:
            return False
        m.heard[rec.replica] = now
        self._muted = True
        try:
            if isinstance(rec, SessionRec):
                return self._apply_session(rec, now, wall)
            if isinstance(rec, Gone):
                return self._apply_gone(rec, now)
        finally:
            self._muted = False
        if isinstance(rec, Waiting):
            m.waiters[rec.ticket] = RemoteWaiter(
                rec.replica,
                rec.engine,
                to_local(rec.enqueued, now, wall),
                to_local(rec.bound, now, wall),
            )
            return False
        if isinstance(rec, Left):
            return m.waiters.pop(rec.ticket, None) is not None
        if isinstance(rec, Engaged):
            reps = m.engaged.setdefault(rec.engine, set())
            before = bool(reps)
            eng = self.engine(rec.engine, now)
            eng.shared_prefix = max(eng.shared_prefix, rec.shared_prefix)
            if rec.engaged:
                reps.add(rec.replica)
            else:
                reps.discard(rec.replica)
            return before != bool(reps)
        return False

    def _newer(self, sid: str, at: float, replica: str) -> bool:
        # (equal: the same sender at the same instant, and one channel keeps its order)
        seen = self.mirror.versions.get(sid)
        return seen is None or (at, replica) >= seen

    def _apply_session(self, rec: SessionRec, now: float, wall: float) -> bool:
        m = self.mirror
        per = m.running.setdefault(rec.sid, {})
        if rec.running > 0:
            per[rec.replica] = rec.running
        else:
            per.pop(rec.replica, None)
        if not per:
            del m.running[rec.sid]
        s = self.sessions.get(rec.sid)
        if s is None:
            if rec.state == SessionState.NEW.value or not self._newer(rec.sid, rec.at, rec.replica):
                return False  # not admitted anywhere yet (it counts nowhere), or stale
            s = self.open(rec.sid, rec.engine, now, rec.est)
        newer = self._newer(rec.sid, rec.at, rec.replica)
        if newer and s.engine != rec.engine:
            EngineLedger.move(self, s, rec.engine, now)
        self._set_remote(s, sum(per.values()), now)
        # A session's context grows with its turns: the record that saw more answers
        # has the newer one, whenever it was sent.
        if rec.turns > s.turns or (rec.turns == s.turns and newer):
            load = self.engine(s.engine, now).load
            for _ in range(min(8, rec.turns - s.turns)):
                load.answered(now)  # the engine moved on (a waiting turn's aging reads it)
            s.ctx, s.growth, s.turns = rec.ctx, rec.growth, rec.turns
        if not newer:
            return True
        m.versions[rec.sid] = (rec.at, rec.replica)
        self._follow(s, rec.state, now)
        s.est = max(rec.est, s.est if s.running else 0)
        if not s.running:
            s.since = to_local(rec.since, now, wall)
        self.sessions.move_to_end(rec.sid)
        return True

    def _follow(self, s: Session, state: str, now: float) -> None:
        """``s`` takes the sender's ``state`` through the ledger's own transitions
        (:data:`~kvproxy.admission.program.session.SESSION_TRANSITIONS`): ACTIVE is an
        activation; PAUSED is a pause of an ACTIVE session (one NEW here was admitted
        on the sender before it paused there: activated, then paused), not while a turn
        of it runs here (that turn's answer decides); NEW changes nothing (a session
        is not un-admitted)."""
        if state == SessionState.ACTIVE.value:
            EngineLedger.activate(self, s)
        elif state == SessionState.PAUSED.value and not s.running:
            if s.state is SessionState.NEW:
                EngineLedger.activate(self, s)
            if s.state is SessionState.ACTIVE:
                EngineLedger.pause(self, s, now)

    def _set_remote(self, s: Session, count: int, now: float) -> None:
        """``s`` has ``count`` turns running on other replicas: they count as in flight
        on its engine too (the work-conserving floor and the busy time read the fleet's
        turns, not this replica's share)."""
        if not isinstance(s, SyncedSession) or count == s.remote_running:
            return
        load = self.engine(s.engine, now).load
        for _ in range(min(64, abs(count - s.remote_running))):
            if count > s.remote_running:
                load.started(now)
            else:
                load.ended(now)
        s.remote_running = count

    def _apply_gone(self, rec: Gone, now: float) -> bool:
        if not self._newer(rec.sid, rec.at, rec.replica):
            return False
        self.mirror.versions[rec.sid] = (rec.at, rec.replica)
        self.mirror.running.pop(rec.sid, None)
        s = self.sessions.get(rec.sid)
        if s is None:
            return False
        self._set_remote(s, 0, now)
        if s.running:
            return False  # (a turn of it runs here: it stays until that turn's answer)
        EngineLedger.drop(self, rec.sid)
        return True

    # -- the other replicas' liveness ---------------------------------------------

    def expire_replicas(self, now: float, ttl_s: float) -> list[str]:
        """Forget replicas not heard for ``ttl_s`` (their running turns, waiters and
        engagement stop counting) and waiters past their bound; returns the replicas.
        An engine a forgotten replica held engaged and no one else holds is engaged
        here (:meth:`~kvproxy.admission.program.engagement.Engagement.take_over`); those
        engines are left in :attr:`taken_over`."""
        m = self.mirror
        dead = [r for r, at in m.heard.items() if now - at > ttl_s]
        self.taken_over = []
        for r in dead:
            held = sorted(url for url, reps in m.engaged.items() if r in reps)
            self._recount(m.forget(r), now)
            for url in held:
                if self.p.engage_on_thrash and not self.engaged(url):
                    eng = self.engine(url, now)
                    if eng.engagement.take_over():
                        eng.theta = self.p.target_start
                        self.taken_over.append(url)
        for ticket in [t for t, w in m.waiters.items() if w.bound <= now]:
            del m.waiters[ticket]
        if len(m.versions) > 4 * max(1, self.p.max_sessions):
            for sid in [sid for sid in m.versions if sid not in self.sessions]:
                del m.versions[sid]
        return dead

    def forget_others(self, now: float) -> None:
        """The channel is lost: nothing another replica claims counts any more (their
        sessions stay here, decaying and expiring as idle ones do)."""
        self._recount(self.mirror.forget(None), now)

    def _recount(self, sids: Iterable[str], now: float) -> None:
        for sid in sids:
            s = self.sessions.get(sid)
            if s is not None:
                self._set_remote(s, self.mirror.remote_running(sid), now)
