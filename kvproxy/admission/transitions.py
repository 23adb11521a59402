"""State machines stated as tables: the one step function that reads them. Pure.

A machine's table sits at the top of its module, as ``{state: {event: next state}}``;
a pair not in the table is not allowed, and :func:`step` raises
:class:`InvalidTransition` for it instead of letting the state drift. The tables:
a waiter's (:mod:`kvproxy.admission.waiters`) and a program session's
(:mod:`kvproxy.admission.program.ledger`); tests/unit/test_admission_transitions.py
walks every (state, event) pair of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S")
E = TypeVar("E")


class InvalidTransition(Exception):
    """An event its state machine's table does not allow in the current state."""


def step(table: Mapping[S, Mapping[E, S]], state: S, event: E, what: str) -> S:
    """The state ``event`` leads to from ``state`` (``what`` names the machine in the error)."""
    nxt = table[state].get(event)
    if nxt is None:
        raise InvalidTransition(f"{what}: {event!s} is not allowed in state {state!s}")
    return nxt
