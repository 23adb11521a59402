"""The pure session table: states, in-flight bookkeeping, idle expiry, bounds."""

from __future__ import annotations

import pytest

from kvproxy.sessions.table import CloseStatus, SessionState, SessionTable


def table(
    max_sessions: int = 100, closed_ttl_s: float = 60.0, idle: float | None = None
) -> SessionTable:
    return SessionTable(max_sessions=max_sessions, closed_ttl_s=closed_ttl_s, idle_timeout_s=idle)


def test_begin_forward_end_updates_counts_and_state() -> None:
    t = table()
    b1 = t.begin("s", 0.0)
    b2 = t.begin("s", 1.0)
    assert b1.created and not b2.created
    assert b1.token is not None and b2.token is not None and b1.token != b2.token
    assert (t.open_count, t.queued_count, t.forwarded_count) == (1, 2, 0)
    assert t.forwarded("s", b1.token, ("rid1",), 2.0)
    assert not t.forwarded("s", b1.token, ("rid1",), 2.0)  # not queued any more
    assert (t.queued_count, t.forwarded_count) == (1, 1)
    entry = t.get("s")
    assert entry is not None and entry.forwarded == {b1.token: ("rid1",)}
    assert entry.requests == 2 and entry.in_flight == 2
    assert t.end("s", b1.token, 3.0) and t.end("s", b2.token, 4.0)
    assert not t.end("s", b2.token, 4.0)  # second end is a no-op
    assert (t.queued_count, t.forwarded_count) == (0, 0)
    assert t.get("s").last_active == 4.0  # type: ignore[union-attr]
    assert t.state("s") is SessionState.OPEN


# Close state machine: (state before, expected status, state after start_close).
@pytest.mark.parametrize(
    ("setup", "status", "known"),
    [
        ("unknown", CloseStatus.STARTED, False),
        ("open", CloseStatus.STARTED, True),
        ("closing", CloseStatus.CLOSING, True),
        ("closed", CloseStatus.CLOSED, False),
    ],
)
def test_start_close_by_state(setup: str, status: CloseStatus, known: bool) -> None:
    t = table()
    if setup in ("open", "closing", "closed"):
        b = t.begin("s", 0.0)
        t.end("s", b.token, 0.0)  # type: ignore[arg-type]
    if setup in ("closing", "closed"):
        assert t.start_close("s", 1.0).status is CloseStatus.STARTED
    if setup == "closed":
        t.finish_close("s", 2.0)
    start = t.start_close("s", 3.0)
    assert start.status is status
    assert start.known is known
    if status is CloseStatus.STARTED:
        assert t.state("s") is SessionState.CLOSING
        assert t.closing_count == 1


def test_close_snapshot_lists_queued_and_forwarded() -> None:
    t = table()
    q = t.begin("s", 0.0).token
    f = t.begin("s", 0.0).token
    assert q is not None and f is not None
    t.forwarded("s", f, ("r1", "r1_0"), 0.0)
    start = t.start_close("s", 1.0)
    assert start.queued == (q,)
    assert start.forwarded == ((f, ("r1", "r1_0")),)
    # While closing, new requests are refused.
    assert t.begin("s", 1.5).token is None
    assert t.open_count == 0 and t.closing_count == 1


def test_a_request_entered_as_forwarded_is_aborted_by_a_close_and_ends_once() -> None:
    t = table()
    tok = t.begin("s", 0.0, ("r2",)).token
    assert tok is not None
    assert (t.queued_count, t.forwarded_count) == (0, 1)
    assert not t.forwarded("s", tok, ("r2",), 0.5)  # not queued: nothing to move
    start = t.start_close("s", 1.0)
    assert start.queued == () and start.forwarded == ((tok, ("r2",)),)
    assert t.end("s", tok, 2.0) and not t.end("s", tok, 2.0)
    assert t.forwarded_count == 0


def test_finish_close_tombstones_and_forgets_in_flight() -> None:
    t = table()
    tok = t.begin("s", 0.0).token
    assert tok is not None
    t.forwarded("s", tok, ("r",), 0.0)
    t.start_close("s", 1.0)
    t.finish_close("s", 2.0)
    assert t.state("s") is SessionState.CLOSED
    assert (t.open_count, t.closing_count, t.closed_count) == (0, 0, 1)
    assert (t.queued_count, t.forwarded_count) == (0, 0)
    # A request that outlived the close ends harmlessly.
    assert not t.end("s", tok, 3.0)


