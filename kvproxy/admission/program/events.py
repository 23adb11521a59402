"""Program admission's decisions and events: enums whose values double as metric labels.

Pure. Every request that program admission sees ends in exactly one :class:`Outcome`
(counted as ``agentic_kv/admission/decision/<value>`` and exported as
``agentic_kv_admission_decisions_total{outcome=...}``); the tick's actions are
:class:`Event` values (``agentic_kv/admission/event/<value>``).
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    # Forwarded at once, never held: a continuing turn of an ACTIVE session.
    CONTINUING_FORWARDED = "continuing_forwarded"
    # Ablation only (hold_continuing: true): a continuing turn that waited to fit.
    CONTINUING_WAITED = "continuing_waited"
    # A new session's first turn fitted its engine at once / after waiting in its FIFO.
    NEW_ADMITTED = "new_admitted"
    NEW_WAITED = "new_waited"
    # Fail open: a new session that waited new_session_max_wait_s went anyway.
    NEW_AGED = "new_aged"
    # A paused session's turn fitted at once / after waiting (< paused_soft_wait_s).
    RESUMED = "resumed"
    RESUMED_WAITED = "resumed_waited"
    # Fail open: a paused session's turn that waited paused_soft_wait_s went anyway.
    PAUSED_AGED = "paused_aged"
    # Work-conserving: a waiting turn its engine took because fewer than min_inflight
    # (3) turns were in flight there (engaged gate; it did not fit yet).
    IDLE_ENGINE = "idle_engine"
    # Fail open, forwarded at once and not held:
    BYPASS_NO_SESSION = "bypass_no_session"  # no session id: nothing to attribute
    BYPASS_NO_PLACEMENT = "bypass_no_placement"  # no ring owner (no available worker)
    BYPASS_NO_METRICS = "bypass_no_metrics"  # the owner has no fresh capacity reading
    BYPASS_OVERSIZED = "bypass_oversized"  # larger than its engine's whole capacity
    BYPASS_QUEUE_FULL = "bypass_queue_full"  # the engine's queues are at max_queue
    # Withdrawn while waiting (client gone); not forwarded.
    CANCELLED = "cancelled"

    @property
    def waited(self) -> bool:
        return self in _WAITED

    @property
    def fail_open(self) -> bool:
        return self in _FAIL_OPEN


_WAITED = frozenset(
    {
        Outcome.CONTINUING_WAITED,
        Outcome.NEW_WAITED,
        Outcome.NEW_AGED,
        Outcome.RESUMED_WAITED,
        Outcome.PAUSED_AGED,
        Outcome.IDLE_ENGINE,
    }
)
_FAIL_OPEN = frozenset(
    {
        Outcome.NEW_AGED,
        Outcome.PAUSED_AGED,
        Outcome.BYPASS_NO_SESSION,
        Outcome.BYPASS_NO_PLACEMENT,
        Outcome.BYPASS_NO_METRICS,
        Outcome.BYPASS_OVERSIZED,
        Outcome.BYPASS_QUEUE_FULL,
    }
)


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
