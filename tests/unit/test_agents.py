"""The agentic workload driver: prompt construction, determinism, accounting, summary,
and one end-to-end run against a minimal in-process SSE server."""

from __future__ import annotations

import dataclasses
import random
import statistics

import orjson
import pytest
from aiohttp import web

from kvproxy.sim import agents
from kvproxy.sim.agents import (
    RequestRecord,
    RunResult,
    SessionRecord,
    StreamState,
    WorkloadConfig,
    WorkloadError,
)

CFG = WorkloadConfig(
    num_sessions=4,
    concurrency=2,
    turns_min=2,
    turns_max=5,
    system_prefix_tokens=32,
    user_tokens=8,
    tool_result_tokens_min=4,
    tool_result_tokens_max=12,
    max_new_tokens=6,
    seed=7,
)


# ------------------------------------------------------------------ determinism


def test_token_streams_are_deterministic_and_seed_dependent() -> None:
    again = dataclasses.replace(CFG)
    other = dataclasses.replace(CFG, seed=8)
    assert agents.system_prefix(CFG) == agents.system_prefix(again)
    assert agents.first_prompt(CFG, 3) == agents.first_prompt(again, 3)
    assert agents.turn_tokens(CFG, 1, 2) == agents.turn_tokens(again, 1, 2)
    assert agents.system_prefix(CFG) != agents.system_prefix(other)
    assert agents.turn_tokens(CFG, 1, 2) != agents.turn_tokens(other, 1, 2)
    # Different sessions and turns draw different inputs.
    assert agents.turn_tokens(CFG, 1, 2) != agents.turn_tokens(CFG, 2, 2)
    assert agents.turn_tokens(CFG, 1, 2) != agents.turn_tokens(CFG, 1, 3)


def test_token_ids_stay_in_range_and_sizes_follow_config() -> None:
    prefix = agents.system_prefix(CFG)
    assert len(prefix) == CFG.system_prefix_tokens
    assert len(agents.turn_tokens(CFG, 0, 0)) == CFG.user_tokens
    for session in range(10):
        for turn in range(1, 6):
            toks = agents.turn_tokens(CFG, session, turn)
            assert CFG.tool_result_tokens_min <= len(toks) <= CFG.tool_result_tokens_max
            assert all(CFG.min_token_id <= t < CFG.vocab_size for t in toks)


def test_first_prompt_shares_the_system_prefix_across_sessions() -> None:
    p0, p1 = agents.first_prompt(CFG, 0), agents.first_prompt(CFG, 1)
    n = CFG.system_prefix_tokens
    assert p0[:n] == p1[:n] == agents.system_prefix(CFG)
    assert p0[n:] != p1[n:]


def test_next_prompt_is_the_whole_conversation_plus_new_input() -> None:
    prompt = [1, 2, 3]
    reply = [9, 8]
    tool = [5]
    nxt = agents.next_prompt(prompt, reply, tool)
    assert nxt == [1, 2, 3, 9, 8, 5]
    # The previous context is an exact prefix of the next prompt.
    assert nxt[: len(prompt) + len(reply)] == prompt + reply


def test_turn_counts_are_in_range_and_vary() -> None:
    counts = {agents.num_turns(CFG, i) for i in range(50)}
    assert counts <= set(range(CFG.turns_min, CFG.turns_max + 1))
    assert len(counts) > 1
    fixed = dataclasses.replace(CFG, turns_min=3, turns_max=3)
    assert {agents.num_turns(fixed, i) for i in range(20)} == {3}


def test_tool_latency_distributions() -> None:
    lognormal = dataclasses.replace(CFG, tool_latency_median_s=0.4, tool_latency_sigma=0.5)
    draws = [agents.tool_latency_s(lognormal, s, t) for s in range(40) for t in range(1, 11)]
    assert all(d > 0 for d in draws)
    assert 0.3 < statistics.median(draws) < 0.55
    assert agents.tool_latency_s(lognormal, 3, 2) == agents.tool_latency_s(lognormal, 3, 2)

    uniform = dataclasses.replace(
        CFG, tool_latency="uniform", tool_latency_low_s=0.2, tool_latency_high_s=0.3
    )
    draws = [agents.tool_latency_s(uniform, s, 1) for s in range(50)]
    assert all(0.2 <= d <= 0.3 for d in draws)

    scaled = dataclasses.replace(uniform, time_scale=0.5)
    assert agents.tool_latency_s(scaled, 4, 1) == pytest.approx(
        0.5 * agents.tool_latency_s(uniform, 4, 1)
    )
    fixed = dataclasses.replace(CFG, tool_latency="fixed", tool_latency_median_s=0.25)
    assert agents.tool_latency_s(fixed, 1, 1) == 0.25


