"""When program admission holds: the engagement rule, its load and cost measurements,
and what a permissive or engaged engine does with a request (tables, injected clock)."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.engagement import Engagement, EngageRule, Load
from kvproxy.admission.program.events import Event, Held
from kvproxy.admission.program.ledger import SessionState
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.records import Outcome

E1 = "http://e1:1"
RULE = EngageRule(
    engage_cost=0.3, engage_busy=0.75, release_busy=0.5, engage_windows=2, release_windows=3
)


# -- load ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "window", "now", "busy"),
    [
        ([], (0.0, 10.0), 10.0, 0.0),
        ([("start", 0.0)], (0.0, 10.0), 10.0, 1.0),
        ([("start", 2.0), ("end", 7.0)], (0.0, 10.0), 10.0, 0.5),
        # two overlapping turns count once
        ([("start", 0.0), ("start", 1.0), ("end", 4.0), ("end", 5.0)], (0.0, 10.0), 10.0, 0.5),
        # a turn running since before the window counts from the window's start
        ([("start", 0.0)], (5.0, 10.0), 10.0, 1.0),
        # an empty window: busy iff something is in flight
        ([("start", 0.0)], (10.0, 10.0), 10.0, 1.0),
    ],
)
def test_busy_fraction(events, window, now, busy) -> None:
    load = Load()
    for kind, at in events:
        (load.started if kind == "start" else load.ended)(at)
    start, _ = window
    if start > 0:
        load.new_window(start)
    assert load.busy_fraction(start, now) == pytest.approx(busy)


def test_an_unmatched_end_is_ignored() -> None:
    load = Load()
    load.ended(1.0)
    assert load.inflight == 0 and load.busy_fraction(0.0, 2.0) == 0.0


@pytest.mark.parametrize(
    ("work", "weight", "min_turns", "cost"),
    [
        ([], 16.0, 1, None),  # nothing answered: no verdict
        ([(100, 0, 10)] * 2, 16.0, 3, None),  # too few answers
        ([(100, 0, 10)] * 3, 16.0, 3, 0.0),  # nothing recomputed
        # W1-like: 20k recomputed of 20.5k computed, 150 decoded -> 20k / (20.5k + 2.4k)
        ([(20_500, 20_000, 150)], 16.0, 1, 20_000 / (20_500 + 16 * 150)),
        # decode-heavy: 500 recomputed, 1000 decoded -> cheap
        ([(600, 500, 1000)], 16.0, 1, 500 / (600 + 16_000)),
        ([(0, 0, 0)], 16.0, 1, 0.0),
    ],
)
def test_recompute_cost(work, weight, min_turns, cost) -> None:
    load = Load()
    for computed, recomputed, decoded in work:
        load.worked(computed, recomputed, decoded)
    got = load.recompute_cost(weight, min_turns)
    assert got == (None if cost is None else pytest.approx(cost))


def test_a_new_window_forgets_the_work_and_the_busy_time() -> None:
    load = Load()
    load.started(0.0)
    load.worked(10, 5, 1)
    load.new_window(4.0)
    assert load.recompute_cost(16.0, 1) is None
    assert load.busy_fraction(4.0, 8.0) == 1.0  # still in flight


def test_a_window_too_thin_to_judge_keeps_its_work_but_not_its_busy_time() -> None:
    load = Load()
    load.started(0.0)
    load.worked(20, 10, 0, exposed=10)
    load.ended(1.0)
    load.new_window(4.0, keep_work=True)
    assert load.busy_fraction(4.0, 8.0) == 0.0  # the busy time is the window's own
    load.worked(20, 10, 0, exposed=10)
    assert load.recompute_cost(16.0, 2) == pytest.approx(0.5)  # both answers judged
    assert load.mean_return() == 10.0
    load.new_window(8.0)
    assert load.recompute_cost(16.0, 1) is None


# -- the rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("windows", "verdicts"),
    [
        # busy and costly twice in a row: engages on the second
        ([(0.9, 0.5), (0.9, 0.5)], [None, True]),
        # costly but not busy (spare engine time absorbs the recompute): never
        ([(0.4, 0.9)] * 4, [None] * 4),
        # busy but cheap (short contexts, long decodes): never
        ([(1.0, 0.1)] * 4, [None] * 4),
        # a window without answers neither counts nor resets
        ([(0.9, 0.5), (0.9, None), (0.9, 0.5)], [None, None, True]),
        # a quiet window resets the count
        ([(0.9, 0.5), (0.9, 0.1), (0.9, 0.5), (0.9, 0.5)], [None, None, None, True]),
        # engaged, then idle three windows in a row: released
        (
            [(0.9, 0.5), (0.9, 0.5), (0.2, None), (0.2, None), (0.2, None)],
            [None, True, None, None, False],
        ),
        # engaged, busy again before the third idle window: stays
        (
            [(0.9, 0.5), (0.9, 0.5), (0.2, 0.0), (0.2, 0.0), (0.6, 0.0), (0.2, 0.0)],
            [None, True, None, None, None, None],
        ),
    ],
)
def test_engagement_rule(windows, verdicts) -> None:
    e = Engagement()
    got = [e.judge(RULE, busy=busy, cost=cost) for busy, cost in windows]
    assert got == verdicts


def test_held_work_that_keeps_starving_the_engine_backs_off_doubling() -> None:
    rule = dataclasses.replace(RULE, starved_windows=2, backoff_windows=3)
    e = Engagement()
    hot = {"busy": 0.9, "cost": 0.5}
    assert [e.judge(rule, **hot) for _ in range(2)] == [None, True]
    # one starved window, then a fed one: the count restarts
    assert e.judge(rule, **hot, idled=1) is None
    assert e.judge(rule, **hot, idled=0) is None
    assert e.judge(rule, **hot, idled=2) is None
    assert e.judge(rule, **hot, idled=1) is False  # two in a row: released
    assert (e.failures, e.backoff) == (1, 3)
    # three windows of back-off, however hot, then it may engage again
    assert [e.judge(rule, **hot) for _ in range(3)] == [None, None, None]
    assert [e.judge(rule, **hot) for _ in range(2)] == [None, True]
    assert [e.judge(rule, **hot, idled=1) for _ in range(2)] == [None, False]
    assert e.backoff == 6  # twice as long the second time


# -- the core, permissive and engaged ----------------------------------------------------

P = ProgramParams(
    headroom=1.0,
    target_start=0.9,
    session_buffer_tokens=0,
    idle_lease_s=5.0,
    idle_half_life_s=10.0,
    paused_soft_wait_s=8.0,
    new_session_max_wait_s=60.0,
    staleness_s=5.0,
    growth_reservation=False,
    feedback_window_s=5.0,
    engage_windows=1,
    release_windows=2,
    engage_cost=0.3,
    engage_min_turns=3,
    # These tables run pools of three contexts, which the floor's own three turns would
    # overflow; that rule has its own table below (floor_room).
    floor_room=0.0,
    floor_room_host=0.0,
)


def core() -> ProgramCore:
    c = ProgramCore(P)
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    return c


def answer(c: ProgramCore, ticket: str, now: float, prompt: int, cached: int, out: int) -> None:
    c.observe_response(
        ticket, now, prompt_tokens=prompt, completion_tokens=out, cached_tokens=cached
    )
    c.turn_ended(ticket, now)


def test_a_permissive_engine_holds_nothing_and_pauses_nobody() -> None:
    c = core()
    assert c.request("a1", "a", E1, 900, 0.0).outcome is Outcome.NEW_ADMITTED
    # Far over capacity: an engaged gate would hold b; a permissive one does not.
    assert c.request("b1", "b", E1, 900, 0.0).outcome is Outcome.NEW_ADMITTED
    answer(c, "a1", 1.0, 900, 0, 10)
    answer(c, "b1", 1.0, 900, 0, 10)
    c.tick(20.0)  # both idle long past the lease, U = 1820 > 950: no pause
    assert c.events[Event.PAUSED] == 0
    assert c.engine_rows(20.0)[0]["engaged"] == 0.0


def engaged_core() -> ProgramCore:
    """An engine busy all window whose continuing turns found their context evicted."""
    c = core()
    for i, sid in enumerate("abc"):
        c.request(f"{sid}1", sid, E1, 300, 0.0)
        answer(c, f"{sid}1", 0.5, 300, 0, 10)
        c.request(f"{sid}2", sid, E1, 320, 0.5 + i * 0.01)
    for sid in "abc":  # each recomputed its 310-token context
        answer(c, f"{sid}2", 5.0, 320, 0, 10)
    c.request("keep", "a", E1, 330, 5.0)  # keeps the engine busy
    c.tick(5.0)
    return c


def test_busy_and_recomputing_engages_and_then_the_gate_holds() -> None:
    c = engaged_core()
    assert c.events[Event.ENGAGED] == 1
    assert c.engine_rows(5.0)[0]["engaged"] == 1.0
    v = c.request("n1", "new", E1, 400, 5.5)  # U = 3 x 330 + 400 > theta x C
    assert v.outcome is None and v.held is Held.NEW_SESSION_FIT


def four_answers(min_turns: int, host_tokens: int | None = None) -> ProgramCore:
    """Two sessions whose second turns recomputed their whole context: four answers in
    the window [0, 5], busy all of it (the window is not judged yet)."""
    c = ProgramCore(dataclasses.replace(P, engage_min_turns=min_turns))
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000, host_tokens=host_tokens)
    for sid in "ab":
        c.request(f"{sid}1", sid, E1, 300, 0.0)
        answer(c, f"{sid}1", 0.5, 300, 0, 10)
        c.request(f"{sid}2", sid, E1, 320, 0.5)
    for sid in "ab":
        answer(c, f"{sid}2", 5.0, 320, 0, 10)
    return c


@pytest.mark.parametrize(("min_turns", "engaged"), [(4, True), (5, False), (6, False)])
def test_a_window_with_too_few_answers_is_not_judged(min_turns, engaged) -> None:
    # Below engage_min_turns answers a window is not judged.
    c = four_answers(min_turns)
    c.request("keep", "a", E1, 330, 5.0)
    c.tick(5.0)
    assert c.ledger.engaged(E1) is engaged


@pytest.mark.parametrize(
    ("min_turns", "host_tokens", "engaged"),
    [
        (5, None, True),
        (6, None, True),
        (7, None, False),
        # with a host tier a thin window is dropped: the next one's two answers alone
        # are too few again
        (5, 2000, False),
    ],
)
def test_a_thin_window_is_judged_with_the_next(min_turns, host_tokens, engaged) -> None:
    # The four answers of the table above, then two more recomputed continuing turns in
    # the next window: six answers in all, judged once there are min_turns of them.
    c = four_answers(min_turns, host_tokens)
    for sid in "ab":
        c.request(f"{sid}3", sid, E1, 340, 5.0)
    c.tick(5.0)
    assert not c.ledger.engaged(E1)  # four answers: too thin, kept
    for sid in "ab":
        answer(c, f"{sid}3", 9.0, 340, 0, 10)
    c.request("keep", "a", E1, 350, 9.0)
    c.tick(10.0)
    assert c.ledger.engaged(E1) is engaged


def test_an_engaged_engine_with_nothing_in_flight_takes_the_next_waiting_turn() -> None:
    c = engaged_core()
    assert c.request("n1", "new", E1, 400, 5.5).outcome is None
    c.observe_response("keep", 6.0, prompt_tokens=330, completion_tokens=10, cached_tokens=320)
    c.turn_ended("keep", 6.0)  # nothing in flight now
    (r,) = c.drain(6.0)
    assert (r.ticket, r.outcome) == ("n1", Outcome.IDLE_ENGINE)
    assert Outcome.IDLE_ENGINE.waited and not Outcome.IDLE_ENGINE.fail_open


def test_an_engaged_engine_left_idle_goes_permissive_again() -> None:
    c = engaged_core()
    answer(c, "keep", 5.6, 330, 320, 10)  # nothing in flight from here on
    c.tick(10.0)
    assert c.events[Event.DISENGAGED] == 0  # one idle window is not enough
    c.tick(15.0)
    assert c.events[Event.DISENGAGED] == 1
    assert c.request("n1", "new", E1, 50, 15.5).outcome is Outcome.NEW_ADMITTED
    assert not c.ledger.engaged(E1)


@pytest.mark.parametrize(
    ("release", "tokens", "held"),
    [
        ("quiet", 900, True),  # does not fit the armed engine: engaged again at once
        ("quiet", 50, False),  # fits: admitted, the engine stays permissive
        ("starved", 900, False),  # holding starved it: not armed, admitted as off
    ],
)
def test_an_engine_released_for_quiet_engages_again_on_a_session_that_does_not_fit(
    release, tokens, held
) -> None:
    c = engaged_core()  # a, b and c hold ~330 each of 1000; "keep" in flight
    if release == "quiet":
        answer(c, "keep", 5.6, 330, 320, 10)  # then nothing in flight: quiet windows
        c.tick(10.0)
        c.tick(15.0)
    else:
        eng = c.ledger.engine(E1)
        for now in (10.0, 15.0, 20.0):  # held work left it idle three windows running
            eng.load.idled = 1
            c.ledger.observe_engine(E1, now, max_total_num_tokens=1000)
            c.tick(now)
    assert c.events[Event.DISENGAGED] == 1
    assert c.engine_rows(21.0)[0]["armed"] == (1.0 if release == "quiet" else 0.0)
    v = c.request("n1", "new", E1, tokens, 21.0)
    assert (v.held is Held.NEW_SESSION_FIT) is held
    assert c.events[Event.REENGAGED] == int(held)
    assert c.ledger.engaged(E1) is held
    assert c.engine_rows(21.0)[0]["armed"] == (1.0 if release == "quiet" and not held else 0.0)


def test_rearm_engages_only_an_engine_released_for_quiet() -> None:
    e = Engagement()
    hot, quiet = {"busy": 0.9, "cost": 0.5}, {"busy": 0.1, "cost": None}
    assert not e.rearm()  # never engaged: nothing measured yet
    assert [e.judge(RULE, **hot) for _ in range(2)] == [None, True]
    assert [e.judge(RULE, **quiet) for _ in range(3)] == [None, None, False]
    assert e.armed and e.rearm() and e.engaged
    assert not e.rearm()  # engaged already
    rule = dataclasses.replace(RULE, starved_windows=1)
    assert e.judge(rule, **hot, idled=1) is False  # starved: disarmed, backing off
    assert not e.armed and not e.rearm() and not e.engaged


def test_a_silent_engine_releases_its_waiters_one_per_tick() -> None:
    c = engaged_core()
    for i in range(3):
        assert c.request(f"n{i}", f"new{i}", E1, 400, 5.5).outcome is None
    # Neither /metrics nor answers for longer than staleness_s (5 s): stale.
    assert not c.ledger.fresh(E1, 11.0)
    first = c.drain(11.0)
    assert [r.outcome for r in first] == [Outcome.BYPASS_NO_METRICS]
    assert c.drain(11.5) == []  # the next one a tick later, not at once
    assert len(c.drain(12.0)) == 1
    assert c.events[Event.STALE_RELEASE] == 2


def test_answers_keep_an_engine_fresh_without_metrics() -> None:
    c = core()
    c.request("a1", "a", E1, 10, 0.0)
    assert not c.ledger.fresh(E1, 9.0)
    answer(c, "a1", 8.0, 10, 0, 1)
    assert c.ledger.fresh(E1, 9.0)  # the last scrape was at 0, the last answer at 8


def test_switching_the_rule_off_engages_the_gate_from_the_start() -> None:
    c = ProgramCore(dataclasses.replace(P, engage_on_thrash=False))
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    c.request("a1", "a", E1, 900, 0.0)
    assert c.request("b1", "b", E1, 900, 0.0).outcome is None
    assert c.drain(1.0) == []  # a1 in flight: b1 is held


@pytest.mark.parametrize("held", ["new", "paused"])
def test_switched_off_the_gate_still_leaves_no_engine_idle(held) -> None:
    # With engage_on_thrash off the floor is one turn: an engine with nothing in flight
    # takes its next held turn, fit or not (held on an idle engine, a turn no target fits
    # waited out its whole bound: swe 8 per engine at 4x the pool 0.14x off's).
    c = ProgramCore(dataclasses.replace(P, engage_on_thrash=False))
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    c.request("a1", "a", E1, 900, 0.0)
    answer(c, "a1", 1.0, 900, 0, 10)
    if held == "paused":
        c.ledger.pause(c.ledger.sessions["a"], 1.0)
        assert c.request("a2", "a", E1, 950, 2.0).held is Held.PAUSED_FIT
        c.request("b1", "b", E1, 900, 2.0)  # behind the resume
    else:
        assert c.request("b1", "b", E1, 900, 2.0).held is Held.NEW_SESSION_FIT
    first = "a2" if held == "paused" else "b1"
    assert [(r.ticket, r.outcome) for r in c.drain(3.0)] == [(first, Outcome.IDLE_ENGINE)]
    assert c.drain(3.0) == []  # one in flight again: the rest stays held


# -- the cold start ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("work", "min_turns", "exposure"),
    [
        ([], 1, None),
        ([(100, 0, 10, 0)] * 2, 3, None),  # too few answers
        # first turns only: nothing was left behind, nothing exposed
        ([(300, 0, 10, 0)] * 3, 3, 0.0),
        # a continuing turn that found its 20k context cached: 20k exposed of
        # 500 new + 20k + 16 x 150
        ([(500, 0, 150, 20_000)], 1, 20_000 / (500 + 20_000 + 16 * 150)),
        # the same turn with its context evicted: the same exposure
        ([(20_500, 20_000, 150, 20_000)], 1, 20_000 / (500 + 20_000 + 16 * 150)),
        # short contexts under long decodes: little exposed
        ([(100, 0, 300, 320)], 1, 320 / (100 + 320 + 16 * 300)),
    ],
)
def test_exposure(work, min_turns, exposure) -> None:
    load = Load()
    for computed, recomputed, decoded, exposed in work:
        load.worked(computed, recomputed, decoded, exposed)
    got = load.exposure(16.0, min_turns)
    assert got == (None if exposure is None else pytest.approx(exposure))


@pytest.mark.parametrize(
    ("windows", "verdicts"),
    [
        # oversubscribed and exposed, busy: engages before any recompute is measured
        ([(0.9, 0.0, True, 0.6)] * 2, [None, True]),
        # exposed but the working set fits: only measured thrash engages
        ([(0.9, 0.0, False, 0.6)] * 3, [None] * 3),
        # oversubscribed but cheap to recompute (short contexts): never
        ([(0.9, 0.0, True, 0.45)] * 3, [None] * 3),
        # oversubscribed and exposed but not busy: never
        ([(0.5, 0.0, True, 0.9)] * 3, [None] * 3),
        # one cold window and one measured-thrash window in a row engage too
        ([(0.9, 0.0, True, 0.6), (0.9, 0.5, False, 0.6)], [None, True]),
    ],
)
def test_cold_start_rule(windows, verdicts) -> None:
    e = Engagement()
    got = [
        e.judge(RULE, busy=busy, cost=cost, oversubscribed=over, exposure=exp)
        for busy, cost, over, exp in windows
    ]
    assert got == verdicts


COLD = dataclasses.replace(P, cold_start_sessions=3, cold_start_ratio=1.3)


def cold_core(params: ProgramParams = COLD, out: int = 10, failures: int = 0) -> ProgramCore:
    """Three sessions whose second turns found their ~310-token contexts cached (no
    thrash), each expected to grow to ~820 tokens (3 x 820 against C = 1000)."""
    c = ProgramCore(params)
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    c.ledger.engine(E1).engagement.failures = failures
    for sid in "abc":
        c.request(f"{sid}1", sid, E1, 300, 0.0)
        answer(c, f"{sid}1", 1.0, 300, 0, 10)
    c.tick(5.0)  # first turns only: nothing exposed yet
    for sid in "abc":
        c.request(f"{sid}2", sid, E1, 330, 5.0)
    for sid in "abc":
        answer(c, f"{sid}2", 9.0, 330, 310, out)
    c.tick(10.0)
    return c


@pytest.mark.parametrize(
    ("params", "out", "failures", "engaged"),
    [
        (COLD, 10, 0, True),
        (dataclasses.replace(COLD, cold_start_sessions=0), 10, 0, False),  # off
        (dataclasses.replace(COLD, cold_start_sessions=4), 10, 0, False),  # too few
        (dataclasses.replace(COLD, cold_start_ratio=3.0), 10, 0, False),  # fits
        (COLD, 100, 0, False),  # long decodes: recomputing would be cheap
        (COLD, 10, 1, False),  # holding starved this engine before
    ],
)
def test_a_cold_start_engages_a_busy_engine_before_it_thrashes(
    params, out, failures, engaged
) -> None:
    c = cold_core(params, out, failures)
    assert c.events[Event.ENGAGED] == int(engaged)
    assert c.ledger.engaged(E1) is engaged


@pytest.mark.parametrize(
    ("host_tokens", "policy", "engaged"),
    [
        (0, None, True),
        (1000, "write_through", False),
        (200, "write_through", True),  # a small host tier: pool + host still overflows
        (200, "write_back", False),  # write-back: no cold start at all
    ],
)
def test_a_host_tier_that_holds_the_overflow_keeps_the_cold_start_off(
    host_tokens, policy, engaged
) -> None:
    # The same three sessions expected to grow to ~2.5x the pool: with a host tier
    # (HiCache) as large as the pool again, what overflows is loaded back, not recomputed;
    # a write-back tier holds what the device does not, and never gets a cold start.
    c = ProgramCore(COLD)
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000, host_tokens=host_tokens)
    c.ledger.set_host_write_policy(E1, policy)
    for sid in "abc":
        c.request(f"{sid}1", sid, E1, 300, 0.0)
        answer(c, f"{sid}1", 1.0, 300, 0, 10)
    c.tick(5.0)
    for sid in "abc":
        c.request(f"{sid}2", sid, E1, 330, 5.0)
    for sid in "abc":
        answer(c, f"{sid}2", 9.0, 330, 310, 10)
    c.tick(10.0)
    assert c.ledger.engaged(E1) is engaged


@pytest.mark.parametrize(("floor", "released"), [(1, 0), (2, 1), (3, 2)])
def test_an_engaged_engine_below_its_floor_takes_held_work(floor, released) -> None:
    c = engaged_core()  # one turn ("keep") in flight
    c.p = c.ledger.p = dataclasses.replace(P, min_inflight=floor)
    for i in range(3):
        assert c.request(f"n{i}", f"new{i}", E1, 400, 5.5).outcome is None
    out = c.drain(5.5)
    assert [r.outcome for r in out] == [Outcome.IDLE_ENGINE] * released
    # releases while turns were in flight are no sign of starvation
    assert c.ledger.engine(E1).load.idled == 0


def test_a_pause_the_floor_undoes_stops_the_engines_pausing_for_a_window() -> None:
    # engaged_core: a, b and c hold 330 each (U = 990 > 950); a's "keep" is in flight.
    # Idle sessions count undecayed here (the pause counts them as admission does).
    c = engaged_core()
    c.configure(dataclasses.replace(c.p, idle_half_life_s=1e9))

    def tick(now: float) -> None:
        c.ledger.observe_engine(E1, now, max_total_num_tokens=1000)  # fresh readings
        c.tick(now)

    tick(11.0)  # b and c idle 6 s: one pause takes U to 660
    assert c.events[Event.PAUSED] == 1
    paused = next(s.sid for s in c.ledger.sessions.values() if s.state is SessionState.PAUSED)
    v = c.request("back", paused, E1, 340, 12.0)  # does not fit yet: it waits...
    assert v.held is Held.PAUSED_FIT
    # ...and the floor (3 turns in flight) takes it: the pause only delayed it.
    assert [r.outcome for r in c.drain(12.0)] == [Outcome.IDLE_ENGINE]
    assert c.events[Event.PAUSE_UNDONE] == 1
    answer(c, "back", 13.0, 340, 330, 10)
    # The pressure is back (U = 1010), but nobody pauses in the window of the undone
    # pause (to 18) or the next (to 27)...
    for now in (18.0, 22.0, 27.0):
        tick(now)
        assert c.events[Event.PAUSED] == 1
    tick(28.0)  # ...and after a whole window without one, pausing resumes
    assert c.events[Event.PAUSED] == 2


def test_mean_return_counts_only_the_turns_that_came_back_to_a_context() -> None:
    load = Load()
    assert load.mean_return() is None
    load.worked(computed=300, recomputed=0, decoded=10)  # a first turn: nothing left behind
    load.worked(computed=320, recomputed=300, decoded=10, exposed=300)
    load.worked(computed=20, recomputed=0, decoded=10, exposed=500)
    assert load.mean_return() == 400.0
    load.new_window(5.0)
    assert load.mean_return() is None


@pytest.mark.parametrize(
    ("capacity", "host", "floor_room", "engaged"),
    [
        (1000, None, 2.0, False),  # 1000 < 2 x 3 x 310: the floor's turns overflow the pool
        (1860, None, 2.0, True),  # 2 x 3 x 310 = 1860: the pool holds them twice over
        (1859, None, 2.0, False),
        (1000, 1860, 2.0, True),  # a host tier of 1860 (write-through: max(pool, host))
        (1000, 1859, 2.0, False),
        (1000, None, 1.0, True),  # 1000 >= 1 x 3 x 310
        (1000, None, 0.0, True),  # the rule off
        (2790, None, None, True),  # the default, 3: 3 x 3 x 310 = 2790
        (2789, None, None, False),
        (1860, None, None, False),  # room for 2 x 3 is not enough by default
        (1000, 1860, None, True),  # with a host tier the default is 2: 2 x 3 x 310 = 1860
        (1000, 1859, None, False),
    ],
)
def test_an_engine_whose_room_the_floor_overflows_never_engages(
    capacity: int, host: int | None, floor_room: float | None, engaged: bool
) -> None:
    # engaged_core's window, on a pool of the given size: busy all window, and every
    # continuing turn recomputed the 310-token context it came back to.
    d = ProgramParams()  # None: the defaults, with and without a host tier
    room, host_room = (d.floor_room, d.floor_room_host) if floor_room is None else (floor_room,) * 2
    c = ProgramCore(dataclasses.replace(P, floor_room=room, floor_room_host=host_room))
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=capacity, host_tokens=host)
    for i, sid in enumerate("abc"):
        c.request(f"{sid}1", sid, E1, 300, 0.0)
        answer(c, f"{sid}1", 0.5, 300, 0, 10)
        c.request(f"{sid}2", sid, E1, 320, 0.5 + i * 0.01)
    for sid in "abc":
        answer(c, f"{sid}2", 5.0, 320, 0, 10)
    c.request("keep", "a", E1, 330, 5.0)
    c.tick(5.0)
    assert c.ledger.engaged(E1) is engaged
    assert c.events[Event.ENGAGED] == int(engaged)


def test_floor_fits_decides_only_a_permissive_engine() -> None:
    rule = EngageRule(
        engage_cost=0.4, engage_busy=0.75, release_busy=0.5, engage_windows=1, release_windows=2
    )
    e = Engagement()
    assert e.judge(rule, busy=1.0, cost=0.9, floor_fits=False) is None
    assert e.judge(rule, busy=1.0, cost=0.9, floor_fits=True) is True
    # Once engaged, it is released by the usual rules, not by the pool.
    assert e.judge(rule, busy=1.0, cost=0.9, floor_fits=False) is None
    assert e.engaged
