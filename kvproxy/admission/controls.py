"""Program mode as the controller offers it: the ring mirror, the engines' modes, the
tick and prefetch.

:class:`ProgramControls` sits between the controller
(:class:`~kvproxy.admission.coordinator.AdmissionController`) and what it shows
(:class:`~kvproxy.admission.view.AdmissionView`): each control is program mode's gate's
(:class:`~kvproxy.admission.program.gate.ProgramGate`), reached through the parts the
controller wired. The lab and the tests set the router's policy, the workers and the
engines' ``/server_info`` here instead of reloading a config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvproxy.admission.view import AdmissionView
from kvproxy.fleet.placement import Placement


class ProgramControls(AdmissionView):
    """Program mode's placement, tick and prefetch controls."""

    _time_scale: float

    @property
    def placement(self) -> Placement:
        """The mirror of the router's consistent-hashing ring."""
        return self._p.program.placement

    @property
    def program_active(self) -> bool:
        """Program admission decides: mode program, ledger engine, and a router policy
        kvproxy can mirror. Otherwise the fleet-wide path decides."""
        return self._p.program.active

    @property
    def fallback_reason(self) -> str | None:
        """Why program mode uses fleet-wide accounting (None when it does not)."""
        return self._p.program.fallback_reason

    @property
    def priority_steering(self) -> bool:
        """Inject priorities: configured, and every known engine evicts by priority."""
        return self._p.program.priority_steering

    def set_router_policy(self, policy: str) -> None:
        """Tell the controller the router's policy (lab / tests: no config reload)."""
        self._p.program.set_router_policy(policy)

    def set_workers(self, workers: Sequence[str], available: Sequence[str] | None = None) -> None:
        """Fix the ring's worker URLs (as the router registered them) and the available
        ones (default: all); replaces the ``workers`` source given at construction."""
        self._p.program.set_workers(workers, available)

    def set_server_info(self, url: str, info: Mapping[str, Any]) -> None:
        """An engine's ``/server_info`` document (lab / tests: no HTTP)."""
        self._p.program.set_server_info(url, info)

    def refresh_placement(self, polled: Sequence[str] | None = None) -> int:
        """Re-read the worker set; on a change re-attribute sessions (returns moves)."""
        return self._p.program.refresh_placement(polled)

    def tick(self) -> None:
        """One program-admission tick now (the tick loop calls it every ``tick_s``)."""
        self._p.program.tick()

    @property
    def prefetching(self) -> bool:
        """Program admission is on and active, with prefetch on."""
        return self._cfg.prefetch and self._p.program.active

    def expect_tool_end(self, session_id: str, in_s: float) -> bool:
        """A client says the session's tool returns in ``in_s`` seconds (of the client's
        time: scaled like every duration): its prefetch is planned
        (docs/admission.md#prefetch-before-the-tool-returns). False when prefetch is off
        or the session is unknown, has no answer yet, or has a turn in flight."""
        if not self.prefetching:
            return False
        core = self._p.core
        session = core.ledger.get(session_id)
        return core.prefetch.expect(session, in_s * self._time_scale, self._clock())
