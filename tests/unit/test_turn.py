"""The turn's flow (kvproxy.proxy.turn) as playbooks: no sockets, no engines.

Each test scripts what the session table, admission and the shell answer (the events),
runs one turn, and reads back every effect the flow asked for, in order. The fakes
below are the flow's protocols and nothing more: the real session table, controller
and shells are tested against real engines elsewhere (the handler through the router
in tests/integration, the lab in tests/lab).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvproxy.admission.records import Action, AdmissionRequest, Decision, Mode, Outcome
from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.pipeline import Plan
from kvproxy.proxy.refusals import Refused
from kvproxy.proxy.turn import ObserveUsage, TurnFlow
from kvproxy.proxy.usage import Usage
from kvproxy.sessions.identity import InjectionPlan
from kvproxy.sessions.lifecycle import SessionClosed

OK = Outcome.CAPACITY_AVAILABLE
ADMIT = Decision(Action.ADMIT, OK, "lease-1", 100, 0.0, mode=Mode.FLEET)
WAITED = Decision(Action.ADMIT, OK, "lease-1", 100, 1.5, mode=Mode.FLEET)
STEERED = Decision(Action.ADMIT, OK, "lease-1", 100, 0.0, priority=7, mode=Mode.FLEET)
# No fresh reading: forwarded without a lease.
FAIL_OPEN = Decision(Action.BYPASS, Outcome.DEGRADED, None, 100, 0.0)
CANCELLED = Decision(Action.BYPASS, Outcome.CANCELLED, None, 0, 0.0)
USAGE = Usage(prompt_tokens=90, completion_tokens=10, cached_tokens=40)


@dataclass
class Script:
    """What the fakes answer, one field per event the flow can meet."""

    closing_at_entry: bool = False  # sessions.enter: the session is closing
    rejected: bool = False  # tracked.rejected before admission
    decide_now: Decision | None = ADMIT  # None: the request waits
    waited: Decision = WAITED  # what the wait answers
    close_while_waiting: bool = False  # tracked.until_forwarded: the close came first
    close_after_grant: bool = False  # tracked.forwarded(): the close began meanwhile
    learns: bool = True  # admission.learns_from
    dynamo_turn: bool = True  # shell.begin_turn: a Dynamo turn (else None: quiet)
    send_raises: BaseException | None = None  # the send fails (e.g. client gone)
    usage: Usage | None = USAGE  # what the engine reports, given to the observer


@dataclass
class Playbook:
    """The flow's collaborators, all recording into one log."""

    script: Script = field(default_factory=Script)
    log: list[tuple[Any, ...]] = field(default_factory=list)

    def run(self, plan: Plan) -> Any:
        flow: TurnFlow[str, str, str, FakeTracked] = TurnFlow(
            FakeSessions(self), FakeAdmission(self), FakeShell(self)
        )
        return asyncio.run(flow.run("req", plan, "/generate", {"X-Client": "c"}))

    def effects(self) -> list[str]:
        return [e[0] for e in self.log]


class FakeTracked:
    def __init__(self, pb: Playbook) -> None:
        self.pb = pb

    @property
    def rejected(self) -> bool:
        return self.pb.script.rejected

    async def until_forwarded(self, aw: Awaitable[Decision]) -> Decision:
        self.pb.log.append(("until_forwarded",))
        if self.pb.script.close_while_waiting:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise SessionClosed("s1")
        return await aw

    def forwarded(self) -> None:
        self.pb.log.append(("forwarded",))
        if self.pb.script.close_after_grant:
            raise SessionClosed("s1")


class FakeSessions:
    def __init__(self, pb: Playbook) -> None:
        self.pb = pb

    def note_injection(self, plan: InjectionPlan) -> None:
        self.pb.log.append(("note_injection",))

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
    ) -> FakeTracked:
        self.pb.log.append(("enter", session_id, rid, rids, close_after, forwarded))
        if parent is not None:
            self.pb.log.append(("parent", session_id, parent))
        if self.pb.script.closing_at_entry:
            raise SessionClosed(session_id)
        return FakeTracked(self.pb)

    def leave(self, req: FakeTracked) -> None:
        self.pb.log.append(("leave",))


class FakeLease:
    def __init__(self, pb: Playbook) -> None:
        self.pb = pb

    def decide_now(self) -> Decision | None:
        self.pb.log.append(("decide_now",))
        return self.pb.script.decide_now

    async def wait(self) -> Decision:
        self.pb.log.append(("wait",))
        return self.pb.script.waited

    def leave(self) -> None:
        self.pb.log.append(("lease_leave",))


class FakeAdmission:
    def __init__(self, pb: Playbook) -> None:
        self.pb = pb

    def admit(self, req: AdmissionRequest) -> FakeLease:
        self.pb.log.append(("admit", req.ticket_id, req.path, req.session_id, req.routing_key))
        return FakeLease(self.pb)

    def learns_from(self, req: AdmissionRequest) -> bool:
        return self.pb.script.learns

    def observe_usage(
        self,
        req: AdmissionRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None = None,
    ) -> None:
        self.pb.log.append(("observe_usage", prompt_tokens, cached_tokens, completion_tokens))


