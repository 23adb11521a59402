"""Wire shapes of the simulated SGLang engine, in-process through the app factory.

Shapes follow the examples in shared sglang-wire.md (sections 1, 2, 3, 5, 6).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient

from kvlab.sim.config import FaultConfig, SimConfig
from kvlab.sim.server import SIM_STATE, create_sim_app
from kvlab.sim.tokenizer import decode, encode

ClientFactory = Callable[..., Awaitable[TestClient]]

LABELS = 'engine_type="unified",model_name="test/model",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


@pytest.fixture
def make_client(aiohttp_client: Any) -> ClientFactory:
    async def factory(**kw: Any) -> TestClient:
        kw.setdefault("time_scale", 0.0)
        kw.setdefault("model_name", "test/model")
        kw.setdefault("max_total_tokens", 50_000)
        return await aiohttp_client(create_sim_app(SimConfig(**kw)))

    return factory


async def poll(check: Callable[[], Awaitable[bool]], limit_s: float = 5.0) -> None:
    """Re-check ``check`` every 5 ms, bounded in count and time."""
    deadline = time.monotonic() + limit_s
    for _ in range(int(limit_s / 0.005) + 1):
        if await check():
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def state(client: TestClient) -> dict[str, Any]:
    resp = await client.get("/sim/state")
    assert resp.status == 200
    return orjson.loads(await resp.read())


async def metrics(client: TestClient) -> dict[str, float]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    out: dict[str, float] = {}
    for line in (await resp.text()).splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into its ``data:`` payloads, checking the framing exactly."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-80:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    payloads = []
    for part in parts[:-1]:
        assert part.startswith(b"data: "), part[:80]
        payloads.append(part[len(b"data: ") :])
    return payloads


# --------------------------------------------------------------------- /generate


async def test_generate_text_non_streaming_shape(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await client.post(
        "/generate",
        json={
            "text": "Hello world, how are you?",
            "rid": "rid-1",
            "sampling_params": {"max_new_tokens": 6},
        },
    )
    assert resp.status == 200
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "rid-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(encode("Hello world, how are you?"))
    assert meta["completion_tokens"] == 6 == len(body["output_ids"])
    assert meta["cached_tokens"] == 0
    for key in ("weight_version", "num_retractions", "reasoning_tokens", "e2e_latency"):
        assert key in meta
    assert body["text"] == decode(body["output_ids"])
    assert isinstance(body["text"], str) and body["text"]


async def test_generate_input_ids_reuses_prefix(make_client: ClientFactory) -> None:
    client = await make_client()
    prompt = [151644, 872, 198, *range(1000, 1200)]
    r1 = await (
        await client.post(
            "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
        )
    ).json()
    turn2 = prompt + r1["output_ids"] + [151645, 198, 42, 43]
    r2 = await (
        await client.post(
            "/generate",
            json={
                "input_ids": turn2,
                "sampling_params": {"max_new_tokens": 4},
                "data_parallel_rank": 0,
            },
        )
    ).json()
    assert r2["meta_info"]["cached_tokens"] == len(prompt) + 4 - 1
    assert r2["meta_info"]["prompt_tokens"] == len(turn2)


async def test_generate_return_logprob(make_client: ClientFactory) -> None:
    client = await make_client()
    body = await (
        await client.post(
            "/generate",
            json={
                "input_ids": [1, 2],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3},
            },
        )
    ).json()
    triples = body["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == body["output_ids"]
    assert all(t[0] < 0 for t in triples)


async def test_generate_default_max_new_tokens_is_128(make_client: ClientFactory) -> None:
    client = await make_client()
    body = await (await client.post("/generate", json={"input_ids": [1, 2, 3]})).json()
    assert body["meta_info"]["completion_tokens"] == 128
    assert len(body["meta_info"]["id"]) == 32  # uuid4 hex when no rid is given


async def test_generate_stop_via_workload_length(make_client: ClientFactory) -> None:
    client = await make_client()
    body = await (
        await client.post(
            "/generate",
            json={
                "input_ids": [1, 2, 3],
                "sampling_params": {
                    "max_new_tokens": 20,
                    "stop_token_ids": [151645],
                    "custom_params": {"sim_output_len": 5},
                },
            },
        )
    ).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
    assert body["output_ids"][-1] == 151645 and len(body["output_ids"]) == 5


async def test_generate_streaming_framing_and_cumulative_chunks(make_client: ClientFactory) -> None:
    # A real time scale, so that tokens are decoded one step at a time.
    client = await make_client(time_scale=0.2)
    resp = await client.post(
        "/generate",
        json={
            "input_ids": list(range(50)),
            "rid": "s-1",
            "stream": True,
            "sampling_params": {"max_new_tokens": 10},
        },
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    chunks: list[dict[str, Any]] = []
    buf = b""
    first_at_tokens = None
    async for data in resp.content.iter_any():
        buf += data
        if first_at_tokens is None and b"\n\n" in buf:
            first_at_tokens = orjson.loads(buf.split(b"\n\n")[0][6:])["meta_info"][
                "completion_tokens"
            ]
    events = sse_events(buf)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert first_at_tokens is not None and first_at_tokens < 10  # streamed while decoding
    assert len(chunks) >= 5
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 10
    for c in chunks[:-1]:
        assert c["meta_info"]["finish_reason"] is None
        assert c["meta_info"]["id"] == "s-1"
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    # Cumulative: each chunk's ids extend the previous chunk's.
    for a, b in itertools.pairwise(chunks):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert b["text"].startswith(a["text"])
    assert len(final["output_ids"]) == 10


# -------------------------------------------------------------------- OpenAI


async def test_chat_completions_shape(make_client: ClientFactory) -> None:
    client = await make_client()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": "test/model",
            "messages": messages,
            "max_tokens": 5,
            "rid": "chat-1",
            "session_id": "x",
            "priority": 3,
        },
    )
    assert resp.status == 200
    body = await resp.json()
    assert body["id"] == "chat-1"
    assert body["object"] == "chat.completion"
    assert body["model"] == "test/model"
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    # The next turn (assistant reply appended) hits the cache.
    messages2 = [
        *messages,
        {"role": "assistant", "content": choice["message"]["content"]},
        {"role": "user", "content": "more"},
    ]
    body2 = await (
        await client.post(
            "/v1/chat/completions",
            json={"model": "test/model", "messages": messages2, "max_completion_tokens": 3},
        )
    ).json()
    assert body2["usage"]["completion_tokens"] == 3
    assert (
        body2["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] + 5 - 1
    )


async def test_chat_completions_streaming_chunks(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "rid": "cs-1",
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.status == 200
    events = sse_events(await resp.read())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["id"] == "cs-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert len(encode(content)) == 4


async def test_completions_shape_and_stream(make_client: ClientFactory) -> None:
    client = await make_client()
    body = await (
        await client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "Once upon", "max_tokens": 3, "rid": "c-1"},
        )
    ).json()
    assert body["id"] == "c-1" and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    resp = await client.post(
        "/v1/completions",
        json={"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": True},
    )
    chunks = [orjson.loads(e) for e in sse_events(await resp.read())[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(encode(streamed)) == 3
    assert chunks[0]["choices"][0]["finish_reason"] is None


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("path", "payload", "status", "check"),
    [
        ("/generate", b"{not json", 400, lambda b: b["object"] == "error" and b["code"] == 400),
        (
            "/generate",
            orjson.dumps({"input_ids": [1], "session_id": "a", "session_params": {"id": "a"}}),
            400,
            lambda b: (
                b == {"error": {"message": "session_id and session_params cannot both be set."}}
            ),
        ),
        (
            "/generate",
            orjson.dumps({"input_ids": [1], "session_params": {"id": "ghost"}}),
            400,
            lambda b: (
                b == {"error": {"message": "Invalid request: session id ghost does not exist"}}
            ),
        ),
        (
            "/generate",
            orjson.dumps({"sampling_params": {}}),
            400,
            lambda b: "input_ids" in b["error"]["message"],
        ),
        ("/generate", orjson.dumps({"input_ids": ["x"]}), 400, lambda b: b["object"] == "error"),
        ("/v1/chat/completions", b"[]", 400, lambda b: b["object"] == "error"),
        (
            "/open_session",
            orjson.dumps({"session_id": "a"}),
            400,
            lambda b: "capacity_of_str_len" in b["message"],
        ),
        (
            "/open_session",
            orjson.dumps({"capacity_of_str_len": 100, "streaming": True}),
            400,
            lambda b: "Streaming sessions are disabled" in b["error"]["message"],
        ),
        ("/close_session", orjson.dumps({}), 400, lambda b: b["object"] == "error"),
    ],
)
async def test_bad_input_gets_sglang_errors(
    make_client: ClientFactory, path: str, payload: bytes, status: int, check: Callable[[Any], bool]
) -> None:
    client = await make_client()
    resp = await client.post(path, data=payload, headers={"Content-Type": "application/json"})
    assert resp.status == status
    assert check(await resp.json())


async def test_streaming_engine_error_is_an_sse_error_event(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await client.post(
        "/generate", json={"input_ids": [1], "stream": True, "session_params": {"id": "ghost"}}
    )
    assert resp.status == 200
    events = sse_events(await resp.read())
    err = orjson.loads(events[0])["error"]
    assert err["code"] == 400 and "ghost" in err["message"]


# ---------------------------------------------------------------------- sessions


async def test_open_and_close_session(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await client.post(
        "/open_session", json={"capacity_of_str_len": 1000, "session_id": "leg-1"}
    )
    assert resp.status == 200 and await resp.json() == "leg-1"
    dup = await client.post(
        "/open_session", json={"capacity_of_str_len": 1000, "session_id": "leg-1"}
    )
    assert dup.status == 400
    anon = await client.post("/open_session", json={"capacity_of_str_len": 1000})
    assert len(await anon.json()) == 32
    for sid in ("leg-1", "leg-1", "unknown"):
        r = await client.post("/close_session", json={"session_id": sid})
        assert r.status == 200 and await r.read() == b""


async def test_session_radix_close_dereferences(make_client: ClientFactory) -> None:
    client = await make_client(mode="session-radix")
    info = await (await client.get("/server_info")).json()
    assert info["enable_session_radix_cache"] is True
    await client.post(
        "/generate",
        json={
            "input_ids": list(range(100)),
            "session_id": "traj-7",
            "sampling_params": {"max_new_tokens": 4},
        },
    )
    st = await state(client)
    assert st["ranks"][0]["sessions"]["radix_referenced"] == ["traj-7"]
    evictable = st["ranks"][0]["pool"]["evictable"]
    assert (await client.post("/close_session", json={"session_id": "traj-7"})).status == 200
    st = await state(client)
    assert st["ranks"][0]["sessions"]["radix_referenced"] == []
    assert st["ranks"][0]["pool"]["evictable"] == evictable


async def test_streaming_session_holds_and_close_frees(make_client: ClientFactory) -> None:
    client = await make_client(mode="streaming", max_total_tokens=10_000)
    assert (
        await (
            await client.post(
                "/open_session",
                json={"capacity_of_str_len": 10, "session_id": "st", "streaming": True},
            )
        ).json()
        == "st"
    )
    r1 = await (
        await client.post(
            "/generate",
            json={
                "input_ids": list(range(100)),
                "session_params": {"id": "st"},
                "sampling_params": {"max_new_tokens": 4},
            },
        )
    ).json()
    assert r1["meta_info"]["cached_tokens"] == 0
    m = await metrics(client)
    assert m[f"sglang:num_streaming_sessions{{{LABELS}}}"] == 1
    assert m[f"sglang:streaming_session_held_tokens{{{LABELS}}}"] == 103
    assert m[f"sglang:kv_evictable_tokens{{{LABELS}}}"] == 0
    assert m[f"sglang:token_usage{{{LABELS}}}"] == 0.01
    r2 = await (
        await client.post(
            "/generate",
            json={
                "input_ids": [5, 6],
                "session_params": {"id": "st"},
                "sampling_params": {"max_new_tokens": 2},
            },
        )
    ).json()
    assert r2["meta_info"]["cached_tokens"] == 103
    assert r2["meta_info"]["prompt_tokens"] == 106
    await client.post("/close_session", json={"session_id": "st"})
    m = await metrics(client)
    assert m[f"sglang:streaming_session_held_tokens{{{LABELS}}}"] == 0
    assert m[f"sglang:kv_available_tokens{{{LABELS}}}"] == 10_000


# ------------------------------------------------------------------------- abort


async def _start(
    client: TestClient, path: str, body: dict[str, Any]
) -> asyncio.Task[aiohttp.ClientResponse]:
    async def go() -> aiohttp.ClientResponse:
        resp = await client.post(path, json=body)
        await resp.read()
        return resp

    return asyncio.create_task(go())


async def test_abort_request_prefix_running_and_queued(make_client: ClientFactory) -> None:
    client = await make_client(time_scale=0.05, max_running_requests=1, context_length=100_000)
    long = {"sampling_params": {"max_new_tokens": 50_000}}
    t_run = await _start(client, "/generate", {"input_ids": [1, 2, 3], "rid": "job-a", **long})

    async def running() -> bool:
        return (await state(client))["ranks"][0]["running"] == ["job-a"]

    await poll(running)
    t_wait = await _start(client, "/generate", {"input_ids": [7, 8, 9], "rid": "job-b", **long})
    t_other = await _start(
        client,
        "/generate",
        {"input_ids": [4, 5], "rid": "other", "sampling_params": {"max_new_tokens": 2}},
    )

    async def queued() -> bool:
        return (await state(client))["ranks"][0]["waiting"] == ["job-b", "other"]

    await poll(queued)
    resp = await client.post("/abort_request", json={"rid": "job-"})
    assert resp.status == 200 and await resp.read() == b""
    r_run, r_wait, r_other = await asyncio.wait_for(asyncio.gather(t_run, t_wait, t_other), 10)
    assert r_run.status == 200 and r_wait.status == 200
    run_body = orjson.loads(await r_run.read())
    wait_body = orjson.loads(await r_wait.read())
    assert run_body["meta_info"]["finish_reason"]["type"] == "abort"
    assert run_body["meta_info"]["finish_reason"]["message"] == "Aborted"
    assert wait_body["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Abort in waiting queue",
        "status_code": None,
        "err_type": None,
    }
    other = orjson.loads(await r_other.read())
    assert other["meta_info"]["finish_reason"]["type"] == "length"
    m = await metrics(client)
    assert (
        m['sglang:num_aborted_requests_total{engine_type="unified",model_name="test/model"}'] == 2
    )
    # Unknown rid and abort_all are 200 too.
    assert (await client.post("/abort_request", json={"rid": "nothing"})).status == 200
    assert (await client.post("/abort_request", json={"abort_all": True})).status == 200


async def test_client_disconnect_aborts_streaming_and_non_streaming(
    make_client: ClientFactory,
) -> None:
    client = await make_client(time_scale=0.05, context_length=100_000)
    resp = await client.post(
        "/generate",
        json={
            "input_ids": [1, 2],
            "stream": True,
            "rid": "gone-1",
            "sampling_params": {"max_new_tokens": 50_000},
        },
    )
    await resp.content.readuntil(b"\n\n")  # the first chunk arrived
    resp.close()
    task = await _start(
        client,
        "/generate",
        {"input_ids": [3, 4], "rid": "gone-2", "sampling_params": {"max_new_tokens": 50_000}},
    )

    async def second_running() -> bool:
        return (await state(client))["ranks"][0]["running"] == ["gone-2"]

    await poll(second_running)  # and the first one is gone already
    task.cancel()

    async def idle() -> bool:
        s = (await state(client))["ranks"][0]
        return not s["running"] and not s["waiting"] and not s["prefilling"]

    await poll(idle)
    m = await metrics(client)
    assert (
        m['sglang:num_aborted_requests_total{engine_type="unified",model_name="test/model"}'] == 2
    )


# ----------------------------------------------------------------------- metrics


async def test_metrics_names_labels_and_token_usage(make_client: ClientFactory) -> None:
    client = await make_client(max_total_tokens=1_000)
    await client.post(
        "/generate", json={"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 10}}
    )
    resp = await client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert "# TYPE sglang:token_usage gauge" in text
    assert "# TYPE sglang:prompt_tokens_total counter" in text
    m = await metrics(client)
    g = lambda name: m[f"sglang:{name}{{{LABELS}}}"]  # noqa: E731
    assert g("max_total_num_tokens") == 1_000
    assert g("kv_evictable_tokens") == 309
    assert g("kv_available_tokens") == 691
    assert g("token_usage") == 0.0  # the finished request's KV is evictable cache
    assert g("num_used_tokens") == 0 and g("kv_used_tokens") == 0
    assert g("num_running_reqs") == 0 and g("num_queue_reqs") == 0
    assert g("num_retracted_reqs") == 0
    for name in ("cache_hit_rate", "gen_throughput"):
        assert f"sglang:{name}{{{LABELS}}}" in m
    tok = 'engine_type="unified",is_streaming="false",model_name="test/model"'
    assert m[f"sglang:prompt_tokens_total{{{tok}}}"] == 300
    assert m[f"sglang:generation_tokens_total{{{tok}}}"] == 10
    assert m[f"sglang:num_requests_total{{{tok}}}"] == 1
    assert (
        m[
            'sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="test/model"}'
        ]
        == 0
    )
    assert f'sglang:evicted_tokens_total{{cache_type="RadixCache",{LABELS}}}' in m
    assert "sglang:num_streaming_sessions" not in text  # only with streaming sessions


async def test_metrics_token_usage_while_running(make_client: ClientFactory) -> None:
    client = await make_client(time_scale=0.05, max_total_tokens=1_000, context_length=100_000)
    task = await _start(
        client,
        "/generate",
        {"input_ids": list(range(300)), "rid": "busy", "sampling_params": {"max_new_tokens": 600}},
    )

    async def running() -> bool:
        return (await state(client))["ranks"][0]["running"] == ["busy"]

    await poll(running)
    m = await metrics(client)
    assert m[f"sglang:token_usage{{{LABELS}}}"] >= 0.3
    assert m[f"sglang:kv_evictable_tokens{{{LABELS}}}"] == 0
    assert m[f"sglang:num_running_reqs{{{LABELS}}}"] == 1
    await client.post("/abort_request", json={"rid": "busy"})
    await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (1, 3), (2, 2)])
async def test_metrics_rank_labels(make_client: ClientFactory, tp: int, dp: int) -> None:
    client = await make_client(tp_size=tp, dp_size=dp)
    text = await (await client.get("/metrics")).text()
    lines = [ln for ln in text.splitlines() if ln.startswith("sglang:max_total_num_tokens{")]
    assert len(lines) == tp * dp
    seen = set()
    for ln in lines:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', ln))
        assert list(labels) == sorted(labels)  # alphabetical, as SGLang's exporter writes
        assert ln.endswith(" 50000.0")
        seen.add((labels.get("tp_rank"), labels.get("dp_rank")))
        assert ("dp_rank" in labels) == (dp > 1)
    assert len(seen) == tp * dp
    info = await (await client.get("/get_server_info")).json()
    assert info["tp_size"] == tp and info["dp_size"] == dp


async def test_dp_ranks_are_independent_and_sticky_by_session(make_client: ClientFactory) -> None:
    client = await make_client(dp_size=2, mode="session-radix")
    for i in range(4):
        await client.post(
            "/generate",
            json={
                "input_ids": [9, 9, i],
                "session_id": "same",
                "sampling_params": {"max_new_tokens": 1},
            },
        )
    await client.post(
        "/generate",
        json={"input_ids": [1, 2], "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 1}},
    )
    st = await state(client)
    counts = [r["stats"]["num_requests_total"] for r in st["ranks"]]
    assert sorted(counts) in ([0, 5], [1, 4])


# ------------------------------------------------------------------ info routes


async def test_info_routes(make_client: ClientFactory, tmp_path: Any) -> None:
    client = await make_client(
        model_path=str(tmp_path / "model"), mode="streaming", eviction_policy="priority"
    )
    for path in ("/health", "/health_generate"):
        assert (await client.get(path)).status == 200
    a = await (await client.get("/server_info")).json()
    b = await (await client.get("/get_server_info")).json()
    assert a == b
    assert a["max_total_num_tokens"] == 50_000
    assert a["enable_streaming_session"] is True and a["enable_session_radix_cache"] is False
    assert a["radix_eviction_policy"] == "priority"
    assert a["served_model_name"] == "test/model"
    assert a["model_path"] == str(tmp_path / "model") and (tmp_path / "model").is_dir()
    mi = await (await client.get("/model_info")).json()
    assert mi == await (await client.get("/get_model_info")).json()
    assert mi["model_path"] == a["model_path"] and mi["is_generation"] is True
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "test/model"
    loads = await (await client.get("/v1/loads")).json()
    assert loads["loads"][0]["max_total_num_tokens"] == 50_000
    flush = await client.post("/flush_cache")
    assert flush.status == 200 and "Cache flushed" in await flush.text()


# ------------------------------------------------------------------------ faults


async def test_fault_knobs_at_run_time(make_client: ClientFactory) -> None:
    client = await make_client()
    assert await (await client.get("/sim/faults")).json() == {
        "metrics": "ok",
        "latency_s": 0.0,
        "drop_stream_after_chunks": None,
        "hold_after_done_s": 0.0,
        "status_503": False,
        "token_usage": None,
    }
    await client.post("/sim/faults", json={"metrics": "error"})
    assert (await client.get("/metrics")).status == 500
    await client.post("/sim/faults", json={"metrics": "garbage"})
    resp = await client.get("/metrics")
    assert resp.status == 200 and "# TYPE" not in await resp.text()
    await client.post("/sim/faults", json={"metrics": "ok", "status_503": True})
    assert (await client.get("/metrics")).status == 200
    assert (await client.post("/generate", json={"input_ids": [1]})).status == 503
    assert (await client.get("/health")).status == 503
    await client.post("/sim/faults", json={"status_503": False, "latency_s": 0.2})
    t0 = time.monotonic()
    assert (
        await client.post(
            "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
        )
    ).status == 200
    assert time.monotonic() - t0 >= 0.2
    bad = await client.post("/sim/faults", json={"metrics": "maybe"})
    assert bad.status == 400
    bad = await client.post("/sim/faults", json={"nonsense": 1})
    assert bad.status == 400
    bad = await client.post("/sim/faults", json={"token_usage": 1.5})
    assert bad.status == 400


async def test_token_usage_override_reset_and_request_recording(
    make_client: ClientFactory,
) -> None:
    client = await make_client(record_requests=2)
    await client.post("/sim/faults", json={"token_usage": 0.97, "latency_s": 0.01})
    text = await (await client.get("/metrics")).text()
    assert 'sglang:token_usage{engine_type="unified"' in text
    usage = [ln for ln in text.splitlines() if ln.startswith("sglang:token_usage{")]
    assert usage and all(ln.endswith(" 0.97") for ln in usage)
    after_reset = await (await client.post("/sim/faults", json={"reset": True})).json()
    assert after_reset["token_usage"] is None and after_reset["latency_s"] == 0.0
    for i in range(3):
        body = {"input_ids": [i], "sampling_params": {"max_new_tokens": 1}}
        assert (await client.post("/generate", json=body, headers={"X-Mark": str(i)})).status == 200
    recorded = (await (await client.get("/sim/requests")).json())["requests"]
    # a ring of the last two, oldest first, with the raw body and headers as received
    assert [r["headers"]["X-Mark"] for r in recorded] == ["1", "2"]
    assert recorded[0]["path"] == "/generate" and recorded[0]["body"].startswith(
        '{"input_ids": [1]'
    )


async def test_fault_drop_stream_mid_way(make_client: ClientFactory) -> None:
    client = await make_client(time_scale=0.05, faults=FaultConfig(drop_stream_after_chunks=2))
    resp = await client.post(
        "/generate",
        json={"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 40}},
    )
    assert resp.status == 200
    buf = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for data in resp.content.iter_any():
            buf += data
    assert buf.count(b"data: ") == 2 and b"[DONE]" not in buf

    async def idle() -> bool:
        return not (await state(client))["ranks"][0]["running"]

    await poll(idle)


async def test_fault_hold_after_done_keeps_a_finished_stream_open(
    make_client: ClientFactory,
) -> None:
    client = await make_client(time_scale=0.05, faults=FaultConfig(hold_after_done_s=0.5))
    resp = await client.post(
        "/generate",
        json={"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 3}},
    )
    assert resp.status == 200
    done_at = None
    async for line in resp.content:  # bounded by the stream: 3 tokens, then [DONE]
        if line == b"data: [DONE]\n":
            done_at = time.monotonic()
    assert done_at is not None
    # The end came after the hold (without it, within milliseconds of [DONE]); the
    # margin is the time a loaded host takes to hand the [DONE] line to this reader.
    assert time.monotonic() - done_at >= 0.25
    bad = await client.post("/sim/faults", json={"hold_after_done_s": -1})
    assert bad.status == 400


async def test_app_factory_uses_typed_state() -> None:
    app = create_sim_app(SimConfig(max_total_tokens=1234))
    assert app[SIM_STATE].cfg.max_total_tokens == 1234
    with pytest.raises(ValueError, match="mode"):
        create_sim_app(SimConfig(mode="bogus"))


async def test_time_model_in_the_shell(make_client: ClientFactory) -> None:
    # prefill 100 tokens, then 9 decode steps of a batch of 1 (default constants)
    expected = (0.010 + 0.00005 * 100) + 9 * (0.012 + 0.0002 * 1)
    client = await make_client(time_scale=0.1)
    t0 = time.monotonic()
    body = await (
        await client.post(
            "/generate",
            json={"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 10}},
        )
    ).json()
    wall = time.monotonic() - t0
    assert body["meta_info"]["e2e_latency"] >= expected - 1e-6
    # Simulated time never runs ahead of the wall clock / time_scale (a step sleeps until
    # its wall deadline; a late wake-up is reported as overrun, not added): an upper
    # bound that a slow host only loosens.
    assert body["meta_info"]["e2e_latency"] <= wall / 0.1 + 1e-3
    assert wall >= expected * 0.1


async def test_streaming_session_idle_timeout_in_the_loop(make_client: ClientFactory) -> None:
    client = await make_client(mode="streaming", time_scale=0.01)
    await client.post(
        "/open_session",
        json={"capacity_of_str_len": 1, "session_id": "idle", "streaming": True, "timeout": 2.0},
    )
    await client.post(
        "/generate",
        json={
            "input_ids": [1, 2, 3],
            "session_params": {"id": "idle"},
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert "idle" in (await state(client))["ranks"][0]["sessions"]["streaming"]

    async def reaped() -> bool:
        return not (await state(client))["ranks"][0]["sessions"]["streaming"]

    await poll(reaped)  # 2 simulated seconds = 20 ms wall at time_scale 0.01
    m = await metrics(client)
    assert (
        m[f"sglang:kv_available_tokens{{{LABELS}}}"] + m[f"sglang:kv_evictable_tokens{{{LABELS}}}"]
        == 50_000
    )


async def test_scheduler_crash_fails_requests_instead_of_hanging(
    make_client: ClientFactory,
) -> None:
    client = await make_client()
    rank = client.server.app[SIM_STATE].ranks[0]

    def boom(now: float) -> None:
        raise RuntimeError("simulated scheduler bug")

    rank.sched.schedule = boom  # type: ignore[method-assign]
    resp = await asyncio.wait_for(client.post("/generate", json={"input_ids": [1, 2]}), 10)
    assert resp.status == 500
    assert (await client.get("/health")).status == 503
    assert (await client.post("/generate", json={"input_ids": [1, 2]})).status == 503


async def test_retraction_under_pressure_over_http(make_client: ClientFactory) -> None:
    client = await make_client(max_total_tokens=2_000)
    bodies = [
        {
            "input_ids": list(range(i * 1000, i * 1000 + 100)),
            "sampling_params": {"max_new_tokens": 300},
        }
        for i in range(10)
    ]
    resps = await asyncio.wait_for(
        asyncio.gather(*(client.post("/generate", json=b) for b in bodies)), 30
    )
    outs = [await r.json() for r in resps]
    assert all(o["meta_info"]["completion_tokens"] == 300 for o in outs)
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    m = await metrics(client)
    assert m[f"sglang:num_retracted_requests_total{{{LABELS}}}"] > 0
    assert m[f"sglang:num_retracted_reqs{{{LABELS}}}"] > 0
