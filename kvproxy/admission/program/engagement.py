"""When program admission holds work on an engine: only while holding is measured to pay.
Pure: no I/O, time injected.

Holding a session back costs the engine the work that session would have given it; it
pays only when the engine is saturated *and* eviction is making it recompute. Both are
measured per engine from what kvproxy sees itself, so neither depends on ``/metrics``:

* **load** (:class:`Load`): the turns kvproxy has in flight on the engine, and the share
  of each feedback window during which at least one was (``busy``). An engine that is
  not busy recomputes an evicted prefix in spare time, and a held session only leaves
  it idle longer;
* **recompute cost**: from the answers' usage, the evicted context that continuing turns
  recomputed over the engine's work in the window, a decoded token weighing
  ``decode_token_weight`` prefill tokens. A window with fewer than ``engage_min_turns``
  answers is too thin to judge; its answers are judged with the next window's (an
  engine whose turns are long decodes, RL's, answers a turn or two a window: judged
  window by window it was never judged at all), but on an engine with a host tier the
  caller drops them (measured there: RL fleets so judged engaged and lost).

An engine starts **permissive** (what kvproxy does with admission off: nothing held,
nothing paused). It **engages** after ``engage_windows`` windows in a row busy at least
``engage_busy`` with a cost at least ``engage_cost``, or, before any thrash shows (the
**cold start**), with an **exposure** (the cost were every context the continuing
turns left behind evicted) at least ``cold_exposure`` while it runs many sessions
expected to outgrow its pool (``oversubscribed``, judged by the caller from the
ledger; not after a starved release), and never while its KV room cannot hold the
work-conserving floor's own turns (``floor_fits``, judged by the caller: three
times ``min_inflight`` of the contexts its continuing turns come back to). It goes
permissive again after ``release_windows`` windows in a row busy under
``release_busy``, or after ``starved_windows`` windows in a row in which held work left
it idle (then it may not engage again for a back-off that doubles each time). Released
for quiet it stays **armed** (the thrash it engaged for was measured on this fleet): the
next new session that does not fit it engages it again at once (:meth:`Engagement.rearm`,
the fit judged by the caller); a starved release disarms it. The hold model
(:mod:`kvproxy.admission.program.forecast`) may engage a permissive engine at once, before any
window (:meth:`Engagement.predict`); the windows that follow confirm the prediction or,
showing twice in a row neither recompute nor exposure, refute it and release the engine
with the starved release's back-off. While
engaged, the gate is work-conserving: an engine with fewer than ``min_inflight`` turns
in flight takes the head of its waiting queues whether or not it fits
(:mod:`kvproxy.admission.program.core`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Load:
    """One engine's load as kvproxy sees it (turns in flight, busy time, answers)."""

    inflight: int = 0
    busy_since: float | None = None  # since when at least one turn is in flight
    busy_s: float = 0.0  # busy time in the current window, before busy_since
    answers: int = 0  # responses observed on the engine (monotone: engine progress)
    last_answer_at: float | None = None
    # The window's work, from the answers' usage: prefill tokens the engine computed
    # (prompt - cached), of them the context a continuing turn had left behind and found
    # evicted (recomputed), and tokens decoded.
    computed: int = 0
    recomputed: int = 0
    decoded: int = 0
    exposed: int = 0  # the context continuing turns left behind, evicted or not
    turns: int = 0
    returns: int = 0  # of the turns, those that came back to a context they left behind
    idled: int = 0  # work-conserving releases this window (held work, idle engine)
    # Paused turns the work-conserving floor released, this window and the last: the
    # engine had room in its batch for them, so their pauses only delayed them.
    floor_resumes: int = 0
    floor_resumes_last: int = 0

    def worked(self, computed: int, recomputed: int, decoded: int, exposed: int = 0) -> None:
        self.computed += computed
        self.recomputed += recomputed
        self.decoded += decoded
        self.exposed += max(exposed, recomputed)
        self.turns += 1
        if exposed > 0:
            self.returns += 1

    def recompute_cost(self, decode_token_weight: float, min_turns: int) -> float | None:
        """The window's share of the engine's work spent recomputing evicted context,
        a decoded token weighing ``decode_token_weight`` prefill tokens; None with fewer
        than ``min_turns`` answers (too little to judge: the last verdict stands)."""
        if self.turns < max(1, min_turns):
            return None
        work = self.computed + decode_token_weight * self.decoded
        return self.recomputed / work if work > 0 else 0.0

    def exposure(self, decode_token_weight: float, min_turns: int) -> float | None:
        """What the recompute cost would be were every context the continuing turns left
        behind evicted (the most eviction can cost this work); None with fewer than
        ``min_turns`` answers."""
        if self.turns < max(1, min_turns):
            return None
        work = float(self.computed - self.recomputed + self.exposed)
        work += decode_token_weight * self.decoded
        return self.exposed / work if work > 0 else 0.0

    def mean_return(self) -> float | None:
        """The mean context a continuing turn came back to this window (None: none did)."""
        return self.exposed / self.returns if self.returns else None

    @property
    def pauses_undone(self) -> bool:
        """Whether the floor released a paused turn in this window or the last."""
        return self.floor_resumes + self.floor_resumes_last > 0

    def started(self, now: float) -> None:
        if self.inflight == 0:
            self.busy_since = now
        self.inflight += 1

    def ended(self, now: float) -> None:
        if self.inflight <= 0:
            return
        self.inflight -= 1
        if self.inflight == 0 and self.busy_since is not None:
            self.busy_s += max(0.0, now - self.busy_since)
            self.busy_since = None

    def answered(self, now: float) -> None:
        self.answers += 1
        self.last_answer_at = now

    def busy_fraction(self, window_start: float, now: float) -> float:
        """The share of ``[window_start, now]`` with a turn in flight."""
        span = now - window_start
        if span <= 0:
            return 1.0 if self.inflight else 0.0
        busy = self.busy_s
        if self.busy_since is not None:
            busy += now - max(self.busy_since, window_start)
        return min(1.0, max(0.0, busy / span))

    def new_window(self, now: float, *, keep_work: bool = False) -> None:
        """Start a window: the busy time and the floor's counts are the window's own;
        with ``keep_work`` (the caller's choice for a window too thin to judge) the
        answers' work stays, to be judged together with the next window's."""
        self.busy_s = 0.0
        if not keep_work:
            self.computed = self.recomputed = self.decoded = self.exposed = 0
            self.turns = self.returns = 0
        self.idled = 0
        self.floor_resumes_last, self.floor_resumes = self.floor_resumes, 0
        if self.busy_since is not None:
            self.busy_since = now