class FakeShell:
    def __init__(self, pb: Playbook) -> None:
        self.pb = pb
        self.observe: ObserveUsage | None = None

    def begin_turn(self, req: str, plan: Plan, session_id: str) -> tuple[str | None, Plan]:
        self.pb.log.append(("begin_turn", session_id))
        turn = "turn-" + session_id if self.pb.script.dynamo_turn else None
        return turn, plan.with_headers({"X-Bound": "e1"}, "rk-" + session_id)

    def end_turn(self, turn: str) -> None:
        self.pb.log.append(("end_turn", turn))

    def entered(self, req: str, plan: Plan, tracked: FakeTracked | None) -> None:
        self.pb.log.append(("entered", tracked is not None))

    def decided(self, req: str, decision: Decision, observe: ObserveUsage | None) -> None:
        self.pb.log.append(("decided", decision.action, decision.reason, observe is not None))
        self.observe = observe

    async def send(
        self,
        req: str,
        plan: Plan,
        turn: str | None,
        fields: Mapping[str, Any],
        source: str | None,
    ) -> str:
        self.pb.log.append(("send", turn, dict(fields), source, dict(plan.headers)))
        if self.pb.script.send_raises is not None:
            raise self.pb.script.send_raises
        if self.observe is not None:
            self.observe(self.pb.script.usage)
        return "response"


def session_plan(*, admit: bool, **kw: Any) -> Plan:
    """A lifecycle plan of session s1 (tracked, a Dynamo turn), as plan_request makes it."""
    kw.setdefault("abort_rids", ("r1",))
    return Plan(
        body={"text": "hi", "rid": "r1"},
        fields={"session_id": "s1"},
        session_id="s1",
        ticket="r1",
        injection=InjectionPlan(fields={"session_id": "s1"}, rid="r1"),
        track=True,
        turn=True,
        admit=admit,
        **kw,
    )


RELEASE = ["lease_leave", "leave", "end_turn"]


# -- the common paths -----------------------------------------------------------------


def test_lifecycle_alone_enters_as_forwarded_sends_and_releases_in_reverse() -> None:
    pb = Playbook()
    assert pb.run(session_plan(admit=False)) == "response"
    assert pb.log == [
        ("note_injection",),
        ("begin_turn", "s1"),
        ("enter", "s1", "r1", ("r1",), False, True),  # nothing awaited: forwarded at once
        ("entered", True),
        ("send", "turn-s1", {"session_id": "s1"}, None, {"X-Bound": "e1"}),
        ("leave",),
        ("end_turn", "turn-s1"),
    ]


def test_admitted_at_once_decides_forwards_sends_observes_and_leaves_the_lease_first() -> None:
    pb = Playbook()
    assert pb.run(session_plan(admit=True)) == "response"
    assert pb.log == [
        ("note_injection",),
        ("begin_turn", "s1"),
        ("enter", "s1", "r1", ("r1",), False, False),  # queued until admitted
        ("entered", True),
        ("admit", "r1", "/generate", "s1", "rk-s1"),  # the turn's routing key
        ("decide_now",),
        ("decided", "admit", "capacity_available", True),
        ("forwarded",),
        ("send", "turn-s1", {"session_id": "s1"}, None, {"X-Bound": "e1"}),
        ("observe_usage", 90, 40, 10),
        ("lease_leave",),
        ("leave",),
        ("end_turn", "turn-s1"),
    ]


def test_a_waiting_request_waits_through_its_session_then_goes_on() -> None:
    pb = Playbook(Script(decide_now=None))
    pb.run(session_plan(admit=True))
    assert pb.effects() == [
        "note_injection",
        "begin_turn",
        "enter",
        "entered",
        "admit",
        "decide_now",
        "until_forwarded",  # a session close cancels the wait
        "wait",
        "decided",
        "forwarded",
        "send",
        "observe_usage",
        *RELEASE,
    ]


def test_admission_alone_without_a_session_tracks_nothing() -> None:
    pb = Playbook()
    plan = Plan(body={"text": "hi"}, ticket="r9", admit=True, routing_key=None)
    pb.run(plan)
    assert pb.log == [
        ("admit", "r9", "/generate", None, None),
        ("decide_now",),
        ("decided", "admit", "capacity_available", True),
        ("send", None, {}, None, {}),
        ("observe_usage", 90, 40, 10),
        ("lease_leave",),
    ]


def test_steering_priority_is_added_to_the_fields_with_its_source() -> None:
    pb = Playbook(Script(decide_now=STEERED))
    pb.run(session_plan(admit=True))
    send = next(e for e in pb.log if e[0] == "send")
    assert send[2] == {"session_id": "s1", "priority": 7} and send[3] == "steering"


