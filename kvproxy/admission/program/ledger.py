"""The per-engine session ledger of program admission. Pure: no I/O, time injected.

Per **session**: its engine (the ring owner of its routing key), its context tokens
(from each response: prompt + completion tokens), the expected growth per turn (an
EMA of the context's growth), its state (NEW before its first turn is admitted,
ACTIVE, PAUSED, CLOSED: its transitions are the table of
:mod:`kvproxy.admission.program.session`), whether a turn is running and since when it
is running or idle, the priority last sent, and an estimate of the running turn's size.

Per **engine**: its capacity ``C = max_total_num_tokens x headroom`` (known while its
last reading is fresh), its admission target theta, the shared-prefix credit (the
largest prefix a session found cached on its first turn: that KV is held once, not
per session), eviction / retraction counters for feedback, and the feedback window.

Footprints::

    footprint(s) = max(s.ctx + s.growth, s.est) + buffer
    weight(s)    = 1 while running or idle < idle_lease_s, then 2^-((idle - lease)/half_life)
                   (half_life 0: 0 once the lease is over)
    W(e) = sum over ACTIVE sessions on e of weight x footprint - credit   (admission, pause)
    U(e) = sum over ACTIVE sessions on e of footprint - credit            (crossover, mark)
    credit(e) = shared_prefix(e) x (active sessions on e - 1)

A lead whose child sessions run (parent links: kvproxy.sessions.family; a child runs
while it is in this ledger, between its turns too) is ``busy``: never expired or
evicted by the bound while a child runs. The tick pauses it as any idle session: its
next turn comes only after its children's, and sparing it moved the pause onto the
children (docs/sessions.md, "Parent sessions"). Its weight decays as any idle
session's (counting a waiting lead at full weight held its own subagents' first turns
longer and lost).

PAUSED, NEW (not yet admitted) and CLOSED sessions count nowhere. A closed session
leaves at once; an idle one leaves after ``idle_ttl_s``; the table is bounded by
``max_sessions`` (least recently active idle session first).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvproxy.admission.program.engagement import Engagement, Load
from kvproxy.admission.program.forecast import Outlook, returned_exposure
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.session import Session, SessionEvent, SessionState
from kvproxy.sessions.family import Family, Link


class PeakModel:
    """What a session is expected to grow to (its peak context), learned on line. Pure.

    Fleet-wide: every engine serves the same workload. Once ``min_closed`` sessions have
    closed (or expired) with at least one response, the expected peak is the ``quantile``
    of the last ``window`` of their final contexts. Before that, the prior: a session's
    context plus the fleet's per-turn growth (an EMA over every response) times
    ``horizon_turns``; before any growth was seen, the engine's context length. Either is
    capped by the engine's context length when known (no session can grow past it).
    """

    def __init__(
        self, *, quantile: float, window: int, min_closed: int, horizon_turns: float, alpha: float
    ) -> None:
        self._order: deque[int] = deque(maxlen=max(1, window))
        self._sorted: list[int] = []
        self._learned: int | None = None  # memoised quantile of _sorted
        self.growth: float | None = None  # fleet EMA of per-turn growth
        self.configure(
            quantile=quantile,
            window=window,
            min_closed=min_closed,
            horizon_turns=horizon_turns,
            alpha=alpha,
        )

    def configure(
        self, *, quantile: float, window: int, min_closed: int, horizon_turns: float, alpha: float
    ) -> None:
        self.quantile = quantile
        self.min_closed = min_closed
        self.horizon_turns = horizon_turns
        self.alpha = alpha
        if self._order.maxlen != max(1, window):
            kept = list(self._order)[-max(1, window) :]
            self._order = deque(kept, maxlen=max(1, window))
            self._sorted = sorted(kept)
        self._learned = None

    def observe_growth(self, delta: float) -> None:
        a = self.alpha
        self.growth = delta if self.growth is None else a * delta + (1 - a) * self.growth

    def observe_closed(self, peak: int) -> None:
        if peak <= 0:
            return
        if len(self._order) == self._order.maxlen:
            old = self._order[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(peak)
        bisect.insort(self._sorted, peak)
        self._learned = None

    @property
    def closed(self) -> int:
        return len(self._sorted)

    def learned(self) -> int | None:
        """The quantile of closed sessions' peaks, or None before ``min_closed``."""
        if len(self._sorted) < max(1, self.min_closed):
            return None
        if self._learned is None:
            i = min(len(self._sorted) - 1, int(self.quantile * len(self._sorted)))
            self._learned = self._sorted[i]
        return self._learned

    def peak(self, ctx: int, context_length: int | None) -> int:
        """The expected peak context of a session now at ``ctx`` tokens."""
        learned = self.learned()
        if learned is not None:
            out = learned
        elif self.growth is not None:
            out = int(ctx + self.growth * self.horizon_turns)
        elif context_length is not None:
            out = context_length
        else:
            out = ctx
        if context_length is not None:
            out = min(out, context_length)
        return max(out, ctx)


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
    # The engine's context length (/server_info), when known: caps an expected peak.
    context_length: int | None = None
    # KV held by the engine's streaming sessions (pinned: never evicted, never decays).
    streaming_held: int = 0
    streaming_sessions: int = 0
    # The engine's host KV tier (SGLang's HiCache, sglang:hicache_host_total_tokens):
    # KV evicted from the pool goes there and is loaded back instead of recomputed.
    host_tokens: int = 0
    # Its write policy is write_back (/server_info): the host holds only what the device
    # evicted, so the two tiers add up (see EngineLedger.kv_room).
    host_write_back: bool = False
    # Decoded tokens per turn (the hold model's input, kvproxy.admission.program.forecast): the
    # mean over the engine's answers once there are some, before that over what its
    # requests asked for (max_new_tokens or an osl hint, as sized).
    decode_asked: float = 0.0
    decode_asks: int = 0
    decode_answered: float = 0.0
    decode_answers: int = 0
    # Its last reading's token usage and waiting requests (the prefetch's gate).
    token_usage: float | None = None
    queue_reqs: int | None = None
    prefetching: int = 0  # prefetches in flight to it
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
    # What kvproxy sees of the engine itself (turns in flight, busy time, answers) and
    # whether holding is measured to pay there (kvproxy.admission.program.engagement).
    load: Load = field(default_factory=Load)
    engagement: Engagement = field(default_factory=Engagement)
    last_stale_release: float = -math.inf

    def note_decode(self, tokens: int, *, answered: bool) -> None:
        """One turn's decode: asked for (a request's completion budget) or answered.
        A running mean over the last ~256 of each."""
        if answered:
            n = min(self.decode_answers, 255)
            self.decode_answered = (self.decode_answered * n + max(0, tokens)) / (n + 1)
            self.decode_answers += 1
        else:
            n = min(self.decode_asks, 255)
            self.decode_asked = (self.decode_asked * n + max(0, tokens)) / (n + 1)
            self.decode_asks += 1

    def decode(self) -> float | None:
        """The expected decode per turn: answered (once 16 answers are in), else asked,
        else None (unknown)."""
        if self.decode_answers >= 16 or (self.decode_answers and not self.decode_asks):
            return self.decode_answered
        if self.decode_asks:
            return self.decode_asked
        return None


