"""One intercepted request's turn, written once: plan, track, admit, send, observe, release.

The proxy's handlers (:class:`kvproxy.proxy.handlers.ProxyHandlers`, over aiohttp) and
the in-process lab (``LabProxy``, over simulated engines) both carry out a planned
request (:func:`kvproxy.proxy.pipeline.plan_request`) through :meth:`TurnFlow.run`.
The flow does no I/O of its own: the session table and the admission controller are
called through the small protocols below, and the Dynamo turn and everything that
touches a socket or an engine is a method of the :class:`TurnShell` that carries it
out (:class:`kvproxy.proxy.dynamo_layer.DynamoLayer`, over the handlers' or the lab's
transport: :func:`kvproxy.proxy.dynamo_layer.turn_flow`). A test drives it with a
recording shell and scripted answers, no sockets (tests/unit/test_turn.py).

In order (what was entered is left on every path, in reverse):

1. the injection counters (``sessions.note_injection``);
2. the Dynamo turn (``shell.begin_turn``: None when Dynamo has nothing to do) and the
   plan with the turn's routing headers and admission's routing key folded in;
3. track: ``sessions.enter`` (as forwarded when no admission wait follows), then
   ``shell.entered`` (what a client disconnect aborts);
4. admit: a session already closing refuses; ``admission.admit(...).decide_now()``,
   else the wait (through ``tracked.until_forwarded``: a session close cancels it);
   ``shell.decided`` with the usage observer (None when the response teaches
   admission nothing); a cancelled ticket refuses; ``tracked.forwarded()`` raises when
   the session began closing meanwhile;
5. send: the final fields (:func:`~kvproxy.proxy.pipeline.final_fields`), then
   ``shell.send``, which calls the observer with the engine's usage report (observe);
6. release: the lease, then the session's tracking, then the Dynamo turn.

A refusal is raised as :class:`~kvproxy.proxy.refusals.Refused` (``session_closed``,
``request_cancelled``); the shell maps it. One coroutine a request (the flow's own):
the admission decision is made at once in the common case (no task, no future), and
``shell.send`` may return its forward's coroutine rather than be one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from kvproxy.admission.records import AdmissionRequest, Decision, Reason
from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.pipeline import Plan, final_fields
from kvproxy.proxy.refusals import Refused
from kvproxy.proxy.usage import Usage
from kvproxy.sessions.identity import InjectionPlan
from kvproxy.sessions.lifecycle import SessionClosed, SessionForbidden

ObserveUsage = Callable[[Usage | None], None]


class Tracked(Protocol):
    """A request tracked in its session (:class:`~kvproxy.sessions.lifecycle.TrackedRequest`)."""

    @property
    def rejected(self) -> bool: ...

    def until_forwarded(self, aw: Awaitable[Decision]) -> Awaitable[Decision]: ...

    def forwarded(self) -> None: ...


_K = TypeVar("_K", bound=Tracked)


class TurnSessions(Protocol[_K]):
    """The session table's side of a turn (:class:`~kvproxy.sessions.lifecycle.SessionManager`)."""

    def note_injection(self, plan: InjectionPlan) -> None: ...

    def enter(
        self,
        session_id: str,
        rid: str,
        rids: tuple[str, ...],
        close_after: bool,
        *,
        forwarded: bool = False,
        headers: Mapping[str, str] | None = None,
        parent: str | None = None,
    ) -> _K: ...

    def leave(self, req: _K) -> None: ...


class Lease(Protocol):
    """One admission attempt (:class:`~kvproxy.admission.coordinator.Admission`)."""

    def decide_now(self) -> Decision | None: ...

    def wait(self) -> Awaitable[Decision]: ...

    def leave(self) -> None: ...


class TurnAdmission(Protocol):
    """Admission's side of a turn (:class:`~kvproxy.admission.coordinator.AdmissionController`)."""

    def admit(self, req: AdmissionRequest) -> Lease: ...

    def learns_from(self, req: AdmissionRequest) -> bool: ...

    def observe_usage(
        self,
        req: AdmissionRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None = None,
    ) -> None: ...


_R = TypeVar("_R", contravariant=True)  # the shell's request (the handler's Exchange)
_T = TypeVar("_T")  # the shell's Dynamo turn (opaque here)
_S = TypeVar("_S", covariant=True)  # what sending answers (the handler's response)
_Kc = TypeVar("_Kc", bound=Tracked, contravariant=True)


class TurnShell(Protocol[_R, _T, _S, _Kc]):
    """What a turn asks of the shell that carries it out (the effects with I/O)."""

    def begin_turn(self, req: _R, plan: Plan, session_id: str) -> tuple[_T | None, Plan]:
        """The session's Dynamo turn (None: nothing to do) and the plan with its routing
        headers and admission's routing key (:func:`~kvproxy.proxy.pipeline.with_turn_headers`)."""
        ...

    def end_turn(self, turn: _T) -> None:
        """The Dynamo turn is over (any outcome)."""
        ...

    def entered(self, req: _R, plan: Plan, tracked: _Kc | None) -> None:
        """The request is tracked (or, None, has abort rids but no session): what a client
        disconnect aborts from now on."""
        ...

    def decided(self, req: _R, decision: Decision, observe: ObserveUsage | None) -> None:
        """Admission decided: the decision's response headers or counters; ``observe``
        takes the engine's usage report (None: the response need not be read for it)."""
        ...

    def send(
        self,
        req: _R,
        plan: Plan,
        turn: _T | None,
        fields: Mapping[str, Any],
        source: str | None,
    ) -> Awaitable[_S]:
        """Send the request with ``fields`` added (``source``: where the ``priority``
        among them came from, None when none was added) and answer its response."""
        ...


