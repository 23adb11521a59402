"""Session lifecycle end to end: kvproxy -> the real router (smg) -> simulated engines.

The shared engines run the session radix cache with priority eviction and record the
requests they receive, so every test uses its own session ids / rids / markers and
reads back only what carries them. Tests that need engines of their own (a dead one,
a small KV pool) start them here and stop them by PID.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvlab import stack
from kvproxy.keys import ADMISSION, SESSIONS
from kvproxy.sessions import lifecycle as lc
from tests.helpers import header_of, new_marker

from .conftest import ENGINE_ARGS, MakeProxy, Proxy, recorded, set_faults, sim_state, wait_until

pytestmark = pytest.mark.usefixtures("router")

HEX_RID = re.compile(r"[0-9a-f]{32}")
MODEL = "kvproxy/sim-model"
# At the engines' time scale (0.05) a decode step takes ~0.6 ms of wall time, so this
# many tokens keep a request running for well over a second.
LONG = 2000


# ------------------------------------------------------------------- helpers
def _sid() -> str:
    return f"lc-{uuid.uuid4().hex}"


async def _post(
    http: aiohttp.ClientSession,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {"headers": headers}
    if body is not None:
        kwargs["json"] = body
    async with http.post(url, **kwargs) as resp:
        raw = await resp.read()
        try:
            return resp.status, orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return resp.status, raw


async def _close(http: aiohttp.ClientSession, proxy: Proxy, sid: str) -> dict[str, Any]:
    status, doc = await _post(http, proxy.url + "/close_session", {"session_id": sid})
    assert status == 200, doc
    return doc


async def _bodies(
    http: aiohttp.ClientSession, engine_urls: list[str], needle: str, *, path: str | None = None
) -> list[dict[str, Any]]:
    """Parsed bodies of the recorded requests whose raw body contains ``needle``."""
    return [
        orjson.loads(r["body"])
        for r in await recorded(http, engine_urls, path=path)
        if needle in r["body"]
    ]


async def _closes_of(http: aiohttp.ClientSession, engine_urls: list[str], sid: str) -> list[str]:
    """The engines (one entry per call received) that got /close_session for ``sid``."""
    out = []
    for url in engine_urls:
        for r in await recorded(http, [url], path="/close_session"):
            if orjson.loads(r["body"]).get("session_id") == sid:
                out.append(url)
    return out


def _stat(proxy: Proxy, key: str) -> float:
    return proxy.app[SESSIONS].stats()[key]


def _cond(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def predicate() -> bool:
        return check()

    return predicate


async def _engine_running(http: aiohttp.ClientSession, engine_urls: list[str], rid: str) -> str:
    """Wait until an engine runs ``rid``; its URL."""
    found: list[str] = []

    async def running() -> bool:
        for url in engine_urls:
            state = await sim_state(http, url)
            if any(rid in r["running"] for r in state["ranks"]):
                found.append(url)
                return True
        return False

    await wait_until(running, timeout_s=5, what=f"an engine to run {rid}")
    return found[0]


async def _engine_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The engine's /metrics, summed per metric name (one DP rank, one TP rank)."""
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


