"""One conformance table for both admission modes' wait queues (pure): program mode's
per-engine Queues and fleet mode's FleetQueues. Each holds two lanes per engine in
arrival order, serves the first lane before the second, and skips a withdrawn entry
lazily (it never shows at a head again)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvproxy.admission.fleet.queue import CONTINUING, FLEET, NEW, FleetEntry, FleetQueues
from kvproxy.admission.program.events import Held
from kvproxy.admission.program.queues import Entry, Queues


@dataclass(frozen=True)
class Impl:
    """One implementation: a fresh queue, its engine, its lanes (served first, second)
    and how it builds an entry (ticket, arrival time)."""

    name: str
    make: Callable[[], Any]
    engine: str
    lanes: tuple[str, str]
    entry: Callable[[str, float], Any]


PROGRAM_ENGINE = "http://e:1"


def _program_entry(ticket: str, at: float) -> Entry:
    return Entry(ticket, "s-" + ticket, PROGRAM_ENGINE, 10, at, at + 30.0, Held.NEW_SESSION_FIT)


def _fleet_entry(ticket: str, at: float) -> FleetEntry:
    return FleetEntry(ticket, 10, at, "s-" + ticket)


IMPLS = [
    Impl("program", Queues, PROGRAM_ENGINE, ("paused", "new"), _program_entry),
    Impl("fleet", FleetQueues, FLEET, (CONTINUING, NEW), _fleet_entry),
]

# Steps: ("push", ticket, lane, at) | ("pop", lane, expected ticket) |
# ("remove", ticket, expected ticket or None). Lanes are 0 (served first) and 1.
# Then the state: live count, each lane's head, (first, second) live counts, the
# oldest entry, the heads in serving order, the live tickets.
CASES: list[tuple[str, list[tuple[Any, ...]], dict[str, Any]]] = [
    (
        "empty",
        [],
        {"len": 0, "heads": (None, None), "waiting": (0, 0), "oldest": None, "live": set()},
    ),
    (
        "a lane is first in, first out",
        [("push", "a", 1, 1.0), ("push", "b", 1, 2.0), ("pop", 1, "a")],
        {"len": 1, "heads": (None, "b"), "waiting": (0, 1), "oldest": "b", "live": {"b"}},
    ),
    (
        "lanes are apart; heads come first lane first",
        [("push", "a", 1, 1.0), ("push", "b", 0, 2.0), ("push", "c", 0, 3.0)],
        {
            "len": 3,
            "heads": ("b", "a"),
            "all_heads": ["b", "a"],
            "waiting": (2, 1),
            "oldest": "a",
            "live": {"a", "b", "c"},
        },
    ),
    (
        "a removed head is skipped",
        [("push", "a", 0, 1.0), ("push", "b", 0, 2.0), ("remove", "a", "a")],
        {"len": 1, "heads": ("b", None), "waiting": (1, 0), "oldest": "b", "live": {"b"}},
    ),
    (
        "a removed entry in the middle is skipped when its turn comes",
        [
            ("push", "a", 1, 1.0),
            ("push", "b", 1, 2.0),
            ("push", "c", 1, 3.0),
            ("remove", "b", "b"),
            ("pop", 1, "a"),
            ("pop", 1, "c"),
        ],
        {"len": 0, "heads": (None, None), "waiting": (0, 0), "oldest": None, "live": set()},
    ),
    (
        "removing an unknown or a removed ticket finds nothing",
        [("push", "a", 0, 1.0), ("remove", "a", "a"), ("remove", "a", None), ("remove", "x", None)],
        {"len": 0, "heads": (None, None), "waiting": (0, 0), "oldest": None, "live": set()},
    ),
    (
        "a popped ticket no longer waits",
        [("push", "a", 0, 1.0), ("pop", 0, "a"), ("remove", "a", None)],
        {"len": 0, "heads": (None, None), "waiting": (0, 0), "oldest": None, "live": set()},
    ),
    (
        "many withdrawn entries (compaction) keep the order of the rest",
        [("push", f"t{i:03}", 1, float(i)) for i in range(100)]
        + [("remove", f"t{i:03}", f"t{i:03}") for i in range(100) if i % 10]
        + [("pop", 1, "t000"), ("pop", 1, "t010")],
        {
            "len": 8,
            "heads": (None, "t020"),
            "waiting": (0, 8),
            "oldest": "t020",
            "live": {f"t{i:03}" for i in range(20, 100, 10)},
        },
    ),
]


def _ticket(entry: Any) -> str | None:
    return None if entry is None else str(entry.ticket)


@pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
@pytest.mark.parametrize(("steps", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_wait_queues_conformance(
    impl: Impl, steps: list[tuple[Any, ...]], want: dict[str, Any]
) -> None:
    q = impl.make()
    lanes = impl.lanes
    for step in steps:
        op = step[0]
        if op == "push":
            _, ticket, lane, at = step
            q.push(impl.entry(ticket, at), lanes[lane])
            assert ticket in q
        elif op == "pop":
            _, lane, expected = step
            assert _ticket(q.head(impl.engine, lanes[lane])) == expected  # pop takes the head
            assert q.pop(impl.engine, lanes[lane]).ticket == expected
        else:
            _, ticket, expected = step
            assert _ticket(q.remove(ticket)) == expected
            assert ticket not in q
    assert len(q) == want["len"]
    assert tuple(_ticket(q.head(impl.engine, lane)) for lane in lanes) == want["heads"]
    assert q.waiting(impl.engine) == want["waiting"]
    assert _ticket(q.oldest()) == want["oldest"]
    served = [h for h in want["heads"] if h is not None]
    assert [e.ticket for e in q.heads()] == want.get("all_heads", served)
    assert {e.ticket for e, _ in q.live()} == want["live"]
    assert all(lane in lanes for _, lane in q.live())
    assert all(e.live and e.engine == impl.engine for e in q.heads())
