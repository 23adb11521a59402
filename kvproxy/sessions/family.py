"""Parent links between sessions: the session table's tree and admission's running leads. Pure.

A subagent's session may name its parent (its lead: docs/sessions.md, "Parent
sessions"). A lead that waits for its subagents runs no turn of its own, yet it is not
idle: its next turn comes as soon as they answer, on its whole context. A subagent
runs from its first request to its end (its close, or admission's idle expiry of it),
its tool calls included: between two of its turns it is still working for its lead.
Admission asks :meth:`Family.running_children` and counts a lead with a running child
as running (never paused, its weight kept; kvproxy.admission.program.ledger).

Bounded: at most ``max_links`` child -> parent links (the least recently linked is
forgotten first) and ``max_children`` children per parent (a link past it is refused).
Every request of a child carries its link again, so a forgotten link comes back with
the child's next turn. Only direct children count: a lead is running while a child of
its own runs a turn.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum


class Link(StrEnum):
    LINKED = "linked"  # a new link
    KNOWN = "known"  # the same link again
    SELF = "self"  # the session named itself: not linked
    CYCLE = "cycle"  # the parent descends from the child: not linked
    FULL = "full"  # the parent has max_children children already: not linked
    MOVED = "moved"  # the child named another parent before: relinked to the new one


# How far up the parent chain a cycle is looked for (deeper chains are not checked).
MAX_DEPTH = 64


class Family:
    __slots__ = ("_children", "_parent_of", "_running", "max_children", "max_links")

    def __init__(self, max_links: int = 100_000, max_children: int = 256) -> None:
        self.max_links = max(1, max_links)
        self.max_children = max(1, max_children)
        self._parent_of: OrderedDict[str, str] = OrderedDict()
        self._children: dict[str, set[str]] = {}
        # Running children (known to admission, not ended), per parent (only parents
        # with one or more).
        self._running: dict[str, set[str]] = {}

    # -- queries ---------------------------------------------------------------------

    def parent(self, sid: str) -> str | None:
        return self._parent_of.get(sid)

    def children(self, sid: str) -> frozenset[str]:
        return frozenset(self._children.get(sid, ()))

    def running_children(self, sid: str) -> int:
        """How many of ``sid``'s children run now."""
        running = self._running.get(sid)
        return len(running) if running else 0

    def __len__(self) -> int:
        return len(self._parent_of)

    # -- links -----------------------------------------------------------------------

    def link(self, child: str, parent: str, *, running: bool = False) -> Link:
        """Record ``child``'s parent (``running``: the child runs now)."""
        if child == parent:
            return Link.SELF
        old = self._parent_of.get(child)
        if old == parent:
            self._parent_of.move_to_end(child)
            return Link.KNOWN
        if self._descends(parent, child):
            return Link.CYCLE
        kids = self._children.get(parent)
        if kids is not None and len(kids) >= self.max_children:
            return Link.FULL
        if old is not None:
            self._unlink(child, old)
        self._parent_of[child] = parent
        self._children.setdefault(parent, set()).add(child)
        if running:
            self._running.setdefault(parent, set()).add(child)
        while len(self._parent_of) > self.max_links:
            oldest, its_parent = next(iter(self._parent_of.items()))
            self._unlink(oldest, its_parent)
        return Link.MOVED if old is not None else Link.LINKED

    def _descends(self, sid: str, ancestor: str) -> bool:
        """Whether ``ancestor`` is ``sid`` or above it (looked for MAX_DEPTH levels up)."""
        node: str | None = sid
        for _ in range(MAX_DEPTH):
            if node is None:
                return False
            if node == ancestor:
                return True
            node = self._parent_of.get(node)
        return False

    def _unlink(self, child: str, parent: str) -> None:
        self._parent_of.pop(child, None)
        kids = self._children.get(parent)
        if kids is not None:
            kids.discard(child)
            if not kids:
                del self._children[parent]
        self._stopped(child, parent)

    def _stopped(self, child: str, parent: str) -> None:
        running = self._running.get(parent)
        if running is not None:
            running.discard(child)
            if not running:
                del self._running[parent]

    def forget(self, sid: str) -> None:
        """``sid`` ended: its own link goes (its children keep theirs: they name it
        again on their next turn, and a lead may outlive one of its ids)."""
        parent = self._parent_of.get(sid)
        if parent is not None:
            self._unlink(sid, parent)

    # -- running children ------------------------------------------------------------

    def started(self, child: str) -> str | None:
        """``child`` began running (its session opened); its parent (None: none linked)."""
        parent = self._parent_of.get(child)
        if parent is not None:
            self._running.setdefault(parent, set()).add(child)
        return parent

    def ended(self, child: str) -> str | None:
        """``child`` ended (its session left admission); its parent (None: none linked)."""
        parent = self._parent_of.get(child)
        if parent is not None:
            self._stopped(child, parent)
        return parent


__all__ = ["MAX_DEPTH", "Family", "Link"]