@pytest.mark.parametrize(
    "change",
    [
        {"concurrency": 0},
        {"turns_min": 3, "turns_max": 2},
        {"turns_min": 0},
        {"api": "grpc"},
        {"tool_latency": "normal"},
        {"max_new_tokens": 0},
        {"tool_result_tokens_min": 5, "tool_result_tokens_max": 4},
        {"request_timeout_s": 0},
    ],
)
def test_validate_rejects_bad_values(change: dict[str, object]) -> None:
    with pytest.raises(WorkloadError):
        dataclasses.replace(CFG, **change).validate()


def test_validate_accepts_defaults() -> None:
    WorkloadConfig().validate()
    CFG.validate()


# ------------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    ("previous", "cached", "expected"),
    [(0, 0, 0), (0, 32, 0), (100, 100, 0), (100, 120, 0), (100, 40, 60), (100, 0, 100)],
)
def test_recomputed_tokens(previous: int, cached: int, expected: int) -> None:
    assert agents.recomputed_tokens(previous, cached) == expected


def test_request_record_prefill_and_recompute_only_count_successes() -> None:
    ok = RequestRecord(
        session=0, turn=2, prompt_tokens=200, cached_tokens=50, previous_context_len=150, ok=True
    )
    assert ok.prefill_tokens == 150
    assert ok.recomputed_tokens == 100
    failed = dataclasses.replace(ok, ok=False)
    assert failed.prefill_tokens == 0
    assert failed.recomputed_tokens == 0


def test_percentile_matches_linear_interpolation() -> None:
    assert agents.percentile([], 50) is None
    assert agents.percentile([3.0], 99) == 3.0
    assert agents.percentile([1, 2, 3, 4], 50) == 2.5
    assert agents.percentile([4, 1, 3, 2], 0) == 1
    assert agents.percentile([4, 1, 3, 2], 100) == 4
    data = list(range(1, 101))
    assert agents.percentile(data, 99) == pytest.approx(99.01)
    rng = random.Random(1)
    sample = [rng.random() for _ in range(101)]
    assert agents.percentile(sample, 50) == pytest.approx(statistics.median(sample))
    with pytest.raises(ValueError):
        agents.percentile([1], 101)


