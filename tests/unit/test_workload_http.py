"""The HTTP driver: wire parsing, engine counters, the summary, the legacy workload, and
end-to-end runs against a minimal in-process SSE server."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvlab.workload import legacy
from kvlab.workload.driver import HttpRun, HttpTransport, nvext_for, parse_sets
from kvlab.workload.legacy import WorkloadConfig, run_legacy
from kvlab.workload.model import (
    SessionRecord,
    TurnRecord,
    WorkloadError,
    WorkloadResult,
    context_after_turn,
    recomputed_tokens,
)
from kvlab.workload.plan import session_plans
from kvlab.workload.report import percentile, summarize
from kvlab.workload.spec import workload_spec
from kvlab.workload.wire import (
    ADMISSION_WAIT_HEADER,
    ROUTING_KEY_HEADER,
    SESSION_HEADER,
    StreamState,
    diff_counters,
    parse_prometheus,
    parse_sse_line,
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


def _plans(cfg: WorkloadConfig, n: int) -> list:
    return [p for _, p in zip(range(n), session_plans(cfg.spec(), cfg.seed), strict=False)]


# ------------------------------------------------------------- legacy workload


def test_legacy_plans_are_deterministic_and_seed_dependent() -> None:
    assert _plans(CFG, 4) == _plans(dataclasses.replace(CFG), 4)
    other = _plans(dataclasses.replace(CFG, seed=8), 4)
    assert [p.turns[0].new_input_ids for p in _plans(CFG, 4)] != [
        p.turns[0].new_input_ids for p in other
    ]


def test_legacy_sizes_follow_the_config_and_share_the_prefix() -> None:
    plans = _plans(CFG, 30)
    n = CFG.system_prefix_tokens
    first = [p.turns[0].new_input_ids for p in plans]
    assert all(len(f) == n + CFG.user_tokens for f in first)
    assert all(f[:n] == first[0][:n] for f in first)
    assert first[0][n:] != first[1][n:]
    turns = {len(p.turns) for p in plans}
    assert turns <= set(range(CFG.turns_min, CFG.turns_max + 1)) and len(turns) > 1
    for p in plans:
        for t in p.turns:
            assert t.max_new_tokens == CFG.max_new_tokens
            assert all(CFG.min_token_id <= x < CFG.vocab_size for x in t.new_input_ids)
        for t in p.turns[1:]:
            assert CFG.tool_result_tokens_min <= len(t.new_input_ids) <= CFG.tool_result_tokens_max
        assert p.turns[-1].tool_latency_s == 0.0


def test_legacy_tool_latency_distributions() -> None:
    lognormal = dataclasses.replace(CFG, tool_latency_median_s=0.4, tool_latency_sigma=0.5)
    draws = [t.tool_latency_s for p in _plans(lognormal, 80) for t in p.turns[:-1]]
    assert all(d > 0 for d in draws)
    assert 0.3 < statistics.median(draws) < 0.55
    uniform = dataclasses.replace(
        CFG, tool_latency="uniform", tool_latency_low_s=0.2, tool_latency_high_s=0.3
    )
    draws = [t.tool_latency_s for p in _plans(uniform, 30) for t in p.turns[:-1]]
    assert all(0.2 <= d <= 0.3 for d in draws)
    fixed = dataclasses.replace(CFG, tool_latency="fixed", tool_latency_median_s=0.25)
    assert {t.tool_latency_s for p in _plans(fixed, 5) for t in p.turns[:-1]} == {0.25}


@pytest.mark.parametrize(
    "change",
    [
        {"concurrency": 0},
        {"turns_min": 3, "turns_max": 2},
        {"turns_min": 0},
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
    assert legacy.WorkloadConfig().spec().name == "legacy"


def test_parse_sets() -> None:
    assert parse_sets(["turns_median=20", " output_hi = 2048 "]) == {
        "turns_median": "20",
        "output_hi": "2048",
    }
    with pytest.raises(WorkloadError, match="NAME=VALUE"):
        parse_sets(["turns_median"])


# ------------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    ("previous", "cached", "expected"),
    [(0, 0, 0), (0, 32, 0), (100, 100, 0), (100, 120, 0), (100, 40, 60), (100, 0, 100)],
)
def test_recomputed_tokens(previous: int, cached: int, expected: int) -> None:
    assert recomputed_tokens(previous, cached) == expected


def test_turn_record_prefill_and_recompute_only_count_successes() -> None:
    ok = TurnRecord("s", 2, prompt_tokens=200, cached_tokens=50, previous_context_len=150, ok=True)
    assert ok.prefill_tokens == 150
    assert ok.recomputed_tokens == 100
    failed = dataclasses.replace(ok, ok=False)
    assert failed.prefill_tokens == 0
    assert failed.recomputed_tokens == 0


def test_context_after_turn_excludes_the_last_sampled_token() -> None:
    assert context_after_turn(100, 10) == 109
    assert context_after_turn(100, 1) == 100
    assert context_after_turn(100, 0) == 100


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4
    data = list(range(1, 101))
    assert percentile(data, 99) == pytest.approx(99.01)
    rng = random.Random(1)
    sample = [rng.random() for _ in range(101)]
    assert percentile(sample, 50) == pytest.approx(statistics.median(sample))
    with pytest.raises(ValueError):
        percentile([1], 101)


# ----------------------------------------------------------- wire and counters


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
sglang:realtime_tokens_total{mode="prefill_compute",model_name="m"} 11
sglang:realtime_tokens_total{model_name="m",mode="decode"} 4
sglang:realtime_tokens_total{mode="decode",model_name="n"} 1
"""


