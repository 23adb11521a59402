"""What admission is asked and what it answers: the request and decision records, and
the enums they are told in: the :class:`Mode` (which gate), the :class:`Outcome` and
the :class:`Action` it implies. Pure.

Every intercepted request becomes one :class:`AdmissionRequest`; the controller
(:mod:`kvproxy.admission.coordinator`) answers each with one :class:`Decision`, whose
``reason`` is an :class:`Outcome` (in either mode) and whose ``action`` is the
outcome's. The values double as metric labels (:mod:`kvproxy.admission.catalogue`):
``agentic_kv/admission/<action>``, fleet mode's ``bypass_<outcome>`` and program
mode's ``decision_<outcome>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final

from kvproxy.record import Record


class Action(StrEnum):
    ADMIT = "admit"  # forwarded holding a lease (at once or after waiting)
    BYPASS = "bypass"  # forwarded without a lease (fail open), or not at all: cancelled
    PASS = "pass"  # not admission's business (disabled, out of scope): not counted


class Mode(StrEnum):
    """Which gate decides a request (and holds its lease)."""

    FLEET = "fleet"  # every request on its own, one fleet-wide ledger (kvproxy.admission.fleet)
    PROGRAM = "program"  # a session's turns as one program, per engine (kvproxy.admission.program)


class Outcome(StrEnum):
    """How admission decided one request: its :attr:`action` and its metric labels
    derive from it (:mod:`kvproxy.admission.catalogue`)."""

    # -- before a mode decides, and both modes -------------------------------------------
    DISABLED = "disabled"  # admission off (or switched off by a reload while waiting)
    OUT_OF_SCOPE = "out_of_scope"  # eval traffic with scope: train
    PROTECTED = "protected"  # protected work: never held
    CANCELLED = "cancelled"  # withdrawn before a decision: the caller must not forward it
    # -- fleet mode ------------------------------------------------------------------------
    CAPACITY_AVAILABLE = "capacity_available"  # admitted with a lease
    DEGRADED = "degraded"  # no engine has a fresh reading (or the body cannot be sized)
    AGED = "aged"  # waited max_wait_s: fail open
    OVERSIZED = "oversized"  # larger than the whole ceiling
    QUEUE_FULL = "queue_full"  # the FIFOs hold max_queue waiters
    # -- program mode (docs/admission.md#program-mode) ----------------------------------
    # Forwarded at once, never held: a continuing turn of an ACTIVE session.
    CONTINUING_FORWARDED = "continuing_forwarded"
    # Ablation only (hold_continuing: true): a continuing turn that waited to fit.
    CONTINUING_WAITED = "continuing_waited"
    # A new session's first turn fitted its engine at once / after waiting in its FIFO.
    NEW_ADMITTED = "new_admitted"
    NEW_WAITED = "new_waited"
    # A new session that waited new_session_soft_wait_s went once admitting it would not
    # push its engine past the pause mark, or (fail open) new_session_max_wait_s anyway.
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

    @property
    def action(self) -> Action:
        """``admit`` (a lease), ``bypass`` (forwarded without one, or not at all when
        cancelled) or ``pass`` (not admission's business)."""
        return _ACTION.get(self, Action.BYPASS)

    @property
    def waited(self) -> bool:
        return self in _WAITED

    @property
    def fail_open(self) -> bool:
        return self in _FAIL_OPEN


# Ledger mode's name of the same enum, kept for its callers.
Reason = Outcome

_ADMITTED = (
    Outcome.CAPACITY_AVAILABLE,
    Outcome.CONTINUING_FORWARDED,
    Outcome.CONTINUING_WAITED,
    Outcome.NEW_ADMITTED,
    Outcome.NEW_WAITED,
    Outcome.RESUMED,
    Outcome.RESUMED_WAITED,
    Outcome.IDLE_ENGINE,
)
_ACTION: dict[Outcome, Action] = {
    **dict.fromkeys(_ADMITTED, Action.ADMIT),
    Outcome.DISABLED: Action.PASS,
    Outcome.OUT_OF_SCOPE: Action.PASS,
}
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
# Program mode's outcomes, in the order of their counters (decision_<outcome>).
PROGRAM_OUTCOMES: tuple[Outcome, ...] = (
    Outcome.CONTINUING_FORWARDED,
    Outcome.CONTINUING_WAITED,
    Outcome.NEW_ADMITTED,
    Outcome.NEW_WAITED,
    Outcome.NEW_AGED,
    Outcome.RESUMED,
    Outcome.RESUMED_WAITED,
    Outcome.PAUSED_AGED,
    Outcome.IDLE_ENGINE,
    Outcome.BYPASS_NO_SESSION,
    Outcome.BYPASS_NO_PLACEMENT,
    Outcome.BYPASS_NO_METRICS,
    Outcome.BYPASS_OVERSIZED,
    Outcome.BYPASS_QUEUE_FULL,
    Outcome.CANCELLED,
)
# Fleet mode's bypass outcomes, each counted bypass_<outcome>.
FLEET_BYPASSES: tuple[Outcome, ...] = (
    Outcome.PROTECTED,
    Outcome.DEGRADED,
    Outcome.AGED,
    Outcome.OVERSIZED,
    Outcome.QUEUE_FULL,
    Outcome.DISABLED,
)


class AdmissionRequest(Record):
    __slots__ = ("body", "headers", "parent_id", "path", "routing_key", "session_id", "ticket_id")

    def __init__(
        self,
        ticket_id: str,
        path: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        session_id: str | None,
        routing_key: str | None = None,
        parent_id: str | None = None,
    ) -> None:
        self.ticket_id: Final = ticket_id  # unique per forwarded attempt (the rid)
        self.path: Final = path  # "/generate", "/v1/chat/completions", "/v1/completions"
        self.headers: Final = headers  # case-insensitive mapping (aiohttp CIMultiDictProxy)
        self.body: Final = body  # parsed JSON object
        self.session_id: Final = session_id
        # The X-SMG-Routing-Key the router will see (None: the session id).
        self.routing_key: Final = routing_key
        # The session's parent, when it names one (docs/sessions.md, "Parent sessions").
        self.parent_id: Final = parent_id


class Decision(Record):
    __slots__ = ("action", "lease_id", "mode", "priority", "reason", "tokens", "wait_s")

    def __init__(
        self,
        action: Action,
        reason: Outcome,
        lease_id: str | None,
        tokens: int,
        wait_s: float,
        priority: int | None = None,
        mode: Mode | None = None,
    ) -> None:
        self.action: Final = action  # reason.action, but for a waiter that left by a bypass
        self.reason: Final = reason
        self.lease_id: Final = lease_id
        # The gate that holds the lease (None: no lease, or decided before a mode).
        self.mode: Final = mode
        self.tokens: Final = tokens
        self.wait_s: Final = wait_s
        # Program mode: the priority to inject when the body carries none (None: nothing).
        self.priority: Final = priority


# The decisions that carry nothing but their reason, built once.
PASS_DISABLED = Decision(Action.PASS, Outcome.DISABLED, None, 0, 0.0)
PASS_OUT_OF_SCOPE = Decision(Action.PASS, Outcome.OUT_OF_SCOPE, None, 0, 0.0)
BYPASS_CANCELLED = Decision(Action.BYPASS, Outcome.CANCELLED, None, 0, 0.0)
BYPASS_PROTECTED = Decision(Action.BYPASS, Outcome.PROTECTED, None, 0, 0.0)
