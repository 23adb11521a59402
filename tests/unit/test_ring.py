"""The consistent-hashing ring mirror (pure). Agreement with real smg is tested in
tests/integration/test_ring_smg.py."""

from __future__ import annotations

from collections import Counter

from kvproxy.fleet.ring import HashRing, position

URLS = ["http://127.0.0.1:31001", "http://127.0.0.1:31002", "http://127.0.0.1:31003"]


def test_position_is_blake3_first_eight_bytes_little_endian() -> None:
    import blake3

    digest = blake3.blake3(b"session-1").digest()
    assert position("session-1") == int.from_bytes(digest[:8], "little")


def test_owner_is_deterministic_and_one_of_the_urls() -> None:
    ring = HashRing(URLS)
    owners = {ring.owner(f"s{i}") for i in range(200)}
    assert owners <= set(URLS)
    assert [ring.owner(f"s{i}") for i in range(50)] == [ring.owner(f"s{i}") for i in range(50)]


def test_keys_spread_over_every_worker() -> None:
    ring = HashRing(URLS)
    counts = Counter(ring.owner(f"key-{i}") for i in range(3000))
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 600  # 150 virtual nodes: no worker far below 1/3


def test_unavailable_owner_moves_keys_clockwise_only_from_that_worker() -> None:
    ring = HashRing(URLS)
    keys = [f"k{i}" for i in range(500)]
    before = {k: ring.owner(k) for k in keys}
    down = URLS[1]
    after = {k: ring.owner(k, available=[URLS[0], URLS[2]]) for k in keys}
    for k in keys:
        if before[k] != down:
            assert after[k] == before[k]  # keys of healthy workers never move
        else:
            assert after[k] in (URLS[0], URLS[2])


def test_no_available_worker_or_empty_ring_gives_none() -> None:
    assert HashRing([]).owner("x") is None
    assert HashRing(URLS).owner("x", available=[]) is None


def test_duplicate_urls_count_once() -> None:
    assert HashRing(URLS + URLS[:1]).urls == tuple(URLS)
    assert HashRing(URLS + URLS[:1]).owner("abc") == HashRing(URLS).owner("abc")