def test_parse_prometheus_sums_counters_and_maxes_gauges() -> None:
    parsed = parse_prometheus(METRICS_TEXT)
    assert parsed["prompt_tokens_total"] == 120.0
    assert parsed["cached_tokens_total"] == 65.0
    assert parsed["evicted_tokens_total"] == 7.0
    assert parsed["num_retracted_reqs"] == 3.0
    assert "token_usage" not in parsed
    assert "generation_tokens_total" not in parsed
    # realtime_tokens_total is kept per mode.
    assert parsed["realtime_tokens_total:prefill_compute"] == 11.0
    assert parsed["realtime_tokens_total:decode"] == 5.0
    assert "realtime_tokens_total" not in parsed


def test_diff_counters_sums_engines_and_never_goes_negative() -> None:
    before = {"a": {"prompt_tokens_total": 10.0}, "b": {"prompt_tokens_total": 5.0}}
    after = {
        "a": {"prompt_tokens_total": 30.0, "num_retracted_reqs": 1.0},
        "b": {"prompt_tokens_total": 4.0, "num_retracted_reqs": 2.0},  # engine restarted
    }
    delta = diff_counters(before, after)
    assert delta["prompt_tokens_total"] == 20.0
    assert delta["num_retracted_reqs"] == 2.0


# ------------------------------------------------------------------ stream parsing


def test_parse_sse_line() -> None:
    assert parse_sse_line(b"data: [DONE]\n") == ("done", None)
    assert parse_sse_line(b'data: {"a": 1}\n') == ("json", {"a": 1})
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b": keepalive\n") is None
    kind, _ = parse_sse_line(b"data: {broken\n") or ("", None)
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


def _turn(
    sid: str,
    turn: int,
    prompt: int,
    cached: int,
    prev: int,
    ttft,
    lat,
    ok=True,
    err=None,
    wait=None,
) -> TurnRecord:  # type: ignore[no-untyped-def]
    return TurnRecord(
        sid,
        turn,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=10 if ok else 0,
        previous_context_len=prev,
        ttft_s=ttft,
        latency_s=lat,
        ok=ok,
        error=err,
        admission_wait_ms=wait,
    )


