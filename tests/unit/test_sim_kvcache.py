"""The simulator's KV pool and radix tree (pure, time injected)."""

from __future__ import annotations

import random

import pytest

from kvlab.sim.kvcache import KVCache
from tests.helpers import seq


def test_insert_then_match_counts_shared_prefix_and_splits() -> None:
    kv = KVCache(100)
    assert kv.alloc(10)
    already, _ = kv.insert(seq(0, 10), now=1.0)
    assert already == 0
    assert kv.evictable == 10
    m = kv.match_prefix([*seq(0, 4), 999], now=2.0)
    assert m.length == 4
    assert len(m.node.key) == 4  # the edge was split at the mismatch
    assert kv.num_nodes == 2
    kv.check_invariants()


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        (seq(0, 10), 10),
        (seq(0, 3), 3),
        ([*seq(0, 6), 50, 51], 6),
        ([7, 8, 9], 0),
        ([], 0),
    ],
)
def test_match_prefix_lengths(ids: list[int], expected: int) -> None:
    kv = KVCache(100)
    kv.alloc(10)
    kv.insert(seq(0, 10), now=0.0)
    assert kv.match_prefix(ids, now=1.0).length == expected
    kv.check_invariants()


def test_insert_reports_already_cached_tokens() -> None:
    kv = KVCache(100)
    kv.alloc(10)
    kv.insert(seq(0, 10), now=0.0)
    kv.alloc(15)
    already, node = kv.insert(seq(0, 15), now=1.0)
    assert already == 10
    kv.free(10)  # the caller frees its duplicate copy of the cached part
    assert len(node.key) == 5
    assert kv.tree_tokens == 15
    kv.check_invariants()


def _three_branches(policy: str, session_refs: bool = False) -> KVCache:
    """Branches A (t=1, prio 5), B (t=2, prio 0), C (t=3, prio 0), 10 tokens each."""
    kv = KVCache(100, eviction_policy=policy, session_refs=session_refs)
    for base, t, prio in ((100, 1.0, 5), (200, 2.0, 0), (300, 3.0, 0)):
        kv.alloc(10)
        kv.insert(seq(base, 10), now=t, priority=prio)
    return kv


def _evict_order(kv: KVCache) -> list[int]:
    order = []
    while kv.evictable:
        before = {c.key[0] for c in kv.root.children.values()}
        assert kv.evict(1) > 0
        after = {c.key[0] for c in kv.root.children.values()}
        order.extend(sorted(before - after))
    return order


@pytest.mark.parametrize(
    ("policy", "touch_a", "expected"),
    [
        ("lru", False, [100, 200, 300]),
        ("lru", True, [200, 300, 100]),  # A accessed last -> evicted last
        ("priority", False, [200, 300, 100]),  # lowest priority first, LRU within
        ("priority", True, [200, 300, 100]),
    ],
)
def test_eviction_order(policy: str, touch_a: bool, expected: list[int]) -> None:
    kv = _three_branches(policy)
    if touch_a:
        kv.match_prefix(seq(100, 10), now=4.0)
    assert _evict_order(kv) == expected
    assert kv.available == 100
    assert kv.evicted_total == 30
    kv.check_invariants()


def test_priority_is_max_of_requests_touching_node() -> None:
    kv = KVCache(100, eviction_policy="priority")
    kv.alloc(10)
    kv.insert(seq(0, 10), now=1.0, priority=0)
    kv.alloc(10)
    kv.insert(seq(100, 10), now=2.0, priority=1)
    kv.insert(seq(0, 10), now=3.0, priority=7)  # re-insert with a higher priority
    kv.insert(seq(0, 10), now=4.0, priority=2)  # lower priority does not lower it
    assert _evict_order(kv) == [100, 0]


def test_locked_nodes_are_not_evictable() -> None:
    kv = _three_branches("lru")
    node = kv.match_prefix(seq(100, 10), now=5.0).node
    kv.inc_lock(node)
    assert kv.evictable == 20 and kv.protected == 10
    assert kv.evict(100) == 20
    assert [c.key[0] for c in kv.root.children.values()] == [100]
    assert not kv.alloc(95)  # 90 free, the locked 10 cannot be evicted
    assert kv.available == 90
    kv.dec_lock(node)
    assert kv.evictable == 10 and kv.protected == 0
    assert kv.alloc(95)
    kv.check_invariants(private_tokens=95)


def test_only_leaves_are_evicted_parent_follows_child() -> None:
    kv = KVCache(100)
    kv.alloc(10)
    kv.insert(seq(0, 10), now=1.0)
    kv.alloc(5)
    kv.insert([*seq(0, 10), *seq(50, 5)], now=2.0)  # child of the first node, newer
    assert kv.evict(1) == 5  # the leaf goes first although its parent is older
    assert kv.tree_tokens == 10
    assert kv.evict(1) == 10
    kv.check_invariants()


