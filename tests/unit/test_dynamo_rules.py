"""Pure rules of Dynamo's nvext: hint mapping, priority combination, streaming-session
translation and fall-backs, bind timers, the speculative-prefill body."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.binding import BindTimers
from kvproxy.dynamo.nvext import (
    NO_NVEXT,
    PREEMPTION_GAP,
    InvalidNvext,
    combine_priority,
    parse_nvext,
    strip_nvext,
)
from kvproxy.dynamo.prefill import prefill_body
from kvproxy.proxy.scan import scan_object

# ------------------------------------------------------------------ hint mapping


@pytest.mark.parametrize(
    ("nvext", "priority", "osl", "spec", "action", "bind_timeout"),
    [
        (None, None, None, False, None, None),
        ({}, None, None, False, None, None),
        ({"agent_hints": {"priority": 5, "osl": 300}}, 5, 300, False, None, None),
        (
            {"agent_hints": {"priority": 2.0, "speculative_prefill": True}},
            2,
            None,
            True,
            None,
            None,
        ),
        (
            {"session_control": {"session_id": "a", "action": "bind"}},
            None,
            None,
            False,
            "bind",
            300,
        ),
        ({"session_control": {"action": "open", "timeout": 7}}, None, None, False, "open", 7.0),
        ({"session_control": {"action": "close"}}, None, None, False, "close", None),
    ],
)
def test_parse_nvext(
    nvext: Any,
    priority: int | None,
    osl: int | None,
    spec: bool,
    action: str | None,
    bind_timeout: float | None,
) -> None:
    body = {} if nvext is None else {"nvext": nvext}
    got = parse_nvext(body)
    assert got.hints.priority == priority
    assert got.hints.osl == osl
    assert got.hints.speculative_prefill is spec
    assert got.control.action == action
    assert got.bind_timeout_s() == bind_timeout
    if nvext is None:
        assert got is NO_NVEXT


def test_a_bind_without_a_timeout_closes_after_dynamos_300_s_idle() -> None:
    # Dynamo's agentic guide: a bound session without ``timeout`` is closed after 300 s.
    # Parse the turn, start and end it on the timers as the shell does, and read when it
    # closes; a later turn's own timeout replaces the default.
    turn = parse_nvext({"nvext": {"session_control": {"session_id": "s", "action": "bind"}}})
    timeout = turn.bind_timeout_s()
    assert timeout is not None
    timers = BindTimers(4)
    timers.started("s", timeout, now=0.0)
    timers.ended("s", now=10.0)
    assert timers.expired(309.9) == []
    assert timers.expired(310.0) == ["s"]
    again = parse_nvext(
        {"nvext": {"session_control": {"session_id": "s", "action": "bind", "timeout": 5}}}
    )
    timers.started("s", timeout, now=0.0)
    timers.started("s", again.bind_timeout_s() or 0.0, now=1.0)
    timers.ended("s", now=2.0)
    timers.ended("s", now=2.0)
    assert timers.expired(7.0) == ["s"]


@pytest.mark.parametrize(
    ("nvext", "needle"),
    [
        ([], "nvext must be an object"),
        ({"agent_hints": 3}, "agent_hints must be an object"),
        ({"agent_hints": {"priority": "high"}}, "agent_hints.priority must be an integer"),
        ({"agent_hints": {"priority": True}}, "agent_hints.priority must be an integer"),
        ({"agent_hints": {"osl": -1}}, "agent_hints.osl must be >= 0"),
        ({"agent_hints": {"speculative_prefill": "yes"}}, "must be a boolean"),
        ({"session_control": {"action": "pin"}}, "action must be one of bind, open, close"),
        ({"session_control": {"timeout": 0}}, "timeout must be in (0, 86400]"),
        ({"session_control": {"timeout": "5"}}, "timeout must be a number"),
    ],
)
def test_bad_nvext_is_a_clear_error(nvext: Any, needle: str) -> None:
    with pytest.raises(InvalidNvext) as exc:
        parse_nvext({"nvext": nvext})
    assert needle in str(exc.value)


# ------------------------------------------------------- the priority combination


@pytest.mark.parametrize(
    ("top", "hint", "steering", "want"),
    [
        (3, 7, 5, (None, "body")),  # SGLang's own field wins; nothing added
        (0, None, 9, (None, "body")),
        (None, 7, 5, (7, "hint")),  # the client's hint, exactly
        (None, -20, 9, (-20, "hint")),
        (None, 100, 0, (100, "hint")),
        (None, None, 4, (4, "steering")),
        (None, None, 42, (9, "steering")),  # steering never leaves [0, 9]
        (None, None, None, (None, "none")),
    ],
)
def test_combine_priority(top: Any, hint: int | None, steering: int | None, want: Any) -> None:
    assert combine_priority(top_level=top, hint=hint, steering=steering) == want


def test_combination_never_changes_a_gap_between_hinted_requests() -> None:
    # Any two hinted requests keep the client's gap, whatever kvproxy would steer.
    for h1 in range(-12, 13):
        for h2 in range(-12, 13):
            for s1 in range(10):
                for s2 in (0, 9):
                    p1, _ = combine_priority(top_level=None, hint=h1, steering=s1)
                    p2, _ = combine_priority(top_level=None, hint=h2, steering=s2)
                    assert p1 is not None and p2 is not None
                    assert (abs(p1 - p2) >= PREEMPTION_GAP) == (abs(h1 - h2) >= PREEMPTION_GAP)


def test_steering_alone_never_reaches_the_preemption_gap() -> None:
    values = [combine_priority(top_level=None, hint=None, steering=s)[0] for s in range(-5, 50)]
    assert max(v for v in values if v is not None) - min(v for v in values if v is not None) < (
        PREEMPTION_GAP
    )


def test_strip_nvext_removes_only_nvext() -> None:
    body = {"b": 1, "nvext": {"agent_hints": {}}, "a": [1, 2], "session_id": "s"}
    raw = orjson.dumps(body)
    assert orjson.loads(strip_nvext(raw, body)) == {"b": 1, "a": [1, 2], "session_id": "s"}
    plain = {"a": 1}
    assert strip_nvext(b'{"a": 1}', plain) == b'{"a": 1}'  # untouched bytes


# ------------------------------------------------------ streaming-session translation

ENGINE = "http://e1"


def _slot(ctx: tuple[int, ...], **kw: Any) -> st.Slot:
    return st.Slot("s", ENGINE, context=ctx, first_token=ctx[0] if ctx else None, **kw)


@pytest.mark.parametrize(
    ("slot", "opening", "ids", "engine", "kind", "reason", "sent", "close"),
    [
        # first turn
        (None, True, [1, 2, 3], ENGINE, st.OPEN, None, (1, 2, 3), None),
        (None, False, [1, 2, 3], ENGINE, st.PLAIN, None, (), None),
        (None, True, [1, 2, 3], None, st.FALLBACK, st.R_PLACEMENT_UNKNOWN, (), None),
        # extend: only the new tokens
        (
            _slot((1, 2, 3, 7, 8)),
            False,
            [1, 2, 3, 7, 8, 4, 5],
            ENGINE,
            st.EXTEND,
            None,
            (4, 5),
            None,
        ),
        # mismatch: the previous output was edited
        (
            _slot((1, 2, 3, 7, 8)),
            False,
            [1, 2, 3, 7, 9, 4],
            ENGINE,
            st.FALLBACK,
            st.R_MISMATCH,
            (),
            ENGINE,
        ),
        # branch / rewind: shorter than what the engine holds
        (_slot((1, 2, 3, 7, 8)), False, [1, 2, 3], ENGINE, st.FALLBACK, st.R_BRANCH, (), ENGINE),
        (_slot((1, 2, 3, 7, 8)), False, [1, 2, 9], ENGINE, st.FALLBACK, st.R_BRANCH, (), ENGINE),
        # the same context again: nothing new to append
        (_slot((1, 2, 3)), False, [1, 2, 3], ENGINE, st.FALLBACK, st.R_NO_NEW_TOKENS, (), ENGINE),
        # a new part starting with the prompt's first token (a BOS SGLang would strip)
        (
            _slot((1, 2, 3)),
            False,
            [1, 2, 3, 1, 4],
            ENGINE,
            st.FALLBACK,
            st.R_LEADING_BOS,
            (),
            ENGINE,
        ),
        # placement moved or unknown
        (_slot((1, 2)), False, [1, 2, 3], "http://e2", st.FALLBACK, st.R_MOVED, (), ENGINE),
        (_slot((1, 2)), False, [1, 2, 3], None, st.FALLBACK, st.R_PLACEMENT_UNKNOWN, (), ENGINE),
        # one turn in flight per streaming session
        (
            _slot((1, 2), in_flight=True),
            False,
            [1, 2, 3],
            ENGINE,
            st.FALLBACK,
            st.R_IN_FLIGHT,
            (),
            ENGINE,
        ),
    ],
)
def test_plan_turn(
    slot: st.Slot | None,
    opening: bool,
    ids: list[int],
    engine: str | None,
    kind: str,
    reason: str | None,
    sent: tuple[int, ...],
    close: str | None,
) -> None:
    plan = st.plan_turn(slot, opening=opening, input_ids=ids, ineligible=None, engine=engine)
    assert (plan.kind, plan.reason, plan.input_ids, plan.close_engine) == (
        kind,
        reason,
        sent,
        close,
    )


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/generate", {"input_ids": [1, 2]}, None),
        ("/v1/chat/completions", {"messages": []}, st.R_NOT_GENERATE),
        ("/generate", {"text": "hi"}, st.R_NO_INPUT_IDS),
        ("/generate", {"input_ids": []}, st.R_NO_INPUT_IDS),
        ("/generate", {"input_ids": [[1], [2]]}, st.R_BATCH),
        ("/generate", {"input_ids": [1], "sampling_params": {"n": 2}}, st.R_BATCH),
        ("/generate", {"input_ids": [1], "stream": True}, None),
        (
            "/generate",
            {"input_ids": [1], "session_params": {"id": "x"}},
            st.R_CLIENT_SESSION_PARAMS,
        ),
    ],
)
def test_request_shape(path: str, body: dict[str, Any], reason: str | None) -> None:
    ids, why = st.request_shape(path, body)
    assert why == reason
    assert (ids is not None) == (reason is None)


def test_an_ineligible_turn_of_an_open_session_falls_back_and_closes() -> None:
    plan = st.plan_turn(
        _slot((1, 2)), opening=False, input_ids=None, ineligible=st.R_BATCH, engine=ENGINE
    )
    assert (plan.kind, plan.reason, plan.close_engine) == (st.FALLBACK, st.R_BATCH, ENGINE)
    first = st.plan_turn(None, opening=True, input_ids=None, ineligible=st.R_BATCH, engine=ENGINE)
    assert (first.kind, first.close_engine) == (st.FALLBACK, None)


def test_session_body_has_session_params_and_no_session_id() -> None:
    body = {"input_ids": [1, 2, 3, 4], "session_id": "s", "sampling_params": {"max_new_tokens": 4}}
    out = st.session_body(body, {"rid": "r1", "session_id": "s", "priority": 3}, (4,), "s")
    assert out == {
        "input_ids": [4],
        "sampling_params": {"max_new_tokens": 4},
        "rid": "r1",
        "priority": 3,
        "session_params": {"id": "s"},
    }


def test_after_turn_records_prompt_plus_output_and_checks_the_engine_prompt() -> None:
    slot = st.Slot("s", ENGINE)
    new, why = st.after_turn(slot, prompt=[1, 2, 3], output_ids=[7, 8], prompt_tokens=3)
    assert why is None and new is not None
    assert (new.context, new.first_token, new.in_flight) == ((1, 2, 3, 7, 8), 1, False)
    bad, why = st.after_turn(slot, prompt=[1, 2, 3], output_ids=[7], prompt_tokens=5)
    assert bad is None and why == st.R_CONTEXT_CHECK
    bad, why = st.after_turn(slot, prompt=[1, 2, 3], output_ids=None, prompt_tokens=3)
    assert bad is None


def test_read_generate_result() -> None:
    ok = {
        "output_ids": [5, 6],
        "meta_info": {"prompt_tokens": 4, "finish_reason": {"type": "stop"}},
    }
    assert st.read_generate_result(ok) == ([5, 6], 4, False)
    ab = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
    assert st.read_generate_result(ab)[2] is True
    assert st.read_generate_result([ok]) == (None, None, True)


def test_slot_table_is_bounded_lru() -> None:
    t = st.SlotTable(2)
    assert t.put(st.Slot("a", ENGINE, (1,))) == []
    assert t.put(st.Slot("b", ENGINE, (1, 2))) == []
    t.put(st.Slot("a", ENGINE, (1, 2, 3)))  # refresh a
    evicted = t.put(st.Slot("c", ENGINE))
    assert [s.session_id for s in evicted] == ["b"]
    assert len(t) == 2 and t.held_tokens() == 3


# --------------------------------------------------------------------- bind timers


def test_bind_timer_slides_from_the_end_of_the_last_response() -> None:
    t = BindTimers(10)
    t.started("s", 5.0, now=0.0)
    assert t.expired(100.0) == []  # running: never expires
    t.ended("s", now=10.0)
    assert t.expired(14.9) == []
    t.started("s", 5.0, now=14.0)  # a new turn before the deadline
    t.ended("s", now=20.0)
    assert t.expired(24.0) == []
    assert t.expired(25.0) == ["s"]
    assert len(t) == 0


def test_bind_timers_are_bounded() -> None:
    t = BindTimers(2)
    for i, sid in enumerate("abc"):
        t.started(sid, 1.0, now=float(i))
    assert len(t) == 2 and t.dropped == 1 and t.timeout_of("a") is None


# -------------------------------------------------------------- speculative prefill


def test_prefill_body_generate_carries_the_output_ids() -> None:
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 64, "temperature": 0},
        "stream": True,
        "nvext": {"agent_hints": {"speculative_prefill": True}},
        "rid": "client",
    }
    out = prefill_body("/generate", body, {"output_ids": [7, 8]}, session_id="s", rid="r")
    assert out == {
        "input_ids": [1, 2, 7, 8],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "rid": "r",
        "session_id": "s",
    }


def test_prefill_body_chat_appends_the_assistant_answer() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [1], "n": 1}
    resp = {"choices": [{"message": {"role": "assistant", "content": "yo"}}]}
    out = prefill_body("/v1/chat/completions", body, resp, session_id="s", rid="r")
    assert out == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "tools": [1],
        "rid": "r",
        "session_id": "s",
        "max_tokens": 1,
    }
    comp = prefill_body(
        "/v1/completions", {"prompt": "a"}, {"choices": [{"text": "b"}]}, session_id="s", rid="r"
    )
    assert comp is not None and comp["prompt"] == "ab"


@pytest.mark.parametrize(
    ("path", "body", "resp"),
    [
        ("/generate", {"input_ids": [1]}, {"error": "x"}),
        ("/generate", {"input_ids": [1]}, [{"output_ids": [1]}]),
        ("/v1/chat/completions", {"messages": []}, {"choices": []}),
        ("/v1/chat/completions", {"messages": []}, {"choices": [{}, {}]}),
    ],
)
def test_prefill_body_unreadable(path: str, body: dict[str, Any], resp: Any) -> None:
    assert prefill_body(path, body, resp, session_id="s", rid="r") is None


# ------------------------------------------------------- streaming pool share


@pytest.mark.parametrize(
    ("body", "footprint"),
    [
        ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 10}}, 13),
        ({"input_ids": [1, 2, 3]}, 3 + st.DEFAULT_MAX_NEW_TOKENS),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, 1 + 128),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -4}}, 1 + 128),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, 1),
        ({"text": "x", "sampling_params": {"max_new_tokens": 5}}, 5),
    ],
)
def test_turn_footprint_is_prompt_plus_output_budget(body: dict[str, Any], footprint: int) -> None:
    assert st.turn_footprint(body) == footprint


@pytest.mark.parametrize("count", [True, False])
def test_turn_footprint_of_a_scanned_body_builds_no_list(count: bool) -> None:
    """The proxy passes a BodyScan: the footprint comes from its count (eager or
    deferred), the same as the dict's, and the 5,000 ids are never materialised."""
    doc = {"input_ids": list(range(5000)), "sampling_params": {"max_new_tokens": 7}}
    scan = scan_object(orjson.dumps(doc), count=count)
    assert scan is not None and scan.excised == ("input_ids",)
    assert st.turn_footprint(scan) == st.turn_footprint(doc) == 5007
    assert scan._materialised == {}