def _run() -> HttpRun:
    res = WorkloadResult(CFG.spec(), seed=7, sessions_requested=3, concurrency=2, time_scale=1.0)
    res.makespan_s = 30.0
    res.sessions = [
        SessionRecord("s0", "main", None, None, 2, start_s=0.1, end_s=10.1, ok=True, exit="done"),
        SessionRecord("s1", "main", None, None, 2, start_s=0.2, end_s=20.2, ok=True, exit="done"),
        SessionRecord("s2", "main", None, None, 2, start_s=0.3, end_s=5.0, exit="error"),
    ]
    res.turns = [
        _turn("s0", 0, 100, 0, 0, 0.1, 1.0, wait=5.0),
        _turn("s0", 1, 130, 60, 110, 0.3, 1.2, wait=15.0),
        _turn("s1", 0, 100, 90, 0, 0.2, 1.1),
        _turn("s1", 1, 130, 130, 110, 0.1, 0.9),
        _turn("s2", 0, 100, 0, 0, None, None, ok=False, err="http_503: busy"),
    ]
    run = HttpRun(result=res, base_url="http://127.0.0.1:1", wall_s=30.0)
    run.engines_before = {"e1": {"evicted_tokens_total": 5.0, "prompt_tokens_total": 0.0}}
    run.engines_after = {
        "e1": {
            "evicted_tokens_total": 45.0,
            "prompt_tokens_total": 180.0,
            "num_retracted_reqs": 1.0,
        }
    }
    run.proxy_stats = {"agentic_kv/session/close": 2.0}
    return run


def test_summary_numbers() -> None:
    s = _run().summary()
    assert (s["sessions_started"], s["sessions_completed"], s["sessions_failed"]) == (3, 2, 1)
    assert s["sessions"] == 2
    assert s["sessions_per_min"] == pytest.approx(4.0)
    assert s["requests"] == 5 and s["requests_failed"] == 1 and s["turns"] == 4
    assert s["prompt_tokens"] == 460
    assert s["cached_tokens"] == 280
    assert s["prefill_tokens"] == 180
    # Turn 1 of s0 recomputed 110 - 60 = 50; s1's turn 1 was fully cached.
    assert s["recomputed_prefill_tokens"] == 50
    assert s["recompute_share"] == pytest.approx(50 / 180, abs=1e-4)
    assert s["cache_hit_rate"] == pytest.approx(280 / 460, abs=1e-4)
    assert s["evicted_tokens"] == 40.0
    assert s["retractions"] == 1.0
    assert s["ttft_p50_s"] == pytest.approx(0.15)
    assert s["ttft_p99_first_s"] == pytest.approx(percentile([0.1, 0.2], 99), abs=1e-4)
    assert s["ttft_p50_continuing_s"] == pytest.approx(0.2)
    assert s["ttft_p99_continuing_s"] == pytest.approx(percentile([0.3, 0.1], 99), abs=1e-4)
    assert s["latency_p99_s"] == pytest.approx(percentile([1.0, 1.2, 1.1, 0.9], 99), abs=1e-4)
    assert s["output_tokens_per_s"] == pytest.approx(40 / 30.0, abs=1e-2)
    assert s["admission_wait_p50_ms"] == pytest.approx(10.0)
    assert s["errors"] == {"http_503": 1}
    assert s["proxy_stats"] == {"agentic_kv/session/close": 2.0}
    # The summary is JSON-serialisable.
    assert orjson.loads(orjson.dumps(s))["sessions_completed"] == 2


def test_summary_prefers_a_cumulative_retraction_counter() -> None:
    run = _run()
    run.engines_after["e1"]["num_retracted_requests_total"] = 9.0
    assert run.summary()["retractions"] == 9.0


def test_summary_of_an_empty_run() -> None:
    res = WorkloadResult(CFG.spec(), seed=0, sessions_requested=0, concurrency=1, time_scale=1.0)
    s = summarize(res)
    assert s["sessions_started"] == 0 and s["sessions_per_min"] == 0.0
    assert s["ttft_p99_s"] is None and s["cache_hit_rate"] == 0.0
    assert "proxy_stats" not in HttpRun(result=res, base_url="x").summary()


