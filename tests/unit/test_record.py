"""The request path's records (kvproxy.record): value semantics, and slots only."""

from __future__ import annotations

import importlib

import pytest

from kvproxy.admission.fleet.ledger import Grant, Lease
from kvproxy.admission.records import Action, Decision, Outcome
from kvproxy.compiled import MODULES
from kvproxy.proxy.usage import Usage
from kvproxy.record import Record


def _records() -> list[type[Record]]:
    for name in MODULES:
        importlib.import_module(name)
    found: list[type[Record]] = []
    todo = list(Record.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_repr_names_every_field() -> None:
    grant = Grant(True, "capacity_available", "0:t", 10, 0, 4)
    assert repr(grant) == (  # in slot order (sorted by the linter)
        "Grant(charged=4, epoch=0, granted=True, lease_id='0:t', "
        "reason='capacity_available', tokens=10)"
    )


def test_equality_and_hash_are_by_value_and_type() -> None:
    a = Usage(10, 5, 2)
    assert a == Usage(10, 5, 2) and hash(a) == hash(Usage(10, 5, 2))
    assert a != Usage(10, 5, 3)
    assert a != (10, 5, 2, 1, "meta_info")  # not a tuple any more
    decision = Decision(Action.ADMIT, Outcome.CAPACITY_AVAILABLE, "0:t", 10, 0.0)
    assert decision != Decision(Action.ADMIT, Outcome.CAPACITY_AVAILABLE, "0:t", 10, 0.5)
    assert len({a, Usage(10, 5, 2), Usage(1)}) == 2


def test_defaults_match_the_signature() -> None:
    lease = Lease("0:t", "t", 4, 0, 1.5)
    assert (lease.session_id, lease.full_tokens) == (None, 0)


@pytest.mark.parametrize("cls", _records(), ids=lambda c: c.__name__)
def test_every_record_is_slots_only(cls: type[Record]) -> None:
    # Every class between the record and Record declares its slots: no instance dict,
    # so a field missing from __slots__ fails at construction, not silently.
    for klass in cls.__mro__[: cls.__mro__.index(Record)]:
        assert "__slots__" in vars(klass), klass
    assert cls.__slots__, cls
