from dataclasses import dataclass

import pytest

from kvproxy.admission.fleet.ledger import (
    CAPACITY_AVAILABLE,
    CAPACITY_EXHAUSTED,
    DEGRADED,
    OVERSIZED,
    PRESSURE_GUARD,
    Ledger,
)
from kvproxy.fleet.engine_metrics import parse_engine_metrics

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def make(
    engines: dict[str, tuple[int, float]] | None = None,
    *,
    now: float = 0.0,
    headroom: float = 1.0,
    pressure_threshold: float = 0.9,
    lease_ttl_s: float = 600.0,
    staleness_s: float = 6.0,
) -> Ledger:
    led = Ledger(
        headroom=headroom,
        pressure_threshold=pressure_threshold,
        lease_ttl_s=lease_ttl_s,
        staleness_s=staleness_s,
    )
    feed(led, engines or {A: (100, 0.1)}, now)
    return led


def feed(led: Ledger, engines: dict[str, tuple[int, float]], now: float) -> None:
    led.retain(list(engines))
    for url, (cap, usage) in engines.items():
        led.observe(url, now=now, max_total_num_tokens=cap, token_usage=usage)
    led.reconcile(now)


def test_reserve_release_exhaust() -> None:
    led = make()
    assert led.epoch == 1 and led.ceiling == 100
    g = led.reserve("request-1:0", 60, now=1.0)
    assert (g.granted, g.reason, g.lease_id, g.tokens) == (
        True,
        CAPACITY_AVAILABLE,
        "1:request-1:0",
        60,
    )
    refused = led.reserve("request-2:0", 41, now=1.0)
    assert (refused.granted, refused.reason, refused.lease_id) == (False, CAPACITY_EXHAUSTED, None)
    assert led.reserve("request-3:0", 40, now=1.0).granted
    assert led.reserved == 100
    assert led.release("1:request-1:0") is not None
    assert led.reserved == 40
    assert led.reserve("request-2:0", 41, now=1.0).granted
    assert led.lease_count == 2


def test_reserve_is_idempotent_per_ticket() -> None:
    led = make()
    first = led.reserve("t:0", 30, now=0.0)
    # A retried acquire with another size returns the same lease, no second charge.
    again = led.reserve("t:0", 90, now=0.5)
    assert again.granted and again.lease_id == first.lease_id and again.tokens == 30
    assert led.reserved == 30 and led.lease_count == 1


def test_double_release_is_noop() -> None:
    led = make()
    lease_id = led.reserve("t:0", 30, now=0.0).lease_id
    assert lease_id is not None
    assert led.release(lease_id) is not None
    assert led.release(lease_id) is None
    assert led.release("unknown") is None
    assert led.release_ticket("t:0") is None
    assert led.reserved == 0 and led.lease_count == 0


@pytest.mark.parametrize(
    ("usages", "tokens", "reserved_first", "expected"),
    [
        ((0.5,), 10, 0, CAPACITY_AVAILABLE),
        ((0.95,), 10, 0, PRESSURE_GUARD),
        ((0.9,), 10, 0, PRESSURE_GUARD),  # at the threshold refuses
        ((0.89, 0.91), 10, 0, PRESSURE_GUARD),  # the worst engine decides
        ((0.5, 0.5), 201, 0, OVERSIZED),  # larger than the whole ceiling (200)
        ((0.95,), 150, 0, OVERSIZED),  # oversized wins over pressure
        ((0.5, 0.5), 150, 100, CAPACITY_EXHAUSTED),
        ((0.5, 0.5), 100, 100, CAPACITY_AVAILABLE),  # reserved + tokens == ceiling fits
    ],
)
def test_decision_table(
    usages: tuple[float, ...], tokens: int, reserved_first: int, expected: str
) -> None:
    engines = {f"http://e{i}:1": (100, u) for i, u in enumerate(usages)}
    led = make(engines)
    if reserved_first:
        assert led.reserve("first", reserved_first, now=0.0).granted
    g = led.reserve("t", tokens, now=0.0)
    assert g.reason == expected
    assert g.granted == (expected == CAPACITY_AVAILABLE)


def test_headroom_ceiling_and_reconfigure() -> None:
    led = make({A: (1000, 0.1), B: (501, 0.1)}, headroom=0.9)
    assert led.ceiling == int(1501 * 0.9)
    led.configure(headroom=0.5, pressure_threshold=0.05, lease_ttl_s=600.0, staleness_s=6.0)
    assert led.reserve("t", 10, now=0.0).reason == PRESSURE_GUARD
    assert led.ceiling == 750


