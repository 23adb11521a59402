"""Program admission's prefetch: the plan, the prompts kept, the one-token body, and the
core's rules (who is due when, and which engine may take it), with an injected clock
and engine readings."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.events import Event
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.prefetch import (
    TOOL_SAMPLES,
    PrefetchPlan,
    Prompts,
    expected_tool_s,
    tool_end_in_s,
    with_tool_call,
)
from kvproxy.config import AdmissionConfig
from kvproxy.proxy.scan import scan_object
from kvproxy.warm import body_bytes, warm_body

E1 = "http://e1:1"
P = ProgramParams(
    engage_on_thrash=False,
    headroom=1.0,
    staleness_s=10.0,
    prefetch=True,
    prefetch_lead_s=2.0,
    prefetch_max_in_flight=1,
    pressure_threshold=0.9,
)


# -- the plan --------------------------------------------------------------------------


def test_the_plan_gives_who_is_due_earliest_first_once() -> None:
    plan = PrefetchPlan(max_sessions=10)
    assert plan.plan("b", 5.0) and plan.plan("a", 3.0) and plan.plan("c", 9.0)
    assert plan.pop_due(2.9) == []
    assert plan.pop_due(5.0) == ["a", "b"]
    assert plan.pop_due(5.0) == []
    assert "c" in plan and len(plan) == 1


def test_a_new_plan_replaces_the_old_and_a_cancelled_one_never_comes() -> None:
    plan = PrefetchPlan(max_sessions=10)
    plan.plan("a", 3.0)
    plan.plan("a", 7.0)  # replaced: not due at 3
    plan.plan("b", 4.0)
    assert plan.cancel("b") and not plan.cancel("b")
    assert plan.pop_due(6.0) == []
    assert plan.pop_due(7.0) == ["a"]


def test_the_plan_is_bounded_and_its_heap_stays_small() -> None:
    plan = PrefetchPlan(max_sessions=2)
    assert plan.plan("a", 1.0) and plan.plan("b", 1.0)
    assert not plan.plan("c", 1.0)  # full
    assert plan.plan("a", 2.0)  # a planned session may be planned again
    for i in range(1000):
        plan.plan("a", float(i))
    assert len(plan._heap) <= 2 * len(plan) + 65


# -- tool calls ------------------------------------------------------------------------


def test_the_expected_tool_call_is_the_shortest_of_the_last_few() -> None:
    calls: tuple[float, ...] = ()
    assert expected_tool_s(calls) is None
    for s in (9.0, 30.0, 12.0, 20.0, 25.0):
        calls = with_tool_call(calls, s)
    assert len(calls) == TOOL_SAMPLES == 4
    assert calls == (30.0, 12.0, 20.0, 25.0)  # the oldest (9) dropped
    assert expected_tool_s(calls) == 12.0


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", 0.0),
        (b"  \n", 0.0),
        (b"{}", 0.0),
        (b'{"in_s": 12}', 12.0),
        (b'{"in_s": 0.5}', 0.5),
        (b"[1]", "JSON object"),
        (b"{", "JSON object"),
        (b'{"in_s": -1}', "in_s"),
        (b'{"in_s": "5"}', "in_s"),
        (b'{"in_s": true}', "in_s"),
        (b'{"in_s": 1e9}', "in_s"),
        (b'{"in_s": 1, "when": 2}', "unknown field"),
    ],
)
def test_the_hook_body_is_empty_or_in_s(raw: bytes, expected: float | str) -> None:
    if isinstance(expected, float):
        assert tool_end_in_s(raw) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            tool_end_in_s(raw)


# -- the prompts kept ------------------------------------------------------------------


def body(n: int) -> dict[str, Any]:
    return {"input_ids": list(range(n)), "sampling_params": {"max_new_tokens": 8}}


def test_prompts_are_bounded_in_bytes_least_recently_kept_out_first() -> None:
    one = body_bytes(body(100))
    kept = Prompts(max_bytes=2 * one + 10)
    kept.keep("a", "/generate", body(100), None, None)
    kept.keep("b", "/generate", body(100), "key-b", "Bearer t")
    assert kept.bytes == 2 * one
    kept.keep("c", "/generate", body(100), None, None)
    assert kept.get("a") is None and kept.get("b") is not None and kept.get("c") is not None
    assert kept.bytes == 2 * one
    b = kept.get("b")
    assert b is not None and (b.routing_key, b.authorization) == ("key-b", "Bearer t")
    kept.keep("b", "/generate", body(10), None, None)  # replaced: counted once
    assert kept.bytes == one + body_bytes(body(10))
    kept.forget("b")
    kept.forget("b")
    assert kept.bytes == one and len(kept) == 1


def test_a_prompt_larger_than_the_bound_is_not_kept() -> None:
    kept = Prompts(max_bytes=100)
    kept.keep("a", "/generate", body(1000), None, None)
    assert len(kept) == 0 and kept.bytes == 0


def big_raw(n: int = 2000) -> bytes:
    ids = ", ".join(str(i) for i in range(n)).encode()
    return (
        b'{"input_ids": [' + ids + b'], "sampling_params": {"max_new_tokens": 4}, "stream": true}'
    )


def test_a_scanned_body_counts_its_raw_bytes() -> None:
    raw = big_raw()
    scanned = scan_object(raw)
    assert scanned is not None and scanned.excised == ("input_ids",)
    assert body_bytes(scanned) == len(raw)
    # A body with no array to excise is parsed whole, and still counts its raw bytes.
    chat = b'{"messages": [{"role": "user", "content": "' + b"x" * 1000 + b'"}]}'
    whole = scan_object(chat)
    assert whole is not None and whole.excised == () and body_bytes(whole) == len(chat)


# -- the one-token body ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "request_body", "expected"),
    [
        (
            "/generate",
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 64, "n": 2, "temperature": 0.7},
                "stream": True,
                "rid": "old",
                "session_params": {"id": "x"},
            },
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.7},
            },
        ),
        ("/generate", {"text": "hi"}, {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 99,
                "stream": True,
                "stream_options": {"include_usage": True},
                "nvext": {"agent_hints": {}},
            },
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        ),
        ("/v1/completions", {"prompt": "p", "n": 3}, {"prompt": "p", "max_tokens": 1}),
        ("/generate", {"sampling_params": {}}, None),  # no prompt
        ("/v1/chat/completions", {"messages": []}, None),
        ("/v1/embeddings", {"input": "x"}, None),  # not a generating path
    ],
)
def test_warm_body_is_the_prompt_with_one_output_token(
    path: str, request_body: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    out = warm_body(path, request_body, session_id="s", rid="r")
    if expected is None:
        assert out is None
    else:
        assert out == {**expected, "rid": "r", "session_id": "s"}


def test_warm_body_reads_a_scanned_bodys_token_ids() -> None:
    scanned = scan_object(big_raw())
    assert scanned is not None
    out = warm_body("/generate", scanned, session_id="s", rid="r")
    assert out is not None and out["input_ids"] == list(range(2000))
    assert out["sampling_params"] == {"max_new_tokens": 1} and "stream" not in out


# -- the core's rules ------------------------------------------------------------------


def core(params: ProgramParams = P, **reading: Any) -> ProgramCore:
    c = ProgramCore(params)
    observe(c, 0.0, **reading)
    return c


def observe(c: ProgramCore, now: float, **reading: Any) -> None:
    r = {"host_tokens": 2000, "token_usage": 0.5, "queue_reqs": 0, **reading}
    c.ledger.observe_engine(E1, now, max_total_num_tokens=1000, **r)


def expect(c: ProgramCore, sid: str, in_s: float, now: float) -> bool:
    return c.prefetch.expect(c.ledger.get(sid), in_s, now)


def answered_turn(c: ProgramCore, sid: str, ticket: str, now: float, tokens: int = 100) -> None:
    """A turn of ``sid`` arrives, runs and is answered at ``now``."""
    c.request(ticket, sid, E1, tokens, now)
    c.observe_response(ticket, now, prompt_tokens=tokens, completion_tokens=10, cached_tokens=0)
    c.turn_ended(ticket, now)


def with_tool_calls(c: ProgramCore, sid: str, calls: list[float]) -> float:
    """``sid`` answers a turn, then one after each tool call; returns the last answer."""
    now = 0.0
    answered_turn(c, sid, f"{sid}-0", now)
    for i, call in enumerate(calls, 1):
        now += call
        answered_turn(c, sid, f"{sid}-{i}", now)
    return now


def test_a_prefetch_is_planned_lead_before_the_shortest_recent_tool_call_ends() -> None:
    c = core()
    end = with_tool_calls(c, "s", [30.0, 10.0, 40.0])
    observe(c, end)
    assert c.prefetches(end + 10.0 - 2.0 - 0.01) == []
    assert c.prefetches(end + 8.0) == [("s", E1)]
    assert c.events[Event.PREFETCH_SENT] == 1
    assert c.ledger.engines[E1].prefetching == 1
    c.prefetch_done(E1)
    c.prefetch_done(E1)  # (twice: never below zero)
    assert c.ledger.engines[E1].prefetching == 0


def test_no_prefetch_before_a_tool_call_was_seen_or_for_short_tools() -> None:
    c = core()
    answered_turn(c, "s", "t0", 0.0)  # no tool call seen yet
    assert len(c.prefetch) == 0
    with_tool_calls(c, "short", [3.9, 20.0])  # the shortest is under twice the lead
    assert "short" not in c.prefetch
    assert c.events[Event.PREFETCH_PLANNED] == 0


def test_a_turn_that_arrives_before_its_prefetch_cancels_it_as_late() -> None:
    c = core()
    end = with_tool_calls(c, "s", [10.0])
    assert "s" in c.prefetch
    answered_turn(c, "s", "s-next", end + 5.0)  # the tool returned early
    assert c.events[Event.PREFETCH_LATE] == 1
    # ... and the next plan counts that shorter call.
    assert c.ledger.get("s").tool_s == (10.0, 5.0)  # type: ignore[union-attr]
    assert "s" in c.prefetch


@pytest.mark.parametrize(
    ("reading", "skip"),
    [
        ({}, None),
        ({"host_tokens": 0}, Event.PREFETCH_SKIPPED_NO_HOST_TIER),
        ({"queue_reqs": 1}, Event.PREFETCH_SKIPPED_BUSY),
        ({"token_usage": 0.9}, Event.PREFETCH_SKIPPED_BUSY),
        ({"token_usage": None}, Event.PREFETCH_SKIPPED_STALE),
    ],
)
def test_a_due_prefetch_goes_only_to_an_idle_engine_with_a_host_tier(
    reading: dict[str, Any], skip: Event | None
) -> None:
    c = core()
    end = with_tool_calls(c, "s", [10.0])
    observe(c, end, **reading)
    sent = c.prefetches(end + 8.0)
    if skip is None:
        assert sent == [("s", E1)]
    else:
        assert sent == [] and c.events[skip] == 1
    assert "s" not in c.prefetch  # due once either way


def test_a_stale_reading_or_a_paused_session_gets_no_prefetch() -> None:
    c = core()
    end = with_tool_calls(c, "s", [10.0])
    assert c.prefetches(end + 8.0 + P.staleness_s) == []  # the reading is from t=end
    assert c.events[Event.PREFETCH_SKIPPED_STALE] == 1
    c = core()
    end = with_tool_calls(c, "s", [10.0])
    observe(c, end)
    c.ledger.pause(c.ledger.get("s"), end)  # type: ignore[arg-type]
    assert c.prefetches(end + 8.0) == []
    assert c.events[Event.PREFETCH_SKIPPED_PAUSED] == 1


def test_at_most_the_bound_of_prefetches_in_flight_per_engine() -> None:
    c = core()
    ends = [with_tool_calls(c, sid, [10.0]) for sid in ("a", "b")]
    observe(c, max(ends))
    assert c.prefetches(max(ends) + 8.0) == [("a", E1)]
    assert c.events[Event.PREFETCH_SKIPPED_BUSY] == 1


def test_a_client_hint_plans_the_prefetch_lead_before_the_tool_ends() -> None:
    c = core()
    assert not expect(c, "unknown", 30.0, 0.0)
    c.request("t0", "s", E1, 100, 0.0)
    assert not expect(c, "s", 30.0, 0.0)  # a turn in flight, none answered
    c.observe_response("t0", 1.0, prompt_tokens=100, completion_tokens=10, cached_tokens=0)
    c.turn_ended("t0", 1.0)
    assert expect(c, "s", 30.0, 1.0)
    observe(c, 28.0)
    assert c.prefetches(28.9) == []
    assert c.prefetches(29.0) == [("s", E1)]
    # A tool under twice the lead: nothing planned (and an earlier plan cancelled).
    c.prefetch_done(E1)
    assert expect(c, "s", 30.0, 40.0) and "s" in c.prefetch
    assert expect(c, "s", 3.0, 40.0) and "s" not in c.prefetch


def test_a_closed_or_expired_session_leaves_the_plan() -> None:
    c = core()
    with_tool_calls(c, "a", [10.0])
    with_tool_calls(c, "b", [10.0])
    c.end_session("a", 20.0)
    assert "a" not in c.prefetch
    c.tick(10.0 + P.idle_ttl_s + 1.0)
    assert "b" not in c.prefetch


def test_prefetch_off_plans_and_learns_nothing() -> None:
    c = core(dataclasses.replace(P, prefetch=False))
    with_tool_calls(c, "s", [10.0, 10.0])
    assert len(c.prefetch) == 0 and c.ledger.get("s").tool_s == ()  # type: ignore[union-attr]


def test_the_config_keys_reach_the_params_scaled() -> None:
    cfg = AdmissionConfig(prefetch=True, prefetch_lead_s=3.0, prefetch_max_in_flight=4)
    p = ProgramParams.from_config(cfg, time_scale=0.5)
    assert (p.prefetch, p.prefetch_lead_s, p.prefetch_max_in_flight) == (True, 1.5, 4)
    assert p.pressure_threshold == cfg.pressure_threshold


def test_no_prefetch_to_an_engine_running_its_floor_of_turns() -> None:
    c = core()
    end = with_tool_calls(c, "s", [10.0])
    observe(c, end)
    c.ledger.engines[E1].load.inflight = P.min_inflight  # (other sessions' turns)
    assert c.prefetches(end + 8.0) == []
    assert c.events[Event.PREFETCH_SKIPPED_BUSY] == 1


@pytest.mark.parametrize(("host", "sent"), [(2000, True), (810, True), (800, False), (100, False)])
def test_no_prefetch_where_the_sessions_overflow_pool_and_host(host: int, sent: bool) -> None:
    """Pool 1000: the session's footprint (1,610 + 100 growth + 100 buffer) fits pool +
    810, not pool + 800. Past both tiers its prefix may be lost, and the prefetch would
    recompute it."""
    c = core(host_tokens=host)
    end = 0.0
    answered_turn(c, "s", "t0", end, tokens=1500)
    end += 10.0
    answered_turn(c, "s", "t1", end, tokens=1600)
    observe(c, end, host_tokens=host)
    assert c.prefetches(end + 8.0) == ([("s", E1)] if sent else [])
    assert c.events[Event.PREFETCH_SKIPPED_OVERFLOW] == (0 if sent else 1)
