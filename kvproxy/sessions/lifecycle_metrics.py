"""The session lifecycle's metric names and help texts, and its gauges. Pure.

The names are pinned (/work/shared/INTERFACE.md): JSON keys of ``/kvproxy/stats``,
and with ``/`` replaced by ``_`` the Prometheus names (counters end in ``_total``).
"""

from __future__ import annotations

from kvproxy.sessions import identity as _identity
from kvproxy.sessions.family import Link
from kvproxy.sessions.table import SessionTable

_P = "agentic_kv/session/"
LIFECYCLE_ENABLED = _P + "lifecycle_enabled"
# Counters (window semantics in /kvproxy/stats; cumulative *_total in /metrics).
CLOSE = _P + "close"
CLOSE_FAILURE = _P + "close_failure"
CLOSED_IDLE = _P + "closed_idle"
CLOSED_FINAL = _P + "closed_final"
STARTED = _P + "started"
REOPENED = _P + "reopened"
EVICTED = _P + "evicted"
ABORTED_REQUESTS = _P + "aborted_requests"
ABORT_FAILURE = _P + "abort_failure"
DISCONNECT_ABORTS = _P + "disconnect_aborts"
REJECTED_QUEUED = _P + "rejected_queued"
REJECTED_CLOSING = _P + "rejected_closing"
INJECTED = _P + "injected"
INJECTION_SKIPPED = _P + "injection_skipped"
# Identity (docs/sessions.md, "Bad or conflicting identity"): the notes of
# kvproxy.sessions.identity, and the parent links the table kept or refused.
ID_CONFLICT = _P + "id_conflict"
ID_REJECTED = _P + "id_rejected"
NVEXT_SESSION_CONTROL = _P + "nvext_session_control"
PARENT_SELF = _P + "parent_self"
PARENT_INVALID = _P + "parent_invalid"
PARENT_LINKED = _P + "parent_linked"
PARENT_CYCLE = _P + "parent_cycle"
PARENT_FULL = _P + "parent_full"
PARENT_MOVED = _P + "parent_moved"
CLOSED_WITH_PARENT = _P + "closed_with_parent"
# Gauges.
OPEN = _P + "open"
CLOSING = _P + "closing"
CLOSED_REMEMBERED = _P + "closed_remembered"
QUEUED_REQUESTS = _P + "queued_requests"
FORWARDED_REQUESTS = _P + "forwarded_requests"

COUNTER_HELP: dict[str, str] = {
    CLOSE: "Session closes run (fan-out of /close_session to every engine).",
    CLOSE_FAILURE: "Session closes where at least one engine failed or timed out.",
    CLOSED_IDLE: "Sessions closed by the idle timeout.",
    CLOSED_FINAL: "Sessions closed after a request marked as the final turn.",
    STARTED: "Sessions started (first request of an id, or of an id closed earlier).",
    REOPENED: "Sessions started with the id of a session closed earlier.",
    EVICTED: "Idle sessions forgotten (not closed) to keep the session table bounded.",
    ABORTED_REQUESTS: "Forwarded requests aborted on the engines (close or client disconnect).",
    ABORT_FAILURE: "Abort fan-outs where at least one engine failed or timed out.",
    DISCONNECT_ABORTS: "Forwarded requests aborted because the client disconnected.",
    REJECTED_QUEUED: "Requests queued in the proxy answered session_closed by a close.",
    REJECTED_CLOSING: "Requests that arrived for a session while it was closing.",
    INJECTED: "Requests given a top-level session_id.",
    INJECTION_SKIPPED: "Requests of a session not given a session_id (they carry session_params).",
    ID_CONFLICT: "Requests whose id sources named different sessions (the first source won).",
    ID_REJECTED: "Requests whose agent or Dynamo session header was invalid (ignored).",
    NVEXT_SESSION_CONTROL: "Requests using the deprecated nvext.session_control block.",
    PARENT_SELF: "Requests whose session named itself as its parent (link dropped).",
    PARENT_INVALID: "Requests whose parent session id was invalid (link dropped).",
    PARENT_LINKED: "Sessions linked to a parent session.",
    PARENT_CYCLE: "Parent links refused because they would close a cycle.",
    PARENT_FULL: "Parent links refused because the parent has max_children children.",
    PARENT_MOVED: "Sessions that named another parent than before (relinked).",
    CLOSED_WITH_PARENT: "Child sessions closed with their parent (close_children).",
}
GAUGE_HELP: dict[str, str] = {
    LIFECYCLE_ENABLED: "1 when session lifecycle is enabled.",
    OPEN: "Open sessions in the session table.",
    CLOSING: "Sessions whose close is in progress.",
    CLOSED_REMEMBERED: "Closed session ids remembered (tombstones).",
    QUEUED_REQUESTS: "Requests of a session queued in the proxy.",
    FORWARDED_REQUESTS: "Requests of a session forwarded upstream and not finished.",
}


def table_gauges(table: SessionTable) -> dict[str, float]:
    """The gauges the session table answers (sessions and requests by state)."""
    return {
        OPEN: float(table.open_count),
        CLOSING: float(table.closing_count),
        CLOSED_REMEMBERED: float(table.closed_count),
        QUEUED_REQUESTS: float(table.queued_count),
        FORWARDED_REQUESTS: float(table.forwarded_count),
    }


# The identity's notes and the table's link outcomes, as counters.
NOTE_COUNTERS = {
    _identity.NOTE_CONFLICT: ID_CONFLICT,
    _identity.NOTE_REJECTED: ID_REJECTED,
    _identity.NOTE_NVEXT: NVEXT_SESSION_CONTROL,
    _identity.NOTE_PARENT_SELF: PARENT_SELF,
    _identity.NOTE_PARENT_INVALID: PARENT_INVALID,
}
LINK_COUNTERS = {
    Link.LINKED: PARENT_LINKED,
    Link.MOVED: PARENT_MOVED,
    Link.CYCLE: PARENT_CYCLE,
    Link.FULL: PARENT_FULL,
    Link.SELF: PARENT_SELF,
}