def test_ttl_expiry_frees_reserved_oldest_first() -> None:
    led = make(lease_ttl_s=10.0)
    led.reserve("old", 30, now=0.0)
    led.reserve("young", 20, now=5.0)
    assert led.expire(now=10.0) == ()
    expired = led.expire(now=10.5)
    assert [lease.ticket_id for lease in expired] == ["old"]
    assert led.reserved == 20 and led.lease_for_ticket("old") is None
    assert [lease.ticket_id for lease in led.expire(now=16.0)] == ["young"]
    assert led.reserved == 0


def test_stale_reading_degrades() -> None:
    led = make(staleness_s=6.0, now=0.0)
    assert not led.is_degraded(6.0)
    assert led.reserve("t", 10, now=6.0).granted
    g = led.reserve("u", 10, now=6.01)
    assert (g.granted, g.reason) == (False, DEGRADED)
    # The lease held from before is untouched by staleness.
    assert led.reserved == 10


def test_never_observed_is_degraded() -> None:
    led = Ledger()
    assert led.is_degraded(0.0)
    assert led.reserve("t", 1, now=0.0).reason == DEGRADED
    assert led.snapshot(0.0)["agentic_kv/budget/degraded"] == 1.0


def test_one_stale_engine_is_left_out_others_keep_admitting() -> None:
    led = make({A: (100, 0.1), B: (100, 0.95)}, now=0.0, staleness_s=6.0)
    assert led.ceiling == 200 and led.reserve("x", 10, now=0.0).reason == PRESSURE_GUARD
    # Only A reports from now on; B's reading (the pressured one) ages out.
    led.observe(A, now=5.0, token_usage=0.2)
    led.reconcile(5.0)
    assert led.ceiling == 200
    g = led.reserve("y", 10, now=6.5)
    assert g.granted
    assert led.ceiling == 100 and led.fresh_count == 1 and not led.is_degraded(6.5)
    assert led.snapshot(6.5)["agentic_kv/budget/engines_stale"] == 1.0


def test_max_total_cached_and_freshness_judged_on_usage() -> None:
    led = Ledger(headroom=1.0, staleness_s=6.0)
    # max_total emitted once (first scrape), later scrapes carry only usage.
    assert led.observe(A, now=0.0, max_total_num_tokens=400, token_usage=0.1)
    assert led.observe(A, now=5.0, token_usage=0.3)
    # A scrape with the constant but no changing gauge does not refresh the engine.
    assert not led.observe(A, now=10.0, max_total_num_tokens=400)
    led.reconcile(10.0)
    assert led.ceiling == 400 and led.pressure == 0.3
    assert led.is_degraded(11.01)
    # num_used_tokens over the cached capacity is a usage too.
    assert led.observe(A, now=12.0, num_used_tokens=200)
    led.reconcile(12.0)
    assert led.pressure == 0.5


def test_usage_without_any_capacity_is_not_fresh() -> None:
    led = Ledger()
    assert not led.observe(A, now=0.0, token_usage=0.5)
    led.reconcile(0.0)
    assert led.is_degraded(0.0)


def test_epoch_bumps_on_set_change_and_leases_survive() -> None:
    led = make({A: (100, 0.1)}, now=0.0)
    assert led.epoch == 1
    lease = led.reserve("t:0", 80, now=0.0)
    assert lease.lease_id == "1:t:0"
    feed(led, {A: (100, 0.1)}, now=1.0)
    assert led.epoch == 1  # same set, no bump
    feed(led, {A: (100, 0.1), B: (100, 0.1)}, now=2.0)
    assert led.epoch == 2 and led.ceiling == 200
    assert led.reserve("u:0", 10, now=2.0).lease_id == "2:u:0"
    feed(led, {B: (100, 0.1)}, now=3.0)  # A left the fleet
    assert led.epoch == 3 and led.ceiling == 100
    # Leases from before the change are kept: reserved may exceed the new ceiling.
    assert led.reserved == 90 and led.lease_for_ticket("t:0") is not None
    assert led.reserve("v:0", 20, now=3.0).reason == CAPACITY_EXHAUSTED
    assert led.release("1:t:0") is not None and led.reserved == 10


def test_epoch_bumps_when_an_engine_goes_stale_without_a_poll() -> None:
    led = make({A: (100, 0.1), B: (100, 0.1)}, now=0.0, staleness_s=6.0)
    led.observe(A, now=5.0, token_usage=0.1)
    led.reconcile(5.0)
    assert led.epoch == 1
    led.refresh(7.0)  # B's reading (t=0) aged out; no poll happened
    assert led.epoch == 2 and led.fresh_count == 1