def test_engine_deltas_are_kept_per_engine() -> None:
    run = _run()
    run.engines_before["e2"] = {"prompt_tokens_total": 10.0}
    run.engines_after["e2"] = {"prompt_tokens_total": 70.0}
    per = run.engine_deltas
    assert per["e1"]["prompt_tokens_total"] == 180.0
    assert per["e2"]["prompt_tokens_total"] == 60.0
    assert run.engine_delta["prompt_tokens_total"] == 240.0


# ---------------------------------------------------------- end to end (in-process)


class PrefixEngine:
    """Minimal /generate SSE server with an exact-prefix cache of everything it has
    seen (prompt + output), enough to check the driver's bookkeeping."""

    def __init__(self, fail_session: str | None = None) -> None:
        self.contexts: list[list[int]] = []
        self.closed: list[str] = []
        self.headers: list[str | None] = []
        self.routing_keys: list[str | None] = []
        self.bodies: list[dict] = []
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
        sid = request.headers.get(SESSION_HEADER)
        self.headers.append(sid)
        self.routing_keys.append(request.headers.get(ROUTING_KEY_HEADER))
        self.bodies.append(body)
        if sid is not None and sid == self.fail_session:
            return web.json_response({"error": "boom"}, status=500)
        prompt = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        out = [(sum(prompt) + i) % 5000 + 1000 for i in range(n)]
        cached = self.cached(prompt)
        self.contexts.append(prompt + out)
        if body.get("stream") is False:
            meta = {
                "prompt_tokens": len(prompt),
                "cached_tokens": cached,
                "completion_tokens": n,
                "finish_reason": {"type": "length", "length": n},
            }
            return web.json_response({"output_ids": out, "meta_info": meta})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.headers[ADMISSION_WAIT_HEADER] = "3.5"
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
    run = await run_legacy(FAST, base, progress=lambda c, f, t: seen.append((c, f, t)))
    s = run.summary()
    assert s["sessions_completed"] == FAST.num_sessions and s["sessions_failed"] == 0
    plans = _plans(FAST, FAST.num_sessions)
    assert s["requests_ok"] == sum(len(p.turns) for p in plans)
    # The conversation was rebuilt from output_ids, so each later turn hits the full
    # previous context and nothing is recomputed.
    assert s["recomputed_prefill_tokens"] == 0
    for r in run.result.turns:
        if r.turn > 0:
            assert r.cached_tokens >= r.previous_context_len > 0
        assert r.admission_wait_ms == 3.5
        assert r.ttft_s is not None and r.latency_s is not None and r.ttft_s <= r.latency_s
    # The shared system prefix is cached after the first session's first turn.
    assert s["cached_tokens"] > 0
    assert sorted(engine.closed) == sorted(p.session_id for p in plans)
    assert set(engine.headers) == set(engine.closed)
    # The routing key is the session id on every request.
    assert engine.routing_keys == engine.headers
    assert all(b["sampling_params"]["ignore_eos"] is True for b in engine.bodies)
    assert s["closes_ok"] == FAST.num_sessions and s["closes_failed"] == 0
    assert seen[-1] == (FAST.num_sessions, 0, FAST.num_sessions)
    assert run.proxy_stats is None  # not a kvproxy: /kvproxy/stats is 404


