"""What admission is asked and what it answers: the request and decision records, and
the enums whose values are their actions and reasons. Pure.

Every intercepted request becomes one :class:`AdmissionRequest`; the controller
(:mod:`kvproxy.admission.coordinator`) answers each with one :class:`Decision`.
``Decision.action`` is an :class:`Action`; ``Decision.reason`` is a :class:`Reason`
in ledger (request) mode and a program :class:`~kvproxy.admission.program.events.Outcome`
value in program mode. Both enums' values double as metric labels: ledger mode
counts ``agentic_kv/admission/<action>`` and ``agentic_kv/admission/bypass_<reason>``
(:mod:`kvproxy.admission.catalogue`).
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


class Reason(StrEnum):
    """Why ledger (request) mode decided as it did."""

    CAPACITY_AVAILABLE = "capacity_available"  # admitted with a lease (ledger.CAPACITY_AVAILABLE)
    PROTECTED = "protected"  # protected work: never held
    DEGRADED = "degraded"  # no engine has a fresh reading (or the body cannot be sized)
    AGED = "aged"  # waited max_wait_s: fail open
    OVERSIZED = "oversized"  # larger than the whole ceiling
    QUEUE_FULL = "queue_full"  # the FIFOs hold max_queue waiters
    CANCELLED = "cancelled"  # withdrawn before a decision: the caller must not forward it
    DISABLED = "disabled"  # admission off (or switched off by a reload while waiting)
    OUT_OF_SCOPE = "out_of_scope"  # eval traffic with scope: train


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
    __slots__ = ("action", "lease_id", "priority", "reason", "tokens", "wait_s")

    def __init__(
        self,
        action: str,
        reason: str,
        lease_id: str | None,
        tokens: int,
        wait_s: float,
        priority: int | None = None,
    ) -> None:
        self.action: Final = action  # an Action: "admit" | "bypass" | "pass"
        # A Reason (ledger mode) or an Outcome's value (program mode).
        self.reason: Final = reason
        self.lease_id: Final = lease_id
        self.tokens: Final = tokens
        self.wait_s: Final = wait_s
        # Program mode: the priority to inject when the body carries none (None: nothing).
        self.priority: Final = priority


# The decisions that carry nothing but their reason, built once.
PASS_DISABLED = Decision(Action.PASS, Reason.DISABLED, None, 0, 0.0)
PASS_OUT_OF_SCOPE = Decision(Action.PASS, Reason.OUT_OF_SCOPE, None, 0, 0.0)
BYPASS_CANCELLED = Decision(Action.BYPASS, Reason.CANCELLED, None, 0, 0.0)
BYPASS_PROTECTED = Decision(Action.BYPASS, Reason.PROTECTED, None, 0, 0.0)