def test_lock_protects_ancestors() -> None:
    kv = KVCache(100)
    kv.alloc(15)
    _, leaf = kv.insert(seq(0, 15), now=1.0)
    kv.match_prefix([*seq(0, 5), 77], now=2.0)  # splits the edge into 5 + 10
    kv.inc_lock(leaf)
    assert kv.protected == 15
    assert kv.evict(100) == 0
    kv.dec_lock(leaf)
    assert kv.evict(100) == 15
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "priority"])
def test_session_referenced_kv_outlives_unreferenced(policy: str) -> None:
    # A is older and tagged; B and C are newer and untagged: B and C go first.
    kv = _three_branches(policy, session_refs=True)
    a = kv.match_prefix(seq(100, 10), now=0.5).node
    kv.tag_session(a, "s1")
    assert _evict_order(kv)[:2] == [200, 300]


def test_release_session_makes_kv_ordinary_cache() -> None:
    kv = _three_branches("lru", session_refs=True)
    a = kv.match_prefix(seq(100, 10), now=0.5).node  # A is now the oldest
    kv.tag_session(a, "s1")
    assert kv.release_session("s1") == 1
    assert kv.release_session("s1") == 0  # idempotent
    assert kv.tree_tokens == 30  # dereferenced, not freed
    assert _evict_order(kv) == [100, 200, 300]


def test_session_tags_ignored_without_session_refs() -> None:
    kv = _three_branches("lru", session_refs=False)
    a = kv.match_prefix(seq(100, 10), now=0.5).node
    kv.tag_session(a, "s1")
    assert _evict_order(kv) == [100, 200, 300]


def test_session_tags_survive_split_and_eviction_bookkeeping() -> None:
    kv = KVCache(100, session_refs=True)
    kv.alloc(10)
    _, leaf = kv.insert(seq(0, 10), now=1.0)
    kv.tag_session(leaf, "s1")
    kv.match_prefix([*seq(0, 4), 99], now=2.0)  # split: both halves keep the tag
    assert kv.session_tokens("s1") == 10
    assert kv.referenced_evictable_tokens() == 10
    kv.evict(100)
    assert kv.session_tokens("s1") == 0
    assert kv.referenced_sessions() == []
    kv.check_invariants()


def test_reset_refuses_while_locked() -> None:
    kv = _three_branches("lru")
    node = kv.match_prefix(seq(100, 10), now=5.0).node
    kv.inc_lock(node)
    assert not kv.reset()
    kv.dec_lock(node)
    assert kv.reset()
    assert kv.available == 100 and kv.tree_tokens == 0


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(7)
    kv = KVCache(2_000, eviction_policy="priority", session_refs=True)
    locked: list = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    private = 0
    for step in range(1_500):
        op = rng.random()
        if op < 0.5:
            ids = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 60))]
            m = kv.match_prefix(ids, now=float(step))
            kv.inc_lock(m.node)
            need = len(ids) - m.length
            if not kv.alloc(need):
                kv.dec_lock(m.node)
                continue
            already, node = kv.insert(ids, now=float(step), priority=rng.randrange(3))
            kv.free(already - m.length)
            kv.inc_lock(node)
            kv.dec_lock(m.node)
            if rng.random() < 0.3:
                kv.tag_session(node, f"s{rng.randrange(5)}")
            locked.append(node)
        elif op < 0.85 and locked:
            kv.dec_lock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.95:
            kv.release_session(f"s{rng.randrange(5)}")
        else:
            n = rng.randint(1, 400)
            if kv.alloc(n):
                private += n
            if private and rng.random() < 0.5:
                kv.free(private)
                private = 0
        if step % 50 == 0:
            kv.check_invariants(private_tokens=private)
    kv.check_invariants(private_tokens=private)
    for node in locked:
        kv.dec_lock(node)
    kv.evict(10_000)
    assert kv.tree_tokens == 0
    assert kv.available + private == 2_000


def test_eviction_goes_on_when_a_deletion_rebuilds_the_heap() -> None:
    # Deleting a leaf pushes its parent once that is a leaf; the push rebuilds the heap as
    # a new list when stale entries pile up. Eviction must go on in the rebuilt heap:
    # stopping in the old one refused a request with the cache still evictable (an idle
    # engine then never scheduled again).
    kv = KVCache(100)
    for ids, t in ((seq(0, 10) + seq(100, 10), 1.0), (seq(0, 10) + seq(200, 10), 2.0)):
        assert kv.alloc(10 if t > 1.0 else 20)
        kv.insert(ids, now=t)
    assert kv.alloc(10)
    _, late = kv.insert(seq(300, 10), now=9.0)  # the last to go, stale entries piled on it
    while len(kv._heap) < 4 * kv.num_nodes + 1024:
        kv._push(late)
    assert (kv.available, kv.evictable) == (60, 40)
    assert kv.alloc(90)  # the branches under seq(0, 10), then their parent
    assert kv.evicted_total == 30
    kv.check_invariants(private_tokens=90)