class EngineLedger:
    """Sessions and engines of program admission; see the module docstring."""

    def __init__(self, params: ProgramParams) -> None:
        self.p = params
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recent first
        self.engines: dict[str, Engine] = {}
        self.family = Family(max_links=params.max_sessions)
        self.peaks = PeakModel(
            quantile=params.growth_quantile,
            window=params.growth_window,
            min_closed=params.growth_min_closed,
            horizon_turns=params.growth_horizon_turns,
            alpha=params.growth_alpha,
        )

    def configure(self, params: ProgramParams) -> None:
        """New parameters; what was learned (peaks, growth) is kept."""
        self.p = params
        self.peaks.configure(
            quantile=params.growth_quantile,
            window=params.growth_window,
            min_closed=params.growth_min_closed,
            horizon_turns=params.growth_horizon_turns,
            alpha=params.growth_alpha,
        )

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
        host_tokens: int | None = None,
        token_usage: float | None = None,
        queue_reqs: int | None = None,
    ) -> bool:
        """One scrape of ``url``; returns whether it carried a capacity (fresh)."""
        eng = self.engine(url, now)
        eng.token_usage = token_usage
        eng.queue_reqs = queue_reqs
        if host_tokens is not None:
            eng.host_tokens = max(0, host_tokens)
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

    def known(self, url: str) -> bool:
        """Whether the engine's capacity was ever read (it does not change while the
        engine runs: a lost scrape keeps the last one)."""
        eng = self.engines.get(url)
        return eng is not None and eng.max_total_num_tokens is not None

    def fresh(self, url: str, now: float) -> bool:
        """Capacity known and the engine heard from within ``staleness_s``: by its
        ``/metrics`` or by an answer to a turn (the contexts come from the answers)."""
        eng = self.engines.get(url)
        if eng is None or eng.max_total_num_tokens is None:
            return False
        heard = max(
            -math.inf if eng.observed_at is None else eng.observed_at,
            -math.inf if eng.load.last_answer_at is None else eng.load.last_answer_at,
        )
        return now - heard <= self.p.staleness_s

    def engaged(self, url: str) -> bool:
        """Whether the gate holds work on ``url`` (always, with ``engage_on_thrash``
        off: the gate of earlier versions)."""
        if not self.p.engage_on_thrash:
            return True
        eng = self.engines.get(url)
        return eng is not None and eng.engagement.engaged

    def capacity(self, url: str) -> float:
        eng = self.engines.get(url)
        if eng is None or eng.max_total_num_tokens is None:
            return 0.0
        return eng.max_total_num_tokens * self.p.headroom

    def kv_room(self, url: str) -> float:
        """The distinct KV the engine keeps without recomputing any: its capacity, or
        with a host tier (SGLang's HiCache) what the two tiers hold together; what
        overflows the device comes back by a load, not a recompute.

        * ``write_through`` (SGLang's default) and ``write_through_selective``: a device
          node is copied to the host when it is hit (once; twice for the selective
          policy), so the host holds the device's KV too and the larger tier bounds
          what the engine keeps: max(capacity, host). (Selective leaves some device
          nodes without a copy, so this undercounts it a little: the safe side.)
        * ``write_back``: a node is copied only when the device evicts it
          (``HiRadixCache.evict``, sgl-project/sglang ``mem_cache/hiradix_cache.py``),
          so the host holds what the device does not: capacity + host."""
        cap = self.capacity(url)
        eng = self.engines.get(url)
        if eng is None or cap <= 0 or eng.host_write_back:
            return self.tier_room(url)
        return max(cap, eng.host_tokens * self.p.headroom)

    def tier_room(self, url: str) -> float:
        """The most KV the engine's two tiers could keep together: its capacity plus its
        host pool (SGLang's HiCache), whatever the write policy. Under write-through
        the host copies the device's KV, so the distinct KV kept is ``kv_room``; this is
        the larger bound, for a decision that must err towards not acting (an engine
        with a host tier pauses only once its sessions overflow it: ProgramCore._pause).
        Without a host tier it is the capacity."""
        cap = self.capacity(url)
        eng = self.engines.get(url)
        if eng is None or cap <= 0:
            return cap
        return cap + eng.host_tokens * self.p.headroom

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
        total = math.fsum(self.weight(s, now) * s.footprint(b) for s in self._active(url))
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

    # -- growth-aware admission of new sessions ------------------------------------

    def set_context_length(self, url: str, context_length: int | None) -> None:
        eng = self.engine(url)
        eng.context_length = context_length if context_length and context_length > 0 else None

    def set_host_write_policy(self, url: str, policy: str | None) -> None:
        """The engine's host tier write policy (``/server_info``); None: none known."""
        self.engine(url).host_write_back = policy == "write_back"

    def reservation(self, s: Session, url: str | None = None) -> int:
        """What the session is expected to hold at its peak: max(footprint, peak)."""
        eng = self.engines.get(url or s.engine)
        cl = None if eng is None else eng.context_length
        b = self.p.session_buffer_tokens
        return max(s.footprint(b), self.peaks.peak(max(s.ctx, s.est), cl) + b)

    def reserved(self, url: str, now: float) -> float:
        """R(e): decayed reservations of the engine's ACTIVE sessions, less the credit."""
        # fsum: exact, so the result does not depend on the set's (hash) order.
        total = math.fsum(self.weight(s, now) * self.reservation(s) for s in self._active(url))
        eng = self.engines.get(url)
        held = float(eng.streaming_held) if eng is not None else 0.0
        return max(0.0, total - self.credit(url), held)

    def fits_new(self, url: str, s: Session, tokens: int, now: float) -> bool:
        """A new session's first turn of ``tokens``: it fits now (``fits``) and, with
        growth reservation on, what the admitted sessions and it are expected to grow to
        fits ``growth_target x`` the engine's KV room (``kv_room``: C, or its host pool
        where larger; the crossover does not apply: a first turn is small, its growth is
        not). An engine with no active session takes it anyway."""
        if not self.fits(url, tokens, now):
            return False
        if not self.p.growth_reservation:
            return True
        eng = self.engines.get(url)
        if eng is None or not eng.sessions:
            return True  # an empty engine takes any session it fits (no deadlock)
        need = self.first_reservation(url, s, tokens, now)
        return self.reserved(url, now) + need <= self.p.growth_target * self.kv_room(url)

    def first_reservation(self, url: str, s: Session, tokens: int, now: float) -> int:
        """What ``s`` with a first turn of ``tokens`` would reserve on ``url``."""
        probe = Session(sid=s.sid, engine=url, since=now, ctx=s.ctx, est=max(s.est, tokens))
        return self.reservation(probe, url)

    def outlook(
        self, url: str, now: float, s: Session | None = None, tokens: int = 0
    ) -> Outlook | None:
        """The hold model's inputs on ``url`` (kvproxy.admission.program.forecast), counting
        ``s``'s first turn of ``tokens`` when it is not active yet; None while the
        engine's decodes are unknown. Expected peaks only once the fleet's growth was
        seen: before, a peak is the engine's context length, and every large fleet would
        look oversubscribed."""
        p, eng = self.p, self.engine(url, now)
        decode = eng.decode()
        if decode is None:
            return None
        demand = float(self.undecayed(url))
        sessions = len(eng.sessions)
        growth = self.peaks.growth
        expected = None if growth is None else self.reserved(url, now)
        if s is not None and s.state is not SessionState.ACTIVE:
            demand += max(s.footprint(p.session_buffer_tokens), tokens)
            sessions += 1
            if expected is not None:
                expected += self.first_reservation(url, s, tokens, now)
        return Outlook(
            demand=demand,
            room=self.tier_room(url),
            sessions=sessions,
            decode=decode,
            inflight=eng.load.inflight,
            measured_exposure=returned_exposure(
                eng.load, p.engage_min_turns, p.decode_token_weight
            ),
            expected=expected,
            growth=growth or 0.0,
        )

    def past_pause_mark(self, url: str, need: int) -> bool:
        """Whether ``need`` more tokens would push the engine's sessions, every one
        counted in full (undecayed), past ``pause_high`` x pool + host. A paused turn
        whose resume would do so waits past its soft bound (a swap that evicts as much
        as it saves: docs/admission.md, "Holds that last as long as they pay"). Stricter
        than the tick's pause, which counts idle sessions decayed: the decayed count
        here was measured to lose the deep fleet (docs/benchmarks.md, "What did not
        work")."""
        return self.undecayed(url) + need > self.p.pause_high * self.tier_room(url)

    # -- sessions ------------------------------------------------------------------

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def new_session(self, sid: str, engine: str, now: float, est: int) -> Session:
        """The record of a session opened now (a subclass's may carry more)."""
        return Session(sid=sid, engine=engine, since=now, est=est)

    def open(self, sid: str, engine: str, now: float, est: int) -> Session:
        s = self.new_session(sid, engine, now, est)
        s.children_running = self.family.running_children(sid)
        self.sessions[sid] = s
        self._child_changed(self.family.started(sid))
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
            if not s.busy and s.state is not SessionState.NEW:
                self.drop(sid)
                dropped.append(sid)
        return dropped

    def activate(self, s: Session) -> None:
        if s.state is not SessionState.ACTIVE:
            s.on(SessionEvent.ACTIVATE)
            self.engine(s.engine).sessions.add(s.sid)

    def mark_pause(self, s: Session, pending: bool) -> None:
        """Whether an ACTIVE session pauses at its next response."""
        s.on(SessionEvent.MARK_PAUSE if pending else SessionEvent.UNMARK)
        s.pause_pending = pending

    def turn_started(self, s: Session, now: float, est: int) -> None:
        s.on(SessionEvent.TURN_START)
        s.running += 1
        s.since = now
        # One id with several turns in flight (a harness sharing it across subagents):
        # the largest turn's size, not the last one's.
        if s.running > 1:
            s.shared = True
        s.est = max(est, 0) if s.running == 1 else max(s.est, est, 0)
        self.sessions.move_to_end(s.sid)

    def turn_ended(self, s: Session, now: float) -> None:
        s.on(SessionEvent.TURN_END)
        s.running = max(0, s.running - 1)
        s.since = now

    # -- parent links --------------------------------------------------------------

    def link(self, sid: str, parent: str) -> Link:
        """Session ``sid`` names ``parent`` (on each of its requests)."""
        s = self.sessions.get(sid)
        old = self.family.parent(sid)
        outcome = self.family.link(sid, parent, running=s is not None)
        if outcome in (Link.LINKED, Link.MOVED):
            self._child_changed(parent)
            self._child_changed(old)
        return outcome

    def has_running_children(self, sid: str) -> bool:
        return self.family.running_children(sid) > 0

    def _child_changed(self, parent: str | None) -> None:
        """A child of ``parent`` started or ended: the parent's count follows."""
        if parent is None:
            return
        p = self.sessions.get(parent)
        if p is not None:
            p.children_running = self.family.running_children(parent)

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
        if completion_tokens is not None:
            eng.note_decode(completion_tokens, answered=True)
        if cached_tokens is not None:
            cached = min(cached_tokens, prompt_tokens)
            left = min(s.ctx, prompt_tokens) if continuing else 0
            lost = max(0, left - cached)
            eng.load.worked(prompt_tokens - cached, lost, completion_tokens or 0, left)
            if s.turns == 0:
                # What a session finds cached on its first turn is the shared prefix.
                eng.shared_prefix = max(eng.shared_prefix, min(cached_tokens, prompt_tokens))
            elif continuing and s.ctx > 0:
                eng.cached_sum += min(cached_tokens, s.ctx)
                eng.resident_sum += s.ctx
                eng.turns_in_window += 1
        if s.shared:
            # One id, several turns at once (a shared id: contexts that diverge, a
            # subagent's smaller than its lead's). The session is counted once, at its
            # largest context; a turn's context is no growth of another's.
            s.ctx = max(s.ctx, total)
            if not s.running > 1:
                s.est = 0
            s.turns += 1
            return
        if s.turns > 0:
            delta = max(0, total - s.ctx)
            a = self.p.growth_alpha
            s.growth = delta if s.turns == 1 else a * delta + (1 - a) * s.growth
            self.peaks.observe_growth(delta)
        s.ctx = total
        s.est = 0
        s.turns += 1

    def pause(self, s: Session, now: float) -> int:
        """ACTIVE -> PAUSED: it stops counting; returns the footprint freed."""
        freed = s.footprint(self.p.session_buffer_tokens)
        s.on(SessionEvent.PAUSE)
        s.pause_pending = False
        eng = self.engine(s.engine, now)
        eng.sessions.discard(s.sid)
        eng.freed_tokens += freed
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
        self._child_changed(self.family.ended(sid))
        self.family.forget(sid)
        if s.turns > 0:  # what it grew to (contexts only grow within a session)
            self.peaks.observe_closed(s.ctx)
        eng = self.engines.get(s.engine)
        if eng is not None and sid in eng.sessions:
            eng.sessions.discard(sid)
            eng.freed_tokens += s.footprint(self.p.session_buffer_tokens)
        s.on(SessionEvent.CLOSE)
        return s

    def expire(self, now: float, waiting: frozenset[str] = frozenset()) -> list[str]:
        """Sessions idle (not busy, not NEW) past ``idle_ttl_s`` leave; returns them.
        A session with a turn ``waiting`` is not idle: its turn is held, not absent (a
        paused session dropped while its turn waits would come back as a new one, its
        next turn held as a first turn)."""
        out = [
            sid
            for sid, s in self.sessions.items()
            if not (s.state is SessionState.NEW or s.busy or sid in waiting)
            and now - s.since > self.p.idle_ttl_s
        ]
        for sid in out:
            self.drop(sid)
        return out

    def on_engine(self, url: str) -> Iterable[Session]:
        return (s for s in self.sessions.values() if s.engine == url)

    def counts(self) -> dict[str, int]:
        out = {state.value: 0 for state in SessionState if state is not SessionState.CLOSED}
        for s in self.sessions.values():
            out[s.state.value] += 1
        out["running"] = sum(1 for s in self.sessions.values() if s.running)
        return out