def test_usage_window_mean_peak_and_reset() -> None:
    led = make({A: (100, 0.2), B: (100, 0.4)}, now=0.0)  # sample 1: mean 0.3, max 0.4
    feed(led, {A: (100, 0.9), B: (100, 0.5)}, now=1.0)  # sample 2: mean 0.7, max 0.9
    feed(led, {A: (100, 0.1), B: (100, 0.1)}, now=2.0)  # sample 3: mean 0.1, max 0.1
    snap = led.snapshot(2.0, reset_usage_window=True)
    assert snap["agentic_kv/budget/kv_token_usage_mean"] == pytest.approx((0.3 + 0.7 + 0.1) / 3)
    assert snap["agentic_kv/budget/kv_token_usage_max"] == pytest.approx(0.9)
    # After the reset the window restarts at the current level, not at zero.
    snap = led.snapshot(2.0)
    assert snap["agentic_kv/budget/kv_token_usage_mean"] == pytest.approx(0.1)
    assert snap["agentic_kv/budget/kv_token_usage_max"] == pytest.approx(0.1)
    feed(led, {A: (100, 0.3), B: (100, 0.5)}, now=3.0)
    snap = led.snapshot(3.0)
    assert snap["agentic_kv/budget/kv_token_usage_mean"] == pytest.approx(0.4)
    assert snap["agentic_kv/budget/kv_token_usage_max"] == pytest.approx(0.5)


def test_snapshot_keys_and_values() -> None:
    led = make({A: (1000, 0.25)}, headroom=0.9)
    led.reserve("t", 300, now=0.0)
    snap = led.snapshot(0.0)
    assert snap == {
        "agentic_kv/budget/ceiling": 900.0,
        "agentic_kv/budget/reserved": 300.0,
        "agentic_kv/budget/resident": 0.0,
        "agentic_kv/budget/resident_sessions": 0.0,
        "agentic_kv/budget/committed": 300.0,
        "agentic_kv/budget/available_tokens": 600.0,
        "agentic_kv/budget/reserved_utilization": pytest.approx(1 / 3),
        "agentic_kv/budget/lease_count": 1.0,
        "agentic_kv/budget/kv_token_usage_mean": 0.25,
        "agentic_kv/budget/kv_token_usage_max": 0.25,
        "agentic_kv/budget/epoch": 1.0,
        "agentic_kv/budget/degraded": 0.0,
        "agentic_kv/budget/engines_fresh": 1.0,
        "agentic_kv/budget/engines_stale": 0.0,
    }
    assert "agentic_kv/budget/reserved_utilization" not in Ledger().snapshot(0.0)


@dataclass
class _Rank:
    tp: int
    usage: float


def test_max_aggregation_across_tp_rank_feeds_the_ledger() -> None:
    # TP4 engine: every rank reports the same per-engine values. A summing parser would
    # read capacity x4 and usage / 4; the ledger must see 1000 tokens and 0.92.
    lines = []
    for r in [_Rank(0, 0.92), _Rank(1, 0.92), _Rank(2, 0.92), _Rank(3, 0.92)]:
        lines.append(f'sglang:token_usage{{model_name="m",tp_rank="{r.tp}"}} {r.usage}')
        lines.append(f'sglang:max_total_num_tokens{{model_name="m",tp_rank="{r.tp}"}} 1000')
    m = parse_engine_metrics("\n".join(lines))
    led = Ledger(headroom=1.0, pressure_threshold=0.92)
    led.observe(A, now=0.0, max_total_num_tokens=m.max_total_num_tokens, token_usage=m.token_usage)
    led.reconcile(0.0)
    assert led.ceiling == 1000
    assert led.reserve("t", 1, now=0.0).reason == PRESSURE_GUARD


def test_retain_forgets_engines_and_clear_degrades() -> None:
    led = make({A: (100, 0.1), B: (100, 0.1)})
    led.retain([B])
    led.refresh(0.0)
    assert led.ceiling == 100 and [e.url for e in led.engines(0.0)] == [B]
    led.clear_engines()
    assert led.is_degraded(0.0) and led.ceiling == 0


# -- session residency (program-aware mode) ------------------------------------------


