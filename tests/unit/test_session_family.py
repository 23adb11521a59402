"""Parent links as admission reads them: the family, and the ledger's running leads."""

from __future__ import annotations

import pytest

from kvproxy.admission.program.ledger import EngineLedger, SessionState
from kvproxy.admission.program.params import ProgramParams
from kvproxy.sessions.family import MAX_DEPTH, Family, Link


@pytest.mark.parametrize(
    ("links", "child", "parent", "expected"),
    [
        ([], "c", "p", Link.LINKED),
        ([("c", "p")], "c", "p", Link.KNOWN),
        ([], "s", "s", Link.SELF),
        # p's parent is c: c naming p would close a cycle.
        ([("p", "c")], "c", "p", Link.CYCLE),
        # A longer cycle: a -> b -> c, c naming a... is fine (a is c's ancestor? no:
        # c's new parent a descends from c only if c is above a).
        ([("a", "b"), ("b", "c")], "c", "a", Link.CYCLE),
        ([("a", "b"), ("b", "c")], "a", "x", Link.MOVED),
        ([("c", "p")], "c", "q", Link.MOVED),
    ],
)
def test_link_outcomes(
    links: list[tuple[str, str]], child: str, parent: str, expected: Link
) -> None:
    f = Family()
    for c, p in links:
        f.link(c, p)
    assert f.link(child, parent) is expected
    if expected in (Link.SELF, Link.CYCLE):
        assert f.parent(child) == dict(links).get(child)
    else:
        assert f.parent(child) == parent


def test_children_per_parent_are_bounded() -> None:
    f = Family(max_children=2)
    assert f.link("a", "p") is Link.LINKED
    assert f.link("b", "p") is Link.LINKED
    assert f.link("c", "p") is Link.FULL
    assert f.children("p") == frozenset({"a", "b"})
    f.forget("a")
    assert f.link("c", "p") is Link.LINKED


def test_links_are_bounded_least_recent_first() -> None:
    f = Family(max_links=2)
    f.link("a", "p")
    f.link("b", "p")
    f.link("a", "p")  # renewed
    f.link("c", "p")
    assert f.parent("b") is None
    assert (f.parent("a"), f.parent("c")) == ("p", "p")
    assert len(f) == 2


def test_running_children_follow_starts_ends_and_relinks() -> None:
    f = Family()
    f.link("a", "p")
    f.link("b", "p")
    assert f.running_children("p") == 0
    assert f.started("a") == "p"
    assert f.started("b") == "p"
    assert f.started("a") == "p"  # twice: counted once
    assert f.running_children("p") == 2
    assert f.ended("a") == "p"
    assert f.running_children("p") == 1
    assert f.link("b", "q", running=True) is Link.MOVED
    assert (f.running_children("p"), f.running_children("q")) == (0, 1)
    f.forget("b")
    assert f.running_children("q") == 0
    assert f.started("unlinked") is None


def test_a_chain_deeper_than_the_cycle_check_is_linked() -> None:
    f = Family()
    for i in range(MAX_DEPTH + 2):
        f.link(f"n{i}", f"n{i + 1}")
    # n0 is below n{MAX_DEPTH+2} further than the check looks: not seen as a cycle.
    assert f.link(f"n{MAX_DEPTH + 2}", "n0") is Link.LINKED
    assert f.link("n2", "n0") is Link.CYCLE


# -- the ledger: a lead counts as running while a child runs -------------------------


def ledger() -> EngineLedger:
    return EngineLedger(ProgramParams(idle_lease_s=5.0, idle_half_life_s=10.0, idle_ttl_s=100.0))


def active(led: EngineLedger, sid: str, now: float) -> None:
    s = led.open(sid, "e1", now, 100)
    led.activate(s)
    led.turn_started(s, now, 100)
    led.turn_ended(s, now + 1)


def test_a_lead_with_a_running_child_is_busy_and_kept() -> None:
    led = ledger()
    active(led, "lead", 0.0)
    lead = led.sessions["lead"]
    assert not lead.busy and lead.idle_s(50.0) == 49.0
    # The child names its lead before its first turn opens it.
    assert led.link("child", "lead") is Link.LINKED
    assert not led.has_running_children("lead")
    active(led, "child", 50.0)
    assert led.has_running_children("lead") and lead.busy
    # Its weight decays as any idle session's (only pausing and expiry spare it).
    assert lead.idle_s(80.0) == 79.0 and led.weight(lead, 80.0) < 1.0
    # Between the child's turns (its tool calls) the lead still waits for it.
    assert led.expire(500.0) == ["child"]  # the child expires; the lead was kept
    assert not led.has_running_children("lead") and not lead.busy
    assert led.expire(501.0) == ["lead"]


def test_a_child_moving_to_another_parent_leaves_the_first() -> None:
    led = ledger()
    for sid in ("p", "q"):
        active(led, sid, 0.0)
    led.link("c", "p")
    active(led, "c", 0.0)
    assert led.sessions["p"].children_running == 1
    assert led.link("c", "q") is Link.MOVED
    assert (led.sessions["p"].children_running, led.sessions["q"].children_running) == (0, 1)


def test_a_closed_child_frees_its_lead_and_a_late_link_counts_at_once() -> None:
    led = ledger()
    active(led, "lead", 0.0)
    active(led, "child", 1.0)  # opened before naming its parent
    assert not led.has_running_children("lead")
    assert led.link("child", "lead") is Link.LINKED
    assert led.sessions["lead"].children_running == 1
    led.drop("child")
    assert led.sessions["lead"].children_running == 0
    assert led.sessions["lead"].state is SessionState.ACTIVE


def test_a_lead_opened_after_its_children_counts_them() -> None:
    led = ledger()
    led.link("child", "lead")
    active(led, "child", 0.0)
    active(led, "lead", 1.0)
    assert led.sessions["lead"].children_running == 1