def test_request_after_close_reopens_as_new_session() -> None:
    t = table()
    old = t.begin("s", 0.0).token
    t.start_close("s", 1.0)
    t.finish_close("s", 2.0)
    b = t.begin("s", 3.0)
    assert b.created and b.reopened and b.token is not None
    assert t.state("s") is SessionState.OPEN and t.closed_count == 0
    # The old request's token cannot touch the new session.
    assert not t.end("s", old, 4.0)  # type: ignore[arg-type]
    assert t.get("s").in_flight == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("ttl", "closed_at", "now", "remembered"),
    [
        (60.0, 0.0, 59.0, True),
        (60.0, 0.0, 61.0, False),
        (0.0, 0.0, 0.5, False),
    ],
)
def test_tombstone_ttl(ttl: float, closed_at: float, now: float, remembered: bool) -> None:
    t = table(closed_ttl_s=ttl)
    t.start_close("s", closed_at)
    t.finish_close("s", closed_at)
    t.prune(now)
    assert (t.state("s") is SessionState.CLOSED) is remembered
    # Once forgotten, a repeated close starts again (harmless on the engines).
    expected = CloseStatus.CLOSED if remembered else CloseStatus.STARTED
    assert t.start_close("s", now).status is expected


def test_tombstones_are_capped() -> None:
    t = SessionTable(max_sessions=10, closed_ttl_s=1e9, max_closed=3)
    for i in range(5):
        t.start_close(f"s{i}", float(i))
        t.finish_close(f"s{i}", float(i))
    assert t.closed_count == 3
    assert [t.state(f"s{i}") for i in range(5)] == [None, None, *[SessionState.CLOSED] * 3]


def test_cap_evicts_least_recently_active_idle_sessions() -> None:
    t = table(max_sessions=3)
    for i, sid in enumerate(("a", "b", "c")):
        tok = t.begin(sid, float(i)).token
        t.end(sid, tok, float(i))  # type: ignore[arg-type]
    # Touch "a" so that "b" is the least recently active.
    t.end("a", t.begin("a", 5.0).token, 5.0)  # type: ignore[arg-type]
    b = t.begin("d", 6.0)
    assert b.evicted == ("b",)
    assert len(t) == 3 and t.state("b") is None
    assert t.state("a") is SessionState.OPEN


def test_cap_never_evicts_busy_or_closing_sessions() -> None:
    t = table(max_sessions=2)
    t.begin("busy", 0.0)  # stays queued
    t.start_close("closing", 0.0)
    b = t.begin("new", 1.0)
    assert b.evicted == ()
    assert len(t) == 3  # over the cap: nothing could be forgotten
    assert t.state("busy") is SessionState.OPEN and t.state("closing") is SessionState.CLOSING
    # Once "new" is idle it is the only candidate, although it is the most recent.
    t.end("new", b.token, 2.0)  # type: ignore[arg-type]
    assert t.begin("newer", 3.0).evicted == ("new",)
    assert t.state("busy") is SessionState.OPEN
    assert t.state("closing") is SessionState.CLOSING


def test_cap_eviction_bounded_for_many_unique_ids() -> None:
    t = table(max_sessions=50)
    evicted = 0
    for i in range(1000):
        b = t.begin(f"u{i}", float(i))
        t.end(f"u{i}", b.token, float(i))  # type: ignore[arg-type]
        evicted += len(b.evicted)
    assert len(t) == 50 and evicted == 950
    assert t.state("u999") is SessionState.OPEN and t.state("u0") is None


@pytest.mark.parametrize(
    ("idle", "events", "now", "expected"),
    [
        # events: (session, start, end or None for still in flight)
        (None, [("a", 0.0, 1.0)], 1e9, []),
        (10.0, [("a", 0.0, 1.0), ("b", 0.0, 5.0)], 10.0, []),
        (10.0, [("a", 0.0, 1.0), ("b", 0.0, 5.0)], 11.0, ["a"]),
        (10.0, [("a", 0.0, 1.0), ("b", 0.0, 5.0)], 15.0, ["a", "b"]),
        # A session with a request in flight is never idle, however old.
        (10.0, [("a", 0.0, None), ("b", 0.0, 1.0)], 100.0, ["b"]),
        # Activity is counted from the end of the last request.
        (10.0, [("a", 0.0, 1.0), ("a", 2.0, 8.0)], 12.0, []),
    ],
)
def test_expired(
    idle: float | None,
    events: list[tuple[str, float, float | None]],
    now: float,
    expected: list[str],
) -> None:
    t = table(idle=idle)
    for sid, start, end in events:
        tok = t.begin(sid, start).token
        if end is not None:
            t.end(sid, tok, end)  # type: ignore[arg-type]
    assert t.expired(now) == expected


def test_closing_sessions_are_not_expired() -> None:
    t = table(idle=1.0)
    t.end("a", t.begin("a", 0.0).token, 0.0)  # type: ignore[arg-type]
    t.start_close("a", 0.5)
    assert t.expired(100.0) == []


def test_configure_changes_bounds() -> None:
    t = table(max_sessions=10, idle=None)
    t.end("a", t.begin("a", 0.0).token, 0.0)  # type: ignore[arg-type]
    assert t.expired(100.0) == []
    t.configure(max_sessions=1, closed_ttl_s=60.0, idle_timeout_s=5.0)
    assert t.expired(100.0) == ["a"]
    assert t.begin("b", 101.0).evicted == ("a",)
