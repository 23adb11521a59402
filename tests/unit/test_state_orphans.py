"""The requests a replica gone had in flight (kvproxy.state.core's ``Orphans``), on the
pure memory store, as a table: the begin and end writes carry their rids, a sweep marks
a replica whose heartbeat is missing, and a later sweep at least ``grace_s`` after takes
its rids, each once; a replica that beats again in between keeps them. Time is each
operation's ``now``. The same operations run against Redis in
tests/integration/test_state_conformance.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvproxy.state.core import Begin, End, Heartbeat, MemoryStore, Op, Orphans

TTL = 60.0
HB = 1.0  # replica_ttl_s: a heartbeat lasts this long
GRACE = 1.0

Step = tuple[Callable[[], Op], Any]

SCENARIOS: dict[str, list[Step]] = {
    "a live replica's requests are never taken": [
        (lambda: Heartbeat("A", 0.0, 100.0), 0),
        (lambda: Begin("s", "A", 0.0, TTL, rids=("a1", "a2")), "open"),
        (lambda: Orphans(10.0, GRACE), []),
        (lambda: Orphans(20.0, GRACE), []),
    ],
    "a dead replica's requests: marked, then taken once after the grace": [
        (lambda: Heartbeat("A", 0.0, HB), 0),
        (lambda: Heartbeat("B", 0.0, 100.0), 0),
        (lambda: Begin("s", "A", 0.0, TTL, rids=("a1",)), "open"),
        (lambda: Begin("t", "A", 0.0, TTL, rids=("a2", "a3")), "open"),
        (lambda: Begin("s", "B", 0.0, TTL, rids=("b1",)), "open"),
        (lambda: End("t", "A", 0.1, TTL, rids=("a3",)), True),
        (lambda: Orphans(0.5, GRACE), []),  # A still beats
        (lambda: Orphans(1.5, GRACE), []),  # A gone: marked
        (lambda: Orphans(2.0, GRACE), []),  # within the grace
        (lambda: Orphans(2.5, GRACE), ["a1", "a2"]),  # (a3 ended; B's untouched)
        (lambda: Orphans(3.0, GRACE), []),  # each once
    ],
    "a replica that beats again within the grace keeps its requests": [
        (lambda: Heartbeat("A", 0.0, HB), 0),
        (lambda: Begin("s", "A", 0.0, TTL, rids=("a1",)), "open"),
        (lambda: Orphans(1.5, GRACE), []),  # marked
        (lambda: Heartbeat("A", 2.0, HB), 0),  # rejoined (the store came back)
        (lambda: Orphans(2.6, GRACE), []),  # unmarked
        (lambda: Orphans(3.5, GRACE), []),  # gone again: marked afresh
        (lambda: Orphans(4.4, GRACE), []),
        (lambda: Orphans(4.5, GRACE), ["a1"]),
    ],
    "the limit: the rest at the next sweep": [
        (lambda: Heartbeat("A", 0.0, HB), 0),
        (lambda: Begin("s", "A", 0.0, TTL, rids=("r3", "r1", "r2")), "open"),
        (lambda: Orphans(2.0, GRACE, limit=2), []),
        (lambda: Orphans(3.0, GRACE, limit=2), ["r1", "r2"]),
        (lambda: Orphans(3.1, GRACE, limit=2), ["r3"]),
        (lambda: Orphans(3.2, GRACE, limit=2), []),
    ],
    "rids expire with the replica's last write": [
        (lambda: Heartbeat("A", 0.0, HB), 0),
        (lambda: Begin("s", "A", 0.0, 5.0, rids=("a1",)), "open"),
        (lambda: Orphans(2.0, GRACE), []),
        (lambda: Orphans(6.0, GRACE), []),  # past the session TTL: nothing left
    ],
    "a request without rids records none": [
        (lambda: Heartbeat("A", 0.0, HB), 0),
        (lambda: Begin("s", "A", 0.0, TTL), "open"),
        (lambda: Orphans(2.0, GRACE), []),
        (lambda: Orphans(4.0, GRACE), []),
    ],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_orphans_table(name: str) -> None:
    mem = MemoryStore()
    for i, (make, expected) in enumerate(SCENARIOS[name]):
        op = make()
        assert mem.apply(op) == expected, f"step {i}: {op}"


def test_rids_recorded_per_replica_and_removed_at_end() -> None:
    mem = MemoryStore()
    mem.apply(Begin("s", "A", 0.0, TTL, rids=("x", "y")))
    mem.apply(Begin("s", "B", 0.0, TTL, rids=("z",)))
    assert mem.in_flight_rids("A", 0.0) == {"x": "s", "y": "s"}
    mem.apply(End("s", "A", 0.1, TTL, rids=("x",)))
    assert mem.in_flight_rids("A", 0.1) == {"y": "s"}
    assert mem.in_flight_rids("B", 0.1) == {"z": "s"}
    mem.apply(End("s", "A", 0.2, TTL, rids=("y",)))
    assert mem.in_flight_rids("A", 0.2) == {}
    assert mem.key_count(0.2) == 2  # the session and B's rids
