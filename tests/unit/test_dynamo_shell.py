"""The nvext shell without engines: sticky headers, bind timers and their reaper, the
speculative prefill's skip reasons, streaming plans (no HTTP is reached)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvproxy.config import from_mapping
from kvproxy.dynamo import control as dynamo
from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.nvext import parse_nvext
from kvproxy.dynamo.prefill import StreamAnswer
from kvproxy.fleet.ring import HashRing
from kvproxy.sessions.identity import ROUTING_KEY_HEADER

W1, W2 = "http://127.0.0.1:1", "http://127.0.0.1:2"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def control() -> Any:
    closed: list[str] = []
    state = {"open": True, "pressure": False}
    clock = Clock()

    async def close(sid: str) -> None:
        closed.append(sid)

    cfg = from_mapping(
        {
            "router": {"policy": "consistent_hashing"},
            "session_lifecycle": {"enabled": True, "speculative_prefill_max_in_flight": 1},
        }
    )
    async with aiohttp.ClientSession() as http:
        c = dynamo.Dynamo(
            cfg,
            http=http,
            router_base="http://127.0.0.1:9",
            ring_workers=lambda: ((W1, W2), (W1, W2)),
            close_session=close,
            session_open=lambda sid: state["open"],
            pressure=lambda engine: state["pressure"],
            clock=clock,
        )
        c.test_closed = closed
        c.test_state = state
        c.test_clock = clock
        yield c
        await c.stop()


def _nv(**control: Any) -> Any:
    return parse_nvext({"nvext": {"session_control": control}})


async def test_bind_routes_stickily_and_closes_after_its_idle_timeout(control: Any) -> None:
    turn, headers = control.begin("s", "/v1/chat/completions", _nv(action="bind", timeout=5), False)
    assert headers == {ROUTING_KEY_HEADER: "s"}
    control.test_clock.t = 100.0
    assert control.reap(100.0) == []  # the turn is still running
    control.end(turn)
    # A later turn without nvext is still sticky and keeps the timer.
    later, headers = control.begin("s", "/v1/chat/completions", _nv(), False)
    assert headers == {ROUTING_KEY_HEADER: "s"} and later.bind_timeout_s == 5.0
    control.test_clock.t = 101.0
    control.end(later)
    assert control.reap(105.9) == []
    assert control.reap(106.0) == ["s"]
    await asyncio.gather(*control._background)
    assert control.test_closed == ["s"]
    assert control.counters.total(dynamo.BIND_CLOSED) == 1


async def test_plain_sessions_get_no_header_and_no_timer(control: Any) -> None:
    turn, headers = control.begin("p", "/generate", _nv(), False)
    assert headers == {} and turn.bind_timeout_s is None and len(control.timers) == 0


async def test_a_turn_is_quiet_only_when_it_would_do_nothing(control: Any) -> None:
    # Quiet: no nvext, no slot held by any session, no timer for this one. The request
    # path then opens no turn, so a quiet turn must be one begin() would leave bare.
    assert control.quiet("p", parse_nvext({}))
    turn, headers = control.begin("p", "/generate", parse_nvext({}), False)
    assert headers == {} and turn.bind_timeout_s is None and not control.involved(turn)
    assert not control.quiet("p", _nv())  # an nvext, even an empty one
    bound, _ = control.begin("b", "/generate", _nv(action="bind", timeout=5), False)
    control.end(bound)
    assert not control.quiet("b", parse_nvext({}))  # its timer keeps it sticky
    assert control.quiet("other", parse_nvext({}))
    control.slots.put(st.Slot("elsewhere", W1))
    assert not control.quiet("other", parse_nvext({}))  # any slot involves Dynamo


async def test_bind_default_timeout_is_300_scaled(control: Any) -> None:
    turn, _ = control.begin("s", "/generate", _nv(action="bind"), False)
    assert turn.bind_timeout_s == 300.0


def _spec_turn(control: Any, *, close_after: bool = False) -> dynamo.Turn:
    nv = parse_nvext({"nvext": {"agent_hints": {"speculative_prefill": True}}})
    turn, _ = control.begin("s", "/v1/chat/completions", nv, close_after)
    turn.response = b'{"choices": [{"message": {"role": "assistant", "content": "ok"}}]}'
    return turn


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("closing", "session_end"),
        ("closed", "session_end"),
        ("streaming", "streaming_session"),
        ("no_body", "no_response_body"),
        ("stream_too_big", "answer_too_big"),
        ("pressure", "pressure"),
        ("unreadable", "unreadable"),
    ],
)
async def test_prefill_skip_reasons(control: Any, setup: str, reason: str) -> None:
    turn = _spec_turn(control, close_after=setup == "closing")
    if setup == "closed":
        control.test_state["open"] = False
    if setup == "streaming":
        control.slots.put(st.Slot("s", W1))
    if setup == "no_body":
        turn.response = None
    if setup == "stream_too_big":  # a streamed answer past its bound
        answer = StreamAnswer("/v1/chat/completions", limit=4)
        answer.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "too long"}}]}\n\n')
        turn.keep_stream(answer)
    if setup == "pressure":
        control.test_state["pressure"] = True
    if setup == "unreadable":
        turn.response = b'{"choices": []}'
    assert control.after_response(turn, BODY, {}) == reason
    assert control.counters.total(dynamo.PREFILL_SKIPPED + reason) == 1
    assert not control._prefills


async def test_prefills_in_flight_are_bounded(control: Any) -> None:
    assert control.after_response(_spec_turn(control), BODY, {}) is None  # started
    assert control.after_response(_spec_turn(control), BODY, {}) == "in_flight_cap"


async def test_no_hint_no_prefill(control: Any) -> None:
    turn, _ = control.begin("s", "/v1/chat/completions", _nv(), False)
    turn.response = b"{}"
    assert control.after_response(turn, BODY, {}) is None
    assert not control._prefills


async def test_only_a_hinted_turn_with_the_feature_on_keeps_its_answer(control: Any) -> None:
    # wants_body decides whether the relay keeps (or accumulates, when streamed) the answer.
    assert _spec_turn(control).wants_body
    assert not control.begin("s", "/v1/chat/completions", _nv(), False)[0].wants_body
    control.reconfigure(
        from_mapping({"session_lifecycle": {"enabled": True, "speculative_prefill": False}})
    )
    assert not _spec_turn(control).wants_body


async def test_streaming_plans_use_the_mirrored_ring(control: Any) -> None:
    turn, _ = control.begin("s", "/generate", _nv(action="open"), False)
    plan = control.plan(turn, {"input_ids": [1, 2]}, "s")
    owner = HashRing((W1, W2)).owner("s", {W1, W2})
    assert (plan.kind, plan.engine) == (st.OPEN, owner)
    chat, _ = control.begin("c", "/v1/chat/completions", _nv(action="open"), False)
    assert control.plan(chat, {"messages": []}, "c").kind == st.PLAIN  # open = bind on chat
    gone, _ = control.begin("g", "/generate", _nv(action="open"), False)
    control.slots.put(st.Slot("g", "http://elsewhere:1", (1, 2)))
    moved = control.plan(gone, {"input_ids": [1, 2, 3]}, "g")
    assert (moved.kind, moved.reason) == (st.FALLBACK, st.R_MOVED)
    assert control.slots.get("g") is None  # closed on fall-back


async def test_an_engine_that_refused_streaming_is_not_asked_again(control: Any) -> None:
    owner = HashRing((W1, W2)).owner("s", {W1, W2})
    control.no_streaming.add(owner)
    turn, _ = control.begin("s", "/generate", _nv(action="open"), False)
    plan = control.plan(turn, {"input_ids": [1, 2]}, "s")
    assert (plan.kind, plan.reason) == (st.FALLBACK, st.R_OPEN_FAILED)
    assert control.counters.total(dynamo.STREAM_FALLBACK + st.R_OPEN_FAILED) == 1


async def test_session_control_is_involved_only_with_slots_or_an_open(control: Any) -> None:
    plain, _ = control.begin("p", "/generate", _nv(), False)
    assert not control.involved(plain)  # nothing to plan or settle: skipped
    assert control.plan(plain, {"input_ids": [1, 2]}, "p").kind == st.PLAIN
    opening, _ = control.begin("o", "/generate", _nv(action="open"), False)
    assert control.involved(opening)
    control.slots.put(st.Slot("x", W1, (1, 2)))  # any slot: settle may release it
    assert control.involved(plain)
