"""SGLang's hierarchical cache (HiCache) in the simulator: the host tier of the radix
tree (kvlab.sim.hicache) and the scheduler's load back, with a fake clock."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvlab.sim.config import CostModel, HiCacheConfig, SchedulerConfig, validate_hicache
from kvlab.sim.hicache import HiKVCache
from kvlab.sim.kvcache import KVCache
from kvlab.sim.prefill import load_overlapped_s
from kvlab.sim.presets import hicache_config, scheduler_config
from kvlab.sim.scheduler import Scheduler, SimRequest
from tests.helpers import seq
from tests.unit.test_sim_scheduler import Clock, drain, req


def hi_cache(pool: int, ratio: float = 2.0, policy: str = "write_through") -> HiKVCache:
    return HiKVCache(pool, HiCacheConfig(ratio=ratio, write_policy=policy))


def put(kv: KVCache, ids: list[int], now: float) -> None:
    """Insert ``ids`` as a finished request would: allocate the new part, hand it over."""
    m = kv.match_prefix(ids, now)
    new = len(ids) - m.length
    assert kv.alloc(new)
    already, node = kv.insert(ids, now)
    assert already == m.length
    kv.inc_lock(node)
    kv.dec_lock(node)


A, B, C = seq(1000, 40), seq(2000, 40), seq(3000, 40)


# ------------------------------------------------------------------ host tier


@pytest.mark.parametrize(
    ("policy", "backed_at_insert"),
    [("write_through", 40), ("write_through_selective", 0), ("write_back", 0)],
)
def test_write_policy_decides_when_a_node_is_backed_up(policy: str, backed_at_insert: int) -> None:
    kv = hi_cache(100, policy=policy)
    put(kv, A, 1.0)
    assert kv.host_used == backed_at_insert
    kv.match_prefix(A, 2.0)  # a second hit: write_through_selective backs up now
    assert kv.host_used == {"write_through": 40, "write_through_selective": 40}.get(policy, 0)
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_device_eviction_keeps_a_host_copy_and_the_match_reports_it(policy: str) -> None:
    kv = hi_cache(100, policy=policy)
    put(kv, A, 1.0)
    put(kv, B, 2.0)
    assert kv.evict(40) == 40  # A is the LRU leaf
    assert kv.available == 60 and kv.host_only == 40
    assert kv.evicted_total == 40
    m = kv.match_prefix(A, 3.0)
    assert (m.length, m.host_length) == (0, 40)
    assert m.host_node is not None and m.host_node.evicted
    # write_back copies at eviction and the scheduler charges that copy as a stall.
    assert (kv.stall_s > 0) == (policy == "write_back")
    kv.check_invariants()


def test_without_hicache_eviction_drops_the_node() -> None:
    kv = KVCache(100)
    put(kv, A, 1.0)
    put(kv, B, 2.0)
    kv.evict(40)
    m = kv.match_prefix(A, 3.0)
    assert (m.length, m.host_length, m.host_node) == (0, 0, None)


def test_host_lru_eviction_drops_the_oldest_host_only_node() -> None:
    # Device 50, host 100: A, B and C each pass through the device.
    kv = hi_cache(50, ratio=2.0)
    put(kv, A, 1.0)
    kv.evict(40)
    put(kv, B, 2.0)
    kv.evict(40)
    assert kv.host_used == 80 and kv.host_only == 80
    put(kv, C, 3.0)  # its write-through needs 40 of the 20 free: A (oldest) goes
    assert kv.host_evicted_total == 40
    assert kv.match_prefix(A, 4.0).host_length == 0
    assert kv.match_prefix(B, 4.0).host_length == 40
    kv.check_invariants()


def test_load_back_brings_the_host_part_back_evicting_for_room() -> None:
    kv = hi_cache(100)
    put(kv, [*A, *B], 1.0)
    put(kv, C, 2.0)  # needs 20 more slots: the 80-token A+B node goes to the host
    assert kv.host_only == 80
    m = kv.match_prefix([*A, *B], 3.0)
    assert (m.length, m.host_length) == (0, 80)
    kv.inc_lock(m.node)
    node = kv.load_back(m)
    assert node is m.host_node and node is not None and not node.evicted
    # 80 slots needed, 60 free: C went to the host to make room.
    assert kv.loaded_back_total == 80 and kv.host_only == 40
    assert kv.match_prefix([*A, *B], 4.0).length == 80
    kv.dec_lock(m.node)
    kv.check_invariants()


def test_load_back_skips_a_hit_under_the_threshold() -> None:
    kv = hi_cache(100)
    short = seq(5000, 9)  # SGLang's load_back_threshold is 10 tokens
    put(kv, short, 1.0)
    put(kv, A, 2.0)
    kv.evict(9)
    m = kv.match_prefix(short, 3.0)
    assert m.host_length == 9
    assert kv.load_back(m) is None
    # The recomputed KV takes the host-only node's place on insertion.
    put(kv, short, 4.0)
    assert kv.host_only == 0
    assert kv.match_prefix(short, 5.0).length == 9
    kv.check_invariants()


def test_a_split_host_only_node_keeps_both_halves_on_the_host() -> None:
    kv = hi_cache(100)
    put(kv, A, 1.0)
    put(kv, B, 2.0)
    kv.evict(40)
    m = kv.match_prefix([*A[:25], 7, 7], 3.0)  # splits A's host-only node at 25
    assert (m.length, m.host_length) == (0, 25)
    assert kv.host_only == 40 and kv.num_nodes == 3
    kv.check_invariants()


def test_flush_clears_the_host_tier() -> None:
    kv = hi_cache(100)
    put(kv, A, 1.0)
    put(kv, B, 2.0)
    kv.evict(40)
    assert kv.reset()
    assert (kv.host_used, kv.host_only, kv.num_nodes, kv.available) == (0, 0, 0, 100)


# ------------------------------------------------------------------- config


def test_host_size_from_ratio_or_gigabytes() -> None:
    h = HiCacheConfig(ratio=2.0)
    assert h.host_tokens(1000) == 2000
    gb = HiCacheConfig(size_gb=10, kv_bytes_per_token=147_456, token_scale=16)
    assert gb.host_tokens(1000) == round(int(10e9 // 147_456) / 16)
    assert hicache_config("qwen3-8b-h100", 16).load_back_threshold == 1
    assert hicache_config("qwen3-8b-h100").load_back_threshold == 10


def test_transfer_time_is_bytes_over_the_link_at_the_token_scale() -> None:
    h = hicache_config("qwen3-8b-h100", 16)
    assert h.transfer_s(1000) == pytest.approx(16_000 * 147_456 / 50e9)


@pytest.mark.parametrize(
    "change",
    [{"write_policy": "write_around"}, {"ratio": 0.0}, {"size_gb": -1}, {"num_layers": 0}],
)
def test_bad_hicache_config_is_rejected(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        validate_hicache(dataclasses.replace(HiCacheConfig(), **change))


# ---------------------------------------------------------------- scheduler

COST = CostModel(t0_prefill_s=0.005, tau_lin_s=30e-6, decode_a_s=0.01)


def two_sessions(hicache: HiCacheConfig | None) -> tuple[Scheduler, SimRequest]:
    """Session 1's turn, then session 2's turns push it out of a 300-token pool; then
    session 1's next turn (its prefix 200 tokens)."""
    s = Scheduler(SchedulerConfig(max_total_tokens=300, cost=COST, hicache=hicache))
    c = Clock()
    one = seq(10_000, 200)
    s.submit(req("1a", one, max_new=4), c.now)
    drain(s, c)
    s.submit(req("2a", seq(20_000, 250), max_new=4), c.now)
    drain(s, c)
    nxt = s.submit(req("1b", [*one, *seq(30_000, 20)], max_new=4), c.now)
    drain(s, c)
    return s, nxt


