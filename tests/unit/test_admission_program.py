"""Program admission's pure core: ledger, queues, decisions, tick, feedback, priority
(tables with an injected clock)."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.events import Event, Held
from kvproxy.admission.program.ledger import SessionState
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.priority import next_priority, size_priority
from kvproxy.admission.records import Outcome
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.placement import Placement
from kvproxy.fleet.ring import HashRing

E1, E2 = "http://e1:1", "http://e2:1"
# Capacity 1000 (headroom 1), gate off below 750, target 900, pause 950 -> 850.
# The gate's mechanics, engaged from the start (engage_on_thrash off); when it
# engages is tested in test_admission_engagement.py.
P = ProgramParams(
    engage_on_thrash=False,
    headroom=1.0,
    target_start=0.9,
    session_buffer_tokens=0,
    idle_lease_s=5.0,
    idle_half_life_s=10.0,
    paused_soft_wait_s=8.0,
    new_session_max_wait_s=60.0,
    staleness_s=1e9,
    growth_alpha=0.5,
)


def core(params: ProgramParams = P, engines: tuple[str, ...] = (E1, E2)) -> ProgramCore:
    c = ProgramCore(params)
    for url in engines:
        c.ledger.observe_engine(url, 0.0, max_total_num_tokens=1000)
    return c


def turn(c: ProgramCore, ticket: str, sid: str, tokens: int, now: float, engine: str = E1):
    return c.request(ticket, sid, engine, tokens, now)


def finish(c: ProgramCore, ticket: str, now: float, prompt: int, completion: int = 0, cached=None):
    c.observe_response(
        ticket, now, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
    )
    c.turn_ended(ticket, now)


# -- ledger --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("idle", "half_life", "weight"),
    [
        (0.0, 10.0, 1.0),
        (4.9, 10.0, 1.0),
        (5.0, 10.0, 1.0),
        (15.0, 10.0, 0.5),
        (25.0, 10.0, 0.25),
        (5.1, 0.0, 0.0),
    ],
)
def test_idle_sessions_count_fully_for_the_lease_then_decay(idle, half_life, weight) -> None:
    c = core(dataclasses.replace(P, idle_half_life_s=half_life))
    turn(c, "t1", "s", 100, 0.0)
    finish(c, "t1", 0.0, prompt=100)
    s = c.ledger.get("s")
    assert s is not None
    assert c.ledger.weight(s, idle) == pytest.approx(weight)
    assert c.ledger.committed(E1, idle) == pytest.approx(100 * weight)
    assert c.ledger.undecayed(E1) == 100  # pause pressure ignores decay


def test_context_is_prompt_plus_completion_and_growth_is_an_ema() -> None:
    c = core()
    for i, (prompt, completion) in enumerate([(100, 20), (200, 20), (300, 60)]):
        turn(c, f"t{i}", "s", prompt, float(i))
        finish(c, f"t{i}", float(i), prompt=prompt, completion=completion)
    s = c.ledger.get("s")
    assert s is not None and s.ctx == 360 and s.turns == 3
    # growth: turn 2 -> 220-120 = 100; turn 3 -> 0.5*(360-220) + 0.5*100 = 120
    assert s.growth == pytest.approx(120.0)
    assert s.footprint(0) == 480


def test_shared_prefix_credit_counts_a_common_prefix_once() -> None:
    c = core()
    for i in range(3):
        turn(c, f"t{i}", f"s{i}", 300, 0.0)
        finish(c, f"t{i}", 0.0, prompt=300, cached=0 if i == 0 else 200)
    assert c.ledger.engines[E1].shared_prefix == 200
    assert c.ledger.undecayed(E1) == 900 - 2 * 200


def test_closed_leaves_at_once_and_idle_ones_expire_after_the_ttl() -> None:
    c = core(dataclasses.replace(P, idle_ttl_s=100.0))
    for sid in ("a", "b"):
        turn(c, sid, sid, 100, 0.0)
        finish(c, sid, 0.0, prompt=100)
    assert c.end_session("a", 1.0) and not c.end_session("a", 1.0)
    assert c.ledger.undecayed(E1) == 100
    c.tick(100.0)
    assert c.ledger.get("b") is not None
    c.tick(100.5)
    assert c.ledger.get("b") is None and c.events[Event.IDLE_EXPIRED] == 1
    assert c.ledger.undecayed(E1) == 0


def test_session_table_is_bounded_least_recent_idle_first() -> None:
    c = core(dataclasses.replace(P, max_sessions=2))
    for i, sid in enumerate(("a", "b", "c")):
        turn(c, sid, sid, 10, float(i))
        if sid != "c":
            finish(c, sid, float(i), prompt=10)
    assert list(c.ledger.sessions) == ["b", "c"]


# -- decisions -----------------------------------------------------------------------


def test_continuing_turn_of_an_active_session_is_never_held() -> None:
    c = core()
    turn(c, "t1", "s", 700, 0.0)
    finish(c, "t1", 0.0, prompt=700)
    # Way over the target and even the capacity: still forwarded at once.
    v = turn(c, "t2", "s", 5000, 1.0)
    assert v.outcome is Outcome.CONTINUING_FORWARDED


def test_hold_continuing_ablation_holds_continuing_turns_that_do_not_fit() -> None:
    c = core(dataclasses.replace(P, hold_continuing=True))
    turn(c, "a1", "a", 800, 0.0)
    finish(c, "a1", 0.0, prompt=800)
    turn(c, "b1", "b", 50, 0.0)
    finish(c, "b1", 0.0, prompt=50)
    v = turn(c, "b2", "b", 200, 1.0)
    assert v.outcome is None and v.held is Held.CONTINUING_FIT
    c.end_session("a", 2.0)
    (r,) = c.drain(2.0)
    assert (r.ticket, r.outcome) == ("b2", Outcome.CONTINUING_WAITED)


def test_new_sessions_wait_in_their_engines_fifo_until_they_fit() -> None:
    c = core()
    assert turn(c, "a1", "a", 800, 0.0).outcome is Outcome.NEW_ADMITTED
    v = turn(c, "b1", "b", 200, 0.0)
    assert v.outcome is None and v.held is Held.NEW_SESSION_FIT
    # The other engine's new sessions pass.
    assert turn(c, "x1", "x", 200, 0.0, engine=E2).outcome is Outcome.NEW_ADMITTED
    # A small one behind the head waits too (FIFO-with-fit: the head blocks).
    assert turn(c, "c1", "c", 10, 0.0).held is Held.NEW_BEHIND
    finish(c, "a1", 1.0, prompt=400)  # a shrank to 400: b (200) fits, then c
    assert [(r.ticket, r.outcome) for r in c.drain(1.0)] == [
        ("b1", Outcome.NEW_WAITED),
        ("c1", Outcome.NEW_WAITED),
    ]


def test_new_session_goes_anyway_after_its_bound_once_its_engine_moved_on() -> None:
    c = core()
    turn(c, "a1", "a", 900, 0.0)
    turn(c, "b1", "b", 200, 0.0)
    assert c.next_deadline(0.0) == 60.0
    assert c.drain(59.9) == []
    # Past its bound, but the engine has answered nothing since b1 was queued: a proxy
    # whose clock ran ahead of its engine does not age it; it looks again a tick later.
    assert c.drain(60.0) == []
    assert c.next_deadline(60.0) == 60.0 + P.tick_s
    c.observe_response("a1", 61.0, prompt_tokens=900, completion_tokens=0, cached_tokens=None)
    (r,) = c.drain(61.0)
    assert (r.ticket, r.outcome, r.wait_s) == ("b1", Outcome.NEW_AGED, 61.0)
    assert Outcome.NEW_AGED.fail_open


def test_a_hold_ages_at_twice_its_bound_without_engine_progress() -> None:
    c = core()
    turn(c, "a1", "a", 900, 0.0)  # never answers
    turn(c, "b1", "b", 200, 0.0)
    assert c.drain(119.9) == []
    (r,) = c.drain(120.0)
    assert (r.ticket, r.outcome) == ("b1", Outcome.NEW_AGED)


@pytest.mark.parametrize(
    ("sid", "owner", "fresh", "tokens", "outcome"),
    [
        (None, E1, True, 10, Outcome.BYPASS_NO_SESSION),
        ("s", None, True, 10, Outcome.BYPASS_NO_PLACEMENT),
        # Stale but known: the last reading stands (capacity does not change).
        ("s", E1, False, 10, Outcome.NEW_ADMITTED),
        ("s", E1, True, 1001, Outcome.BYPASS_OVERSIZED),
        ("s", E1, True, 700, Outcome.NEW_ADMITTED),
    ],
)
def test_fail_open_paths(sid, owner, fresh, tokens, outcome) -> None:
    c = core(dataclasses.replace(P, staleness_s=5.0))
    now = 10.0 if not fresh else 1.0
    v = c.request("t", sid, owner, tokens, now)
    assert v.outcome is outcome


def test_full_queues_fail_open() -> None:
    c = core(dataclasses.replace(P, max_queue=1))
    turn(c, "a1", "a", 900, 0.0)
    assert turn(c, "b1", "b", 200, 0.0).outcome is None
    assert turn(c, "c1", "c", 200, 0.0).outcome is Outcome.BYPASS_QUEUE_FULL


def test_cancelled_waiter_leaves_and_a_never_admitted_session_is_forgotten() -> None:
    c = core()
    turn(c, "a1", "a", 900, 0.0)
    turn(c, "b1", "b", 200, 0.0)
    assert c.cancel("b1") and not c.cancel("b1")
    assert c.ledger.get("b") is None and len(c.queues) == 0


# -- pause, resume, the bounded hold --------------------------------------------------


def fill(c: ProgramCore, sizes: dict[str, int], now: float = 0.0) -> None:
    # First turns admitted small (target lifted for the set-up); their responses
    # report the whole context.
    eng = c.ledger.engines[E1]
    theta, eng.theta = eng.theta, 1.0
    for sid, size in sizes.items():
        assert turn(c, sid + "0", sid, 10, now).outcome is Outcome.NEW_ADMITTED
        finish(c, sid + "0", now, prompt=size)
    eng.theta = theta


# Ten idle sessions, U = 965 > 0.95 x 1000: the two largest (105, 100) pause, down to 760.
TEN = {"s1": 105, "s2": 100, **{f"s{i}": 95 for i in range(3, 11)}}
# The pause counts sessions as admission does (an idle one decays); these tables keep
# idle sessions at full weight, so that what they count is U.
PAUSING = dataclasses.replace(P, feedback=False, idle_half_life_s=1e9)


def test_pause_takes_idle_sessions_largest_first_until_the_low_mark() -> None:
    c = core(PAUSING)
    fill(c, TEN)
    c.tick(4.0)  # idle < lease: nobody pausable yet
    assert c.events[Event.PAUSED] == 0
    c.tick(6.0)
    paused = {sid for sid in TEN if c.ledger.sessions[sid].state is SessionState.PAUSED}
    # 965 - 105 = 860 > 850 -> also s2: 760 <= 850
    assert paused == {"s1", "s2"}
    assert c.ledger.undecayed(E1) == 760 and c.events[Event.PAUSED] == 2


@pytest.mark.parametrize(
    ("half_life", "paused"),
    [
        (1e9, {"s1", "s2"}),  # full weight: 965 > 950; 860 > 850, 760
        # 6 s after their turns (1 s past the lease) each counts 2^(-1/50) = 0.986:
        # 951.7 > 950, and after s1 848.2 <= 850 (undecayed, 860 would take s2 too)
        (50.0, {"s1"}),
        (10.0, set()),  # 0.933 each: 900 <= 950, the engine's LRU holds the rest
    ],
)
def test_the_pause_counts_idle_sessions_decayed_as_admission_does(
    half_life: float, paused: set[str]
) -> None:
    c = core(dataclasses.replace(PAUSING, idle_half_life_s=half_life))
    fill(c, TEN)
    c.tick(6.0)
    assert {sid for sid in TEN if c.ledger.sessions[sid].state is SessionState.PAUSED} == paused
    assert c.ledger.undecayed(E1) == 965 - sum(TEN[sid] for sid in paused)


def test_no_pause_while_the_gate_is_off_or_disabled() -> None:
    c = core()
    fill(c, {"a": 300, "b": 300})
    c.tick(100.0)
    assert c.events[Event.PAUSED] == 0
    c2 = core(dataclasses.replace(P, pause=False))
    fill(c2, {"a": 500, "b": 460})
    c2.tick(100.0)
    assert c2.events[Event.PAUSED] == 0


@pytest.mark.parametrize(
    ("host_tokens", "write_back", "paused"),
    [
        (0, False, 2),  # no host tier: U 965 > 0.95 x 1000; the two largest, to 850
        (15, False, 1),  # room 1015: 965 > 964.25; after s1 860 <= 862.75
        (16, False, 0),  # room 1016: 965 <= 965.2, the two tiers hold them: nobody
        (500, False, 0),
        (15, True, 1),  # the same room whatever the write policy
        (2000, True, 0),
    ],
)
def test_an_engine_with_a_host_tier_pauses_only_once_its_sessions_overflow_both_tiers(
    host_tokens: int, write_back: bool, paused: int
) -> None:
    # With a host KV tier (SGLang's HiCache) what overflows the device comes back from
    # host memory by a load: pausing pays only once the sessions overflow pool + host.
    c = core(PAUSING)
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000, host_tokens=host_tokens)
    if write_back:
        c.ledger.set_host_write_policy(E1, "write_back")
    fill(c, TEN)
    c.tick(6.0)
    assert c.events[Event.PAUSED] == paused
    (row,) = [r for r in c.engine_rows(6.0) if r["url"] == E1]  # what operators see
    assert row["tier_room"] == c.ledger.tier_room(E1) == 1000 + host_tokens
    # A new session still waits for room either way.
    v = turn(c, "n0", "new", 400, 6.5)
    assert v.outcome is None and v.held is Held.NEW_SESSION_FIT


def test_with_no_idle_session_the_smallest_running_one_pauses_at_its_response() -> None:
    c = core(dataclasses.replace(P, feedback=False))
    turn(c, "a0", "a", 600, 0.0)
    assert turn(c, "b0", "b", 100, 0.0).outcome is Outcome.NEW_ADMITTED
    c.ledger.sessions["b"].est = 380  # U = 980 > 950, nobody idle
    c.tick(10.0)
    assert c.events[Event.PAUSE_MARKED] == 1
    finish(c, "b0", 11.0, prompt=380)
    assert c.ledger.sessions["b"].state is SessionState.PAUSED


def paused_setup() -> ProgramCore:
    c = core(PAUSING)
    fill(c, TEN)
    c.tick(6.0)  # pauses s1 and s2; U = 760
    return c


def test_a_paused_turn_that_fits_resumes_at_once() -> None:
    c = paused_setup()
    assert turn(c, "s2-1", "s2", 100, 7.0).outcome is Outcome.RESUMED
    assert c.ledger.undecayed(E1) == 860


def test_a_paused_turn_waits_at_most_its_bound_ahead_of_new_sessions() -> None:
    c = paused_setup()
    # no decay from here on; the fixed hold (a hold past its soft bound that would still
    # overflow: tests/unit/test_admission_forecast.py)
    c.configure(
        dataclasses.replace(c.p, idle_lease_s=1000.0, paused_max_wait_s=c.p.paused_soft_wait_s)
    )
    turn(c, "s3-1", "s3", 95, 7.0)  # continuing: forwarded
    c.ledger.sessions["s3"].growth = 100  # s3 is expected to grow: W ~ 860
    v = turn(c, "s2-1", "s2", 100, 7.0)
    assert v.outcome is None and v.held is Held.PAUSED_FIT
    # A new session now waits behind the paused turn, even a tiny one.
    assert turn(c, "n1", "new", 1, 7.5).held is Held.NEW_BEHIND
    assert c.drain(14.9) == []
    # At its bound, once the engine has answered something since it was queued.
    c.ledger.engine(E1).load.answered(14.0)
    releases = c.drain(15.0)
    assert [(r.ticket, r.outcome) for r in releases] == [("s2-1", Outcome.PAUSED_AGED)]
    assert releases[0].wait_s == pytest.approx(8.0)
    assert c.paused_waits == [pytest.approx(8.0)]


def test_resumes_go_before_new_sessions_in_the_tick() -> None:
    c = paused_setup()
    c.configure(dataclasses.replace(c.p, idle_lease_s=1000.0))  # no decay from here on
    turn(c, "s3-1", "s3", 95, 7.0)
    c.ledger.sessions["s3"].growth = 100
    turn(c, "s2-1", "s2", 100, 7.0)
    turn(c, "n1", "new", 50, 7.0)
    finish(c, "s3-1", 8.0, prompt=20)  # s3 shrinks: room for both
    c.ledger.sessions["s3"].growth = 0
    out = c.tick(8.0)
    assert [(r.ticket, r.outcome) for r in out] == [
        ("s2-1", Outcome.RESUMED_WAITED),
        ("n1", Outcome.NEW_WAITED),
    ]


# -- feedback ------------------------------------------------------------------------


def hot(c: ProgramCore) -> None:
    fill(c, {"a": 400, "b": 400})  # U = 800: gate on (>= 750), no pause (< 950)


def continuing_turns(c: ProgramCore, now: float, cached: int, n: int = 3) -> None:
    for i in range(n):
        sid = "ab"[i % 2]
        t = f"{sid}{now}{i}"
        turn(c, t, sid, 400, now)
        finish(c, t, now, prompt=400, cached=cached)


def test_feedback_cuts_the_target_on_a_low_cached_fraction_at_most_once_per_interval() -> None:
    c = core()
    hot(c)
    continuing_turns(c, 1.0, cached=200)  # 0.5 < 0.85
    c.tick(5.0)
    assert c.ledger.engines[E1].theta == pytest.approx(0.72)
    continuing_turns(c, 6.0, cached=200)
    c.tick(10.0)  # within cut_interval_s (10 s) of the last cut
    assert c.ledger.engines[E1].theta == pytest.approx(0.72)
    continuing_turns(c, 11.0, cached=200)
    c.tick(15.0)
    assert c.ledger.engines[E1].theta == pytest.approx(0.6)  # 0.576, floored at target_min
    assert c.events[Event.TARGET_CUT] == 2


def test_feedback_cuts_on_retractions_and_unexplained_evictions() -> None:
    for kwargs in ({"retracted_total": 1}, {"evicted_total": 500}):
        c = core()
        c.ledger.observe_engine(
            E1, 0.0, max_total_num_tokens=1000, retracted_total=0, evicted_total=0
        )
        hot(c)
        c.ledger.observe_engine(E1, 1.0, max_total_num_tokens=1000, **kwargs)
        c.tick(5.0)
        assert c.ledger.engines[E1].theta < 0.9, kwargs


def test_feedback_raises_after_quiet_windows_only_with_new_sessions_waiting() -> None:
    c = core()
    hot(c)
    for k in range(1, 4):
        continuing_turns(c, 5.0 * k - 1, cached=400)
        c.tick(5.0 * k)
    assert c.ledger.engines[E1].theta == pytest.approx(0.9)  # nobody waiting
    turn(c, "a16", "a", 400, 16.0)  # in flight: the engine is not idle
    turn(c, "n1", "n", 400, 16.0)  # 800 + 400 > 900: waits
    for k in range(4, 7):
        c.tick(5.0 * k)
    assert c.ledger.engines[E1].theta == pytest.approx(0.92)


def test_feedback_stays_out_of_the_way_while_the_gate_is_off_or_disabled() -> None:
    c = core()
    fill(c, {"a": 100})
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000, retracted_total=0)
    c.ledger.observe_engine(E1, 1.0, max_total_num_tokens=1000, retracted_total=5)
    c.tick(5.0)
    assert c.ledger.engines[E1].theta == pytest.approx(0.9)
    c2 = core(dataclasses.replace(P, feedback=False))
    hot(c2)
    continuing_turns(c2, 1.0, cached=0)
    c2.tick(5.0)
    assert c2.ledger.engines[E1].theta == pytest.approx(0.9)


# -- priority ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ctx", "prio"),
    [(0, 0), (4095, 0), (8191, 0), (8192, 1), (16384, 2), (40_000, 3), (10**9, 9)],
)
def test_size_priority(ctx: int, prio: int) -> None:
    assert size_priority(ctx) == prio


def test_priority_is_monotone_per_session_and_below_the_preemption_gap() -> None:
    assert next_priority(3, 100) == 3
    assert next_priority(0, 10**12, max_priority=9) == 9
    c = core()
    turn(c, "t1", "s", 20_000, 0.0)
    assert c.priority("s") == 2
    finish(c, "t1", 1.0, prompt=100)
    assert c.priority("s") == 2  # never lowered
    assert c.priority("unknown") is None


# -- placement -----------------------------------------------------------------------


def test_placement_mirrors_the_ring_and_strips_dp_suffixes() -> None:
    urls = ["http://h:1@0", "http://h:1@1", "http://h:2"]
    p = Placement("consistent_hashing")
    assert p.owner("k") is None  # nothing registered yet
    assert p.update(urls, urls) and not p.update(urls, urls)
    ring = HashRing(urls)
    for i in range(50):
        raw = ring.owner(f"k{i}")
        assert raw is not None
        assert p.owner(f"k{i}") == raw.split("@")[0]
    assert Placement("round_robin").owner("k") is None
    assert not Placement("cache_aware").mirrored


def test_reattribution_moves_sessions_and_their_waiting_turns() -> None:
    c = core()
    turn(c, "a1", "a", 900, 0.0)
    turn(c, "b1", "b", 200, 0.0)  # waits on E1
    assert c.reattribute({"a": E1, "b": E2}, 1.0) == 1
    assert c.events[Event.MOVED] == 1
    assert c.queues.waiting(E2) == (0, 1)
    (r,) = c.drain(1.0)
    assert (r.ticket, r.outcome) == ("b1", Outcome.NEW_WAITED)


def test_params_scale_every_duration_by_the_time_scale() -> None:
    cfg = AdmissionConfig(enabled=True, paused_soft_wait_s=30.0)
    p = ProgramParams.from_config(cfg, time_scale=0.5)
    assert (p.tick_s, p.paused_soft_wait_s, p.idle_lease_s, p.idle_half_life_s) == (
        0.5,
        15.0,
        0.0,
        0.5,
    )
    assert p.new_session_max_wait_s == 900.0 and p.idle_ttl_s == 300.0


@pytest.mark.parametrize(
    ("wait", "keys", "soft", "hard"),
    [
        # a paused turn's: the defaults, a soft bound then the hold while it pays
        ("paused", {}, 30.0, 600.0),
        ("paused", {"paused_max_wait_s": 30.0}, 30.0, 30.0),  # alone: the fixed 30 s hold
        ("paused", {"paused_max_wait_s": 8.0}, 8.0, 8.0),  # never a soft bound past the hard
        ("paused", {"paused_soft_wait_s": 5.0, "paused_max_wait_s": 60.0}, 5.0, 60.0),
        # a first turn's
        ("new_session", {}, 180.0, 1800.0),
        ("new_session", {"new_session_max_wait_s": 120.0}, 120.0, 120.0),  # the plain bound
        (
            "new_session",
            {"new_session_soft_wait_s": 60.0, "new_session_max_wait_s": 900.0},
            60.0,
            900.0,
        ),
    ],
)
def test_the_hard_bound_stays_the_most_a_held_turn_waits(
    wait: str, keys: dict[str, float], soft: float, hard: float
) -> None:
    p = ProgramParams.from_config(AdmissionConfig(enabled=True, **keys))
    assert (getattr(p, f"{wait}_soft_wait_s"), getattr(p, f"{wait}_max_wait_s")) == (soft, hard)


def test_the_token_scale_divides_every_token_valued_setting() -> None:
    from kvproxy.admission.scaling import token_scaled

    cfg = AdmissionConfig(enabled=True, expected_decode_cap=2048)
    assert token_scaled(cfg, 1) is cfg
    scaled = token_scaled(cfg, 16)
    assert (
        scaled.default_completion_tokens,
        scaled.expected_decode_cap,
        scaled.priority_unit_tokens,
        scaled.session_buffer_tokens,
    ) == (256, 128, 256, 6)
    # Durations and ratios are the time scale's business, not the token scale's.
    assert (scaled.paused_soft_wait_s, scaled.headroom) == (cfg.paused_soft_wait_s, cfg.headroom)
    assert token_scaled(AdmissionConfig(), 16).expected_decode_cap is None


def test_the_same_attempt_asked_twice_is_one_running_turn() -> None:
    c = core()
    turn(c, "t1", "s", 100, 0.0)
    turn(c, "t1", "s", 100, 0.0)
    c.turn_ended("t1", 1.0)
    s = c.ledger.get("s")
    assert s is not None and s.running == 0


def test_a_session_closed_while_its_turn_waits_is_not_brought_back() -> None:
    c = core()
    turn(c, "a1", "a", 900, 0.0)
    turn(c, "b1", "b", 200, 0.0)
    c.end_session("b", 1.0)
    c.end_session("a", 1.0)
    (r,) = c.drain(1.0)
    assert r.ticket == "b1" and c.ledger.get("b") is None
    assert c.ledger.undecayed(E1) == 0


# -- Dynamo's agent_hints.osl ----------------------------------------------------------


def test_osl_hint_floors_the_sessions_expected_growth() -> None:
    c = core()
    turn(c, "t1", "s", 100, 0.0)
    finish(c, "t1", 1.0, prompt=100, completion=10)
    s = c.ledger.get("s")
    assert s is not None
    before = s.footprint(0)
    c.hint_growth("s", 300)
    assert s.growth == 300.0
    assert s.footprint(0) == max(before, int(s.ctx + 300))
    c.hint_growth("s", 5)  # never lowers what was observed or hinted
    assert s.growth == 300.0
    c.hint_growth(None, 300)  # no session: nothing
    c.hint_growth("unknown", 300)
    assert c.ledger.get("unknown") is None


def test_streaming_held_kv_counts_as_committed_and_never_decays() -> None:
    c = core()
    led = c.ledger
    assert led.committed(E1, 0.0) == 0.0
    led.observe_engine(E1, 0.0, max_total_num_tokens=1000, streaming_held=400, streaming_sessions=2)
    assert led.committed(E1, 0.0) == 400.0
    assert led.committed(E1, 1e6) == 400.0  # pinned: no idle decay
    assert led.committed(E2, 0.0) == 0.0  # per engine
    row = next(r for r in c.engine_rows(0.0) if r["url"] == E1)
    assert (row["streaming_sessions"], row["streaming_held"]) == (2.0, 400.0)
    led.observe_engine(E1, 1.0, max_total_num_tokens=1000)  # closed: the metric is gone
    assert led.committed(E1, 1.0) == 0.0


def test_program_params_defaults_are_the_configs_defaults() -> None:
    # ProgramParams takes its defaults from AdmissionConfig (so the pure core can be built
    # without a config); from_config must carry every key over, unscaled at time scale 1.
    assert ProgramParams() == ProgramParams.from_config(AdmissionConfig())


def test_a_lead_whose_child_runs_is_paused_as_any_idle_session_but_never_expires() -> None:
    # s1 (the largest) is a lead; s10 names it as parent: s1 is busy while s10 runs.
    # Its next turn comes only after its child's, so the tick pauses it as it pauses any
    # idle session (sparing it moved the pause onto the children: docs/sessions.md).
    c = core(dataclasses.replace(PAUSING, idle_ttl_s=100.0))
    c.ledger.link("s10", "s1")
    fill(c, TEN)
    assert c.ledger.has_running_children("s1") and c.ledger.sessions["s1"].busy
    c.tick(6.0)
    paused = {sid for sid in TEN if c.ledger.sessions[sid].state is SessionState.PAUSED}
    # 965 - 105 (s1) - 100 (s2) = 760 <= 850: the two largest, as without the link
    assert paused == {"s1", "s2"}
    # A child still working keeps its lead: idle expiry passes over a busy lead.
    c.ledger.sessions["s10"].since = 150.0  # the child's last answer (it works on)
    expired = c.ledger.expire(150.0)  # everyone else idle past the ttl leaves
    assert "s2" in expired and "s1" not in expired and "s10" not in expired
    c.end_session("s10", 151.0)
    assert not c.ledger.has_running_children("s1")
    assert "s1" in c.ledger.expire(152.0)


def test_one_id_with_turns_in_flight_at_once_is_counted_once() -> None:
    # A harness sharing one id across its subagents: the lead's turn, then three
    # subagent turns at once on smaller, diverging contexts, then the lead again.
    c = core(dataclasses.replace(P, feedback=False))
    assert turn(c, "lead0", "s", 10, 0.0).outcome is Outcome.NEW_ADMITTED
    finish(c, "lead0", 1.0, prompt=400)
    for i in range(3):
        assert turn(c, f"sub{i}", "s", 50, 2.0).outcome is Outcome.CONTINUING_FORWARDED
    s = c.ledger.sessions["s"]
    assert s.running == 3 and s.shared
    assert c.ledger.counts()["running"] == 1  # one session running, not three
    for i in range(3):
        finish(c, f"sub{i}", 3.0 + i, prompt=60 + i, completion=10)
    assert s.running == 0 and s.turns == 4
    assert s.ctx == 400  # the largest context, not the last subagent's 72
    assert s.growth == 0.0  # no subagent's context counted as growth
    assert turn(c, "lead1", "s", 500, 6.0).outcome is Outcome.CONTINUING_FORWARDED
    finish(c, "lead1", 7.0, prompt=480, completion=20)
    assert s.ctx == 500 and s.growth == 0.0
    assert c.ledger.undecayed(E1) == 500  # the session's footprint, once
