"""The session table as JSON: ``GET /kvproxy/sessions`` and the dashboard's tree. Pure.

A page lists live sessions in table order (least recently active first), each with its
state, its requests in flight, its parent and its children (at most
:data:`CHILDREN_SHOWN`, and how many there are): the tree is read from the rows. The
dashboard's tree is the parents among the most recently active sessions, each with its
children, bounded the same way.
"""

from __future__ import annotations

from typing import Any

from kvproxy.sessions.table import SessionEntry, SessionTable

# Bounds of one answer.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
CHILDREN_SHOWN = 64
TREE_PARENTS = 20
TREE_SCAN = 2000  # most recently active sessions the dashboard's tree looks at


def session_row(table: SessionTable, entry: SessionEntry, now: float) -> dict[str, Any]:
    sid = entry.session_id
    children = sorted(table.children(sid))
    return {
        "session_id": sid,
        "state": str(entry.state),
        "parent": table.parent(sid),
        "children": children[:CHILDREN_SHOWN],
        "children_count": len(children),
        "in_flight": entry.in_flight,
        "requests": entry.requests,
        "age_s": round(max(0.0, now - entry.created_at), 3),
        "idle_s": round(max(0.0, now - entry.last_active), 3) if entry.idle else 0.0,
    }


def parse_limit(raw: str | None) -> int:
    """``?limit=`` as a page size in [1, MAX_LIMIT] (ValueError: not an integer >= 1)."""
    if raw is None or raw == "":
        return DEFAULT_LIMIT
    n = int(raw)
    if n < 1:
        raise ValueError("limit must be >= 1")
    return min(n, MAX_LIMIT)


def sessions_page(
    table: SessionTable, now: float, *, after: str | None, limit: int
) -> dict[str, Any]:
    """One page of live sessions after session ``after``; ``next`` names the last one
    when more may follow (pass it as ``after``), else None."""
    entries = table.entries(after, limit + 1)
    more = len(entries) > limit
    rows = [session_row(table, e, now) for e in entries[:limit]]
    return {
        "sessions": rows,
        "next": rows[-1]["session_id"] if more and rows else None,
        "open": table.open_count,
        "closing": table.closing_count,
    }


def session_tree(table: SessionTable, now: float) -> list[dict[str, Any]]:
    """The parents among the most recently active sessions (at most TREE_PARENTS, the
    most recent first), each with its children's rows (CHILDREN_SHOWN at most)."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for entry in table.recent(TREE_SCAN):
        sid = entry.session_id
        parent = table.parent(sid)
        top = parent if parent is not None else sid
        if top in seen or not table.children(top):
            continue
        seen.add(top)
        lead = table.get(top)
        row: dict[str, Any] = (
            session_row(table, lead, now)
            if lead is not None
            else {"session_id": top, "state": "closed", "parent": None}
        )
        kids = [table.get(c) for c in sorted(table.children(top))[:CHILDREN_SHOWN]]
        row["child_rows"] = [session_row(table, k, now) for k in kids if k is not None]
        out.append(row)
        if len(out) >= TREE_PARENTS:
            break
    return out


__all__ = ["parse_limit", "session_row", "session_tree", "sessions_page"]