def test_flag_absent_the_scheduler_uses_the_plain_radix_cache() -> None:
    s = Scheduler(SchedulerConfig())
    assert s.hi is None and type(s.kv) is KVCache
    assert scheduler_config("qwen3-8b-h100", 16).hicache is None


def test_an_evicted_prefix_is_loaded_back_and_counted_as_cached() -> None:
    _, turn_off = two_sessions(None)
    on, turn_on = two_sessions(HiCacheConfig(ratio=4.0))
    assert turn_off.cached_tokens == 0  # recomputed
    assert turn_on.cached_tokens == 200 and turn_on.host_cached_tokens == 200
    assert on.stats.host_cached_tokens_total == 200
    assert on.hi is not None and on.hi.loaded_back_total == 200
    # Loading 200 tokens over the link is cheaper than recomputing them.
    assert turn_on.first_token_time is not None and turn_off.first_token_time is not None
    ttft_on = turn_on.first_token_time - turn_on.arrival
    ttft_off = turn_off.first_token_time - turn_off.arrival
    assert ttft_on < ttft_off


def test_load_overlaps_the_prefill_layer_by_layer() -> None:
    hc = HiCacheConfig(num_layers=4)
    assert load_overlapped_s(hc, 1.0, 0) == pytest.approx(1.0)
    load = hc.transfer_s(1_000_000)
    # Load-bound: the whole load plus the last layer's compute.
    assert load_overlapped_s(hc, 0.1, 1_000_000) == pytest.approx(load + 0.1 / 4)


def test_write_back_stall_is_charged_to_the_step() -> None:
    back, _ = two_sessions(HiCacheConfig(ratio=4.0, write_policy="write_back"))
    through, _ = two_sessions(HiCacheConfig(ratio=4.0))
    assert back.hi is not None and back.hi.backed_up_total > 0 and back.hi.stall_s == 0.0
    assert back.stats.busy_time_s > through.stats.busy_time_s


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_multi_turn_sessions_under_pressure_keep_every_counter_exact(
    policy: str, ratio: float
) -> None:
    """Twelve sessions of growing turns through a pool that holds about three: the
    step() helper checks the device and host accounting after every step."""
    from tests.unit.test_sim_scheduler import step

    hc = HiCacheConfig(ratio=ratio, write_policy=policy)
    s = Scheduler(
        SchedulerConfig(max_total_tokens=2_000, cost=COST, hicache=hc, mode="session-radix")
    )
    c = Clock()
    history = {i: seq(100_000 * (i + 1), 150) for i in range(12)}
    for turn in range(4):
        for i, ids in history.items():
            r = s.submit(req(f"{i}-{turn}", ids, max_new=20, session_id=f"s{i}"), c.now)
            for _ in range(3):  # a little overlap between sessions
                step(s, c)
            history[i] = [*ids, *seq(10_000_000 + 1000 * i + 100 * turn, 60)]
            assert r is not None
        drain(s, c)
    assert s.hi is not None
    s.check_invariants()
    assert s.kv.evicted_total > 0
    if ratio >= 2.0:
        assert s.hi.loaded_back_total > 0 and s.stats.host_cached_tokens_total > 0