METRICS_TEXT = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="m"} 100.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="m"} 20.0
sglang:prompt_tokens_created{model_name="m"} 1.7e9
sglang:cached_tokens_total{cache_source="device",model_name="m"} 60
sglang:cached_tokens_total{cache_source="host",model_name="m"} 5
sglang_evicted_tokens_total{model_name="m",worker_addr="http://x"} 7
sglang:num_retracted_reqs{tp_rank="0"} 2
sglang:num_retracted_reqs{tp_rank="1"} 3
sglang:token_usage{tp_rank="0"} 0.5
other_metric 99
sglang:generation_tokens_total NaN
"""


def test_parse_prometheus_sums_counters_and_maxes_gauges() -> None:
    parsed = agents.parse_prometheus(METRICS_TEXT)
    assert parsed["prompt_tokens_total"] == 120.0
    assert parsed["cached_tokens_total"] == 65.0
    assert parsed["evicted_tokens_total"] == 7.0
    assert parsed["num_retracted_reqs"] == 3.0
    assert "token_usage" not in parsed
    assert "generation_tokens_total" not in parsed


def test_diff_counters_sums_engines_and_never_goes_negative() -> None:
    before = {"a": {"prompt_tokens_total": 10.0}, "b": {"prompt_tokens_total": 5.0}}
    after = {
        "a": {"prompt_tokens_total": 30.0, "num_retracted_reqs": 1.0},
        "b": {"prompt_tokens_total": 4.0, "num_retracted_reqs": 2.0},  # engine restarted
    }
    delta = agents.diff_counters(before, after)
    assert delta["prompt_tokens_total"] == 20.0
    assert delta["num_retracted_reqs"] == 2.0


# ------------------------------------------------------------------ stream parsing


def test_parse_sse_line() -> None:
    assert agents.parse_sse_line(b"data: [DONE]\n") == ("done", None)
    assert agents.parse_sse_line(b'data: {"a": 1}\n') == ("json", {"a": 1})
    assert agents.parse_sse_line(b"\n") is None
    assert agents.parse_sse_line(b": keepalive\n") is None
    kind, _ = agents.parse_sse_line(b"data: {broken\n") or ("", None)
    assert kind == "bad"


def test_stream_state_handles_cumulative_and_incremental_output_ids() -> None:
    cumulative = StreamState()
    cumulative.feed_generate({"output_ids": [5], "meta_info": {"completion_tokens": 1}})
    cumulative.feed_generate({"output_ids": [5, 6], "meta_info": {"completion_tokens": 2}})
    cumulative.feed_generate(
        {
            "output_ids": [5, 6, 7],
            "meta_info": {
                "completion_tokens": 3,
                "prompt_tokens": 40,
                "cached_tokens": 30,
                "finish_reason": {"type": "length", "length": 3},
            },
        }
    )
    assert cumulative.output_ids == [5, 6, 7]
    assert (cumulative.prompt_tokens, cumulative.cached_tokens) == (40, 30)
    assert cumulative.finish_reason == "length"

    incremental = StreamState()
    for i, tok in enumerate([5, 6, 7], start=1):
        incremental.feed_generate({"output_ids": [tok], "meta_info": {"completion_tokens": i}})
    assert incremental.output_ids == [5, 6, 7]

    err = StreamState()
    err.feed_generate({"error": {"message": "bad"}})
    assert err.error is not None


def test_stream_state_chat_chunks() -> None:
    st = StreamState()
    st.feed_chat({"choices": [{"delta": {"role": "assistant", "content": "a"}}]})
    st.feed_chat({"choices": [{"delta": {"content": " b"}, "finish_reason": "stop"}]})
    st.feed_chat(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
    )
    assert st.text == "a b"
    assert st.finish_reason == "stop"
    assert (st.prompt_tokens, st.completion_tokens, st.cached_tokens) == (10, 2, 4)


# ---------------------------------------------------------------------- summary


def _result() -> RunResult:
    res = RunResult(config=CFG, base_url="http://127.0.0.1:1", wall_s=30.0)
    res.sessions = [
        SessionRecord(index=0, session_id="s0", turns_planned=2, start_s=0.1, end_s=10.1, ok=True),
        SessionRecord(index=1, session_id="s1", turns_planned=2, start_s=0.2, end_s=20.2, ok=True),
        SessionRecord(index=2, session_id="s2", turns_planned=2, start_s=0.3, end_s=5.0, ok=False),
    ]
    res.requests = [
        RequestRecord(0, 0, 100, 0, 10, 0, "length", 0.1, 1.0, 200, True, None, 5.0),
        RequestRecord(0, 1, 130, 60, 10, 110, "length", 0.3, 1.2, 200, True, None, 15.0),
        RequestRecord(1, 0, 100, 90, 10, 0, "length", 0.2, 1.1, 200, True),
        RequestRecord(1, 1, 130, 130, 10, 110, "length", 0.1, 0.9, 200, True),
        RequestRecord(2, 0, 100, 0, 0, 0, None, None, None, 503, False, "http_503: busy"),
    ]
    res.engines_before = {"e1": {"evicted_tokens_total": 5.0, "prompt_tokens_total": 0.0}}
    res.engines_after = {
        "e1": {
            "evicted_tokens_total": 45.0,
            "prompt_tokens_total": 180.0,
            "num_retracted_reqs": 1.0,
        }
    }
    res.proxy_stats = {"agentic_kv/session/close": 2.0}
    return res


def test_summary_numbers() -> None:
    s = _result().summary()
    assert (s["sessions_started"], s["sessions_completed"], s["sessions_failed"]) == (3, 2, 1)
    assert s["sessions_per_min"] == pytest.approx(4.0)
    assert s["requests"] == 5 and s["requests_failed"] == 1
    assert s["prompt_tokens"] == 460
    assert s["cached_tokens"] == 280
    assert s["prefill_tokens"] == 180
    # Turn 1 of session 0 recomputed 110 - 60 = 50; session 1's turn 1 was fully cached.
    assert s["recomputed_prefill_tokens"] == 50
    assert s["cache_hit_rate"] == pytest.approx(280 / 460, abs=1e-4)
    assert s["evicted_tokens"] == 40.0
    assert s["retractions"] == 1.0
    assert s["ttft_p50_s"] == pytest.approx(0.15)
    assert s["ttft_first_turn_p99_s"] == pytest.approx(agents.percentile([0.1, 0.2], 99), abs=1e-4)
    assert s["ttft_later_turns_p50_s"] == pytest.approx(0.2)
    assert s["latency_p99_s"] == pytest.approx(
        agents.percentile([1.0, 1.2, 1.1, 0.9], 99), abs=1e-4
    )
    assert s["admission_wait_p50_ms"] == pytest.approx(10.0)
    assert s["errors"] == {"http_503": 1}
    assert s["proxy_stats"] == {"agentic_kv/session/close": 2.0}
    # The summary is JSON-serialisable.
    assert orjson.loads(orjson.dumps(s))["sessions_completed"] == 2


def test_summary_prefers_a_cumulative_retraction_counter() -> None:
    res = _result()
    res.engines_after["e1"]["num_retracted_requests_total"] = 9.0
    assert res.summary()["retractions"] == 9.0


def test_summary_of_an_empty_run() -> None:
    s = RunResult(config=CFG, base_url="http://127.0.0.1:1").summary()
    assert s["sessions_started"] == 0 and s["sessions_per_min"] == 0.0
    assert s["ttft_p99_s"] is None and s["cache_hit_rate"] == 0.0
    assert "proxy_stats" not in s


# ---------------------------------------------------------- end to end (in-process)


class PrefixEngine:
    """Minimal /generate SSE server with an exact-prefix cache of everything it has
    seen (prompt + output), enough to check the driver's bookkeeping."""

    def __init__(self, fail_session: str | None = None) -> None:
        self.contexts: list[list[int]] = []
        self.closed: list[str] = []
        self.headers: list[str | None] = []
        self.fail_session = fail_session

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for ctx in self.contexts:
            n = 0
            for a, b in zip(ctx, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sid = request.headers.get(agents.SESSION_HEADER)
        self.headers.append(sid)
        if sid is not None and sid == self.fail_session:
            return web.json_response({"error": "boom"}, status=500)
        prompt = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        out = [(sum(prompt) + i) % 5000 + 1000 for i in range(n)]
        cached = self.cached(prompt)
        self.contexts.append(prompt + out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.headers[agents.ADMISSION_WAIT_HEADER] = "3.5"
        await resp.prepare(request)
        for i in range(1, n + 1):
            meta = {
                "prompt_tokens": len(prompt),
                "cached_tokens": cached,
                "completion_tokens": i,
                "finish_reason": {"type": "length", "length": n} if i == n else None,
            }
            chunk = {"output_ids": out[:i], "meta_info": meta}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def close_session(self, request: web.Request) -> web.Response:
        self.closed.append((await request.json())["session_id"])
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/close_session", self.close_session)
        return app


FAST = dataclasses.replace(
    CFG, tool_latency="fixed", tool_latency_median_s=0.0, request_timeout_s=10, run_timeout_s=30
)


async def test_run_against_a_prefix_cache_server(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    engine = PrefixEngine()
    server = await aiohttp_server(engine.app(), host="127.0.0.1")
    base = f"http://127.0.0.1:{server.port}"
    seen: list[tuple[int, int, int]] = []
    result = await agents.run_workload(
        FAST, base, progress=lambda c, f, t: seen.append((c, f, t)), read_stats=True
    )
    s = result.summary()
    assert s["sessions_completed"] == FAST.num_sessions and s["sessions_failed"] == 0
    expected_turns = sum(agents.num_turns(FAST, i) for i in range(FAST.num_sessions))
    assert s["requests_ok"] == expected_turns
    # The conversation was rebuilt from output_ids, so each later turn hits the full
    # previous context and nothing is recomputed.
    assert s["recomputed_prefill_tokens"] == 0
    for r in result.requests:
        if r.turn > 0:
            assert r.cached_tokens >= r.previous_context_len > 0
        assert r.admission_wait_ms == 3.5
        assert r.ttft_s is not None and r.latency_s is not None and r.ttft_s <= r.latency_s
    # The shared system prefix is cached after the first session's first turn.
    assert s["cached_tokens"] > 0
    assert sorted(engine.closed) == sorted(agents.session_id(FAST, i) for i in range(4))
    assert set(engine.headers) == set(engine.closed)
    assert seen[-1] == (FAST.num_sessions, 0, FAST.num_sessions)
    assert result.proxy_stats is None  # not a kvproxy: /kvproxy/stats is 404


async def test_same_seed_sends_the_same_prompts(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    prompts: list[list[tuple[int, int, int]]] = []
    for _ in range(2):
        engine = PrefixEngine()
        server = await aiohttp_server(engine.app(), host="127.0.0.1")
        res = await agents.run_workload(FAST, f"http://127.0.0.1:{server.port}")
        prompts.append(sorted((r.session, r.turn, r.prompt_tokens) for r in res.requests))
        await server.close()
    assert prompts[0] == prompts[1]


async def test_a_failing_session_is_counted_and_its_slot_moves_on(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    engine = PrefixEngine(fail_session=agents.session_id(FAST, 1))
    server = await aiohttp_server(engine.app(), host="127.0.0.1")
    res = await agents.run_workload(FAST, f"http://127.0.0.1:{server.port}")
    s = res.summary()
    assert s["sessions_started"] == FAST.num_sessions
    assert s["sessions_completed"] == FAST.num_sessions - 1
    assert s["sessions_failed"] == 1
    failed = [x for x in res.sessions if not x.ok]
    assert [x.index for x in failed] == [1] and failed[0].turns_done == 0
    assert s["errors"] == {"http_500": 1}


async def test_a_truncated_stream_is_a_failure(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    async def truncated(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"output_ids": [1], "meta_info": {"completion_tokens": 1}}\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/generate", truncated)
    server = await aiohttp_server(app, host="127.0.0.1")
    one = dataclasses.replace(FAST, num_sessions=1, close_at_end=False)
    res = await agents.run_workload(one, f"http://127.0.0.1:{server.port}")
    assert res.summary()["sessions_failed"] == 1
    assert res.requests[0].error is not None and res.requests[0].error.startswith("truncated")


async def test_close_404_is_tolerated(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    engine = PrefixEngine()
    app = web.Application()
    app.router.add_post("/generate", engine.generate)  # no /close_session: 404
    server = await aiohttp_server(app, host="127.0.0.1")
    res = await agents.run_workload(FAST, f"http://127.0.0.1:{server.port}")
    assert res.summary()["sessions_completed"] == FAST.num_sessions
    assert {s.close_status for s in res.sessions} == {404}


def test_context_after_turn_excludes_the_last_sampled_token() -> None:
    assert agents.context_after_turn(100, 10) == 109
    assert agents.context_after_turn(100, 1) == 100
    assert agents.context_after_turn(100, 0) == 100


def test_engine_deltas_are_kept_per_engine() -> None:
    res = _result()
    res.engines_before["e2"] = {"prompt_tokens_total": 10.0}
    res.engines_after["e2"] = {"prompt_tokens_total": 70.0}
    per = res.engine_deltas
    assert per["e1"]["prompt_tokens_total"] == 180.0
    assert per["e2"]["prompt_tokens_total"] == 60.0
    assert res.engine_delta["prompt_tokens_total"] == 240.0


def test_only_the_first_wave_is_staggered() -> None:
    cfg = dataclasses.replace(CFG, concurrency=4, start_stagger_s=0.2, time_scale=0.5)
    assert [agents.start_delay_s(cfg, i) for i in range(6)] == pytest.approx(
        [0.0, 0.1, 0.2, 0.3, 0.0, 0.0]
    )
    assert agents.start_delay_s(CFG, 1) == 0.0