@pytest.mark.parametrize(
    ("footprint", "session_held", "own", "reported", "capacity", "share", "verdict"),
    [
        # Empty engine: a turn within the share opens, one past it does not.
        (2000, 0, 0, None, 4000, 0.5, None),
        (2001, 0, 0, None, 4000, 0.5, st.R_POOL_SHARE),
        # Other sessions' held KV counts; this session's own slot is not counted twice.
        (1000, 0, 1500, None, 4000, 0.5, st.R_POOL_SHARE),
        (1500, 800, 1300, None, 4000, 0.5, None),
        (1501, 800, 1300, None, 4000, 0.5, st.R_POOL_SHARE),
        # The engine's reported held KV (sessions kvproxy did not open) wins when larger.
        (500, 0, 0, 1600, 4000, 0.5, st.R_POOL_SHARE),
        (500, 0, 1600, 200, 4000, 0.5, st.R_POOL_SHARE),
        (500, 0, 0, 1500, 4000, 0.5, None),
        # Share 1: the whole pool.
        (4000, 0, 0, 0, 4000, 1.0, None),
        (4001, 0, 0, 0, 4000, 1.0, st.R_POOL_SHARE),
        # Unknown capacity: nothing to compare with, it opens.
        (10**9, 0, 0, None, None, 0.5, None),
        (10**9, 0, 0, None, 0, 0.5, None),
    ],
)
def test_pool_share_check(
    footprint: int,
    session_held: int,
    own: int,
    reported: int | None,
    capacity: int | None,
    share: float,
    verdict: str | None,
) -> None:
    got = st.pool_share_check(
        footprint=footprint,
        session_held=session_held,
        own_held=own,
        reported_held=reported,
        capacity=capacity,
        share=share,
    )
    assert got == verdict