async def test_same_seed_sends_the_same_prompts(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    prompts: list[list[tuple[str, int, int]]] = []
    for _ in range(2):
        engine = PrefixEngine()
        server = await aiohttp_server(engine.app(), host="127.0.0.1")
        run = await run_legacy(FAST, f"http://127.0.0.1:{server.port}")
        prompts.append(sorted((r.session_id, r.turn, r.prompt_tokens) for r in run.result.turns))
        await server.close()
    assert prompts[0] == prompts[1]


async def test_a_failing_session_is_counted_and_its_slot_moves_on(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    victim = _plans(FAST, 2)[1].session_id
    engine = PrefixEngine(fail_session=victim)
    server = await aiohttp_server(engine.app(), host="127.0.0.1")
    run = await run_legacy(FAST, f"http://127.0.0.1:{server.port}")
    s = run.summary()
    assert s["sessions_started"] == FAST.num_sessions
    assert s["sessions_completed"] == FAST.num_sessions - 1
    assert s["sessions_failed"] == 1
    failed = [x for x in run.result.sessions if not x.ok]
    assert [x.session_id for x in failed] == [victim] and failed[0].turns_done == 0
    assert failed[0].exit == "error"
    assert s["errors"] == {"http_500": 1}
    # A failed session is closed too.
    assert victim in engine.closed


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
    run = await run_legacy(one, f"http://127.0.0.1:{server.port}")
    assert run.summary()["sessions_failed"] == 1
    err = run.result.turns[0].error
    assert err is not None and err.startswith("truncated")
    assert run.close_status == {}


async def test_close_404_is_tolerated(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    engine = PrefixEngine()
    app = web.Application()
    app.router.add_post("/generate", engine.generate)  # no /close_session: 404
    server = await aiohttp_server(app, host="127.0.0.1")
    run = await run_legacy(FAST, f"http://127.0.0.1:{server.port}")
    assert run.summary()["sessions_completed"] == FAST.num_sessions
    assert set(run.close_status.values()) == {404}
    assert run.summary()["closes_failed"] == FAST.num_sessions


async def test_transport_sends_the_final_header_only_when_asked(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    seen: list[str | None] = []

    async def gen(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Session-Final"))
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"output_ids": [3], "meta_info": {"completion_tokens": 1}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", gen)
    server = await aiohttp_server(app, host="127.0.0.1")
    import aiohttp

    async with aiohttp.ClientSession() as http:
        plain = HttpTransport(f"http://127.0.0.1:{server.port}", http)
        marked = HttpTransport(f"http://127.0.0.1:{server.port}", http, send_final=True)
        out = await plain.generate("s", [1, 2], 1, final=True)
        await marked.generate("s", [1, 2], 1, final=False)
        await marked.generate("s", [1, 2], 1, final=True)
    assert out.ok and out.output_ids == [3] and out.prompt_tokens == 2
    assert seen == [None, None, "1"]


async def test_a_deadline_cancels_running_sessions_and_counts_them_failed(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    release = asyncio.Event()

    async def stuck(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", stuck)
    server = await aiohttp_server(app, host="127.0.0.1")
    cfg = dataclasses.replace(FAST, num_sessions=2, close_at_end=False, run_timeout_s=0.2)
    try:
        run = await run_legacy(cfg, f"http://127.0.0.1:{server.port}")
    finally:
        release.set()
    assert run.result.timed_out
    assert run.summary()["sessions_failed"] == 2
    assert {s.exit for s in run.result.sessions} == {"cancelled"}


def test_a_trace_spec_via_workload_spec_runs_the_sample() -> None:
    spec = workload_spec("trace:sample", 16)
    assert spec.trace is not None and len(list(session_plans(spec, 0))) == len(spec.trace.sessions)


# ------------------------------------------------------------- Dynamo nvext


@pytest.mark.parametrize(
    ("sid", "first", "final", "control", "spec", "scope", "expected"),
    [
        ("s", True, False, "none", False, "all", None),
        ("s", True, False, "open", False, "all", {"osl": 8, "action": "open", "timeout": 30}),
        ("s", False, False, "open", False, "all", {"osl": 8, "action": "bind", "timeout": 30}),
        ("s", False, True, "open", False, "all", {"osl": 8, "action": "close"}),
        (
            "s",
            True,
            False,
            "bind",
            True,
            "all",
            {"osl": 8, "action": "bind", "timeout": 30, "spec": True},
        ),
        ("s", True, True, "bind", False, "all", {"osl": 8, "action": "close"}),
        ("s", True, False, "none", True, "all", {"osl": 8, "spec": True}),
        ("lead-1", True, False, "open", False, "subagents", None),
        (
            "lead-1-sub2.0",
            True,
            False,
            "open",
            False,
            "subagents",
            {"osl": 8, "action": "open", "timeout": 30},
        ),
    ],
)
def test_nvext_for(
    sid: str, first: bool, final: bool, control: str, spec: bool, scope: str, expected: dict | None
) -> None:
    got = nvext_for(
        sid,
        first=first,
        final=final,
        max_new_tokens=8,
        control=control,
        speculative_prefill=spec,
        timeout_s=30,
        scope=scope,
    )
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got["agent_hints"].get("osl") == expected["osl"]
    assert got["agent_hints"].get("speculative_prefill", False) == expected.get("spec", False)
    sc = got.get("session_control")
    if "action" not in expected:
        assert sc is None
    else:
        assert sc == {
            "session_id": sid,
            "action": expected["action"],
            **({"timeout": 30} if "timeout" in expected else {}),
        }


@pytest.mark.parametrize(("control", "scope"), [("close", "all"), ("open", "leads")])
def test_nvext_options_are_validated(control: str, scope: str) -> None:
    with pytest.raises(WorkloadError):
        nvext_for("s", first=True, final=False, max_new_tokens=1, control=control, scope=scope)


async def test_session_control_open_then_close_per_session(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    import aiohttp

    engine = PrefixEngine()
    server = await aiohttp_server(engine.app(), host="127.0.0.1")
    async with aiohttp.ClientSession() as http:
        t = HttpTransport(
            f"http://127.0.0.1:{server.port}",
            http,
            session_control="open",
            speculative_prefill=True,
            session_timeout_s=60,
        )
        outs = []
        for sid in ("a", "b"):
            prompt = [1, 2, 3]
            for i in range(3):
                out = await t.generate(sid, prompt, 4, final=i == 2)
                assert out.ok, out.error
                outs.append(out)
                prompt = [*prompt, *out.output_ids, 9]
    actions = [
        (b["nvext"]["session_control"]["session_id"], b["nvext"]["session_control"]["action"])
        for b in engine.bodies
    ]
    assert actions == [(s, a) for s in "ab" for a in ("open", "bind", "close")]
    # Speculative prefill needs the whole answer: not streamed, still read in full.
    assert all(b["stream"] is False for b in engine.bodies)
    assert all(
        b["nvext"]["agent_hints"] == {"osl": 4, "speculative_prefill": True} for b in engine.bodies
    )
    assert all(len(o.output_ids) == 4 and o.completion_tokens == 4 for o in outs)
    assert outs[1].cached_tokens == 3 + 4  # the previous prompt + output was found


@pytest.mark.parametrize(("retries", "ok"), [(0, False), (1, True)])
async def test_a_client_that_retries_sends_a_failed_turn_again(  # type: ignore[no-untyped-def]
    aiohttp_server, retries: int, ok: bool
) -> None:
    engine = PrefixEngine()
    left = [1]  # the first attempt meets a replica that died (nginx answers 502)

    async def flaky(request: web.Request) -> web.StreamResponse:
        if left[0]:
            left[0] -= 1
            await request.read()
            return web.json_response({"error": "bad gateway"}, status=502)
        return await engine.generate(request)

    app = web.Application()
    app.router.add_post("/generate", flaky)
    server = await aiohttp_server(app, host="127.0.0.1")
    async with aiohttp.ClientSession() as http:
        t = HttpTransport(f"http://127.0.0.1:{server.port}", http, retries=retries)
        out = await t.generate("s-1", [5, 6, 7], 2, final=False)
    assert (out.error is None, t.retried, len(engine.bodies)) == (ok, retries, retries)
