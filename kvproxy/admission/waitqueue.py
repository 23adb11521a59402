"""The protocol both admission modes' waiting queues follow. Pure.

A wait queue holds waiting entries (each with a ``ticket``, the ``engine`` it waits
for, its ``tokens`` and when it was ``enqueued_at``) in two lanes per engine, each in
arrival order; the first lane is served before the second:

* program mode, :class:`kvproxy.admission.queues.Queues`: one pair per engine,
  lanes ``paused`` and ``new``;
* ledger (request) mode, :class:`kvproxy.admission.fleet_queue.FleetQueues`: one
  pair for the whole fleet (engine :data:`~kvproxy.admission.fleet_queue.FLEET`),
  lanes ``continuing`` and ``new``.

A withdrawn entry (``remove``) is skipped lazily: it never shows at a head again.
``pop`` takes the head that ``head`` just returned. tests/unit/test_wait_queues.py
runs one conformance table against both implementations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar


class QueueEntry(Protocol):
    @property
    def ticket(self) -> str: ...

    @property
    def engine(self) -> str: ...

    @property
    def tokens(self) -> int: ...

    @property
    def enqueued_at(self) -> float: ...

    @property
    def live(self) -> bool: ...


E = TypeVar("E", bound=QueueEntry)


class WaitQueues(Protocol[E]):
    def __len__(self) -> int:
        """Live entries, over every engine and lane."""
        ...

    def __contains__(self, ticket: object) -> bool:
        """Whether ``ticket`` waits (live)."""
        ...

    def push(self, entry: E, which: str) -> None:
        """Append ``entry`` to lane ``which`` of its engine."""
        ...

    def head(self, url: str, which: str) -> E | None:
        """The first live entry of a lane (None: the lane is empty)."""
        ...

    def pop(self, url: str, which: str) -> E:
        """Take the head :meth:`head` returned out of its lane."""
        ...

    def remove(self, ticket: str) -> E | None:
        """Withdraw a waiting ticket (None: not waiting)."""
        ...

    def waiting(self, url: str) -> tuple[int, int]:
        """Live entries of an engine's (first, second) lane."""
        ...

    def heads(self) -> Iterator[E]:
        """The live head of every lane that has one."""
        ...

    def oldest(self) -> E | None:
        """The live entry that has waited longest (None: nothing waits)."""
        ...

    def live(self) -> Iterator[tuple[E, str]]:
        """Every live entry with its lane."""
        ...
