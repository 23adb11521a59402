"""Ledger (request) mode's pure decisions (kvproxy.admission.fleet.queue), table-tested
over a real fleet ledger with injected time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvproxy.admission.catalogue import COUNTERS
from kvproxy.admission.fleet.ledger import Ledger
from kvproxy.admission.fleet.queue import CONTINUING, FLEET, NEW, FleetAdmission, FleetEntry
from kvproxy.admission.records import Action, Decision, Reason
from kvproxy.admission.report import WaitHistogram
from kvproxy.observability import WindowedCounters

A = "agentic_kv/admission/"
ENGINE = "http://e:1"


@dataclass
class Env:
    fleet: FleetAdmission
    ledger: Ledger
    counters: WindowedCounters
    waits: WaitHistogram
    usage: float

    def counted(self) -> dict[str, float]:
        """The counters that moved, short names (``admission/`` prefix dropped)."""
        items = self.counters.total_items().items()
        return {k.removeprefix(A): v for k, v in items if v}


def make(
    *, capacity: int | None = 1000, usage: float = 0.1, max_wait_s: float = 5.0, max_queue: int = 10
) -> Env:
    ledger = Ledger(headroom=1.0, pressure_threshold=0.9, staleness_s=60.0)
    if capacity is not None:
        ledger.observe(ENGINE, now=0.0, max_total_num_tokens=capacity, token_usage=usage)
    counters = WindowedCounters(COUNTERS)
    waits = WaitHistogram()
    fleet = FleetAdmission(ledger, counters, waits, max_wait_s=max_wait_s, max_queue=max_queue)
    return Env(fleet, ledger, counters, waits, usage)


def resident(env: Env, sid: str, tokens: int) -> None:
    """Make ``sid`` a resident session holding ``tokens`` between its turns (its turn
    ran before the pressure, if any, set in)."""
    env.ledger.observe(ENGINE, now=0.0, token_usage=0.1)
    grant = env.ledger.reserve("setup-" + sid, tokens, 0.0, sid)
    assert grant.granted and grant.lease_id is not None
    env.ledger.release(grant.lease_id, 0.0)
    env.ledger.observe(ENGINE, now=0.0, token_usage=env.usage)
    assert env.ledger.is_resident(sid)


def hold(env: Env, tokens: int) -> str:
    """A lease of ``tokens`` taken outside the FIFOs (another request running)."""
    grant = env.ledger.reserve("holder", tokens, 0.0)
    assert grant.granted and grant.lease_id is not None
    return grant.lease_id


def enqueue(env: Env, ticket: str, tokens: int, now: float, sid: str | None = None) -> FleetEntry:
    out = env.fleet.offer(ticket, tokens, now, sid, env.ledger.is_resident(sid))
    assert isinstance(out, FleetEntry), out
    return out


def summary(out: Decision | FleetEntry) -> tuple[str, str]:
    if isinstance(out, FleetEntry):
        return ("wait", CONTINUING if out.session and out.session.startswith("r") else NEW)
    return (out.action, out.reason)


# -- offer: the decision on arrival ------------------------------------------------------

OFFERS: list[
    tuple[str, dict[str, Any], str, tuple[Any, ...], tuple[str, str], dict[str, float]]
] = [
    # (name, make(...), setup, (tokens, sid), (action | "wait", reason | lane), counters)
    ("fits: a lease at once", {}, "", (100, "s"), ("admit", "capacity_available"), {"admit": 1}),
    (
        "no fresh engine: degraded, fail open",
        {"capacity": None},
        "",
        (100, "s"),
        ("bypass", "degraded"),
        {"bypass": 1, "bypass_degraded": 1},
    ),
    (
        "larger than the whole ceiling: oversized at once",
        {},
        "",
        (1001, "s"),
        ("bypass", "oversized"),
        {"bypass": 1, "bypass_oversized": 1},
    ),
    (
        "a new session that does not fit waits in the new FIFO",
        {},
        "hold",
        (100, "s"),
        ("wait", NEW),
        {"wait": 1, "wait_new_session": 1},
    ),
    (
        "a request without a session waits too, not counted as a new session",
        {},
        "hold",
        (100, None),
        ("wait", NEW),
        {"wait": 1},
    ),
    (
        "a resident session is not held for capacity",
        {},
        "hold+resident",
        (400, "r"),
        ("admit", "capacity_available"),
        {"admit": 1},
    ),
    (
        "a resident session under the pressure guard waits in the continuing FIFO",
        {"usage": 0.95},
        "resident",
        (10, "r"),
        ("wait", CONTINUING),
        {"wait": 1, "wait_continuing": 1},
    ),
    (
        "someone ahead in its FIFO: it waits even though it fits",
        {},
        "hold+waiter",
        (10, "s"),
        ("wait", NEW),
        {"wait": 2, "wait_new_session": 2},
    ),
    (
        "a continuing request never waits behind a new one",
        {},
        "hold+waiter+resident",
        (10, "r"),
        ("admit", "capacity_available"),
        {"admit": 1, "wait": 1, "wait_new_session": 1},
    ),
    (
        "the FIFOs hold max_queue waiters: queue_full, fail open",
        {"max_queue": 1},
        "hold+waiter",
        (10, "s"),
        ("bypass", "queue_full"),
        {"bypass": 1, "bypass_queue_full": 1, "wait": 1, "wait_new_session": 1},
    ),
]


@pytest.mark.parametrize(
    ("kw", "setup", "request_", "want", "counted"),
    [o[1:] for o in OFFERS],
    ids=[o[0] for o in OFFERS],
)
def test_offer(
    kw: dict[str, Any],
    setup: str,
    request_: tuple[Any, ...],
    want: tuple[str, str],
    counted: dict[str, float],
) -> None:
    env = make(**kw)
    if "resident" in setup:
        resident(env, "r", 300)
    if "hold" in setup:
        hold(env, 950 - env.ledger.resident_total)
    if "waiter" in setup:
        enqueue(env, "ahead", 100, 0.5, "w")
    tokens, sid = request_
    out = env.fleet.offer("t", tokens, 1.0, sid, env.ledger.is_resident(sid))
    assert summary(out) == want
    assert env.counted() == counted
    if isinstance(out, FleetEntry):
        assert "t" in env.fleet.queues and out.enqueued_at == 1.0
    else:
        assert "t" not in env.fleet.queues


# -- drain: heads leave while the ledger admits them ----------------------------------------


def never(_: str) -> bool:
    return False


def test_a_head_that_fits_now_is_granted_with_its_wait() -> None:
    env = make()
    lease = hold(env, 950)
    enqueue(env, "a", 100, 1.0, "s")
    assert env.fleet.drain(2.0, never) == []  # still refused
    env.ledger.release(lease, 2.5)
    [(entry, decision)] = env.fleet.drain(3.0, never)
    assert entry.ticket == "a" and decision is not None
    assert (decision.action, decision.reason, decision.tokens, decision.wait_s) == (
        Action.ADMIT,
        Reason.CAPACITY_AVAILABLE,
        100,
        2.0,
    )
    assert decision.lease_id == env.ledger.lease_for_ticket("a").lease_id  # type: ignore[union-attr]
    assert env.counted()["wait_granted"] == 1 and env.counted()["wait_seconds_sum"] == 2.0
    assert len(env.fleet.queues) == 0 and env.waits.sum == 2.0


def test_a_refused_head_blocks_its_fifo_strict_arrival_order() -> None:
    env = make()
    lease = hold(env, 800)
    enqueue(env, "big", 300, 1.0, "s1")
    enqueue(env, "small", 10, 1.1, "s2")  # would fit, but "big" is ahead
    assert env.fleet.drain(2.0, never) == []
    env.ledger.release(lease, 2.0)
    assert [e.ticket for e, _ in env.fleet.drain(2.0, never)] == ["big", "small"]


def test_the_continuing_fifo_goes_first() -> None:
    env = make(usage=0.95)
    resident(env, "r", 100)
    enqueue(env, "new", 10, 1.0, "s")
    enqueue(env, "cont", 10, 2.0, "r")
    assert env.fleet.queues.waiting(FLEET) == (1, 1)
    env.ledger.observe(ENGINE, now=3.0, token_usage=0.1)
    assert [e.ticket for e, _ in env.fleet.drain(3.0, never)] == ["cont", "new"]


@pytest.mark.parametrize(
    ("now", "left"),
    [(5.999, []), (6.0, ["a"])],
    ids=["before its deadline: still waits", "at its deadline: aged, fail open"],
)
def test_a_refused_head_ages_at_max_wait(now: float, left: list[str]) -> None:
    env = make(max_wait_s=5.0)
    hold(env, 950)
    enqueue(env, "a", 100, 1.0, "s")
    assert env.fleet.next_deadline() == 6.0
    out = env.fleet.drain(now, never)
    assert [e.ticket for e, _ in out] == left
    for _, d in out:
        assert d is not None and (d.action, d.reason, d.lease_id) == ("bypass", "aged", None)
        assert d.wait_s == 5.0 and env.counted()["bypass_aged"] == 1


def test_an_engine_gone_stale_while_waiting_bypasses_degraded() -> None:
    env = make()
    hold(env, 950)
    enqueue(env, "a", 100, 1.0, "s")
    [(_, d)] = env.fleet.drain(61.0, never)  # staleness 60 s: no fresh engine left
    assert d is not None and (d.action, d.reason) == ("bypass", "degraded")


def test_an_abandoned_head_leaves_cancelled_and_the_next_one_goes() -> None:
    env = make()
    lease = hold(env, 950)
    enqueue(env, "gone", 100, 1.0, "s1")
    enqueue(env, "next", 100, 1.0, "s2")
    env.ledger.release(lease, 2.0)
    out = env.fleet.drain(2.0, lambda t: t == "gone")
    assert [(e.ticket, d is None) for e, d in out] == [("gone", True), ("next", False)]
    assert env.ledger.lease_for_ticket("gone") is None
    assert env.counted()["cancelled"] == 1


@pytest.mark.parametrize(
    ("ticket", "was_head", "after"),
    [("a", True, "b"), ("b", False, "a"), ("x", False, "a")],
    ids=["the head", "behind the head", "not waiting"],
)
def test_cancel_says_whether_a_head_left(ticket: str, was_head: bool, after: str) -> None:
    env = make()
    hold(env, 950)
    enqueue(env, "a", 100, 1.0, "s1")
    enqueue(env, "b", 100, 1.0, "s2")
    assert env.fleet.cancel(ticket, 2.0) is was_head
    assert _head(env) == after
    assert env.counted().get("cancelled", 0) == (0 if ticket == "x" else 1)


def _head(env: Env) -> str | None:
    h = env.fleet.queues.head(FLEET, NEW)
    return None if h is None else h.ticket


def test_release_all_bypasses_every_waiter_continuing_first() -> None:
    env = make(usage=0.95)
    resident(env, "r", 100)
    enqueue(env, "new", 10, 1.0, "s")
    enqueue(env, "cont", 10, 2.0, "r")
    out = env.fleet.release_all(Reason.DISABLED, 4.0)
    assert [(e.ticket, d.reason, d.wait_s) for e, d in out if d is not None] == [
        ("cont", "disabled", 2.0),
        ("new", "disabled", 3.0),
    ]
    assert len(env.fleet.queues) == 0 and env.fleet.next_deadline() is None
    assert env.counted()["bypass_disabled"] == 2


def test_housekeeping_reclaims_leases_past_their_ttl() -> None:
    env = make()
    env.ledger.configure(headroom=1.0, pressure_threshold=0.9, lease_ttl_s=10.0, staleness_s=60.0)
    hold(env, 100)
    env.fleet.housekeep(5.0, idle_s=600.0)
    assert "agentic_kv/budget/lease_expired" not in env.counters.total_items() or not (
        env.counters.total("agentic_kv/budget/lease_expired")
    )
    env.fleet.housekeep(11.0, idle_s=600.0)
    assert env.counters.total("agentic_kv/budget/lease_expired") == 1
    assert env.ledger.lease_count == 0
