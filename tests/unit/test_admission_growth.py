"""Growth-aware admission of new sessions (program mode): the expected peak model and the
gate on new sessions (tables with an injected clock)."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.events import Held
from kvproxy.admission.program.ledger import PeakModel
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.records import Outcome
from kvproxy.config import AdmissionConfig, ConfigError, from_mapping
from kvproxy.fleet.engine_info import parse_server_info

E1, E2 = "http://e1:1", "http://e2:1"
# Capacity 1000 (headroom 1); the footprint gate is off below 750 and admits to 900; the
# growth gate admits while the reservations stay within 900. Two closed sessions teach
# the peak model (median).
# The gate's mechanics, engaged from the start (engage_on_thrash off); when it
# engages is tested in test_admission_engagement.py.
P = ProgramParams(
    engage_on_thrash=False,
    headroom=1.0,
    target_start=0.9,
    session_buffer_tokens=0,
    staleness_s=1e9,
    growth_target=0.9,
    growth_quantile=0.5,
    growth_min_closed=2,
    growth_horizon_turns=4.0,
    growth_alpha=0.5,
)


def core(params: ProgramParams = P) -> ProgramCore:
    c = ProgramCore(params)
    for url in (E1, E2):
        c.ledger.observe_engine(url, 0.0, max_total_num_tokens=1000)
    return c


def run_turn(c: ProgramCore, ticket: str, sid: str, prompt: int, now: float, completion=0):
    v = c.request(ticket, sid, E1, prompt, now)
    c.observe_response(
        ticket, now, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=None
    )
    c.turn_ended(ticket, now)
    return v


def learn_peaks(c: ProgramCore, peaks: list[int], now: float = 0.0) -> None:
    """Sessions on the other engine that grow to ``peaks`` and close."""
    for i, peak in enumerate(peaks):
        sid = f"done{i}"
        c.request(f"{sid}-1", sid, E2, 10, now)
        c.observe_response(f"{sid}-1", now, prompt_tokens=10, completion_tokens=0, cached_tokens=0)
        c.turn_ended(f"{sid}-1", now)
        c.request(f"{sid}-2", sid, E2, peak, now)
        c.observe_response(
            f"{sid}-2", now, prompt_tokens=peak, completion_tokens=0, cached_tokens=0
        )
        c.turn_ended(f"{sid}-2", now)
        c.end_session(sid, now)


# -- the peak model ----------------------------------------------------------------


def model(**kw) -> PeakModel:
    args = {"quantile": 0.5, "window": 4, "min_closed": 2, "horizon_turns": 4.0, "alpha": 0.5}
    args.update(kw)
    return PeakModel(**args)


@pytest.mark.parametrize(
    ("growths", "closed", "ctx", "context_length", "peak"),
    [
        ([], [], 50, None, 50),  # nothing known: the session's own context
        ([], [], 50, 800, 800),  # nothing grew yet: the engine's context length
        ([100], [], 50, None, 450),  # prior: ctx + growth x horizon (4 turns)
        ([100, 200], [], 50, None, 650),  # growth is an EMA (150)
        ([100], [], 50, 300, 300),  # capped by the context length
        ([100], [700], 50, None, 450),  # one close is under min_closed: still the prior
        ([100], [700, 300], 50, None, 700),  # learned: the quantile of closed peaks
        ([100], [700, 300], 900, None, 900),  # never below the session's own context
        ([100], [700, 300], 50, 600, 600),  # learned, capped by the context length
    ],
)
def test_expected_peak_prior_then_learned_quantile_capped_by_context_length(
    growths, closed, ctx, context_length, peak
) -> None:
    m = model()
    for g in growths:
        m.observe_growth(g)
    for p in closed:
        m.observe_closed(p)
    assert m.peak(ctx, context_length) == peak


@pytest.mark.parametrize(
    ("quantile", "peak"), [(0.0, 100), (0.25, 200), (0.5, 300), (0.75, 400), (1.0, 400)]
)
def test_learned_peak_is_the_quantile_of_the_closed_sessions(quantile, peak) -> None:
    m = model(quantile=quantile)
    for p in (400, 100, 300, 200):
        m.observe_closed(p)
    assert m.learned() == peak


def test_the_closed_window_is_bounded_oldest_first() -> None:
    m = model(window=3, quantile=0.0)
    for p in (100, 500, 600, 700):  # 100 leaves when 700 comes
        m.observe_closed(p)
    assert (m.closed, m.learned()) == (3, 500)


def test_a_smaller_window_on_reconfigure_keeps_the_newest() -> None:
    m = model(window=4, quantile=0.0)
    for p in (100, 200, 300, 400):
        m.observe_closed(p)
    m.configure(quantile=0.0, window=2, min_closed=1, horizon_turns=4.0, alpha=0.5)
    assert (m.closed, m.learned()) == (2, 300)


# -- the gate on new sessions --------------------------------------------------------


def test_a_new_session_waits_until_what_the_engines_sessions_grow_to_fits() -> None:
    c = core()
    learn_peaks(c, [400, 400])  # every session is expected to grow to 400
    # Footprints are tiny (the footprint gate is off), but reservations are 400 each.
    assert run_turn(c, "a1", "a", 50, 1.0).outcome is Outcome.NEW_ADMITTED
    assert run_turn(c, "b1", "b", 50, 1.0).outcome is Outcome.NEW_ADMITTED  # 800 <= 900
    v = c.request("c1", "c", E1, 50, 1.0)  # 1200 > 900
    assert v.outcome is None and v.held is Held.NEW_SESSION_FIT
    c.end_session("a", 2.0)  # a closes: 400 + 400 fits again
    assert [(r.ticket, r.outcome) for r in c.drain(2.0)] == [("c1", Outcome.NEW_WAITED)]


@pytest.mark.parametrize(
    ("host_tokens", "held"),
    [(0, True), (1000, True), (1400, False)],  # host as large as the pool: a copy, no room
)
def test_a_host_tier_larger_than_the_pool_is_the_room_the_growth_gate_fills(
    host_tokens, held
) -> None:
    # With SGLang's host tier (write-through: the host holds the device's KV too) what
    # the sessions grow to beyond the pool is loaded back, not recomputed: the gate fills
    # the host pool, not the device's.
    c = core()
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000, host_tokens=host_tokens)
    learn_peaks(c, [400, 400])
    run_turn(c, "a1", "a", 50, 1.0)
    run_turn(c, "b1", "b", 50, 1.0)
    v = c.request("c1", "c", E1, 50, 1.0)  # 1200 > 0.9 x 1000, <= 0.9 x 1400
    assert (v.held is Held.NEW_SESSION_FIT) is held
    assert (v.outcome is Outcome.NEW_ADMITTED) is not held


@pytest.mark.parametrize(
    ("policy", "held"),
    [
        (None, True),  # no write policy known: the host copies the device (max)
        ("write_through", True),  # max(1000, 1000) = 1000: 1200 > 900
        ("write_through_selective", True),
        ("write_back", False),  # the tiers add up: 1200 <= 0.9 x 2000
    ],
)
def test_under_write_back_the_growth_gate_fills_the_pool_and_the_host_together(
    policy, held
) -> None:
    # SGLang's write-back copies a node to the host only when the device evicts it, so
    # the host holds what the device does not; the write-through policies copy what
    # the device holds, so the larger tier bounds the room. Read from /server_info.
    c = core()
    c.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000, host_tokens=1000)
    info = {"enable_session_radix_cache": True, "enable_hierarchical_cache": policy is not None}
    if policy is not None:
        info["hicache_write_policy"] = policy
    mode = parse_server_info(E1, info)
    c.ledger.set_host_write_policy(E1, mode.hicache_write_policy)
    assert c.ledger.kv_room(E1) == (2000 if policy == "write_back" else 1000)
    (row,) = [r for r in c.engine_rows(0.0) if r["url"] == E1]  # what operators see
    assert (row["host_write_back"], row["kv_room"]) == (
        policy == "write_back",
        c.ledger.kv_room(E1),
    )
    learn_peaks(c, [400, 400])
    run_turn(c, "a1", "a", 50, 1.0)
    run_turn(c, "b1", "b", 50, 1.0)
    v = c.request("c1", "c", E1, 50, 1.0)
    assert (v.held is Held.NEW_SESSION_FIT) is held
    assert c.clear() == (["c1"] if held else [])
    assert c.ledger.kv_room(E1) == 0  # (capacity forgotten until the next scrape)
    c.ledger.observe_engine(E1, 3.0, max_total_num_tokens=1000, host_tokens=1000)
    assert c.ledger.kv_room(E1) == (2000 if policy == "write_back" else 1000)  # kept


def test_continuing_turns_are_never_held_by_the_growth_reservation() -> None:
    c = core()
    learn_peaks(c, [600, 600])
    run_turn(c, "a1", "a", 50, 1.0)
    assert c.request("b1", "b", E1, 50, 1.0).held is Held.NEW_SESSION_FIT  # 1200 > 900
    v = c.request("a2", "a", E1, 80, 2.0)
    assert v.outcome is Outcome.CONTINUING_FORWARDED


def test_an_empty_engine_takes_a_new_session_whatever_its_expected_growth() -> None:
    c = core()
    learn_peaks(c, [5000, 5000])  # more than the engine holds
    assert run_turn(c, "a1", "a", 50, 1.0).outcome is Outcome.NEW_ADMITTED
    assert c.request("b1", "b", E1, 50, 1.0).held is Held.NEW_SESSION_FIT


def test_idle_sessions_reservations_decay_like_their_footprints() -> None:
    c = core(dataclasses.replace(P, idle_lease_s=5.0, idle_half_life_s=10.0))
    learn_peaks(c, [500, 500])
    run_turn(c, "a1", "a", 50, 0.0)
    assert c.ledger.reserved(E1, 1.0) == pytest.approx(500)
    assert c.request("b1", "b", E1, 50, 1.0).held is Held.NEW_SESSION_FIT  # 1000 > 900
    b = c.ledger.get("b")
    assert b is not None
    # (judged by the ledger: on E1, with nothing in flight, the floor takes b1 at once)
    assert not c.ledger.fits_new(E1, b, 50, 6.0)  # a idle 6 s: 500 x 0.93 + 500 > 900
    assert c.ledger.reserved(E1, 15.0) == pytest.approx(250)  # idle 15 s: weight 0.5
    assert c.ledger.fits_new(E1, b, 50, 15.0)  # 250 + 500 <= 900


def test_growth_reservation_off_admits_on_the_current_footprint_only() -> None:
    c = core(dataclasses.replace(P, growth_reservation=False))
    learn_peaks(c, [600, 600])
    run_turn(c, "a1", "a", 50, 1.0)
    assert c.request("b1", "b", E1, 50, 1.0).outcome is Outcome.NEW_ADMITTED


def test_the_engines_context_length_is_the_prior_before_any_growth() -> None:
    c = core()
    c.ledger.set_context_length(E1, 500)
    run_turn(c, "a1", "a", 50, 0.0)  # (its first response: no growth seen yet)
    assert c.ledger.reserved(E1, 0.0) == 500
    assert c.request("b1", "b", E1, 50, 0.0).held is Held.NEW_SESSION_FIT  # 1000 > 900
    c.ledger.set_context_length(E1, 400)
    assert [r.ticket for r in c.drain(0.0)] == ["b1"]  # 800 <= 900


def test_context_length_survives_clear() -> None:
    c = core()
    c.ledger.set_context_length(E1, 500)
    c.clear()
    assert c.ledger.engines[E1].context_length == 500


def test_server_info_carries_the_context_length() -> None:
    assert parse_server_info("http://e", {"context_length": 40960}).context_length == 40960
    assert parse_server_info("http://e", {"context_length": "x"}).context_length is None
    assert parse_server_info("http://e", {}).context_length is None


# -- configuration -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("growth_target", 0, "admission.growth_target: must be in (0, 1]"),
        ("growth_quantile", 1.5, "admission.growth_quantile: must be in (0, 1]"),
        ("growth_window", 0, "admission.growth_window: must be >= 1"),
        ("growth_min_closed", -1, "admission.growth_min_closed: must be >= 0"),
        ("growth_horizon_turns", -2, "admission.growth_horizon_turns: must be >= 0"),
        ("growth_reservation", "yes", "admission.growth_reservation: must be true or false"),
    ],
)
def test_bad_growth_settings_are_rejected_by_name(key, value, needle) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        from_mapping({"admission": {"enabled": True, key: value}})


def test_growth_params_follow_the_config() -> None:
    cfg = AdmissionConfig(growth_reservation=False, growth_quantile=0.75, growth_window=32)
    p = ProgramParams.from_config(cfg)
    assert (p.growth_reservation, p.growth_quantile, p.growth_window) == (False, 0.75, 32)


def test_engine_rows_show_the_reserved_tokens() -> None:
    c = core()
    learn_peaks(c, [400, 400])
    run_turn(c, "a1", "a", 50, 1.0)
    (row,) = [r for r in c.engine_rows(1.0) if r["url"] == E1]
    assert (row["footprint"], row["reserved"]) == (50.0, 400.0)
