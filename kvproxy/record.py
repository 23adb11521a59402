"""The base of the small read-only records a request builds (plans, decisions, leases).

A record is a class with ``__slots__``, an ``__init__`` that sets each slot once, and
its attributes declared ``Final`` (mypy refuses an assignment; compiled, so does the
runtime). This base gives it a ``repr``, value equality and a hash over its slots.

Not a ``NamedTuple`` or a dataclass: each is built on every intercepted request, and a
plain ``__init__`` is the cheapest constructor in both builds. Counted per construction
of a four-field record (valgrind, CPython 3.11): a named tuple 3.2k instructions in
either build (its ``__new__`` is Python code, which compiled callers call too), a slotted
dataclass 2.0k / 2.6k (Python / compiled), a frozen one 7.0k (it sets each field through
``object.__setattr__``), this 2.0k / 0.4k (compiled, the ``__init__`` is C).
docs/benchmarks.md, "Instructions per request", has the request-path counts.
"""

from __future__ import annotations

from typing import ClassVar


class Record:
    """Slots-based value record: ``repr``, ``==`` and ``hash`` from ``__slots__``."""

    __slots__: ClassVar[tuple[str, ...]] = ()

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={getattr(self, name)!r}" for name in type(self).__slots__)
        return f"{type(self).__name__}({parts})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in type(self).__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in type(self).__slots__))