@pytest.fixture
def blackhole() -> Iterator[str]:
    """An engine URL that accepts connections and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


# ------------------------------------------------------------------ identity
async def test_lifecycle_off_changes_no_body_and_closes_nothing(
    make_proxy: MakeProxy,
    router: stack.ManagedProcess,
    http: aiohttp.ClientSession,
    engine_urls: list[str],
) -> None:
    proxy = await make_proxy()
    sid = _sid()
    headers = {"X-Session-ID": sid, "X-Session-Final": "true"}
    seen: list[bytes] = []
    for base in (router.url, proxy.url):
        marker = new_marker()
        body = {
            "text": f"off {marker}",
            "sampling_params": {"max_new_tokens": 2},
            "nvext": {"session_control": {"session_id": sid, "action": "close"}},
        }
        status, _ = await _post(http, base + "/generate", body, headers)
        assert status == 200
        (entry,) = [
            r for r in await recorded(http, engine_urls, path="/generate") if marker in r["body"]
        ]
        assert "session_id" not in orjson.loads(entry["body"])
        assert header_of(entry, "X-SMG-Routing-Key") is None
        seen.append(entry["body"].replace(marker, "<m>"))
    direct, through_proxy = seen
    assert through_proxy == direct  # the engine receives what it receives without kvproxy
    assert proxy.app[SESSIONS].stats() == {}
    # /close_session is not served by kvproxy: it reaches the router, as without kvproxy.
    statuses = []
    for base in (router.url, proxy.url):
        status, _ = await _post(http, base + "/close_session", {"session_id": sid})
        statuses.append(status)
    assert statuses[0] == statuses[1]
    # Neither the nvext action, the final header nor /close_session told any engine.
    assert await _closes_of(http, engine_urls, sid) == []


@pytest.mark.parametrize("source", ["body", "header", "nvext", "routing_key", "path"])
async def test_each_id_source_reaches_the_engine_as_top_level_session_id(
    source: str, make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True, "sticky_routing": True})
    sid, marker = _sid(), new_marker()
    body: dict[str, Any] = {"text": f"src {marker}", "sampling_params": {"max_new_tokens": 2}}
    headers: dict[str, str] = {}
    path = "/generate"
    if source == "body":
        body["session_id"] = sid
    elif source == "header":
        headers["X-Session-ID"] = sid
    elif source == "nvext":
        body["nvext"] = {"session_control": {"session_id": sid}}
    elif source == "routing_key":
        headers["X-SMG-Routing-Key"] = sid
    else:
        path = f"/sessions/{sid}/generate"
    status, doc = await _post(http, proxy.url + path, body, headers)
    assert status == 200, doc
    (entry,) = [
        r for r in await recorded(http, engine_urls, path="/generate") if marker in r["body"]
    ]
    got = orjson.loads(entry["body"])
    assert got["session_id"] == sid
    # A fixed-length rid was added (the client sent none), and the engine ran under it.
    assert HEX_RID.fullmatch(got["rid"])
    assert doc["meta_info"]["id"] == got["rid"]
    # Everything the client sent arrives unchanged.
    assert got["text"] == body["text"] and got["sampling_params"] == body["sampling_params"]
    if "nvext" in body:
        assert got["nvext"] == body["nvext"]
    # Sticky routing: the router (and behind it the engine) sees the session id as key.
    assert header_of(entry, "X-SMG-Routing-Key") == sid
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.INJECTED] == (0.0 if source == "body" else 1.0)  # body: already there
    assert stats[lc.STARTED] == 1.0 and stats[lc.OPEN] == 1.0
    assert proxy.app[SESSIONS].state(sid) == "open"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "t {m}", "sampling_params": {"max_new_tokens": 2}}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "c {m}"}], "max_tokens": 2},
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "p {m}", "max_tokens": 2, "ext": [1]}),
    ],
)
async def test_injection_adds_only_session_id_and_rid_on_every_llm_path(
    path: str,
    body: dict[str, Any],
    make_proxy: MakeProxy,
    router: stack.ManagedProcess,
    http: aiohttp.ClientSession,
    engine_urls: list[str],
) -> None:
    """What the engine receives through kvproxy equals what it receives when the client
    itself sends the two fields to the router; a client rid is kept."""
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _sid()

    def fill(marker: str) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(body).replace(b"{m}", marker.encode()))

    async def engine_body(marker: str) -> str:
        (entry,) = [r for r in await recorded(http, engine_urls, path=path) if marker in r["body"]]
        assert header_of(entry, "X-SMG-Routing-Key") is None  # sticky_routing is off
        return entry["body"]

    # 1. Through kvproxy without a rid (header source), then the same fields sent directly.
    m1, m2 = new_marker(), new_marker()
    status, _ = await _post(http, proxy.url + path, fill(m1), {"X-Session-ID": sid})
    assert status == 200
    proxied = orjson.loads(await engine_body(m1))
    rid = proxied["rid"]
    assert HEX_RID.fullmatch(rid) and proxied["session_id"] == sid
    direct_body = {**fill(m2), "session_id": sid, "rid": rid[::-1]}
    status, _ = await _post(http, router.url + path, direct_body)
    assert status == 200
    direct = orjson.loads(await engine_body(m2))
    assert {**direct, "rid": rid} == orjson.loads(
        orjson.dumps(proxied).replace(m1.encode(), m2.encode())
    )

    # 2. The path prefix, with the client's own rid: kept as it is.
    m3, own_rid = new_marker(), f"client-{new_marker()}"
    status, doc = await _post(
        http, f"{proxy.url}/sessions/{sid}{path}", {**fill(m3), "rid": own_rid}
    )
    assert status == 200, doc
    got = orjson.loads(await engine_body(m3))
    assert got["session_id"] == sid and got["rid"] == own_rid


async def test_session_params_bodies_are_left_alone(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    legacy, sid, marker = _sid(), _sid(), new_marker()
    for url in engine_urls:  # a legacy session on every engine (the router picks one)
        status, _ = await _post(
            http, url + "/open_session", {"capacity_of_str_len": 1000, "session_id": legacy}
        )
        assert status == 200
    try:
        proxy = await make_proxy(session_lifecycle={"enabled": True})
        body = {
            "text": f"legacy {marker}",
            "session_params": {"id": legacy},
            "sampling_params": {"max_new_tokens": 2},
        }
        status, doc = await _post(http, proxy.url + "/generate", body, {"X-Session-ID": sid})
        # SGLang rejects session_id together with session_params: none was added.
        assert status == 200, doc
        (got,) = await _bodies(http, engine_urls, marker, path="/generate")
        assert "session_id" not in got
        assert got["session_params"] == {"id": legacy}
        stats = proxy.app[SESSIONS].stats()
        assert stats[lc.INJECTION_SKIPPED] == 1.0 and stats[lc.INJECTED] == 0.0
    finally:
        for url in engine_urls:
            await _post(http, url + "/close_session", {"session_id": legacy})


async def test_bad_session_ids_are_400_and_never_forwarded(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    marker = new_marker()
    body = {"text": f"bad {marker}", "sampling_params": {"max_new_tokens": 2}}
    cases: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
        ("/generate", {**body, "session_id": 123}, {}, "session_id"),
        ("/generate", {**body, "session_id": ""}, {}, "session_id"),
        ("/generate", body, {"X-Session-ID": "has space"}, "session header"),
        ("/generate", body, {"X-Session-ID": "a" * 129}, "session header"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": marker, "nvext": {"session_control": {"session_id": "a/b"}}},
            {},
            "nvext",
        ),
        ("/v1/chat/completions", body, {"X-SMG-Routing-Key": "a,b"}, "X-SMG-Routing-Key"),
        ("/sessions/a%20b/generate", body, {}, "path prefix"),
        ("/sessions/bad%ZZ/generate", body, {}, "path prefix"),
    ]
    for path, payload, headers, named in cases:
        status, doc = await _post(http, proxy.url + path, payload, headers)
        assert status == 400, (path, headers, doc)
        assert doc["error"]["type"] == "invalid_session_id"
        assert named in doc["error"]["message"], doc
    for close_path, payload in (
        ("/close_session", {"session_id": "no spaces allowed"}),
        ("/kvproxy/sessions/a%20b/close", None),
    ):
        status, doc = await _post(http, proxy.url + close_path, payload)
        assert status == 400 and doc["error"]["type"] == "invalid_session_id", doc
    assert [r for r in await recorded(http, engine_urls) if marker in r["body"]] == []
    assert await _closes_of(http, engine_urls, "no spaces allowed") == []
    assert _stat(proxy, lc.STARTED) == 0.0 and _stat(proxy, lc.CLOSE) == 0.0


# --------------------------------------------------------------------- close
async def test_close_fans_out_to_every_engine_including_dead_ones(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str], blackhole: str
) -> None:
    refused = f"http://127.0.0.1:{stack.free_port()}"
    proxy = await make_proxy(
        router={"engines": [*engine_urls, refused, blackhole]},
        session_lifecycle={"enabled": True, "close_timeout_s": 1, "check_engines": False},
    )
    sid = _sid()
    status, _ = await _post(
        http,
        proxy.url + "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 2}},
        {"X-Session-ID": sid},
    )
    assert status == 200
    started = time.monotonic()
    result = await _close(http, proxy, sid)
    elapsed = time.monotonic() - started
    # Answered although one engine never answers: by the 1 s bound, not by the client's
    # own timeout. 5 s of slack for a busy host; unbounded, the close would wait on the
    # blackhole for as long as the client does.
    assert elapsed < 1 + 5, elapsed
    assert result["session_id"] == sid and result["already_closed"] is False
    assert result["engines_told"] == 2 and result["engines_failed"] == 2
    assert set(result["failures"]) == {refused, blackhole}
    assert result["failures"][blackhole].startswith("timeout")
    assert sorted(await _closes_of(http, engine_urls, sid)) == sorted(engine_urls)
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.CLOSE] == 1.0 and stats[lc.CLOSE_FAILURE] == 1.0
    assert proxy.app[SESSIONS].state(sid) == "closed"


async def test_closing_twice_sends_once(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _sid()
    status, _ = await _post(
        http,
        proxy.url + "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 2}},
        {"X-Session-ID": sid},
    )
    assert status == 200
    first = await _close(http, proxy, sid)
    assert first["already_closed"] is False and first["engines_told"] == 2
    second = await _close(http, proxy, sid)
    status, third = await _post(http, f"{proxy.url}/kvproxy/sessions/{sid}/close")
    assert status == 200
    assert second["already_closed"] is True and third["already_closed"] is True
    assert second["engines_told"] == 0 and third["engines_told"] == 0
    assert sorted(await _closes_of(http, engine_urls, sid)) == sorted(engine_urls)
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.CLOSE] == 1.0 and stats[lc.CLOSE_FAILURE] == 0.0


async def test_concurrent_closes_share_one_fan_out(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str], blackhole: str
) -> None:
    # The unanswering engine keeps the first close's fan-out open for close_timeout_s,
    # so the other closes arrive while it is in progress.
    proxy = await make_proxy(
        router={"engines": [*engine_urls, blackhole]},
        session_lifecycle={"enabled": True, "close_timeout_s": 1, "check_engines": False},
    )
    sid = _sid()
    first = asyncio.create_task(_close(http, proxy, sid))
    await wait_until(
        _cond(lambda: proxy.app[SESSIONS].state(sid) == "closing"),
        timeout_s=5,
        what="the close to start",
    )

    async def admin_close() -> dict[str, Any]:
        status, doc = await _post(http, f"{proxy.url}/kvproxy/sessions/{sid}/close")
        assert status == 200
        return doc

    others = await asyncio.gather(
        *(_close(http, proxy, sid) for _ in range(3)), *(admin_close() for _ in range(2))
    )
    results = [await first, *others]
    assert all(r["already_closed"] is False for r in results)
    assert all(r["engines_told"] == 2 and r["engines_failed"] == 1 for r in results)
    assert len({orjson.dumps(r, option=orjson.OPT_SORT_KEYS) for r in results}) == 1
    assert sorted(await _closes_of(http, engine_urls, sid)) == sorted(engine_urls)
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.CLOSE] == 1.0 and stats[lc.CLOSE_FAILURE] == 1.0


async def test_abort_mode_aborts_forwarded_requests_before_the_close(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True, "on_close": "abort"})
    sid, marker = _sid(), new_marker()
    # No rid from the client: the close aborts the one kvproxy generated.
    body = {"text": f"abort {marker}", "sampling_params": {"max_new_tokens": LONG}}
    request = asyncio.create_task(_post(http, proxy.url + "/generate", body, {"X-Session-ID": sid}))
    sent: list[dict[str, Any]] = []

    async def arrived() -> bool:
        sent[:] = await _bodies(http, engine_urls, marker, path="/generate")
        return bool(sent)

    await wait_until(arrived, timeout_s=5, what="the request to reach an engine")
    rid = sent[0]["rid"]
    assert HEX_RID.fullmatch(rid)
    engine = await _engine_running(http, engine_urls, rid)
    aborted_before = (await sim_state(http, engine))["ranks"][0]["stats"][
        "num_aborted_requests_total"
    ]
    assert _stat(proxy, lc.FORWARDED_REQUESTS) == 1.0

    result = await _close(http, proxy, sid)
    assert result["aborted"] == 1 and result["awaited"] == 0 and result["engines_told"] == 2
    status, doc = await request
    assert status == 200
    assert doc["meta_info"]["id"] == rid
    assert doc["meta_info"]["finish_reason"]["type"] == "abort"
    assert doc["meta_info"]["completion_tokens"] < LONG
    state = await sim_state(http, engine)
    assert state["ranks"][0]["stats"]["num_aborted_requests_total"] == aborted_before + 1
    assert rid not in state["ranks"][0]["running"]
    # Every engine got the abort for the rid, and only then the close.
    for url in engine_urls:
        calls = [
            (r["path"], orjson.loads(r["body"]))
            for r in await recorded(http, [url])
            if r["path"] in ("/abort_request", "/close_session")
        ]
        order = [p for p, b in calls if b.get("rid") == rid or b.get("session_id") == sid]
        assert order == ["/abort_request", "/close_session"], (url, order)
    assert _stat(proxy, lc.ABORTED_REQUESTS) == 1.0


async def test_wait_mode_lets_forwarded_requests_finish_before_the_close(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(
        session_lifecycle={"enabled": True, "on_close": "wait", "wait_timeout_s": 30}
    )
    sid, rid = _sid(), new_marker()
    body = {
        "input_ids": list(range(9, 49)),
        "rid": rid,
        "sampling_params": {"max_new_tokens": LONG},
    }
    request = asyncio.create_task(_post(http, proxy.url + "/generate", body, {"X-Session-ID": sid}))
    await _engine_running(http, engine_urls, rid)
    close = asyncio.create_task(_close(http, proxy, sid))
    await wait_until(
        _cond(lambda: proxy.app[SESSIONS].state(sid) == "closing"),
        timeout_s=5,
        what="the close to start",
    )
    # The close is waiting for the request: nothing has been sent to the engines yet.
    assert await _closes_of(http, engine_urls, sid) == []
    assert not request.done()
    status, doc = await request
    finished_at = time.monotonic()
    assert status == 200
    assert doc["meta_info"]["finish_reason"]["type"] == "length"
    assert doc["meta_info"]["completion_tokens"] == LONG
    result = await close
    assert time.monotonic() >= finished_at
    assert result["awaited"] == 1 and result["aborted"] == 0 and result["engines_told"] == 2
    aborts = await recorded(http, engine_urls, path="/abort_request")
    assert [r for r in aborts if rid in r["body"]] == []
    assert sorted(await _closes_of(http, engine_urls, sid)) == sorted(engine_urls)


async def test_queued_requests_get_409_and_never_reach_an_engine(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # The engines report 99% usage: admission holds every request in its FIFO.
    await set_faults(http, engine_urls, token_usage=0.99)
    proxy = await make_proxy(
        session_lifecycle={"enabled": True},
        admission={"enabled": True, "poll_interval_s": 0.2, "max_wait_s": 30},
    )
    admission = proxy.app[ADMISSION]
    sid, marker = _sid(), new_marker()
    body = {"text": f"queued {marker}", "sampling_params": {"max_new_tokens": 8}}
    request = asyncio.create_task(_post(http, proxy.url + "/generate", body, {"X-Session-ID": sid}))
    await wait_until(
        _cond(lambda: admission.stats()["agentic_kv/admission/waiting"] == 1.0),
        timeout_s=5,
        what="the request to wait for admission",
    )
    assert _stat(proxy, lc.QUEUED_REQUESTS) == 1.0

    result = await _close(http, proxy, sid)
    assert result["rejected_queued"] == 1 and result["aborted"] == 0
    status, doc = await request
    assert status == 409
    assert doc["error"]["type"] == "session_closed"
    assert admission.stats()["agentic_kv/admission/waiting"] == 0.0
    assert _stat(proxy, lc.REJECTED_QUEUED) == 1.0 and _stat(proxy, lc.QUEUED_REQUESTS) == 0.0
    assert [r for r in await recorded(http, engine_urls) if marker in r["body"]] == []
    assert sorted(await _closes_of(http, engine_urls, sid)) == sorted(engine_urls)


# ------------------------------------------------------------ ways to end it
async def _closed_on_every_engine(
    http: aiohttp.ClientSession, engine_urls: list[str], sid: str
) -> None:
    async def told() -> bool:
        return sorted(await _closes_of(http, engine_urls, sid)) == sorted(engine_urls)

    await wait_until(told, timeout_s=5, what=f"/close_session for {sid} on every engine")


async def test_nvext_close_action_ends_the_session_after_the_request(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _sid()
    turn = {"input_ids": list(range(11, 51)), "sampling_params": {"max_new_tokens": 200}}
    status, _ = await _post(
        http, proxy.url + "/generate", {**turn, "nvext": {"session_control": {"session_id": sid}}}
    )
    assert status == 200
    assert proxy.app[SESSIONS].state(sid) == "open"
    assert await _closes_of(http, engine_urls, sid) == []
    final = {**turn, "nvext": {"session_control": {"session_id": sid, "action": "close"}}}
    status, doc = await _post(http, proxy.url + "/generate", final)
    assert status == 200
    # The final turn itself completes; the close follows it.
    assert doc["meta_info"]["finish_reason"]["type"] == "length"
    await _closed_on_every_engine(http, engine_urls, sid)
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.CLOSED_FINAL] == 1.0 and stats[lc.ABORTED_REQUESTS] == 0.0
    await wait_until(
        _cond(lambda: proxy.app[SESSIONS].state(sid) == "closed"), what="the close to finish"
    )


async def test_final_header_ends_the_session_after_the_request(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _sid()
    turn = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"hello {sid}"}],
        "max_tokens": 200,
    }
    status, _ = await _post(
        http,
        proxy.url + "/v1/chat/completions",
        turn,
        {"X-Session-ID": sid, "X-Session-Final": "no"},
    )
    assert status == 200
    assert proxy.app[SESSIONS].state(sid) == "open"
    status, doc = await _post(
        http,
        proxy.url + "/v1/chat/completions",
        turn,
        {"X-Session-ID": sid, "X-Session-Final": "true"},
    )
    assert status == 200
    assert doc["choices"][0]["finish_reason"] == "length"
    await _closed_on_every_engine(http, engine_urls, sid)
    assert _stat(proxy, lc.CLOSED_FINAL) == 1.0 and _stat(proxy, lc.ABORTED_REQUESTS) == 0.0


async def test_path_prefix_session_ends_with_its_final_turn(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _sid()
    base = f"{proxy.url}/sessions/{sid}"
    turn = {"model": MODEL, "prompt": f"hello {sid}", "max_tokens": 50}
    status, _ = await _post(http, base + "/v1/completions", turn)
    assert status == 200
    assert proxy.app[SESSIONS].state(sid) == "open"
    status, _ = await _post(http, base + "/v1/completions", turn, {"X-Session-Final": "1"})
    assert status == 200
    await _closed_on_every_engine(http, engine_urls, sid)
    assert _stat(proxy, lc.CLOSED_FINAL) == 1.0


async def test_close_session_under_the_path_prefix_closes_that_session(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _sid()
    base = f"{proxy.url}/sessions/{sid}"
    status, _ = await _post(
        http, base + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200
    # An SGLang client whose base URL is the session's prefix closes "its" session.
    status, doc = await _post(http, base + "/close_session")
    assert status == 200, doc
    assert doc["session_id"] == sid
    await _closed_on_every_engine(http, engine_urls, sid)


async def test_idle_timeout_ends_a_session_only_when_nothing_is_in_flight(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    idle_s = 0.3
    proxy = await make_proxy(session_lifecycle={"enabled": True, "idle_timeout_s": idle_s})
    sid = _sid()
    # One request that runs longer than the idle timeout (about 0.6 s): not idle meanwhile.
    body = {"input_ids": list(range(13, 53)), "sampling_params": {"max_new_tokens": 1000}}
    started = time.monotonic()
    status, doc = await _post(http, proxy.url + "/generate", body, {"X-Session-ID": sid})
    finished = time.monotonic()
    assert status == 200
    assert finished - started > idle_s
    assert doc["meta_info"]["finish_reason"]["type"] == "length"
    assert proxy.app[SESSIONS].state(sid) == "open"
    assert await _closes_of(http, engine_urls, sid) == []
    await _closed_on_every_engine(http, engine_urls, sid)
    assert time.monotonic() - finished >= idle_s * 0.9  # the idle clock starts at the end
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.CLOSED_IDLE] == 1.0 and stats[lc.ABORTED_REQUESTS] == 0.0


# ------------------------------------------------------------- the KV effect
PROMPT = 1000  # tokens per session prompt
POOL = 3 * PROMPT  # two sessions' KV fit; a 1.5-prompt request then forces one out


async def test_closed_sessions_kv_is_evicted_before_live_sessions_kv(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, stack_logs: Path
) -> None:
    """One engine with a small pool, priority eviction, session radix cache.

    Two sessions put 1,000 tokens of KV each in the pool, the older one first; a
    request of 1,500 tokens then needs room for one of them. Without a close the
    engine evicts the older (least recently used) session. After closing the newer
    session its KV is unreferenced, and it goes first while the live session stays.
    """
    engine: stack.ManagedProcess | None = None
    router: stack.ManagedProcess | None = None
    try:
        engine = await asyncio.to_thread(
            stack.start_sim_engine,
            max_total_tokens=POOL,
            mode="session-radix",
            eviction_policy="priority",
            extra_args=ENGINE_ARGS,
            log_dir=stack_logs,
        )
        router = await asyncio.to_thread(stack.start_router, [engine.url], log_dir=stack_logs)
        proxy = await make_proxy(
            router={"url": router.url, "engines": [engine.url]},
            session_lifecycle={"enabled": True},
        )
        url = engine.url

        async def turn(sid: str | None, first_token: int, n: int = PROMPT) -> int:
            """One request through kvproxy; the engine's cached_tokens for it."""
            body = {
                "input_ids": list(range(first_token, first_token + n)),
                "sampling_params": {"max_new_tokens": 1},
            }
            status, doc = await _post(
                http, proxy.url + "/generate", body, {"X-Session-ID": sid} if sid else None
            )
            assert status == 200, doc
            return int(doc["meta_info"]["cached_tokens"])

        async def referenced() -> tuple[list[str], int]:
            (rank,) = (await sim_state(http, url))["ranks"]
            return rank["sessions"]["radix_referenced"], rank["pool"][
                "session_referenced_evictable"
            ]

        async def run(close_newer: bool, base: int) -> tuple[int, int]:
            """cached_tokens of the older and the newer session's next turn."""
            older, newer = _sid(), _sid()
            assert await turn(older, base) == 0
            assert await turn(newer, base + 10_000) == 0
            assert await referenced() == (sorted([older, newer]), 2 * PROMPT)
            before = await _engine_metrics(http, url)
            assert before["sglang:kv_evictable_tokens"] == 2 * PROMPT
            if close_newer:
                result = await _close(http, proxy, newer)
                assert result["engines_told"] == 1 and result["engines_failed"] == 0
                # Unreferenced, not freed: still cached, but no longer the session's.
                assert await referenced() == ([older], PROMPT)
                after_close = await _engine_metrics(http, url)
                assert after_close["sglang:kv_evictable_tokens"] == 2 * PROMPT
                assert (
                    after_close["sglang:evicted_tokens_total"]
                    == before["sglang:evicted_tokens_total"]
                )
            # Pressure: room for 1,500 new tokens means evicting one session's KV.
            await turn(None, base + 20_000, PROMPT * 3 // 2)
            after = await _engine_metrics(http, url)
            evicted = after["sglang:evicted_tokens_total"] - before["sglang:evicted_tokens_total"]
            assert evicted == PROMPT
            cached = await turn(older, base), await turn(newer, base + 10_000)
            # Empty the pool for the next run (nothing is running now).
            async with http.post(url + "/flush_cache") as resp:
                assert resp.status == 200
            return cached

        # Control, no close: the least recently used (older) session's KV goes.
        assert await run(close_newer=False, base=100_000) == (0, PROMPT - 1)
        # The newer session is closed: its KV goes first, the live older one stays.
        assert await run(close_newer=True, base=200_000) == (PROMPT - 1, 0)
    finally:
        if router is not None:
            router.stop()
        if engine is not None:
            engine.stop()


async def test_a_client_hanging_up_after_done_is_not_a_disconnect(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    """Streaming clients often close the connection as soon as they read ``[DONE]``,
    before the chunked terminator. The request is complete: nothing is aborted."""
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = f"done-hangup-{uuid.uuid4().hex[:8]}"

    async def one(i: int) -> None:
        body = {
            "input_ids": list(range(5, 25)),
            "stream": True,
            "sampling_params": {"max_new_tokens": 4},
        }
        async with http.post(
            proxy.url + "/generate", json=body, headers={"X-Session-ID": sid}
        ) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    break
            resp.close()  # hang up before reading the end of the chunked body

    for batch in range(10):
        await asyncio.gather(*(one(batch * 20 + i) for i in range(20)))
    stats = proxy.app[SESSIONS].stats()
    assert stats[lc.DISCONNECT_ABORTS] == 0
    assert stats[lc.ABORTED_REQUESTS] == 0
    aborts = await recorded(http, engine_urls, path="/abort_request")
    assert not [a for a in aborts if sid in orjson.dumps(a).decode()]
