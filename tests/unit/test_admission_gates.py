"""One conformance table for both admission gates (fleet mode's and program mode's):
the same scripted cases, the same expected answers, run against each through the
:class:`~kvproxy.admission.gate.Gate` protocol only.

Each case starts from one engine of 1,000 tokens that three sessions of 250 tokens
already hold a turn on (all three fit); a fourth session's turn of 300 does not fit
and waits. What a case does next (a release, a session's end, a cancellation, a stop)
must end the same way in either mode."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from multidict import CIMultiDict

from kvproxy.admission.gate import Gate
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.records import AdmissionRequest, Decision, Mode, Outcome
from kvproxy.admission.waiters import Waiter, WaiterState
from kvproxy.admission.wiring import Parts, build
from kvproxy.config import AdmissionConfig
from kvproxy.observability import RateLimitedLog

URL = "http://e:1"
NOW = 1000.0
CFG = AdmissionConfig(
    enabled=True,
    headroom=1.0,
    staleness_s=3600.0,
    target_start=0.9,
    session_buffer_tokens=0,
    engage_on_thrash=False,  # program mode's gate engaged from the start
)
METRICS = (
    'sglang:max_total_num_tokens{model_name="m"} 1000\nsglang:token_usage{model_name="m"} 0.0\n'
)
# On a stop, each mode's waiters leave with the controller's outcome for it.
ON_STOP = {Mode.FLEET: Outcome.DEGRADED, Mode.PROGRAM: Outcome.BYPASS_NO_METRICS}


def request(ticket: str, sid: str, tokens: int) -> AdmissionRequest:
    body = {"input_ids": [1] * tokens, "sampling_params": {"max_new_tokens": 0}}
    return AdmissionRequest(ticket, "/generate", CIMultiDict(), body, sid)


async def _fetch(url: str) -> str:
    return METRICS


def parts() -> Parts:
    p = build(
        CFG,
        ProgramParams.from_config(CFG),
        http=None,
        fetch_metrics=_fetch,
        metrics_timeout_s=lambda: 1.0,
        router_policy="consistent_hashing",
        workers=lambda: ([URL], [URL]),
        router_url=None,
        clock=lambda: NOW,
        log=RateLimitedLog(logging.getLogger("test"), 30.0),
    )
    p.program.refresh_placement()
    p.poller.observe([URL], [METRICS], NOW, p.ledger, p.core.ledger)
    return p


@dataclass
class World:
    gate: Gate
    leases: dict[str, Decision]
    waiter: Waiter


def ready(mode: Mode) -> World:
    gate = parts().gates[mode]
    assert gate.mode is mode
    leases = {}
    for sid in ("s1", "s2", "s3"):
        d = gate.decide(request(sid + ":1", sid, 250))
        assert isinstance(d, Decision) and d.action == "admit", d
        leases[sid] = d
    pending = gate.decide(request("s4:1", "s4", 300))
    assert isinstance(pending, tuple), pending
    waiter, shared = pending
    assert not shared and gate.waiters == {"s4:1": waiter}
    return World(gate, leases, waiter)


def end_one(w: World) -> None:
    d = w.leases["s1"]
    assert d.lease_id is not None
    w.gate.release(d.lease_id, "s1:1", NOW)
    assert w.gate.end_session("s1", NOW) and not w.gate.end_session("s1", NOW)


def release_only(w: World) -> None:
    d = w.leases["s1"]
    assert d.lease_id is not None
    w.gate.release(d.lease_id, "s1:1", NOW)


def cancel(w: World) -> None:
    w.gate.cancel(w.waiter, NOW)


def stop(w: World) -> None:
    w.gate.release_all(ON_STOP[w.gate.mode])


def duplicate(w: World) -> None:
    again = w.gate.decide(request("s4:1", "s4", 300))
    assert again == (w.waiter, True)


def unknown_session(w: World) -> None:
    assert not w.gate.end_session("nobody", NOW)


# (case, what it does, the waiter's state after, its decision's (action, holds a lease,
# mode of the lease) or None while it waits, the gate's waiters after)
Case = tuple[str, Callable[[World], None], WaiterState, Any, int]
CASES: list[Case] = [
    (
        "a session's end frees room: the waiter goes",
        end_one,
        WaiterState.RESOLVED,
        ("admit", True),
        0,
    ),
    ("a release alone keeps the session's room", release_only, WaiterState.WAITING, None, 1),
    (
        "a cancelled waiter leaves, not forwarded",
        cancel,
        WaiterState.CANCELLED,
        ("bypass", False),
        0,
    ),
    ("a stop lets every waiter go, fail open", stop, WaiterState.RESOLVED, ("bypass", False), 0),
    ("a second attempt shares the waiter", duplicate, WaiterState.WAITING, None, 1),
    ("an unknown session's end changes nothing", unknown_session, WaiterState.WAITING, None, 1),
]


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(
    ("name", "act", "state", "decided", "left"), CASES, ids=[c[0] for c in CASES]
)
async def test_every_gate_answers_the_script_alike(
    mode: Mode, name: str, act: Callable[[World], None], state: WaiterState, decided: Any, left: int
) -> None:
    w = ready(mode)
    assert w.gate.oldest() == NOW
    act(w)
    assert w.waiter.state is state
    assert len(w.gate.waiters) == left
    assert (w.gate.oldest() is None) == (left == 0)
    if decided is None:
        assert not w.waiter.future.done()
        return
    d = w.waiter.future.result()
    action, leased = decided
    assert d.action == action and (d.lease_id is not None) == leased
    assert d.mode == (mode if leased else None)
    if leased:
        assert d.lease_id is not None
        w.gate.release(d.lease_id, "s4:1", NOW)  # its release is accepted
