"""Program admission's decisions and tick over the per-engine ledger and queues. Pure.

Time is injected (``now``); the asyncio coordinator owns one :class:`ProgramCore`,
calls it on the event loop only, and turns its answers into futures and timers.

Rules (docs/admission.md#program-mode): a continuing turn of an ACTIVE session is
forwarded at once, never held; a NEW session's first turn waits in its engine's FIFO
(with fit) until it fits, past ``new_session_soft_wait_s`` only while admitting it would
push its engine past the pause mark, at most ``new_session_max_wait_s``; a PAUSED session's turn
waits ahead of new sessions until it fits, past ``paused_soft_wait_s`` only while its
resume would push its engine past the pause mark, at most ``paused_max_wait_s``; an
engine holds only while engaged (:mod:`.engagement`: measured thrash, the cold start,
or the hold model of :mod:`.forecast`); every failure of a signal fails open. The tick (every ``tick_s``): idle expiry, drain (resumes first), pause
(largest idle first) under growth pressure, the feedback window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Final

from kvproxy.admission.program.events import Event, Held
from kvproxy.admission.program.forecast import holding_pays, returned_exposure
from kvproxy.admission.program.ledger import Engine, EngineLedger, Session, SessionState
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.prefetch import Prefetches
from kvproxy.admission.program.priority import next_priority
from kvproxy.admission.program.queues import Entry, Queues
from kvproxy.admission.records import Outcome
from kvproxy.record import Record


class Verdict(Record):
    """The answer to one request: forward now (``outcome``) or wait (``held``)."""

    __slots__ = ("engine", "held", "outcome")

    def __init__(
        self, outcome: Outcome | None, held: Held | None = None, engine: str | None = None
    ) -> None:
        self.outcome: Final = outcome
        self.held: Final = held
        self.engine: Final = engine


class Release(Record):
    """A waiting ticket's decision, made by a drain or a tick."""

    __slots__ = ("outcome", "ticket", "wait_s")

    def __init__(self, ticket: str, outcome: Outcome, wait_s: float) -> None:
        self.ticket: Final = ticket
        self.outcome: Final = outcome
        self.wait_s: Final = wait_s


