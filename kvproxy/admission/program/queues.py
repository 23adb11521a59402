"""Per-engine waiting queues of program admission. Pure.

Each engine has two queues of waiting turns, both in arrival order:

* ``paused``: turns of PAUSED sessions, each with a deadline (``paused_soft_wait_s``
  after it arrived); served first (resumes go before new sessions);
* ``new``: first turns of NEW sessions (FIFO-with-fit: a head that does not fit
  blocks the rest of that engine's queue), each with its own deadline
  (``new_session_max_wait_s``); and, only in the hold_continuing ablation,
  continuing turns.

A withdrawn entry (its client went away) is removed lazily: it is marked dead and
skipped when it reaches a head. The total of live entries is bounded by the caller.
:class:`Queues` has the two-lane shape of fleet mode's FIFOs
(:mod:`kvproxy.admission.fleet.queue`); tests/unit/test_wait_queues.py runs one
conformance table against both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvproxy.admission.program.events import Held


@dataclass(slots=True)
class Entry:
    ticket: str
    sid: str
    engine: str
    tokens: int
    enqueued_at: float
    deadline: float
    held: Held
    # The engine's answers when it was queued: a hold ages only once the engine has
    # moved on (kvproxy.admission.program.engagement.Load.answers), so a proxy whose clock
    # runs ahead of its engines does not age holds early.
    mark: int = 0
    live: bool = True


@dataclass(slots=True)
class EngineQueues:
    paused: deque[Entry] = field(default_factory=deque)
    new: deque[Entry] = field(default_factory=deque)
    live_paused: int = 0
    live_new: int = 0

    def head(self, which: str) -> Entry | None:
        q = self.paused if which == "paused" else self.new
        while q and not q[0].live:
            q.popleft()
        return q[0] if q else None

    def pop(self, which: str) -> Entry:
        q = self.paused if which == "paused" else self.new
        e = q.popleft()
        self._unlive(e, which)
        return e

    def _unlive(self, e: Entry, which: str) -> None:
        if e.live:
            e.live = False
            if which == "paused":
                self.live_paused -= 1
            else:
                self.live_new -= 1


class Queues:
    """All engines' queues and an index of live entries by ticket."""

    def __init__(self) -> None:
        self.by_engine: dict[str, EngineQueues] = {}
        self.entries: dict[str, tuple[Entry, str]] = {}  # ticket -> (entry, queue name)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self.entries

    def engine(self, url: str) -> EngineQueues:
        q = self.by_engine.get(url)
        if q is None:
            q = self.by_engine[url] = EngineQueues()
        return q

    def push(self, entry: Entry, which: str) -> None:
        q = self.engine(entry.engine)
        if which == "paused":
            q.paused.append(entry)
            q.live_paused += 1
        else:
            q.new.append(entry)
            q.live_new += 1
        self.entries[entry.ticket] = (entry, which)

    def head(self, url: str, which: str) -> Entry | None:
        """The live head of an engine's ``paused`` or ``new`` queue."""
        q = self.by_engine.get(url)
        return None if q is None else q.head(which)

    def pop(self, url: str, which: str) -> Entry:
        e = self.engine(url).pop(which)
        self.entries.pop(e.ticket, None)
        return e

    def remove(self, ticket: str) -> Entry | None:
        """Withdraw a waiting ticket (lazy: it is skipped when it reaches a head)."""
        found = self.entries.pop(ticket, None)
        if found is None:
            return None
        entry, which = found
        self.engine(entry.engine)._unlive(entry, which)
        self._compact(entry.engine)
        return entry

    def _compact(self, url: str) -> None:
        q = self.engine(url)
        if len(q.new) > 64 and len(q.new) > 2 * q.live_new:
            q.new = deque(e for e in q.new if e.live)
        if len(q.paused) > 64 and len(q.paused) > 2 * q.live_paused:
            q.paused = deque(e for e in q.paused if e.live)

    def waiting(self, url: str) -> tuple[int, int]:
        """(paused, new) live entries of an engine."""
        q = self.by_engine.get(url)
        return (0, 0) if q is None else (q.live_paused, q.live_new)

    def heads(self) -> Iterator[Entry]:
        """The live head of every engine's paused and new queue."""
        for q in self.by_engine.values():
            for which in ("paused", "new"):
                h = q.head(which)
                if h is not None:
                    yield h

    def oldest(self) -> Entry | None:
        best: Entry | None = None
        for entry, _ in self.entries.values():
            if best is None or entry.enqueued_at < best.enqueued_at:
                best = entry
        return best

    def live(self) -> Iterator[tuple[Entry, str]]:
        yield from self.entries.values()

    def move(self, ticket: str, engine: str) -> None:
        """Re-queue a waiting ticket on another engine (its session moved)."""
        found = self.entries.get(ticket)
        if found is None:
            return
        entry, which = found
        self.remove(ticket)
        moved = Entry(
            entry.ticket,
            entry.sid,
            engine,
            entry.tokens,
            entry.enqueued_at,
            entry.deadline,
            entry.held,
            0,  # progress is counted per engine: the new one's answers start it
        )
        self.push(moved, which)