def test_a_response_that_teaches_nothing_is_not_observed() -> None:
    pb = Playbook(Script(learns=False))
    pb.run(session_plan(admit=True))
    assert ("decided", "admit", "capacity_available", False) in pb.log
    assert "observe_usage" not in pb.effects()


def test_an_unreadable_usage_report_is_observed_as_unknown() -> None:
    pb = Playbook(Script(usage=None))
    pb.run(session_plan(admit=True))
    assert ("observe_usage", None, None, None) in pb.log


def test_a_quiet_dynamo_turn_is_not_ended() -> None:
    pb = Playbook(Script(dynamo_turn=False))
    pb.run(session_plan(admit=False))
    assert pb.effects()[-2:] == ["send", "leave"]


def test_abort_rids_without_a_session_say_what_a_disconnect_aborts() -> None:
    pb = Playbook()
    pb.run(Plan(body={"text": "hi"}, ticket="r1", abort_rids=("r1", "r1-n1")))
    assert pb.log == [("entered", False), ("send", None, {}, None, {})]


def test_a_plan_without_abort_rids_tracks_none() -> None:
    # A short client rid is never named in an abort: not even as the ticket.
    pb = Playbook()
    pb.run(session_plan(admit=False, abort_rids=()))
    assert ("enter", "s1", "r1", (), False, True) in pb.log


def test_abort_rids_are_what_the_session_tracks() -> None:
    pb = Playbook()
    pb.run(session_plan(admit=False, abort_rids=("r1", "r1-n1")))
    assert ("enter", "s1", "r1", ("r1", "r1-n1"), False, True) in pb.log


# -- fail-open ------------------------------------------------------------------------


def test_a_fail_open_bypass_is_forwarded_and_holds_no_lease_of_its_own() -> None:
    pb = Playbook(Script(decide_now=FAIL_OPEN))
    assert pb.run(session_plan(admit=True)) == "response"
    assert pb.effects() == [
        "note_injection",
        "begin_turn",
        "enter",
        "entered",
        "admit",
        "decide_now",
        "decided",
        "forwarded",
        "send",
        "observe_usage",
        *RELEASE,  # leaving is the lease's business (a bypass holds none)
    ]
    assert ("decided", "bypass", "degraded", True) in pb.log


# -- refusals and aborts --------------------------------------------------------------


def _refused(pb: Playbook, plan: Plan) -> ErrorType:
    with pytest.raises(Refused) as info:
        pb.run(plan)
    return info.value.refusal.kind


def test_a_closing_session_refuses_at_entry_and_leaves_only_the_dynamo_turn() -> None:
    pb = Playbook(Script(closing_at_entry=True))
    assert _refused(pb, session_plan(admit=True)) == ErrorType.SESSION_CLOSED
    assert pb.effects() == ["note_injection", "begin_turn", "enter", "end_turn"]


def test_a_session_rejected_before_admission_is_never_admitted() -> None:
    pb = Playbook(Script(rejected=True))
    assert _refused(pb, session_plan(admit=True)) == ErrorType.SESSION_CLOSED
    assert pb.effects() == ["note_injection", "begin_turn", "enter", "entered", "leave", "end_turn"]


def test_a_close_while_waiting_cancels_the_wait_and_holds_no_lease() -> None:
    pb = Playbook(Script(decide_now=None, close_while_waiting=True))
    assert _refused(pb, session_plan(admit=True)) == ErrorType.SESSION_CLOSED
    assert pb.effects() == [
        "note_injection",
        "begin_turn",
        "enter",
        "entered",
        "admit",
        "decide_now",
        "until_forwarded",
        "leave",
        "end_turn",
    ]


def test_a_close_after_the_grant_refuses_and_releases_the_lease() -> None:
    pb = Playbook(Script(close_after_grant=True))
    assert _refused(pb, session_plan(admit=True)) == ErrorType.SESSION_CLOSED
    assert pb.effects()[-5:] == ["decided", "forwarded", *RELEASE]
    assert "send" not in pb.effects()


def test_a_cancelled_ticket_is_refused_before_it_is_sent() -> None:
    pb = Playbook(Script(decide_now=CANCELLED))
    assert _refused(pb, session_plan(admit=True)) == ErrorType.REQUEST_CANCELLED
    assert pb.effects()[-4:] == ["decided", *RELEASE]
    assert "forwarded" not in pb.effects() and "send" not in pb.effects()


@pytest.mark.parametrize("failure", [asyncio.CancelledError(), ConnectionResetError("client gone")])
def test_a_failed_send_propagates_and_releases_everything_in_reverse(
    failure: BaseException,
) -> None:
    pb = Playbook(Script(send_raises=failure))
    with pytest.raises(type(failure)):
        pb.run(session_plan(admit=True))
    assert pb.effects()[-4:] == ["send", *RELEASE]
    assert "observe_usage" not in pb.effects()