R = TypeVar("R")
T = TypeVar("T")
S = TypeVar("S")
K = TypeVar("K", bound=Tracked)


class TurnFlow(Generic[R, T, S, K]):
    """The turn's flow over one shell's session table and admission controller."""

    __slots__ = ("admission", "sessions", "shell")

    def __init__(
        self,
        sessions: TurnSessions[K],
        admission: TurnAdmission,
        shell: TurnShell[R, T, S, K],
    ) -> None:
        self.sessions = sessions
        self.admission = admission
        self.shell = shell

    async def run(self, req: R, plan: Plan, path: str, headers: Mapping[str, str]) -> S:
        """Carry out ``plan`` (not a passthrough) for ``req`` received on ``path`` with
        ``headers``; see the module docstring for the order."""
        if plan.injection is not None:
            self.sessions.note_injection(plan.injection)
        sid = plan.session_id
        turn: T | None = None
        if plan.turn and sid is not None:
            turn, plan = self.shell.begin_turn(req, plan, sid)
        tracked: K | None = None
        lease: Lease | None = None
        try:
            tracked = self._track(req, plan, headers)
            steering: int | None = None
            if plan.admit:
                if tracked is not None and tracked.rejected:
                    raise SessionClosed(sid or "")
                areq = AdmissionRequest(
                    plan.ticket,
                    path,
                    headers,
                    plan.body if plan.body is not None else {},
                    plan.session_id,
                    plan.routing_key,
                    plan.parent_id,
                )
                admission = self.admission.admit(areq)
                decision = admission.decide_now()
                if decision is None:
                    waiting = admission.wait()
                    decision = await (
                        tracked.until_forwarded(waiting) if tracked is not None else waiting
                    )
                lease = admission  # released once granted, whatever follows
                steering = self._decided(req, plan, areq, decision)
                if tracked is not None:
                    tracked.forwarded()  # raises when the session began closing meanwhile
            fields, source = final_fields(plan, steering)
            return await self.shell.send(req, plan, turn, fields, source)
        except SessionClosed as exc:
            raise Refused(ErrorType.SESSION_CLOSED, str(exc)) from None
        except SessionForbidden as forbidden:  # its own name: mypyc types a name once
            raise Refused(ErrorType.FORBIDDEN, str(forbidden)) from None
        finally:
            if lease is not None:
                lease.leave()
            if tracked is not None:
                self.sessions.leave(tracked)
            if turn is not None:
                self.shell.end_turn(turn)

    def _track(self, req: R, plan: Plan, headers: Mapping[str, str]) -> K | None:
        """Track the request in its session (None: no session, or not tracked).
        ``headers`` carry the credential a bound session is checked against."""
        sid = plan.session_id
        if plan.track and sid is not None:
            # Nothing is awaited before the send unless admission waits: otherwise the
            # request is entered as forwarded (not queued, then moved). The rids are
            # the plan's, possibly none (a short client rid is never aborted by name).
            tracked = self.sessions.enter(
                sid,
                plan.ticket,
                plan.abort_rids,
                plan.close_after,
                forwarded=not plan.admit,
                headers=headers,
                parent=plan.parent_id,
            )
            self.shell.entered(req, plan, tracked)
            return tracked
        if plan.abort_rids:
            self.shell.entered(req, plan, None)
        return None

    def _decided(
        self, req: R, plan: Plan, areq: AdmissionRequest, decision: Decision
    ) -> int | None:
        """The decision told to the shell; its steering priority (None: none)."""
        admission = self.admission
        observe = _observer(admission, areq) if admission.learns_from(areq) else None
        self.shell.decided(req, decision, observe)
        if decision.reason == Reason.CANCELLED:
            # The ticket was cancelled from outside (e.g. a duplicate rid whose twin was
            # withdrawn): it must not reach the engines.
            raise Refused(
                ErrorType.REQUEST_CANCELLED,
                f"request {plan.ticket} was cancelled before it was forwarded",
            )
        return decision.priority


def _observer(admission: TurnAdmission, areq: AdmissionRequest) -> ObserveUsage:
    def observe(usage: Usage | None) -> None:
        # The engine's own usage report, from the final chunk (or the body).
        if usage is not None:
            admission.observe_usage(
                areq, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
            )
        else:
            admission.observe_usage(areq, None, None, None)

    return observe


__all__ = [
    "Lease",
    "ObserveUsage",
    "Tracked",
    "TurnAdmission",
    "TurnFlow",
    "TurnSessions",
    "TurnShell",
]
