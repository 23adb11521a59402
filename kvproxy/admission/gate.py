"""The protocol both admission modes' gates follow on the event loop.

A gate decides a request in its mode, holds the futures of the requests that wait,
releases what an attempt held when it ends, and lets its waiters go when admission
stops or its mode is switched off. :class:`~kvproxy.admission.fleet.gate.FleetGate`
(:attr:`~kvproxy.admission.records.Mode.FLEET`) and
:class:`~kvproxy.admission.program.gate.ProgramGate`
(:attr:`~kvproxy.admission.records.Mode.PROGRAM`) implement it; the controller
(:mod:`kvproxy.admission.coordinator`) routes through a ``dict[Mode, Gate]`` and knows
nothing else of either. tests/unit/test_admission_gates.py runs one conformance table
against both.
"""

from __future__ import annotations

from typing import Protocol

from kvproxy.admission.records import AdmissionRequest, Decision, Mode, Outcome
from kvproxy.admission.waiters import Waiter
from kvproxy.config import AdmissionConfig


class Gate(Protocol):
    """One admission mode on the event loop."""

    @property
    def mode(self) -> Mode:
        """The mode it decides in (its leases and waiters carry it)."""
        ...

    @property
    def waiters(self) -> dict[str, Waiter]:
        """The requests waiting now, by ticket."""
        ...

    def decide(self, req: AdmissionRequest) -> Decision | tuple[Waiter, bool]:
        """The decision for an in-scope, unprotected request, or its waiter (and
        whether it is another attempt's, shared)."""
        ...

    def cancel(self, w: Waiter, now: float) -> None:
        """The awaiting task was cancelled: the waiter leaves its queue, or what was
        granted to it in the race is released."""
        ...

    def release(self, lease_id: str, ticket: str, now: float) -> None:
        """The attempt holding ``lease_id`` (of request ``ticket``) ended."""
        ...

    def drain(self, now: float) -> None:
        """Resolve the waiters that may go now; re-arm the timer."""
        ...

    def end_session(self, session_id: str, now: float) -> bool:
        """The session closed: forget it (idempotent); whether it was known."""
        ...

    def release_all(self, outcome: Outcome) -> None:
        """Every waiter leaves now as a bypass with ``outcome`` (stop, mode off)."""
        ...

    def configure(self, cfg: AdmissionConfig) -> None:
        """A reloaded (scaled) config: applies to the next decision."""
        ...

    def rearm(self) -> None:
        """Still enabled after a reload: drain and re-arm from scratch."""
        ...

    def oldest(self) -> float | None:
        """When the longest-waiting request began waiting (None: none waits)."""
        ...
