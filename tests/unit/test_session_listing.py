"""The session table as JSON: pages of /kvproxy/sessions and the dashboard's tree."""

from __future__ import annotations

import pytest

from kvproxy.sessions.listing import MAX_LIMIT, parse_limit, session_tree, sessions_page
from kvproxy.sessions.table import SessionTable


def table_with_tree() -> SessionTable:
    t = SessionTable(max_sessions=100, closed_ttl_s=60.0, max_children=2)
    for i, sid in enumerate(("lead", "a", "b", "c", "solo")):
        begin = t.begin(sid, float(i), forwarded=("r",))
        assert begin.token is not None
        t.end(sid, begin.token, float(i))
    for kid in ("a", "b", "c"):
        t.link(kid, "lead")  # c: past max_children, not linked
    return t


def test_pages_walk_the_table_once_with_parents_and_children() -> None:
    t = table_with_tree()
    seen: list[dict] = []
    after = None
    for _ in range(5):
        page = sessions_page(t, 10.0, after=after, limit=2)
        seen.extend(page["sessions"])
        after = page["next"]
        if after is None:
            break
    assert [r["session_id"] for r in seen] == ["lead", "a", "b", "c", "solo"]
    rows = {r["session_id"]: r for r in seen}
    assert rows["lead"]["children"] == ["a", "b"] and rows["lead"]["children_count"] == 2
    assert rows["a"]["parent"] == "lead" and rows["c"]["parent"] is None
    assert rows["solo"]["idle_s"] == 6.0 and rows["solo"]["in_flight"] == 0


def test_tree_lists_parents_with_their_children() -> None:
    (lead,) = session_tree(table_with_tree(), 10.0)
    assert lead["session_id"] == "lead"
    assert [c["session_id"] for c in lead["child_rows"]] == ["a", "b"]


@pytest.mark.parametrize(
    ("raw", "limit"), [(None, 100), ("", 100), ("5", 5), (str(MAX_LIMIT + 1), MAX_LIMIT)]
)
def test_parse_limit(raw: str | None, limit: int) -> None:
    assert parse_limit(raw) == limit


@pytest.mark.parametrize("raw", ["0", "-1", "x"])
def test_parse_limit_refuses(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_limit(raw)
