"""Dynamo's nvext end to end: simulated engines in streaming mode
(``--enable-streaming-session``), the real router (smg, ``--policy
consistent_hashing``), kvproxy in front with only session lifecycle on.

``action: open`` pins the session's KV in a streaming session on exactly one engine,
later turns go in streaming-session form and are served from the slot, close frees
it, and the generated tokens equal a run without session control; a mismatching
turn falls back without an error; ``bind`` with a short timeout is closed after it;
a speculative prefill reaches the session's engine after the response, streamed
(SSE) or not.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvlab import stack
from kvlab.workload.wire import StreamState, parse_sse_line
from kvproxy.dynamo import control as dynamo
from kvproxy.keys import DYNAMO, FLEET, SESSIONS

from .conftest import Proxy, StartProxy, recorded, reset_faults, set_faults, wait_until

MODEL = "kvproxy/sim-model"

POOL = 20_000
ENGINE_ARGS = ("--time-scale", "0.02", "--record-requests", "4096")
_ids = itertools.count()


@pytest.fixture(scope="module")
def st_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[stack.ManagedProcess]]:
    with stack.sim_engines(
        2,
        max_total_tokens=POOL,
        mode="streaming",
        extra_args=ENGINE_ARGS,
        log_dir=tmp_path_factory.mktemp("dynamo-stack"),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def st_router(
    st_engines: list[stack.ManagedProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.ManagedProcess]:
    with stack.start_router(
        [e.url for e in st_engines],
        policy="consistent_hashing",
        extra_args=("--disable-worker-overload-protection",),
        log_dir=Path(tmp_path_factory.mktemp("dynamo-router")),
    ) as proc:
        yield proc


def _config(router_url: str, **lifecycle: Any) -> dict[str, Any]:
    return {
        "server": {"log_level": "WARNING"},
        "router": {"url": router_url, "policy": "consistent_hashing", "discovery_interval_s": 0.5},
        "session_lifecycle": {"enabled": True, "check_engines": False, **lifecycle},
    }


async def _placed(p: Proxy, sid: str) -> None:
    async def placed() -> bool:
        return p.app[DYNAMO]._owner(sid) is not None

    await wait_until(placed, timeout_s=10, what="placement known")


@pytest.fixture
async def proxy(st_router: stack.ManagedProcess, start_proxy: StartProxy) -> Proxy:
    p = await start_proxy(_config(st_router.url))
    await _placed(p, "probe")
    return p


_METRIC = re.compile(r"^sglang:(num_streaming_sessions|streaming_session_held_tokens)\S*\s+(\S+)$")


async def streaming_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    out = {"num_streaming_sessions": 0.0, "streaming_session_held_tokens": 0.0}
    async with http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            m = _METRIC.match(line)
            if m:
                out[m.group(1)] += float(m.group(2))
    return out


async def generate(http: aiohttp.ClientSession, p: Proxy, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(f"{p.url}/generate", json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        return orjson.loads(text)


def _turn(
    ids: list[int], rid: str, sid: str | None, action: str | None = None, **control: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    if sid is not None:
        sc: dict[str, Any] = {"session_id": sid, **control}
        if action is not None:
            sc["action"] = action
        body["nvext"] = {"session_control": sc}
    return body


async def _conversation(
    http: aiohttp.ClientSession, p: Proxy, sid: str | None, tag: str, *, plain_sid: str
) -> list[dict[str, Any]]:
    """Three turns, each the previous prompt + output + 5 new tokens; the last closes."""
    prompt = [1000 + i for i in range(40)]
    results = []
    for turn in range(3):
        action = ("open", None, "close")[turn] if sid is not None else None
        body = _turn(prompt, f"{tag}-t{turn}", sid, action, timeout=60)
        if sid is None:
            body["session_id"] = plain_sid
        doc = await generate(http, p, body)
        results.append(doc)
        prompt = prompt + doc["output_ids"] + [2000 + 10 * turn + k for k in range(5)]
    return results


async def test_open_pins_kv_on_one_engine_serves_from_the_slot_and_matches_a_plain_run(
    proxy: Proxy, st_engines: list[stack.ManagedProcess], http: aiohttp.ClientSession
) -> None:
    urls = [e.url for e in st_engines]
    sid = f"sub-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    assert owner in urls
    prompt = [1000 + i for i in range(40)]
    first = await generate(http, proxy, _turn(prompt, f"{sid}-t0", sid, "open", timeout=60))
    # Pinned on exactly one engine, the session's.
    per_engine = {u: await streaming_metrics(http, u) for u in urls}
    assert [u for u, m in per_engine.items() if m["num_streaming_sessions"] == 1] == [owner]
    assert per_engine[owner]["streaming_session_held_tokens"] > 0
    assert all(m["num_streaming_sessions"] == 0 for u, m in per_engine.items() if u != owner)

    # The second turn: full context from the client, only the new tokens to the engine.
    prev = prompt + first["output_ids"]
    second_prompt = [*prev, 3000, 3001, 3002]
    second = await generate(http, proxy, _turn(second_prompt, f"{sid}-t1", sid))
    assert second["meta_info"]["prompt_tokens"] == len(second_prompt)
    assert second["meta_info"]["cached_tokens"] >= len(prev) - 1  # served from the slot
    sent = [
        orjson.loads(e["body"])
        for e in await recorded(http, [owner])
        if e["path"] == "/generate" and f"{sid}-t1" in e["body"]
    ]
    assert len(sent) == 1
    assert sent[0]["input_ids"] == [3000, 3001, 3002]
    assert sent[0]["session_params"] == {"id": sid}
    assert "session_id" not in sent[0]

    # close: the final turn is served, then the slot is freed on every engine.
    third_prompt = second_prompt + second["output_ids"] + [3003]
    await generate(http, proxy, _turn(third_prompt, f"{sid}-t2", sid, "close"))

    async def freed() -> bool:
        ms = [await streaming_metrics(http, u) for u in urls]
        return all(
            m["num_streaming_sessions"] == 0 and m["streaming_session_held_tokens"] == 0 for m in ms
        )

    await wait_until(freed, timeout_s=10, what="the streaming session freed")
    assert proxy.app[DYNAMO].counters.total(dynamo.STREAM_EXTENDED) >= 2
    assert len(proxy.app[DYNAMO].slots) == 0


async def test_a_streaming_session_builds_the_context_a_plain_run_sends(
    proxy: Proxy, st_engines: list[stack.ManagedProcess], http: aiohttp.ClientSession
) -> None:
    tag = f"same-{next(_ids)}"
    with_control = await _conversation(http, proxy, f"{tag}-s", tag, plain_sid="unused")
    without = await _conversation(http, proxy, None, tag, plain_sid=f"{tag}-plain")
    # The simulator draws a turn's output ids from its rid (the same in both runs), so
    # they cannot tell the runs apart. What can: the context the engine built. The
    # streaming session's slot holds each turn's prompt and answer, and kvproxy sends a
    # later turn's new tokens only; slot + new tokens must be the full prompt the plain
    # run sent, turn by turn, and served from the slot.
    bodies = [
        orjson.loads(e["body"])
        for e in await recorded(http, [e.url for e in st_engines], path="/generate")
        if f'"{tag}-t' in e["body"]
    ]
    plain = sorted((b for b in bodies if b.get("session_id") == f"{tag}-plain"), key=_rid)
    streamed = sorted((b for b in bodies if b.get("session_id") != f"{tag}-plain"), key=_rid)
    assert (
        [_rid(b) for b in plain] == [_rid(b) for b in streamed] == [f"{tag}-t{k}" for k in range(3)]
    )
    slot: list[int] = []
    for turn, (sent, full, doc) in enumerate(zip(streamed, plain, with_control, strict=True)):
        assert sent["session_params"]["id"] == f"{tag}-s"  # every turn in the slot
        assert slot + sent["input_ids"] == full["input_ids"]
        assert doc["meta_info"]["prompt_tokens"] == len(full["input_ids"])
        if turn > 0:
            assert doc["meta_info"]["cached_tokens"] >= len(slot) - 1
        slot = full["input_ids"] + doc["output_ids"]
    assert [d["meta_info"]["prompt_tokens"] for d in without] == [
        len(b["input_ids"]) for b in plain
    ]


def _rid(body: dict[str, Any]) -> str:
    return str(body["rid"])


async def test_a_mismatching_turn_falls_back_without_an_error(
    proxy: Proxy, st_engines: list[stack.ManagedProcess], http: aiohttp.ClientSession
) -> None:
    urls = [e.url for e in st_engines]
    sid = f"mis-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    prompt = [5000 + i for i in range(30)]
    first = await generate(http, proxy, _turn(prompt, f"{sid}-t0", sid, "open", timeout=60))
    edited = [*prompt, 9, *first["output_ids"][1:], 7, 7]  # the answer was rewritten
    doc = await generate(http, proxy, _turn(edited, f"{sid}-t1", sid))
    assert doc["meta_info"]["prompt_tokens"] == len(edited)
    sent = [
        orjson.loads(e["body"])
        for e in await recorded(http, [owner])
        if e["path"] == "/generate" and f"{sid}-t1" in e["body"]
    ]
    assert len(sent) == 1
    assert sent[0]["input_ids"] == edited and sent[0]["session_id"] == sid
    assert "session_params" not in sent[0]

    async def closed() -> bool:
        counts = [(await streaming_metrics(http, u))["num_streaming_sessions"] for u in urls]
        return counts == [0] * len(urls)

    await wait_until(closed, timeout_s=10, what="the streaming session closed on fall-back")
    assert proxy.app[DYNAMO].counters.total(dynamo.STREAM_FALLBACK + "mismatch") == 1


async def test_bind_with_a_short_timeout_is_closed_after_it(
    proxy: Proxy, st_engines: list[stack.ManagedProcess], http: aiohttp.ClientSession
) -> None:
    sid = f"bind-{next(_ids)}"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "nvext": {"session_control": {"session_id": sid, "action": "bind", "timeout": 1}},
    }
    async with http.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    assert proxy.app[SESSIONS].state(sid) == "open"
    # Routed stickily although sticky_routing is off.
    owner = proxy.app[DYNAMO]._owner(sid)
    chats = [e for e in await recorded(http, [owner]) if e["path"] == "/v1/chat/completions"]
    assert any(
        e["headers"].get("X-SMG-Routing-Key") == sid or e["headers"].get("x-smg-routing-key") == sid
        for e in chats
    ) or any(sid in e["body"] for e in chats)

    async def closed() -> bool:
        return proxy.app[SESSIONS].state(sid) == "closed"

    await wait_until(closed, timeout_s=10, what="the bind timeout closing the session")
    assert proxy.app[DYNAMO].counters.total(dynamo.BIND_CLOSED) >= 1
    closes = [
        e
        for e in await recorded(http, [e.url for e in st_engines], path="/close_session")
        if sid in e["body"]
    ]
    assert len(closes) == len(st_engines)  # broadcast to every engine


async def test_speculative_prefill_reaches_the_sessions_engine_after_the_response(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"spec-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"plan the task {sid}"}],
        "max_tokens": 5,
        "nvext": {
            "session_control": {"session_id": sid, "action": "bind"},
            "agent_hints": {"speculative_prefill": True, "priority": 3},
        },
    }
    async with http.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        doc = orjson.loads(await resp.read())
    answer = doc["choices"][0]["message"]["content"]

    def mine(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            orjson.loads(e["body"])
            for e in entries
            if e["path"] == "/v1/chat/completions" and sid in e["body"]
        ]

    async def prefilled() -> bool:
        return len(mine(await recorded(http, [owner]))) == 2

    await wait_until(prefilled, timeout_s=10, what="the speculative prefill")
    turn, prefill = mine(await recorded(http, [owner]))  # arrival order on the engine
    assert turn["priority"] == 3  # agent_hints.priority became the top-level priority
    assert proxy.app[DYNAMO].counters.total(dynamo.HINT_PRIORITY) >= 1
    # The prefill carries the answer the client received: it was built after it.
    assert prefill["messages"][-1] == {"role": "assistant", "content": answer}
    assert prefill["max_tokens"] == 1 and prefill["session_id"] == sid
    assert "nvext" not in prefill and prefill["rid"] != turn["rid"]

    async def answered() -> bool:
        return proxy.app[DYNAMO].counters.total(dynamo.PREFILL_SENT) == 1

    await wait_until(answered, timeout_s=10, what="the prefill's answer")
    # Never counted as a turn: one request tracked for the session.
    await proxy.app[SESSIONS].close(sid, reason="test")


async def _sse_lines(resp: aiohttp.ClientResponse) -> tuple[list[Any], float]:
    """A streamed answer's JSON events, and when its ``[DONE]`` was read."""
    events: list[Any] = []
    async for line in resp.content:
        ev = parse_sse_line(line)
        if ev is not None and ev[0] == "json":
            events.append(ev[1])
        elif ev is not None and ev[0] == "done":
            return events, time.monotonic()
    raise AssertionError("the stream ended without [DONE]")