@dataclass(frozen=True, slots=True)
class EngageRule:
    """The rule's parameters: the first five are ``admission.*`` keys (their defaults live
    in :class:`~kvproxy.config.AdmissionConfig`), the rest are the rule's own."""

    engage_cost: float
    engage_busy: float
    release_busy: float
    engage_windows: int
    release_windows: int
    # Consecutive windows in which held work left the engine idle that release it.
    starved_windows: int = 3
    # Windows a starved release keeps the engine permissive (doubling each time).
    backoff_windows: int = 12
    max_backoff_windows: int = 192
    # The cold start's bar: the exposure (the cost were every context left behind
    # evicted) a window must show before any thrash is measured.
    cold_exposure: float = 0.5


@dataclass(slots=True)
class Engagement:
    """Permissive or engaged, with the window counts of its hysteresis."""

    engaged: bool = False
    hot: int = 0  # consecutive windows busy and recomputing (while permissive)
    cool: int = 0  # consecutive windows not busy (while engaged)
    starved: int = 0  # consecutive windows the held work left the engine idle
    failures: int = 0  # starved releases so far
    backoff: int = 0  # windows left before it may engage again
    # Released because its load dropped, not because holding starved it: the thrash it
    # engaged for was real, and the next burst of sessions may bring it back at once.
    armed: bool = False
    # Engaged by the hold model's prediction (kvproxy.admission.program.forecast), not yet
    # confirmed by a window; ``wrong``: consecutive windows that contradicted it.
    predicted: bool = False
    wrong: int = 0

    def judge(
        self,
        rule: EngageRule,
        *,
        busy: float,
        cost: float | None,
        idled: int = 0,
        exposure: float | None = None,
        oversubscribed: bool = False,
        floor_fits: bool = True,
        returned: float | None = None,
    ) -> bool | None:
        """One window's verdict: True when it engages now, False when it releases now,
        None when nothing changes. ``cost`` None (too few answers to judge yet): a
        permissive engine keeps its count, neither engaging nor forgetting. ``idled``:
        how often the engine ran out of work this window while turns were held.
        ``oversubscribed`` (the cold start): the engine runs enough sessions expected to
        outgrow its pool; with an ``exposure`` (the cost were every context left behind
        evicted) of at least ``engage_cost`` such a window counts as hot before any
        thrash is measured. ``floor_fits`` false (the engine's KV room cannot hold the
        work-conserving floor's own turns, judged by the caller): no window counts as
        hot. ``returned``: the exposure of a window in which enough continuing turns came
        back to judge it (None: too few), which confirms or refutes a predicted
        engagement."""
        if not self.engaged:
            if self.backoff > 0:
                self.backoff -= 1
                return None
            if cost is None:
                return None
            costly = cost >= rule.engage_cost or (
                oversubscribed and exposure is not None and exposure >= rule.cold_exposure
            )
            hot = costly and busy >= rule.engage_busy and floor_fits
            self.hot = self.hot + 1 if hot else 0
            if self.hot >= rule.engage_windows:
                self.engaged, self.hot, self.cool = True, 0, 0
                return True
            return None
        self.starved = self.starved + 1 if idled > 0 else 0
        if self._refuted(rule, cost, returned):
            self.starved = rule.starved_windows  # the prediction was wrong: back off
        if self.starved >= rule.starved_windows:
            # Holding keeps starving the engine: it holds the wrong work here.
            self.failures += 1
            self.backoff = min(
                rule.max_backoff_windows, rule.backoff_windows * 2 ** (self.failures - 1)
            )
            self.engaged, self.hot, self.cool, self.starved = False, 0, 0, 0
            self.armed = self.predicted = False
            self.wrong = 0
            return False
        self.cool = self.cool + 1 if busy < rule.release_busy else 0
        if self.cool >= rule.release_windows:
            self.engaged, self.hot, self.cool, self.starved = False, 0, 0, 0
            self.armed, self.predicted, self.wrong = True, False, 0
            return False
        return None

    def _refuted(self, rule: EngageRule, cost: float | None, exposure: float | None) -> bool:
        """Whether the windows since a predicted engagement refute it: ``engage_windows``
        in a row judged (enough answers) with neither the recompute cost at
        ``engage_cost`` nor the exposure at ``cold_exposure``: the contexts the turns
        come back to are cheap to recompute against their decodes, so holding cannot
        pay. A window that shows either confirms it (measured from then on)."""
        if not self.predicted or cost is None or exposure is None:
            return False
        if cost >= rule.engage_cost or exposure >= rule.cold_exposure:
            self.predicted, self.wrong = False, 0
            return False
        self.wrong += 1
        return self.wrong >= rule.engage_windows

    def predict(self) -> bool:
        """Engage now on the hold model's prediction (kvproxy.admission.program.forecast), unless
        the engine backs off after a starved or refuted engagement, or holding failed
        on it before (then only measured thrash engages it)."""
        if self.engaged or self.backoff > 0 or self.failures > 0:
            return False
        self.engaged, self.hot, self.cool, self.starved = True, 0, 0, 0
        self.predicted, self.wrong = True, 0
        return True

    def take_over(self) -> bool:
        """Engage now: the replica that held this engine engaged for the fleet is gone
        (kvproxy.replication.ledger): its windows showed the thrash, and this replica,
        whose turns the dead one's clients now send here, holds on from where it was
        (its own windows release it when the load drops). Not while this engine backs
        off after a starved release here."""
        if self.engaged or self.backoff > 0:
            return False
        self.engaged, self.hot, self.cool, self.starved = True, 0, 0, 0
        return True

    def rearm(self) -> bool:
        """Engage now, on a new session the caller judged not to fit, if the engine
        is armed (released for a drop in load after it engaged; a starved release,
        the only one that backs off, disarms it). A fleet whose sessions start together
        (an RL step) fills the pool with first turns before any window can show thrash;
        the engine that thrashed on the last burst holds this one from its first
        session that does not fit."""
        if self.engaged or not self.armed:
            return False
        self.engaged, self.hot, self.cool, self.starved = True, 0, 0, 0
        return True
