"""The per-engine session ledger of program admission. Pure: no I/O, time injected.

Per **session**: its engine (the ring owner of its routing key), its context tokens
(from each response: prompt + completion tokens), the expected growth per turn (an
EMA of the context's growth), its state (NEW before its first turn is admitted,
ACTIVE, PAUSED, CLOSED), whether a turn is running and since when it is running or
idle, the priority last sent, and an estimate of the running turn's size.

Per **engine**: its capacity ``C = max_total_num_tokens x headroom`` (known while its
last reading is fresh), its admission target theta, the shared-prefix credit (the
largest prefix a session found cached on its first turn: that KV is held once, not
per session), eviction / retraction counters for feedback, and the feedback window.

Footprints::

    footprint(s) = max(s.ctx + s.growth, s.est) + buffer
    weight(s)    = 1 while running or idle < idle_lease_s, then 2^-((idle - lease)/half_life)
                   (half_life 0: 0 once the lease is over)
    W(e) = sum over ACTIVE sessions on e of weight x footprint - credit   (admission)
    U(e) = sum over ACTIVE sessions on e of footprint - credit            (pause pressure)
    credit(e) = shared_prefix(e) x (active sessions on e - 1)

PAUSED, NEW (not yet admitted) and CLOSED sessions count nowhere. A closed session
leaves at once; an idle one leaves after ``idle_ttl_s``; the table is bounded by
``max_sessions`` (least recently active idle session first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from kvproxy.admission.params import ProgramParams


class SessionState(StrEnum):
    NEW = "new"
    ACTIVE = "active"
    PAUSED = "paused"
    CLOSED = "closed"


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

    def footprint(self, buffer: int) -> int:
        return int(max(self.ctx + self.growth, self.est)) + buffer

    def idle_s(self, now: float) -> float:
        return 0.0 if self.running else max(0.0, now - self.since)


@dataclass(slots=True)
class Engine:
    url: str
    theta: float
    max_total_num_tokens: int | None = None
    observed_at: float | None = None
    shared_prefix: int = 0
    evicted_total: int | None = None
    retracted_total: int | None = None
    sessions: set[str] = field(default_factory=set)  # ACTIVE sessions on it
    # KV held by the engine's streaming sessions (pinned: never evicted, never decays).
    streaming_held: int = 0
    streaming_sessions: int = 0
    # Feedback window (since window_start).
    window_start: float = 0.0
    evicted_delta: int = 0
    retracted_delta: int = 0
    freed_tokens: int = 0  # footprint paused or closed in the window
    cached_sum: int = 0  # continuing turns: tokens found cached
    resident_sum: int = 0  # continuing turns: the context they left behind
    turns_in_window: int = 0
    quiet: int = 0
    last_cut: float = -math.inf


class EngineLedger:
    """Sessions and engines of program admission; see the module docstring."""

    def __init__(self, params: ProgramParams) -> None:
        self.p = params
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recent first
        self.engines: dict[str, Engine] = {}

    # -- engines -------------------------------------------------------------------

    def engine(self, url: str, now: float = 0.0) -> Engine:
        eng = self.engines.get(url)
        if eng is None:
            eng = self.engines[url] = Engine(url, self.p.target_start, window_start=now)
        return eng

    def observe_engine(
        self,
        url: str,
        now: float,
        *,
        max_total_num_tokens: int | None,
        evicted_total: int | None = None,
        retracted_total: int | None = None,
        streaming_held: int | None = None,
        streaming_sessions: int | None = None,
    ) -> bool:
        """One scrape of ``url``; returns whether it carried a capacity (fresh)."""
        eng = self.engine(url, now)
        # Absent (engine without --enable-streaming-session): nothing pinned.
        eng.streaming_held = streaming_held or 0
        eng.streaming_sessions = streaming_sessions or 0
        if evicted_total is not None:
            if eng.evicted_total is not None and evicted_total >= eng.evicted_total:
                eng.evicted_delta += evicted_total - eng.evicted_total
            eng.evicted_total = evicted_total
        if retracted_total is not None:
            if eng.retracted_total is not None and retracted_total >= eng.retracted_total:
                eng.retracted_delta += retracted_total - eng.retracted_total
            eng.retracted_total = retracted_total
        if max_total_num_tokens is None or max_total_num_tokens <= 0:
            return False
        eng.max_total_num_tokens = max_total_num_tokens
        eng.observed_at = now
        return True

    def fresh(self, url: str, now: float) -> bool:
        eng = self.engines.get(url)
        return (
            eng is not None
            and eng.observed_at is not None
            and eng.max_total_num_tokens is not None
            and now - eng.observed_at <= self.p.staleness_s
        )

    def capacity(self, url: str) -> float:
        eng = self.engines.get(url)
        if eng is None or eng.max_total_num_tokens is None:
            return 0.0
        return eng.max_total_num_tokens * self.p.headroom

    # -- footprints ----------------------------------------------------------------

    def weight(self, s: Session, now: float) -> float:
        idle = s.idle_s(now)
        lease = self.p.idle_lease_s
        if idle < lease:
            return 1.0
        half = self.p.idle_half_life_s
        if half <= 0:
            return 0.0
        return 2.0 ** (-(idle - lease) / half)

    def _active(self, url: str) -> Iterator[Session]:
        eng = self.engines.get(url)
        if eng is None:
            return
        for sid in eng.sessions:
            yield self.sessions[sid]

    def credit(self, url: str) -> int:
        eng = self.engines.get(url)
        if eng is None or len(eng.sessions) < 2:
            return 0
        return eng.shared_prefix * (len(eng.sessions) - 1)

    def committed(self, url: str, now: float) -> float:
        """W(e): decayed footprint of the engine's ACTIVE sessions, less the credit,
        and never below the KV the engine's streaming sessions hold: that KV is pinned
        (``sglang:streaming_session_held_tokens``), so it stays committed however long
        its session idles."""
        b = self.p.session_buffer_tokens
        total = sum(self.weight(s, now) * s.footprint(b) for s in self._active(url))
        eng = self.engines.get(url)
        held = float(eng.streaming_held) if eng is not None else 0.0
        return max(0.0, total - self.credit(url), held)

    def undecayed(self, url: str) -> int:
        """U(e): undecayed footprint of the engine's ACTIVE sessions, less the credit."""
        b = self.p.session_buffer_tokens
        return max(0, sum(s.footprint(b) for s in self._active(url)) - self.credit(url))

    def gate_off(self, url: str, extra: int = 0) -> bool:
        """Below the crossover the gate is out of the way: admit all, pause none."""
        return self.undecayed(url) + extra < self.p.gate_off_below * self.capacity(url)

    def fits(self, url: str, tokens: int, now: float) -> bool:
        if self.gate_off(url, tokens):
            return True
        eng = self.engines.get(url)
        theta = self.p.target_start if eng is None else eng.theta
        return self.committed(url, now) + tokens <= theta * self.capacity(url)

    # -- sessions ------------------------------------------------------------------

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def open(self, sid: str, engine: str, now: float, est: int) -> Session:
        s = Session(sid=sid, engine=engine, since=now, est=est)
        self.sessions[sid] = s
        self.engine(engine, now)
        self._bound()
        return s

    def _bound(self) -> list[str]:
        """Drop least recently active idle sessions past max_sessions; returns them."""
        dropped: list[str] = []
        if len(self.sessions) <= self.p.max_sessions:
            return dropped
        for sid, s in list(self.sessions.items()):
            if len(self.sessions) <= self.p.max_sessions:
                break
            if not s.running and s.state is not SessionState.NEW:
                self.drop(sid)
                dropped.append(sid)
        return dropped

    def activate(self, s: Session) -> None:
        if s.state is not SessionState.ACTIVE:
            s.state = SessionState.ACTIVE
            self.engine(s.engine).sessions.add(s.sid)

    def turn_started(self, s: Session, now: float, est: int) -> None:
        s.running += 1
        s.since = now
        s.est = max(est, 0)
        self.sessions.move_to_end(s.sid)

    def turn_ended(self, s: Session, now: float) -> None:
        s.running = max(0, s.running - 1)
        s.since = now

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
        """A turn's usage: the context is prompt + completion; growth is its EMA.

        ``continuing`` (a turn of a session that was ACTIVE and not resumed) feeds the
        engine's cached-fraction window: the share of the context it left behind that
        the engine still had cached.
        """
        eng = self.engine(s.engine, now)
        if prompt_tokens is None:
            return
        total = prompt_tokens + (completion_tokens or 0)
        if cached_tokens is not None:
            if s.turns == 0:
                # What a session finds cached on its first turn is the shared prefix.
                eng.shared_prefix = max(eng.shared_prefix, min(cached_tokens, prompt_tokens))
            elif continuing and s.ctx > 0:
                eng.cached_sum += min(cached_tokens, s.ctx)
                eng.resident_sum += s.ctx
                eng.turns_in_window += 1
        if s.turns > 0:
            delta = max(0, total - s.ctx)
            a = self.p.growth_alpha
            s.growth = delta if s.turns == 1 else a * delta + (1 - a) * s.growth
        s.ctx = total
        s.est = 0
        s.turns += 1

    def pause(self, s: Session, now: float) -> int:
        """ACTIVE -> PAUSED: it stops counting; returns the footprint freed."""
        freed = s.footprint(self.p.session_buffer_tokens)
        s.pause_pending = False
        if s.state is SessionState.ACTIVE:
            eng = self.engine(s.engine, now)
            eng.sessions.discard(s.sid)
            eng.freed_tokens += freed
        s.state = SessionState.PAUSED
        return freed

    def move(self, s: Session, engine: str, now: float) -> None:
        """Re-attribute a session to another engine (the ring moved its key)."""
        if s.engine == engine:
            return
        if s.state is SessionState.ACTIVE:
            self.engine(s.engine, now).sessions.discard(s.sid)
            self.engine(engine, now).sessions.add(s.sid)
        else:
            self.engine(engine, now)
        s.engine = engine

    def drop(self, sid: str) -> Session | None:
        """The session leaves the ledger (closed, expired or evicted by the bound)."""
        s = self.sessions.pop(sid, None)
        if s is None:
            return None
        eng = self.engines.get(s.engine)
        if eng is not None and sid in eng.sessions:
            eng.sessions.discard(sid)
            eng.freed_tokens += s.footprint(self.p.session_buffer_tokens)
        s.state = SessionState.CLOSED
        return s

    def expire(self, now: float) -> list[str]:
        """Sessions idle (not running, not NEW) past ``idle_ttl_s`` leave; returns them."""
        ttl = self.p.idle_ttl_s
        out: list[str] = []
        for sid, s in list(self.sessions.items()):
            if s.state is SessionState.NEW or s.running:
                continue
            if now - s.since > ttl:
                self.drop(sid)
                out.append(sid)
        return out

    def on_engine(self, url: str) -> Iterable[Session]:
        return (s for s in self.sessions.values() if s.engine == url)

    def counts(self) -> dict[str, int]:
        out = {state.value: 0 for state in SessionState if state is not SessionState.CLOSED}
        running = 0
        for s in self.sessions.values():
            out[s.state.value] += 1
            running += 1 if s.running else 0
        out["running"] = running
        return out
