"""Program admission's events and why a turn is held: enums whose values double as
metric labels. Pure.

The tick's actions are :class:`Event` values (``agentic_kv/admission/event/<value>``);
every request ends in one :class:`~kvproxy.admission.records.Outcome` (counted as
``agentic_kv/admission/decision/<value>`` and exported as
``agentic_kv_admission_decisions_total{outcome=...}``).
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    PAUSED = "paused"  # an idle session paused under growth pressure
    PAUSE_MARKED = "pause_marked"  # no idle one: a running one pauses at its response
    # A paused turn the work-conserving floor released: its pause only delayed it (the
    # engine pauses nobody until a feedback window passes without one).
    PAUSE_UNDONE = "pause_undone"
    MOVED = "moved"  # a session re-attributed after a worker-set / health change
    IDLE_EXPIRED = "idle_expired"  # a session idle past idle_ttl_s left the ledger
    CLOSED = "closed"  # a session closed (end_session)
    EVICTED = "evicted"  # dropped by the session-table bound
    TARGET_CUT = "target_cut"  # feedback lowered an engine's target
    TARGET_RAISED = "target_raised"  # feedback raised it
    ENGAGED = "engaged"  # an engine's gate engaged: busy and thrashing (holding pays)
    DISENGAGED = "disengaged"  # an engine's gate went permissive: quiet, or starved
    # An engine released for a drop in load engaged again on a new session that did not
    # fit it (the next burst of a fleet whose sessions start together).
    REENGAGED = "reengaged"
    # A permissive engine engaged by the hold model's prediction, before any thrash is
    # measured (kvproxy.admission.program.forecast).
    PREDICTED = "predicted"
    # An engine heard from neither by /metrics nor by answers: its waiting turns leave
    # one per tick (fail open, gradually), never all at once.
    STALE_RELEASE = "stale_release"
    # Prefetch (kvproxy.admission.program.prefetch): planned at an answer (or a client's call),
    # sent when due, skipped when due (paused session; engine without a host tier, not
    # heard from, busy, or its sessions overflowing pool + host), or late (the turn
    # came first).
    PREFETCH_PLANNED = "prefetch_planned"
    PREFETCH_SENT = "prefetch_sent"
    PREFETCH_LATE = "prefetch_late"
    PREFETCH_SKIPPED_PAUSED = "prefetch_skipped_paused"
    PREFETCH_SKIPPED_NO_HOST_TIER = "prefetch_skipped_no_host_tier"
    PREFETCH_SKIPPED_STALE = "prefetch_skipped_stale"
    PREFETCH_SKIPPED_BUSY = "prefetch_skipped_busy"
    PREFETCH_SKIPPED_OVERFLOW = "prefetch_skipped_overflow"


class Held(StrEnum):
    """Why a request is waiting now (the dashboard's "why held")."""

    NEW_SESSION_FIT = "new_session_fit"  # its first turn does not fit its engine yet
    NEW_BEHIND = "new_behind"  # an earlier new session of its engine waits
    PAUSED_FIT = "paused_fit"  # a paused session whose footprint does not fit yet
    CONTINUING_FIT = "continuing_fit"  # ablation: hold_continuing
