from dataclasses import dataclass

import pytest

from kvproxy.admission.ledger import (
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