def test_release_makes_session_resident_with_full_tokens() -> None:
    led = make({A: (1000, 0.1)})
    g = led.reserve("s1:t1", 300, now=1.0, session_id="s1")
    assert (g.granted, g.tokens, g.charged) == (True, 300, 300)
    assert led.lease_for_ticket("s1:t1").session_id == "s1"  # type: ignore[union-attr]
    assert not led.is_resident("s1") and led.committed == 300
    led.release(g.lease_id or "", now=2.0)
    assert led.is_resident("s1") and led.resident_tokens("s1") == 300
    assert (led.reserved, led.resident_total, led.committed) == (0, 300, 300)
    # Residency keeps the max of the turns' full tokens.
    g2 = led.reserve("s1:t2", 200, now=3.0, session_id="s1")
    assert (g2.tokens, g2.charged) == (200, 0)
    led.release(g2.lease_id or "", now=4.0)
    assert led.resident_tokens("s1") == 300


def test_resident_turn_charges_growth_and_is_admitted_over_the_ceiling() -> None:
    led = make({A: (1000, 0.1)})
    for sid, n in (("s1", 600), ("s2", 300)):
        led.release(led.reserve(f"{sid}:t", n, now=0.0, session_id=sid).lease_id or "", now=0.0)
    # A new session fills the rest: committed == ceiling.
    assert led.reserve("s3:t", 100, now=0.0, session_id="s3").granted
    assert led.committed == 1000
    # s1's next turn grows by 150: over the ceiling, admitted anyway, charged the growth.
    g = led.reserve("s1:t2", 750, now=1.0, session_id="s1")
    assert (g.granted, g.reason, g.tokens, g.charged) == (True, CAPACITY_AVAILABLE, 750, 150)
    assert led.committed == 1150 and led.reserved == 250
    # A new session waits on committed + tokens > ceiling; so does work without a session.
    assert led.reserve("s4:t", 1, now=1.0, session_id="s4").reason == CAPACITY_EXHAUSTED
    assert led.reserve("anon", 1, now=1.0).reason == CAPACITY_EXHAUSTED
    # A resident turn larger than the whole ceiling is not oversized.
    assert led.reserve("s2:t2", 5000, now=1.0, session_id="s2").granted
    led.release_ticket("s1:t2", now=2.0)
    assert led.resident_tokens("s1") == 750


@pytest.mark.parametrize(
    ("engines", "sid", "resident", "expected"),
    [
        ({A: (1000, 0.1)}, "s1", True, CAPACITY_AVAILABLE),
        ({A: (1000, 0.95)}, "s1", True, PRESSURE_GUARD),
        ({A: (1000, 0.1)}, "new", False, CAPACITY_EXHAUSTED),
        ({A: (1000, 0.95)}, "new", False, PRESSURE_GUARD),
        ({A: (5000, 0.1)}, "new", False, CAPACITY_AVAILABLE),
    ],
)
def test_residency_decision_table(
    engines: dict[str, tuple[int, float]], sid: str, resident: bool, expected: str
) -> None:
    led = make({A: (1000, 0.1)})
    led.release(led.reserve("s1:t", 900, now=0.0, session_id="s1").lease_id or "", now=0.0)
    feed(led, engines, 1.0)
    assert led.is_resident(sid) is resident
    assert led.check(200, 1.0, sid) == expected
    assert led.reserve(f"{sid}:x", 200, now=1.0, session_id=sid).reason == expected


def test_degraded_applies_to_resident_sessions() -> None:
    led = make({A: (1000, 0.1)})
    led.release(led.reserve("s1:t", 100, now=0.0, session_id="s1").lease_id or "", now=0.0)
    assert led.reserve("s1:t2", 100, now=100.0, session_id="s1").reason == DEGRADED


def test_end_session_frees_room_and_is_idempotent() -> None:
    led = make({A: (1000, 0.1)})
    led.release(led.reserve("s1:t", 900, now=0.0, session_id="s1").lease_id or "", now=0.0)
    assert led.reserve("s2:t", 200, now=0.0, session_id="s2").reason == CAPACITY_EXHAUSTED
    assert led.end_session("s1") is True
    assert led.end_session("s1") is False and led.end_session("never") is False
    assert (led.resident_total, led.resident_sessions) == (0, 0)
    assert led.reserve("s2:t", 200, now=0.0, session_id="s2").granted


def test_end_session_while_a_turn_runs_adds_no_residency_on_release() -> None:
    led = make({A: (1000, 0.1)})
    g = led.reserve("s1:t", 100, now=0.0, session_id="s1")
    led.end_session("s1")
    led.release(g.lease_id or "", now=1.0)
    assert not led.is_resident("s1") and led.committed == 0