async def _one_prefill_soon(
    proxy: Proxy,
    http: aiohttp.ClientSession,
    owner: str,
    mine: Any,
    done_at: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The turn and its one prefill on the session's engine, the prefill sent once the
    turn's [DONE] is read (a bounded poll, no fixed sleep)."""

    async def prefilled() -> bool:
        return len(mine(await recorded(http, [owner]))) >= 2

    # Sent at the end of the stream, not at the bind's timeout (300 s) or the session's
    # close: 10 s bounds it with room for a busy host.
    await wait_until(prefilled, timeout_s=10, what="the prefill soon after [DONE]")
    assert time.monotonic() - done_at < 10

    async def answered() -> bool:
        return proxy.app[DYNAMO].counters.total(dynamo.PREFILL_SENT) == 1

    await wait_until(answered, timeout_s=10, what="the prefill's answer")
    found = mine(await recorded(http, [owner]))
    assert len(found) == 2, found  # the turn and exactly one prefill
    assert proxy.app[DYNAMO].counters.total(dynamo.PREFILL_FAILED) == 0
    return found[0], found[1]


async def test_a_streamed_chat_turn_gets_its_speculative_prefill_after_done(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"spec-sse-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"plan the task {sid}"}],
        "max_tokens": 5,
        "stream": True,
        "nvext": {
            "session_control": {"session_id": sid, "action": "bind"},
            "agent_hints": {"speculative_prefill": True},
        },
    }
    async with http.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events, done_at = await _sse_lines(resp)
    answer = "".join(
        c["delta"].get("content") or "" for e in events for c in e["choices"] if "delta" in c
    )
    assert answer

    def mine(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            orjson.loads(e["body"])
            for e in entries
            if e["path"] == "/v1/chat/completions" and sid in e["body"]
        ]

    turn, prefill = await _one_prefill_soon(proxy, http, owner, mine, done_at)
    assert turn["stream"] is True
    # The prefill carries the answer the client received, as a buffered turn's does.
    assert prefill["messages"][-1] == {"role": "assistant", "content": answer}
    assert prefill["max_tokens"] == 1 and prefill["session_id"] == sid
    # Not streamed (the router writes its default, stream: false, into what it sends).
    assert not prefill.get("stream") and "nvext" not in prefill and prefill["rid"] != turn["rid"]
    await proxy.app[SESSIONS].close(sid, reason="test")


async def test_a_streamed_generate_turn_gets_its_prefill_with_the_output_ids(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"spec-gen-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    prompt = [7000 + i for i in range(24)]
    body = _turn(prompt, f"{sid}-t0", sid, "bind")
    body["nvext"]["agent_hints"] = {"speculative_prefill": True}
    body["stream"] = True
    async with http.post(f"{proxy.url}/generate", json=body) as resp:
        assert resp.status == 200
        events, done_at = await _sse_lines(resp)
    state = StreamState()
    for ev in events:
        state.feed_generate(ev)
    assert state.output_ids

    def mine(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            orjson.loads(e["body"])
            for e in entries
            if e["path"] == "/generate" and sid in e["body"]
        ]

    _, prefill = await _one_prefill_soon(proxy, http, owner, mine, done_at)
    assert prefill["input_ids"] == [*prompt, *state.output_ids]
    assert prefill["sampling_params"]["max_new_tokens"] == 1
    await proxy.app[SESSIONS].close(sid, reason="test")


async def test_nvext_on_generate_reaches_the_engine_unless_stripped(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"nv-{next(_ids)}"
    body = _turn([1, 2, 3], f"{sid}-r", sid)
    body["nvext"]["agent_hints"] = {"osl": 3}
    doc = await generate(http, proxy, body)
    assert doc["meta_info"]["prompt_tokens"] == 3
    bad = _turn([1, 2, 3], f"{sid}-bad", sid)
    bad["nvext"]["agent_hints"] = {"priority": "urgent"}
    async with http.post(f"{proxy.url}/generate", json=bad) as resp:
        assert resp.status == 400
        assert "agent_hints.priority must be an integer" in await resp.text()


async def test_a_session_the_engine_no_longer_knows_falls_back_to_the_same_tokens(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"gone-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    prompt = [6000 + i for i in range(20)]
    first = await generate(http, proxy, _turn(prompt, f"{sid}-t0", sid, "open", timeout=60))
    # The engine drops the session behind kvproxy's back (as its own timeout would).
    async with http.post(f"{owner}/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200
    nxt = [*prompt, *first["output_ids"], 42, 43]
    doc = await generate(http, proxy, _turn(nxt, f"{sid}-t1", sid))
    assert doc["meta_info"]["prompt_tokens"] == len(nxt)
    # Same tokens as the ordinary request with that rid gives.
    plain = await generate(
        http, proxy, {**_turn(nxt, f"{sid}-t1", None), "session_id": f"{sid}-plain"}
    )
    assert doc["output_ids"] == plain["output_ids"]
    bodies = [
        orjson.loads(e["body"])
        for e in await recorded(http, [owner])
        if e["path"] == "/generate" and f"{sid}-t1" in e["body"]
    ]
    # The translated attempt (refused by the engine), then the ordinary retry.
    assert [("session_params" in b, b["input_ids"] == nxt) for b in bodies[:2]] == [
        (True, False),
        (False, True),
    ]
    assert proxy.app[DYNAMO].counters.total(dynamo.STREAM_FALLBACK + "engine_error") >= 1
    assert proxy.app[DYNAMO].slots.get(sid) is None
    # kvproxy's /close_session reached the engine after the refused attempt and before
    # the ordinary retry (a slot's pinned KV is freed before the retry needs room).
    log = await recorded(http, [owner])
    marks = [
        (e["path"], "session_params" in orjson.loads(e["body"]))
        for e in log
        if f"{sid}-t1" in e["body"] or (e["path"] == "/close_session" and sid in e["body"])
    ]
    attempt = marks.index(("/generate", True))
    retry = marks.index(("/generate", False), attempt)
    assert ("/close_session", False) in marks[attempt:retry], marks


async def test_no_speculative_prefill_when_the_session_ends(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"end-{next(_ids)}"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "last words"}],
        "max_tokens": 3,
        "nvext": {
            "session_control": {"session_id": sid, "action": "close"},
            "agent_hints": {"speculative_prefill": True},
        },
    }
    async with http.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    assert proxy.app[DYNAMO].counters.total(dynamo.PREFILL_SKIPPED + "session_end") == 1
    assert proxy.app[DYNAMO].counters.total(dynamo.PREFILL_SENT) == 0


async def stream_generate(
    http: aiohttp.ClientSession, p: Proxy, body: dict[str, Any]
) -> StreamState:
    state = StreamState()
    async with http.post(f"{p.url}/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            ev = parse_sse_line(line)
            if ev is not None and ev[0] == "json":
                state.feed_generate(ev[1])
    assert state.error is None
    return state


async def test_streamed_turns_are_translated_too_and_generate_the_same_tokens(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    tag = f"sse-{next(_ids)}"
    sid = f"{tag}-s"
    owner = proxy.app[DYNAMO]._owner(sid)
    runs: dict[str, list[list[int]]] = {}
    for mode in ("control", "plain"):
        prompt = [7000 + i for i in range(30)]
        outs = []
        for turn in range(3):
            action = ("open", None, "close")[turn]
            if mode == "control":
                body = _turn(prompt, f"{tag}-t{turn}", sid, action, timeout=60)
            else:
                body = {**_turn(prompt, f"{tag}-t{turn}", None), "session_id": f"{tag}-p"}
            state = await stream_generate(http, proxy, body)
            assert state.prompt_tokens == len(prompt)
            outs.append(state.output_ids)
            prompt = [*prompt, *state.output_ids, 8000 + turn]
        runs[mode] = outs
    assert runs["control"] == runs["plain"]
    sent = [
        orjson.loads(e["body"])
        for e in await recorded(http, [owner])
        if e["path"] == "/generate" and f"{tag}-t1" in e["body"] and sid in e["body"]
    ]
    assert len(sent) == 1 and sent[0]["session_params"] == {"id": sid}
    assert sent[0]["input_ids"] == [8000]  # only the new tokens


async def test_a_streamed_turn_hung_up_on_after_its_done_keeps_its_streaming_session(
    proxy: Proxy, http: aiohttp.ClientSession, st_engines: list[stack.ManagedProcess]
) -> None:
    # The client hangs up once it has read [DONE] while the stream is still open
    # upstream (held here): the turn is complete, its slot kept with its context.
    sid = f"sse-hangup-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    urls = [e.url for e in st_engines]
    prompt = [7700 + i for i in range(20)]
    body = {**_turn(prompt, f"{sid}-t0", sid, "open", timeout=60), "stream": True}
    hold_s = 2.0
    await set_faults(http, urls, hold_after_done_s=hold_s)
    state = StreamState()
    try:
        async with http.post(f"{proxy.url}/generate", json=body) as resp:
            assert resp.status == 200
            for _ in range(1000):  # a few tokens' events, then [DONE]
                ev = parse_sse_line(await resp.content.readline())
                if ev is not None and ev[0] == "json":
                    state.feed_generate(ev[1])
                if ev is not None and ev[0] == "done":
                    break
            else:
                raise AssertionError("no [DONE]")
            resp.close()  # the connection, at once
        assert state.output_ids
        context = (*prompt, *state.output_ids)

        async def kept() -> bool:
            slot = proxy.app[DYNAMO].slots.get(sid)
            return slot is not None and not slot.in_flight and slot.context == context

        # Past the hold: a turn recorded late, not lost, would be by then.
        await wait_until(kept, timeout_s=hold_s + 3, what="the turn recorded on its slot")
    finally:
        await reset_faults(urls)
    nxt = [*context, 1]
    again = await stream_generate(http, proxy, _turn(nxt, f"{sid}-t1", sid))
    assert again.prompt_tokens == len(nxt)
    sent = [
        orjson.loads(e["body"])
        for e in await recorded(http, [owner])
        if e["path"] == "/generate" and f"{sid}-t1" in e["body"]
    ]
    assert len(sent) == 1 and sent[0]["input_ids"] == [1]  # served from the slot
    assert proxy.app[DYNAMO].counters.total(dynamo.STREAM_FALLBACK + "engine_error") == 0


async def test_a_streamed_turn_the_engine_refuses_is_sent_as_the_ordinary_request(
    proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    sid = f"sse-gone-{next(_ids)}"
    owner = proxy.app[DYNAMO]._owner(sid)
    prompt = [7500 + i for i in range(20)]
    first = await stream_generate(http, proxy, _turn(prompt, f"{sid}-t0", sid, "open", timeout=60))
    async with http.post(f"{owner}/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200
    nxt = [*prompt, *first.output_ids, 1]
    again = await stream_generate(http, proxy, _turn(nxt, f"{sid}-t1", sid))
    assert again.prompt_tokens == len(nxt) and again.output_ids
    assert proxy.app[DYNAMO].slots.get(sid) is None


async def test_strip_nvext_paths_removes_only_nvext(
    st_router: stack.ManagedProcess, http: aiohttp.ClientSession, start_proxy: StartProxy
) -> None:
    # No discovery_interval_s here: the default, as before.
    doc = _config(st_router.url, strip_nvext_paths=["/generate"])
    del doc["router"]["discovery_interval_s"]
    p = await start_proxy(doc)
    sid = f"strip-{next(_ids)}"
    body = {**_turn([1, 2, 3], f"{sid}-r", sid), "custom_labels": {"k": "v"}}
    await generate(http, p, body)
    await _placed(p, sid)
    sent = [
        orjson.loads(e["body"])
        for e in await recorded(http, p.app[FLEET].all_engines(), path="/generate")
        if f"{sid}-r" in e["body"]
    ]
    assert len(sent) == 1
    assert "nvext" not in sent[0]
    assert sent[0]["custom_labels"] == {"k": "v"} and sent[0]["session_id"] == sid
    assert sent[0]["input_ids"] == [1, 2, 3]
