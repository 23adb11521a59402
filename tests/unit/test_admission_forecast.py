"""The hold model (what holding will pay, judged before any window closes), its
confirmation and refutation by the windows that follow, and holds that last as long as
they pay: tables over pure code, injected clock and readings."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.engagement import Engagement, EngageRule
from kvproxy.admission.program.events import Event, Held
from kvproxy.admission.program.forecast import (
    ForecastRule,
    Outlook,
    exposure,
    holding_pays,
    overflow,
)
from kvproxy.admission.program.ledger import SessionState
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.records import Outcome

E1 = "http://e1:1"
RULE = ForecastRule(min_sessions=4)


def outlook(**kw: float | int | None) -> Outlook:
    """A burst of 16 sessions of 150 tokens each on a room of 1600, asking 5 tokens."""
    base: dict[str, float | int | None] = {
        "demand": 2400.0,
        "room": 1600.0,
        "sessions": 16,
        "decode": 5.0,
        "inflight": 16,
    }
    base.update(kw)
    return Outlook(**base)  # type: ignore[arg-type]


# -- the model -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "pays", "why"),
    [
        ({}, True, "known contexts 1.5x the room, 150 against 16 x 5 decoded"),
        ({"demand": 1500.0}, False, "the known contexts fit the room"),
        ({"decode": 100.0}, False, "long decodes: recompute is cheap (150 / 1750)"),
        ({"growth": 400.0}, False, "each turn prefills more than it comes back to"),
        ({"inflight": 2}, False, "fewer turns in flight than the floor: nothing to hold"),
        ({"sessions": 3}, False, "too few sessions"),
        ({"room": 0.0}, False, "no capacity read"),
        # the floor's own contexts overflow: 16 sessions of 800 on a room of 6000
        ({"demand": 16 * 800.0, "room": 6000.0}, False, "room < 3 x 3 x 800"),
        # measured exposure caps the prediction once turns came back
        ({"measured_exposure": 0.3}, False, "measured cheap: the prediction is not enough"),
        ({"measured_exposure": 0.9}, True, "measured and predicted agree"),
        # expected peaks that overflow engage only on a measured exposure
        ({"demand": 1400.0, "expected": 4000.0}, False, "expected, not measured yet"),
        (
            {"demand": 1400.0, "expected": 4000.0, "measured_exposure": 0.8},
            True,
            "expected 2.5x the room, measured exposure 0.8",
        ),
        ({"demand": 1400.0, "expected": 2300.0, "measured_exposure": 0.8}, False, "< 1.5x"),
        (
            {"demand": 1400.0, "expected": 3200.0, "measured_exposure": 0.8},
            False,
            "peaks 2x the room, but midway (2300) under 1.5x it: sessions at every stage fit",
        ),
    ],
)
def test_holding_pays(change, pays, why) -> None:
    assert holding_pays(outlook(**change), RULE) is pays, why


@pytest.mark.parametrize(
    ("change", "known", "total", "x"),
    [
        ({}, True, 2400.0, 150 / (150 + 80)),
        ({"growth": 40.0}, True, 2400.0, 150 / (150 + 40 + 80)),
        ({"measured_exposure": 0.2}, True, 2400.0, 0.2),
        ({"measured_exposure": 0.99}, True, 2400.0, 150 / (150 + 80)),
        ({}, False, 2400.0, None),
        ({"measured_exposure": 0.7}, False, 2400.0, 0.7),
    ],
)
def test_exposure(change, known, total, x) -> None:
    got = exposure(outlook(**change), RULE, total, known)
    assert got == (None if x is None else pytest.approx(x))


def test_overflow_counts_expected_peaks_midway() -> None:
    assert overflow(outlook(), RULE) == (2400.0, True)
    assert overflow(outlook(demand=1400.0, expected=4000.0), RULE) == (2700.0, False)
    assert overflow(outlook(demand=1400.0), RULE) is None
    # the midway total is what overflows, not the peaks alone (2300 <= 1.5 x 1600)
    assert overflow(outlook(demand=1400.0, expected=3200.0), RULE) is None
    assert overflow(outlook(demand=1400.0, expected=3500.0), RULE) == (2450.0, False)


# -- confirmed or refuted ----------------------------------------------------------------

E_RULE = EngageRule(
    engage_cost=0.4, engage_busy=0.75, release_busy=0.5, engage_windows=2, release_windows=3
)


@pytest.mark.parametrize(
    ("windows", "verdicts", "failures"),
    [
        # two windows whose returns were cheap to recompute: refuted, backs off
        ([(0.1, 0.2), (0.1, 0.2)], [None, False], 1),
        # a window too thin to judge neither confirms nor refutes
        ([(0.1, None), (0.1, 0.2), (0.1, None), (0.1, 0.2)], [None, None, None, False], 1),
        # a window whose returns were costly confirms it: measured from then on
        ([(0.1, 0.8), (0.1, 0.2), (0.1, 0.2)], [None, None, None], 0),
        # recompute measured at engage_cost confirms it too
        ([(0.5, 0.2), (0.1, 0.2), (0.1, 0.2)], [None, None, None], 0),
    ],
)
def test_a_prediction_is_confirmed_or_refuted_by_the_windows_after(
    windows, verdicts, failures
) -> None:
    e = Engagement()
    assert e.predict() and e.engaged and e.predicted
    got = [e.judge(E_RULE, busy=0.9, cost=c, returned=x) for c, x in windows]
    assert got == verdicts
    assert e.failures == failures
    if failures:
        assert not e.engaged and e.backoff > 0 and not e.armed
        assert not e.predict()  # backing off, and failed before: only measured thrash


def test_predict_engages_only_a_permissive_engine_that_never_failed() -> None:
    e = Engagement()
    assert e.predict() and not e.predict()  # engaged already
    e2 = Engagement(failures=1)
    assert not e2.predict()


# -- on the core -------------------------------------------------------------------------

P = ProgramParams(
    headroom=1.0,
    target_start=0.9,
    session_buffer_tokens=0,
    idle_lease_s=5.0,
    idle_half_life_s=10.0,
    paused_soft_wait_s=8.0,
    paused_max_wait_s=8.0,
    new_session_max_wait_s=60.0,
    staleness_s=5.0,
    growth_reservation=False,
    feedback_window_s=5.0,
    cold_start_sessions=4,
    floor_room=0.0,
    floor_room_host=0.0,
)


def burst(c: ProgramCore, n: int, tokens: int, decode: int, now: float = 0.0) -> list[Outcome]:
    out = []
    for i in range(n):
        v = c.request(f"s{i}", f"s{i}", E1, tokens, now, decode=decode)
        out.append(v.outcome if v.outcome is not None else v.held)
    return out


@pytest.mark.parametrize(
    ("decode", "forecast", "held"),
    [
        (10, True, True),  # long prompts, short answers: engages at the overflow
        (200, True, False),  # long decodes: recompute is cheap, admitted as off
        (10, False, False),  # the model switched off: admitted as off
    ],
)
def test_a_burst_engages_from_its_first_requests(decode, forecast, held) -> None:
    c = ProgramCore(dataclasses.replace(P, engage_on_forecast=forecast))
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    got = burst(c, 8, 300, decode)
    # four fit (1200 > 1000 at the fourth): engaged there; the rest wait for room
    assert got[:3] == [Outcome.NEW_ADMITTED] * 3
    assert (Held.NEW_SESSION_FIT in got) is held
    assert c.events[Event.PREDICTED] == int(held)


def test_no_decode_known_no_prediction() -> None:
    c = ProgramCore(P)
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    got = [c.request(f"s{i}", f"s{i}", E1, 300, 0.0).outcome for i in range(8)]
    assert got == [Outcome.NEW_ADMITTED] * 8 and c.events[Event.PREDICTED] == 0


def paused_core(hold_max: float) -> tuple[ProgramCore, str]:
    """An engine of 1000 whose gate is engaged: a (400) and b (300) keep running with
    turns of 450 and 400; c (200), paused, asks for its next turn (320) at t=20:
    resuming it would cross pause_high (850 + 320 > 950)."""
    c = ProgramCore(dataclasses.replace(P, engage_on_thrash=False, paused_max_wait_s=hold_max))
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    for sid, size in (("a", 400), ("b", 300), ("c", 200)):
        assert c.request(f"{sid}1", sid, E1, size, 0.0).outcome is Outcome.NEW_ADMITTED
        c.observe_response(f"{sid}1", 0.0, prompt_tokens=size, completion_tokens=0, cached_tokens=0)
        c.turn_ended(f"{sid}1", 0.0)
    c.ledger.pause(c.ledger.sessions["c"], 0.0)
    for sid, size in (("a", 450), ("b", 400)):  # never idle: never decayed
        c.request(f"{sid}2", sid, E1, size, 1.0)
    return c, "c"


@pytest.mark.parametrize(
    ("hold_max", "at", "outcome"),
    [
        (8.0, 40.0, Outcome.PAUSED_AGED),  # the fixed hold: goes at its bound
        (600.0, 40.0, None),  # past the soft bound, resuming still overflows: waits
        (600.0, 625.0, Outcome.PAUSED_AGED),  # the hard bound: goes however full
    ],
)
def test_a_paused_turn_waits_while_resuming_it_would_overflow(hold_max, at, outcome) -> None:
    c, sid = paused_core(hold_max)
    v = c.request("c2", sid, E1, 320, 20.0)
    assert v.held is Held.PAUSED_FIT
    c.ledger.observe_engine(E1, at, max_total_num_tokens=1000)
    c.ledger.engine(E1).load.answered(at - 1)  # the engine moved on since c2 queued
    released = {r.ticket: r.outcome for r in c.drain(at)}
    assert released.get("c2") is outcome


def test_a_paused_turn_goes_past_its_soft_bound_once_resuming_fits() -> None:
    c, sid = paused_core(600.0)
    c.request("c2", sid, E1, 320, 20.0)
    c.ledger.observe_engine(E1, 30.0, max_total_num_tokens=1000)
    assert c.drain(30.0) == []
    c.turn_ended("a2", 39.0)
    c.end_session("a", 39.0)  # a closes: 400 + 320 fit
    c.ledger.observe_engine(E1, 40.0, max_total_num_tokens=1000)
    released = {r.ticket: r.outcome for r in c.drain(40.0)}
    assert released == {"c2": Outcome.RESUMED_WAITED}


def test_a_session_whose_turn_is_held_is_not_expired_as_idle() -> None:
    c, sid = paused_core(6000.0)
    c.p = dataclasses.replace(c.p, idle_ttl_s=100.0)
    c.ledger.p = c.p
    c.request("c2", sid, E1, 320, 20.0)
    c.ledger.observe_engine(E1, 500.0, max_total_num_tokens=1000)
    c.tick(500.0)
    s = c.ledger.get(sid)
    assert s is not None and s.state is SessionState.PAUSED  # still held, still known
    assert c.queues.engine(E1).live_paused == 1


def waiting_new_core(soft: float) -> ProgramCore:
    """An engine of 1000 whose gate is engaged: a (400) and b (300) keep running with
    turns of 450 and 400; n, a new session, asks for its first turn (200) at t=10 and
    does not fit (850 + 200 > 900): admitting it would cross pause_high (850 + 200 > 950)."""
    c = ProgramCore(
        dataclasses.replace(
            P,
            engage_on_thrash=False,
            paused_max_wait_s=600.0,
            new_session_soft_wait_s=soft,
            new_session_max_wait_s=600.0,
        )
    )
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    for sid, size in (("a", 400), ("b", 300)):
        assert c.request(f"{sid}1", sid, E1, size, 0.0).outcome is Outcome.NEW_ADMITTED
        c.observe_response(f"{sid}1", 0.0, prompt_tokens=size, completion_tokens=0, cached_tokens=0)
        c.turn_ended(f"{sid}1", 0.0)
    for sid, size in (("a", 450), ("b", 400)):  # never idle: never decayed
        c.request(f"{sid}2", sid, E1, size, 1.0)
    assert c.request("n1", "n", E1, 200, 10.0).held is Held.NEW_SESSION_FIT
    return c


@pytest.mark.parametrize(
    ("soft", "at", "outcome"),
    [
        (600.0, 400.0, None),  # the plain bound (soft = hard): waits to it
        (300.0, 200.0, None),  # before its soft bound: waits
        (300.0, 400.0, None),  # past it, admitting it still overflows: waits
        (300.0, 615.0, Outcome.NEW_AGED),  # the hard bound: goes however full
    ],
)
def test_a_first_turn_waits_past_its_soft_bound_while_admitting_it_would_overflow(
    soft, at, outcome
) -> None:
    c = waiting_new_core(soft)
    c.ledger.observe_engine(E1, at, max_total_num_tokens=1000)
    c.ledger.engine(E1).load.answered(at - 1)  # the engine moved on since n1 queued
    released = {r.ticket: r.outcome for r in c.drain(at)}
    assert released.get("n1") is outcome


@pytest.mark.parametrize(("soft", "outcome"), [(300.0, Outcome.NEW_AGED), (600.0, None)])
def test_a_first_turn_past_its_soft_bound_goes_once_it_fits_under_the_pause_mark(
    soft, outcome
) -> None:
    """A first turn of 60 does not fit the target (850 + 60 > 900) but stays under the
    pause mark (850 + 60 <= 950): past its soft bound it goes; before the hard bound, with
    the soft bound at the hard one, it waits."""
    c = waiting_new_core(soft)
    c.cancel("n1")
    assert c.request("n2", "n", E1, 60, 10.0).held is Held.NEW_SESSION_FIT
    led = c.ledger
    s = led.get("n")
    assert s is not None and not led.past_pause_mark(E1, led.first_reservation(E1, s, 60, 320.0))
    led.observe_engine(E1, 305.0, max_total_num_tokens=1000)
    assert c.drain(305.0) == []  # before the soft bound (310)
    led.observe_engine(E1, 320.0, max_total_num_tokens=1000)
    led.engine(E1).load.answered(319.0)
    released = {r.ticket: r.outcome for r in c.drain(320.0)}
    assert released.get("n2") is outcome


@pytest.mark.parametrize(
    ("tokens", "outcome"),
    [
        (60, Outcome.NEW_AGED),  # held for room, under the mark: leaves ahead of the resume
        (30, None),  # it fits: held for its order behind the resume, as before
    ],
)
def test_past_its_soft_bound_a_first_turn_held_for_room_leaves_while_resumes_wait(
    tokens, outcome
) -> None:
    """a is paused and asks for 600, which overflows beside b: it waits ahead of new
    sessions. b's running turn is 850: n's first turn of 60 does not fit the target
    (910 > 900) but stays under the pause mark; one of 30 fits (880)."""
    c = waiting_new_core(300.0)
    c.cancel("n1")
    c.turn_ended("a2", 2.0)
    c.ledger.pause(c.ledger.sessions["a"], 2.0)
    assert c.request("a3", "a", E1, 600, 5.0).held is Held.PAUSED_FIT
    c.ledger.sessions["b"].est = 850
    assert c.request("n2", "n", E1, tokens, 10.0).held is Held.NEW_BEHIND
    led = c.ledger
    s = led.get("n")
    assert s is not None and not led.past_pause_mark(E1, led.first_reservation(E1, s, tokens, 0))
    led.observe_engine(E1, 315.0, max_total_num_tokens=1000)
    led.engine(E1).load.answered(314.0)
    released = {r.ticket: r.outcome for r in c.drain(315.0)}
    assert "a3" not in released  # the resume still overflows; its hard bound is 600 s
    assert released.get("n2") is outcome