def test_idle_expiry_drops_only_idle_sessions_without_live_leases() -> None:
    led = make({A: (1000, 0.1)}, staleness_s=1000.0)
    for sid, t in (("old", 0.0), ("busy", 1.0), ("young", 50.0)):
        led.release(led.reserve(f"{sid}:1", 100, now=t, session_id=sid).lease_id or "", now=t)
    assert led.reserve("busy:2", 100, now=51.0, session_id="busy").granted  # in flight
    assert led.expire_sessions(now=60.0, idle_s=30.0) == ("old",)
    assert led.is_resident("busy") and led.is_resident("young")
    assert led.residency_expired == 1 and led.resident_total == 200
    # A touch (a request arriving) keeps a session from expiring.
    led.touch("young", 80.0)
    assert led.expire_sessions(now=100.0, idle_s=30.0) == ()
    assert led.expire_sessions(now=111.0, idle_s=30.0) == ("young",)


def test_resident_table_is_bounded_least_recently_active_idle_first() -> None:
    led = make({A: (10_000, 0.1)})
    led.max_resident_sessions = 2
    led.release(led.reserve("a:1", 10, now=0.0, session_id="a").lease_id or "", now=0.0)
    led.release(led.reserve("b:1", 10, now=1.0, session_id="b").lease_id or "", now=1.0)
    led.reserve("a:2", 10, now=2.0, session_id="a")  # a is busy: not evictable
    led.release(led.reserve("c:1", 10, now=3.0, session_id="c").lease_id or "", now=3.0)
    assert (led.is_resident("a"), led.is_resident("b"), led.is_resident("c")) == (
        True,
        False,
        True,
    )
    assert led.residency_evicted == 1 and led.resident_total == 20


def test_lease_ttl_expiry_adds_no_residency() -> None:
    led = make({A: (1000, 0.1)}, lease_ttl_s=10.0, staleness_s=100.0)
    led.reserve("s1:t", 300, now=0.0, session_id="s1")
    assert [lease.ticket_id for lease in led.expire(11.0)] == ["s1:t"]
    assert not led.is_resident("s1") and led.committed == 0
    # A resident session's expired turn keeps its old residency, not the expired size.
    led.release(led.reserve("s2:t1", 100, now=20.0, session_id="s2").lease_id or "", now=20.0)
    led.reserve("s2:t2", 500, now=21.0, session_id="s2")
    led.expire(32.0)
    assert led.resident_tokens("s2") == 100 and led.reserved == 0
    # It is idle since its last real activity.
    assert led.expire_sessions(now=32.0, idle_s=11.0) == ("s2",)


def test_residency_off_is_per_request() -> None:
    led = make({A: (1000, 0.1)})
    led.configure(headroom=1.0, pressure_threshold=0.9, lease_ttl_s=600, staleness_s=6.0)
    led.release(led.reserve("s1:t", 900, now=0.0, session_id="s1").lease_id or "", now=0.0)
    led.configure(
        headroom=1.0,
        pressure_threshold=0.9,
        lease_ttl_s=600,
        staleness_s=6.0,
        session_residency=False,
    )
    assert led.resident_total == 0 and not led.is_resident("s1")
    g = led.reserve("s1:t2", 900, now=0.0, session_id="s1")
    assert g.charged == 900 and led.lease_for_ticket("s1:t2").session_id is None  # type: ignore[union-attr]
    led.release(g.lease_id or "", now=1.0)
    assert led.committed == 0


def test_residency_metrics() -> None:
    led = make({A: (1000, 0.1)})
    led.release(led.reserve("s1:t", 400, now=0.0, session_id="s1").lease_id or "", now=0.0)
    led.reserve("s2:t", 100, now=0.0, session_id="s2")
    snap = led.snapshot(0.0)
    assert snap["agentic_kv/budget/reserved"] == 100.0
    assert snap["agentic_kv/budget/resident"] == 400.0
    assert snap["agentic_kv/budget/resident_sessions"] == 1.0
    assert snap["agentic_kv/budget/committed"] == 500.0
    assert snap["agentic_kv/budget/available_tokens"] == 500.0
    assert snap["agentic_kv/budget/reserved_utilization"] == pytest.approx(0.5)


def test_note_unleased_turn_sets_residency_as_a_release_would() -> None:
    led = make({A: (1000, 0.1)})
    led.note_unleased_turn("s1", 300, now=1.0)
    led.note_unleased_turn("s1", 200, now=2.0)
    assert led.resident_tokens("s1") == 300 and led.committed == 300
    assert led.expire_sessions(now=5.0, idle_s=2.5) == ("s1",)
    led.configure(
        headroom=1.0,
        pressure_threshold=0.9,
        lease_ttl_s=600,
        staleness_s=6.0,
        session_residency=False,
    )
    led.note_unleased_turn("s2", 300, now=6.0)
    assert not led.is_resident("s2")