class ProgramCore:
    def __init__(self, params: ProgramParams) -> None:
        self.p = params
        self.ledger = EngineLedger(params)
        self.queues = Queues()
        self.events: Counter[str] = Counter()
        self.paused_waits: list[float] = []  # waits of paused turns since last read
        # ticket -> (sid, outcome, engine it was started on)
        self._inflight: dict[str, tuple[str, Outcome, str]] = {}
        self._last_tick = 0.0
        self.prefetch = Prefetches(params, self.events)

    def configure(self, params: ProgramParams) -> None:
        self.p = params
        self.ledger.configure(params)
        self.prefetch.configure(params)

    # -- requests ------------------------------------------------------------------

    def request(
        self,
        ticket: str,
        sid: str | None,
        owner: str | None,
        tokens: int,
        now: float,
        *,
        decode: int | None = None,
    ) -> Verdict:
        """Decide for one turn. ``owner``: the ring owner of its routing key;
        ``decode``: the completion part of ``tokens`` (what the request asks to decode),
        when known: the hold model's input before any answer."""
        if sid is None:
            return Verdict(Outcome.BYPASS_NO_SESSION)
        led = self.ledger
        if decode is not None and owner is not None:
            led.engine(owner, now).note_decode(decode, answered=False)
        s = led.get(sid)
        if owner is None:
            if s is not None:
                self._start(ticket, s, now, tokens, Outcome.BYPASS_NO_PLACEMENT)
            return Verdict(Outcome.BYPASS_NO_PLACEMENT)
        if s is None:
            s = led.open(sid, owner, now, tokens)
        elif self.p.prefetch and not s.running and s.turns:
            self.prefetch.tool_returned(s, now)
        if s.engine != owner:
            self._move(s, owner, now)
        if s.state is SessionState.ACTIVE and not self.p.hold_continuing:
            return self._go(ticket, s, now, tokens, Outcome.CONTINUING_FORWARDED)
        if not led.known(owner):
            return self._go(ticket, s, now, tokens, Outcome.BYPASS_NO_METRICS)
        if s.state is SessionState.PAUSED:
            return self._resume(ticket, s, tokens, now)
        return self._first_turn(ticket, s, tokens, now)

    def _go(self, ticket: str, s: Session, now: float, tokens: int, outcome: Outcome) -> Verdict:
        """Forward now: the session counts on its engine from this turn on."""
        self.ledger.activate(s)
        self._start(ticket, s, now, tokens, outcome)
        return Verdict(outcome, engine=s.engine)

    def _resume(self, ticket: str, s: Session, tokens: int, now: float) -> Verdict:
        """A paused session's turn: at once if permissive or it fits, else it waits."""
        led, url = self.ledger, s.engine
        need = max(s.footprint(self.p.session_buffer_tokens), tokens)
        if not led.engaged(url) or led.fits(url, need, now):
            return self._go(ticket, s, now, tokens, Outcome.RESUMED)
        deadline = now + self.p.paused_soft_wait_s
        return self._wait(ticket, s, tokens, now, "paused", deadline, Held.PAUSED_FIT)

    def _first_turn(self, ticket: str, s: Session, tokens: int, now: float) -> Verdict:
        """A new session's first turn (or, in the hold_continuing ablation, a continuing
        turn): at once if permissive or it fits with nobody ahead, else its engine's FIFO."""
        led, url = self.ledger, s.engine
        continuing = s.state is SessionState.ACTIVE
        if tokens > led.capacity(url):
            return self._go(ticket, s, now, tokens, Outcome.BYPASS_OVERSIZED)
        paused_waiting, new_waiting = self.queues.waiting(url)
        engaged = led.engaged(url) or (
            not continuing
            and (self._reengage(url, s, tokens, now) or self._forecast(url, now, s, tokens))
        )
        if not engaged:
            fit = True
        elif continuing:
            fit = led.fits(url, tokens, now)
        else:
            fit = led.fits_new(url, s, tokens, now)
        if not paused_waiting and not new_waiting and fit:
            outcome = Outcome.CONTINUING_FORWARDED if continuing else Outcome.NEW_ADMITTED
            return self._go(ticket, s, now, tokens, outcome)
        if continuing:
            held = Held.CONTINUING_FIT
        elif paused_waiting or new_waiting:
            held = Held.NEW_BEHIND
        else:
            held = Held.NEW_SESSION_FIT
        s.est = max(s.est, tokens)
        deadline = now + self.p.new_session_max_wait_s
        return self._wait(ticket, s, tokens, now, "new", deadline, held)

    def _reengage(self, url: str, s: Session, tokens: int, now: float) -> bool:
        """Whether a new session's first turn that does not fit engages its armed
        permissive engine now (``Engagement.rearm``)."""
        if not self.p.engage_on_thrash:
            return False
        eng = self.ledger.engine(url, now)
        e = eng.engagement
        if not e.armed or self.ledger.fits_new(url, s, tokens, now) or not e.rearm():
            return False
        eng.theta = self.p.target_start
        self.events[Event.REENGAGED] += 1
        return True

    def _forecast(self, url: str, now: float, s: Session | None = None, tokens: int = 0) -> bool:
        """Whether the hold model (kvproxy.admission.program.forecast) engages the permissive
        engine ``url`` now; later windows confirm or refute it (Engagement.judge)."""
        if not (self.p.engage_on_thrash and self.p.engage_on_forecast):
            return False
        eng = self.ledger.engine(url, now)
        e = eng.engagement
        if e.engaged or e.backoff > 0 or e.failures > 0 or not self.ledger.known(url):
            return False
        if not self._floor_fits(url, eng):
            return False  # (measured: the contexts turns come back to, as the rule's)
        o = self.ledger.outlook(url, now, s, tokens)
        if o is None or not holding_pays(o, self.p.forecast_rule) or not e.predict():
            return False
        eng.theta = self.p.target_start
        self.events[Event.PREDICTED] += 1
        return True

    def hint_growth(self, sid: str | None, osl: int | None) -> None:
        """A client's expected output per turn (``agent_hints.osl``) floors the
        session's expected growth, so its footprint counts the next answer."""
        if sid is None or not osl:
            return
        s = self.ledger.get(sid)
        if s is not None:
            s.growth = max(s.growth, float(osl))

    def _wait(
        self,
        ticket: str,
        s: Session,
        tokens: int,
        now: float,
        which: str,
        deadline: float,
        held: Held,
    ) -> Verdict:
        if len(self.queues) >= self.p.max_queue:
            self.ledger.activate(s)
            self._start(ticket, s, now, tokens, Outcome.BYPASS_QUEUE_FULL)
            return Verdict(Outcome.BYPASS_QUEUE_FULL, engine=s.engine)
        mark = self.ledger.engine(s.engine, now).load.answers
        self.queues.push(Entry(ticket, s.sid, s.engine, tokens, now, deadline, held, mark), which)
        return Verdict(None, held=held, engine=s.engine)

    def _start(self, ticket: str, s: Session, now: float, tokens: int, outcome: Outcome) -> None:
        if ticket in self._inflight:  # the same attempt asked twice: one running turn
            return
        self.ledger.turn_started(s, now, tokens)
        self.ledger.engine(s.engine, now).load.started(now)
        self._inflight[ticket] = (s.sid, outcome, s.engine)

    def priority(self, sid: str | None) -> int | None:
        """The priority to send with the session's request (monotone), or None."""
        if sid is None:
            return None
        s = self.ledger.get(sid)
        if s is None:
            return None
        s.prio = next_priority(
            s.prio,
            max(s.ctx, s.est),
            unit_tokens=self.p.priority_unit_tokens,
            max_priority=self.p.priority_max,
        )
        return s.prio

    def cancel(self, ticket: str) -> bool:
        """Withdraw a waiting ticket; True if it was waiting."""
        entry = self.queues.remove(ticket)
        if entry is None:
            return False
        s = self.ledger.get(entry.sid)
        if (
            s is not None
            and s.state is SessionState.NEW
            and not s.running
            and s.turns == 0
            and not any(e.sid == s.sid for e, _ in self.queues.live())
        ):
            self.ledger.drop(s.sid)  # never admitted: forget it
        return True

    def turn_ended(self, ticket: str, now: float) -> None:
        """The forwarded turn's ``async with`` block exited (any path)."""
        found = self._inflight.pop(ticket, None)
        if found is None:
            return
        eng = self.ledger.engines.get(found[2])
        if eng is not None:
            eng.load.ended(now)
        s = self.ledger.get(found[0])
        if s is None:
            return
        self.ledger.turn_ended(s, now)
        if s.pause_pending and not s.running and s.state is SessionState.ACTIVE:
            self.ledger.pause(s, now)
            self.events[Event.PAUSED] += 1
        if self.p.prefetch and not s.running:
            self.prefetch.answered(s, now)

    def running(self, ticket: str) -> bool:
        """Whether ``ticket`` is a turn this program admission let run (and still runs)."""
        return ticket in self._inflight

    def observe_response(
        self,
        ticket: str,
        now: float,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        found = self._inflight.get(ticket)
        if found is None:
            return
        sid, outcome, url = found
        self.ledger.engine(url, now).load.answered(now)
        s = self.ledger.get(sid)
        if s is None:
            return
        self.ledger.observe_response(
            s,
            now,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            continuing=outcome in (Outcome.CONTINUING_FORWARDED, Outcome.CONTINUING_WAITED),
        )

    def end_session(self, sid: str, now: float) -> bool:
        """The session closed: it leaves at once (waiting turns of it stay queued)."""
        self.prefetch.cancel(sid)
        if self.ledger.drop(sid) is None:
            return False
        self.events[Event.CLOSED] += 1
        return True

    def prefetches(self, now: float) -> list[tuple[str, str]]:  # (prefetch.Prefetches)
        return self.prefetch.due(self.ledger, now)

    def prefetch_done(self, url: str) -> None:
        self.prefetch.done(self.ledger, url)

    # -- placement -----------------------------------------------------------------

    def _move(self, s: Session, owner: str, now: float) -> None:
        self.ledger.move(s, owner, now)
        self.events[Event.MOVED] += 1

    def reattribute(self, owner_of: dict[str, str | None], now: float) -> int:
        """Apply new owners (sid -> engine) after a worker-set or health change."""
        moved = 0
        for sid, owner in owner_of.items():
            s = self.ledger.get(sid)
            if s is None or owner is None or owner == s.engine:
                continue
            self._move(s, owner, now)
            moved += 1
        if moved:
            for entry, _ in list(self.queues.live()):
                s = self.ledger.get(entry.sid)
                if s is not None and s.engine != entry.engine:
                    self.queues.move(entry.ticket, s.engine)
        return moved

    # -- draining and the tick -----------------------------------------------------

    def drain(self, now: float, engines: Iterable[str] | None = None) -> list[Release]:
        """Release waiting heads that fit or are past their deadline (resumes first)."""
        out: list[Release] = []
        urls = list(self.queues.by_engine) if engines is None else list(engines)
        for url in urls:
            out.extend(self._drain_engine(url, now))
        return out

    def _drain_engine(self, url: str, now: float) -> list[Release]:
        out: list[Release] = []
        q = self.queues.engine(url)
        if not q.live_paused and not q.live_new:
            return out
        if not self.ledger.fresh(url, now):
            return self._drain_stale(url, now)
        engaged = self.ledger.engaged(url)
        for _ in range(len(q.paused) + 1):
            e = q.head("paused")
            outcome = None if e is None else self._paused_outcome(url, e, engaged, now)
            if outcome is None:
                break
            out.append(self._release(url, "paused", outcome, now))
        if not q.live_paused:
            for _ in range(len(q.new) + 1):
                e = q.head("new")
                outcome = None if e is None else self._new_outcome(url, e, engaged, now)
                if outcome is None:
                    break
                out.append(self._release(url, "new", outcome, now))
        else:
            # Resumes go before new sessions; but an aged new head still leaves.
            out.extend(self._age_new(url, now))
        out.extend(self._conserve(url, now))
        return out

    def _conserve(self, url: str, now: float) -> list[Release]:
        """Work conservation: an engine with fewer than ``min_inflight`` turns in flight
        (one, with ``engage_on_thrash`` off: the gate engaged from the start) takes the
        next waiting turns (resumes first); a release to an engine with nothing in
        flight counts toward starvation. Held off an idle engine, work would keep the
        idle sessions' KV resident at the price of all of the engine's throughput
        (measured to lose: docs/admission.md, "When admission holds")."""
        out: list[Release] = []
        q = self.queues.engine(url)
        load = self.ledger.engine(url, now).load
        floor = max(1, self.p.min_inflight) if self.p.engage_on_thrash else 1
        while load.inflight < floor:
            which = "paused" if q.head("paused") is not None else "new"
            if q.head(which) is None:
                break
            if load.inflight == 0:
                load.idled += 1
            if which == "paused":
                load.floor_resumes += 1
                self.events[Event.PAUSE_UNDONE] += 1
            out.append(self._release(url, which, Outcome.IDLE_ENGINE, now))
        return out

    def _drain_stale(self, url: str, now: float) -> list[Release]:
        """An engine heard from neither by /metrics nor by answers: fail open
        gradually, one waiting turn per tick (resumes first), never all at once."""
        eng = self.ledger.engine(url, now)
        if now - eng.last_stale_release < self.p.tick_s:
            return []
        q = self.queues.engine(url)
        which = "paused" if q.head("paused") is not None else "new"
        if q.head(which) is None:
            return []
        eng.last_stale_release = now
        self.events[Event.STALE_RELEASE] += 1
        return [self._release(url, which, Outcome.BYPASS_NO_METRICS, now)]

    def _aged(self, url: str, e: Entry, now: float) -> bool:
        """A hold past its bound, once its engine has moved on since it was queued (an
        answer, or nothing left in flight), or past twice its bound in any case."""
        if now < e.deadline:
            return False
        load = self.ledger.engine(url, now).load
        moved_on = load.answers > e.mark or load.inflight == 0
        return moved_on or now >= e.deadline + (e.deadline - e.enqueued_at)

    def _paused_outcome(self, url: str, e: Entry, engaged: bool, now: float) -> Outcome | None:
        """How the head of a paused queue leaves now, or None while it must wait."""
        led = self.ledger
        s = led.get(e.sid)
        if s is None or s.state is not SessionState.PAUSED or not engaged:
            return Outcome.RESUMED_WAITED  # closed or resumed meanwhile, or permissive
        need = max(s.footprint(self.p.session_buffer_tokens), e.tokens)
        if led.fits(url, need, now):
            return Outcome.RESUMED_WAITED
        if not self._aged(url, e, now):
            return None
        if now < e.enqueued_at + self.p.paused_max_wait_s and led.past_pause_mark(url, need):
            return None  # past its soft bound, but its resume would make the tick pause another
        return Outcome.PAUSED_AGED

    def _new_outcome(self, url: str, e: Entry, engaged: bool, now: float) -> Outcome | None:
        """How the head of a new-session queue leaves now, or None while it must wait."""
        led = self.ledger
        s = led.get(e.sid)
        if s is None or not engaged:
            return Outcome.NEW_WAITED
        if e.tokens > led.capacity(url):
            return Outcome.BYPASS_OVERSIZED
        continuing = s.state is SessionState.ACTIVE
        if continuing and led.fits(url, e.tokens, now):
            return Outcome.CONTINUING_WAITED
        if not continuing and led.fits_new(url, s, e.tokens, now):
            return Outcome.NEW_WAITED
        if self._aged(url, e, now):
            return Outcome.NEW_AGED
        if not continuing and self._past_soft_bound(url, e, s, now):
            return Outcome.NEW_AGED
        return None

    def _past_soft_bound(self, url: str, e: Entry, s: Session, now: float) -> bool:
        """A new session's first turn, held for room, past ``new_session_soft_wait_s``
        and whose admission would not push its engine past the pause mark: holding it
        longer no longer keeps the engine's sessions resident (docs/admission.md, "First
        turns, the same way")."""
        if now < e.enqueued_at + self.p.new_session_soft_wait_s:
            return False
        led = self.ledger
        return not led.past_pause_mark(url, led.first_reservation(url, s, e.tokens, now))

    def _age_new(self, url: str, now: float) -> list[Release]:
        """New heads that leave while resumes wait ahead of them: those past their bound,
        and those held for room past their soft bound (``_new_outcome``'s ``new_aged``);
        one that fits keeps its place behind the resumes."""
        out: list[Release] = []
        q = self.queues.engine(url)
        for _ in range(len(q.new) + 1):
            e = q.head("new")
            if e is None:
                break
            aged = self._aged(url, e, now)
            if not aged and self._new_outcome(url, e, True, now) is not Outcome.NEW_AGED:
                break
            out.append(self._release(url, "new", Outcome.NEW_AGED, now))
        return out

    def _release(self, url: str, which: str, outcome: Outcome, now: float) -> Release:
        e = self.queues.pop(url, which)
        s = self.ledger.get(e.sid)
        if s is not None:  # (closed while waiting: its turn goes uncounted)
            self.ledger.activate(s)
            self._start(e.ticket, s, now, e.tokens, outcome)
        wait = max(0.0, now - e.enqueued_at)
        if which == "paused":
            self.paused_waits.append(wait)
            if len(self.paused_waits) > 10_000:
                del self.paused_waits[:5_000]
        return Release(e.ticket, outcome, wait)

    def next_deadline(self, now: float) -> float | None:
        """When a waiting turn may next age. A hold past its bound whose engine has not
        moved on yet is looked at again a tick later, or at twice its bound (an answer
        drains it sooner)."""
        best: float | None = None
        for e in self.queues.heads():
            at = e.deadline
            if at <= now:
                at = min(now + self.p.tick_s, 2 * e.deadline - e.enqueued_at)
                if at <= now:  # (a paused turn held past its bounds: the next tick)
                    at = now + self.p.tick_s
            if best is None or at < best:
                best = at
        return best

    def tick(self, now: float) -> list[Release]:
        """Expiry, then per engine: resume/admit (drain), pause, feedback."""
        self._last_tick = now
        waiting = frozenset(e.sid for e, _ in self.queues.entries.values())
        for sid in self.ledger.expire(now, waiting):
            self.prefetch.cancel(sid)
            self.events[Event.IDLE_EXPIRED] += 1
        out = self.drain(now)
        urls = set(self.ledger.engines) | set(self.queues.by_engine)
        for url in urls:
            if self._pauses(url, now):
                self._pause(url, now)
            if self.p.feedback or self.p.engage_on_thrash:
                self._feedback(url, now)
        if out or urls:
            out.extend(self.drain(now))
        return out

    def _pauses(self, url: str, now: float) -> bool:
        """Whether the engine's idle sessions may be paused now: it is engaged and fresh,
        and the floor undid no pause of it this window or the last (that pause only
        delayed its turn: docs/benchmarks.md, "A pause the floor undoes")."""
        led = self.ledger
        if not (self.p.pause and led.engaged(url) and led.fresh(url, now)):
            return False
        return not led.engines[url].load.pauses_undone  # (fresh: the engine is known)

    def _pause(self, url: str, now: float) -> None:
        """Pause idle sessions, the largest first, while the engine's sessions, counted
        as admission counts them (``committed``: an idle session's footprint decays),
        overflow ``pause_high`` x its room, down to ``pause_low`` x it; with none idle,
        mark the smallest running one to pause at its answer. The room is ``tier_room``
        (pool + host): with a host tier a pause pays only once both tiers overflow.
        Measured (the largest first, the room, the decayed count): docs/admission.md,
        "The tick"."""
        led = self.ledger
        cap = led.tier_room(url)
        if cap <= 0 or led.gate_off(url):
            return
        u = led.committed(url, now)
        if u <= self.p.pause_high * cap:
            return
        b = self.p.session_buffer_tokens
        active = [led.sessions[sid] for sid in led.engines[url].sessions]
        # (a lead waiting for its children is idle here: sparing it paused the children)
        idle = [s for s in active if not s.in_flight and s.idle_s(now) >= self.p.idle_lease_s]
        # (ties last by id: the set's order depends on the hash seed)
        idle.sort(key=lambda s: (-s.footprint(b), s.sid))
        target = self.p.pause_low * cap
        for s in idle:
            if u <= target:
                return
            u -= led.weight(s, now) * s.footprint(b)
            led.pause(s, now)
            self.events[Event.PAUSED] += 1
        if u > target:
            running = [s for s in active if s.running and not s.pause_pending]
            if running:
                smallest = min(running, key=lambda s: (s.footprint(b), s.sid))
                led.mark_pause(smallest, True)
                self.events[Event.PAUSE_MARKED] += 1

    def _feedback(self, url: str, now: float) -> None:
        """Once per window: cut theta on thrash, raise it after quiet windows."""
        led = self.ledger
        eng = led.engines.get(url)
        if eng is None or now - eng.window_start < self.p.feedback_window_s:
            return
        p = self.p
        low_cache = (
            eng.turns_in_window >= p.min_feedback_turns
            and eng.resident_sum > 0
            and eng.cached_sum / eng.resident_sum < p.thrash_cached_fraction
        )
        thrash = low_cache or eng.retracted_delta > 0 or eng.evicted_delta > eng.freed_tokens
        self._engage(url, eng, now)
        _, new_waiting = self.queues.waiting(url)
        if not p.feedback:
            pass
        elif not led.engaged(url) or led.gate_off(url):
            eng.quiet = 0
        elif thrash:
            eng.quiet = 0
            if now - eng.last_cut >= p.cut_interval_s:
                cut = max(p.target_min, eng.theta * p.target_cut)
                if cut < eng.theta:
                    eng.theta = cut
                    eng.last_cut = now
                    self.events[Event.TARGET_CUT] += 1
        else:
            eng.quiet += 1
            if eng.quiet >= p.quiet_windows and new_waiting and eng.theta < p.target_max:
                eng.theta = min(p.target_max, eng.theta + p.target_step)
                eng.quiet = 0
                self.events[Event.TARGET_RAISED] += 1
        eng.window_start = now
        # A window too thin to judge keeps its answers' work for the next one; not on an
        # engine with a host tier, where RL fleets so judged engaged and lost 3-6% against
        # off+HiCache (docs/benchmarks.md, "Thin windows judged with the next").
        thin = eng.load.turns < p.engage_min_turns
        eng.load.new_window(now, keep_work=thin and eng.host_tokens <= 0)
        eng.evicted_delta = eng.retracted_delta = eng.freed_tokens = 0
        eng.cached_sum = eng.resident_sum = eng.turns_in_window = 0

    def _engage(self, url: str, eng: Engine, now: float) -> None:
        """The window's engagement verdict (kvproxy.admission.program.engagement)."""
        if not self.p.engage_on_thrash:
            return
        p = self.p
        changed = eng.engagement.judge(
            p.engage_rule,
            busy=eng.load.busy_fraction(eng.window_start, now),
            cost=eng.load.recompute_cost(p.decode_token_weight, p.engage_min_turns),
            idled=eng.load.idled,
            exposure=eng.load.exposure(p.decode_token_weight, p.engage_min_turns),
            oversubscribed=self._oversubscribed(url, eng, now),
            floor_fits=self._floor_fits(url, eng),
            returned=returned_exposure(eng.load, p.engage_min_turns, p.decode_token_weight),
        )
        if changed is None and not eng.engagement.engaged:
            self._forecast(url, now)
        if changed is True:
            self.events[Event.ENGAGED] += 1
            eng.theta = p.target_start
        elif changed is False:
            self.events[Event.DISENGAGED] += 1
            for s in self.ledger.on_engine(url):
                self.ledger.mark_pause(s, False)  # permissive: nobody pauses

    def _floor_fits(self, url: str, eng: Engine) -> bool:
        """Whether the engine's KV room holds ``floor_room`` x ``min_inflight`` of the
        contexts its continuing turns came back to this window (``floor_room_host`` x
        with a host tier): where the floor's own turns overflow the room they evict each
        other whatever is held (docs/admission.md, "A pool the floor overflows" in
        "When admission holds"). True while the room or the contexts are unknown."""
        back = eng.load.mean_return()
        cap = self.ledger.kv_room(url)
        if back is None or cap <= 0:
            return True
        factor = self.p.floor_room if eng.host_tokens <= 0 else self.p.floor_room_host
        return cap >= factor * max(1, self.p.min_inflight) * back

    def _oversubscribed(self, url: str, eng: Engine, now: float) -> bool:
        """The cold start's condition: at least ``cold_start_sessions`` sessions on the
        engine, expected to grow to more than ``cold_start_ratio`` x pool + host (the
        larger room: it errs towards not engaging); none on a write-back host tier.
        Why each, measured: docs/admission.md, "When admission holds"."""
        p, led = self.p, self.ledger
        e = eng.engagement
        if p.cold_start_sessions <= 0 or e.engaged or e.failures > 0:
            return False  # (after a starved release, only measured thrash engages)
        if len(eng.sessions) < p.cold_start_sessions or eng.host_write_back:
            return False
        # (pool + host as tier_room counts it, but the host without the headroom factor:
        # the rule as measured; the two differ by 10% of the host pool at the default)
        room = led.capacity(url) + eng.host_tokens
        return led.reserved(url, now) > p.cold_start_ratio * room

    # -- reads ---------------------------------------------------------------------

    def engine_rows(self, now: float) -> list[dict[str, float | str | bool | None]]:
        led = self.ledger
        rows: list[dict[str, float | str | bool | None]] = []
        for url in sorted(set(led.engines) | set(self.queues.by_engine)):
            eng = led.engine(url, now)
            paused_w, new_w = self.queues.waiting(url)
            states = Counter(led.sessions[sid].state for sid in eng.sessions)
            paused = sum(1 for s in led.on_engine(url) if s.state is SessionState.PAUSED)
            rows.append(
                {
                    "url": url,
                    "fresh": led.fresh(url, now),
                    "capacity": led.capacity(url),
                    "max_total_num_tokens": eng.max_total_num_tokens,
                    "host_tokens": float(eng.host_tokens),
                    "host_write_back": eng.host_write_back,
                    "kv_room": led.kv_room(url),
                    "tier_room": led.tier_room(url),
                    "committed": led.committed(url, now),
                    "footprint": float(led.undecayed(url)),
                    "reserved": led.reserved(url, now),
                    "target": eng.theta,
                    "gate_off": led.gate_off(url),
                    "engaged": 1.0 if led.engaged(url) else 0.0,
                    "armed": 1.0 if eng.engagement.armed and not led.engaged(url) else 0.0,
                    "busy": round(eng.load.busy_fraction(eng.window_start, now), 4),
                    "inflight": float(eng.load.inflight),
                    "shared_prefix": float(eng.shared_prefix),
                    "active_sessions": float(states[SessionState.ACTIVE]),
                    "paused_sessions": float(paused),
                    "waiting_new": float(new_w),
                    "waiting_paused": float(paused_w),
                    "streaming_sessions": float(eng.streaming_sessions),
                    "streaming_held": float(eng.streaming_held),
                }
            )
        return rows

    def clear(self) -> list[str]:
        """Forget everything; returns the tickets that were waiting."""
        tickets = list(self.queues.entries)
        self.queues = Queues()
        # What /server_info said (read once per engine) outlives the clear.
        info = {u: (e.context_length, e.host_write_back) for u, e in self.ledger.engines.items()}
        self.ledger = EngineLedger(self.p)
        for url, (n, write_back) in info.items():
            if n is not None:
                self.ledger.set_context_length(url, n)
            if write_back:
                self.ledger.set_host_write_policy(url, "write_back")
        self._inflight.clear()
        self.prefetch.clear()
        return tickets