def test_slot_table_counts_in_flight_reservations_per_engine() -> None:
    t = st.SlotTable(10)
    t.put(st.Slot("a", "e1", context=(1, 2, 3)))
    t.put(st.Slot("b", "e1", context=(1,), in_flight=True, reserved=50))
    t.put(st.Slot("c", "e2", context=(1, 2), in_flight=True, reserved=1))
    assert t.held_tokens("e1") == 3 + 50
    assert t.held_tokens("e2") == 2
    assert t.held_tokens() == 55


@pytest.mark.parametrize("share", [0, -0.1, 1.01])
def test_pool_share_config_is_validated(share: float) -> None:
    from kvproxy.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match="streaming_max_pool_share"):
        from_mapping({"session_lifecycle": {"enabled": True, "streaming_max_pool_share": share}})


def _slots(*specs: tuple[str, str, int, bool]) -> list[st.Slot]:
    return [
        st.Slot(sid, eng, context=tuple(range(n)), in_flight=busy) for sid, eng, n, busy in specs
    ]


@pytest.mark.parametrize(
    ("slots", "footprint", "capacity", "released"),
    [
        # Fits beside the pinned KV: nothing released.
        (_slots(("a", "e1", 1000, False), ("b", "e1", 1000, False)), 2000, 4000, []),
        # Least recently used first, only as many as needed.
        (_slots(("a", "e1", 1000, False), ("b", "e1", 1000, False)), 2500, 4000, ["a"]),
        (_slots(("a", "e1", 1000, False), ("b", "e1", 1000, False)), 3500, 4000, ["a", "b"]),
        # A slot with a turn in flight is kept; other engines are not touched.
        (
            _slots(("a", "e1", 1000, True), ("x", "e2", 3000, False), ("b", "e1", 1000, False)),
            2500,
            4000,
            ["b"],
        ),
        # Even all idle ones are not enough: release them all.
        (_slots(("a", "e1", 1000, True), ("b", "e1", 1000, False)), 3900, 4000, ["b"]),
        # Unknown capacity: nothing.
        (_slots(("a", "e1", 1000, False)), 10**6, None, []),
    ],
)
def test_slots_to_release(
    slots: list[st.Slot], footprint: int, capacity: int | None, released: list[str]
) -> None:
    got = st.slots_to_release(slots, engine="e1", footprint=footprint, capacity=capacity)
    assert [s.session_id for s in got] == released
