"""The session close sequence against fake engines (real aiohttp apps on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from kvproxy.config import SessionLifecycleConfig
from kvproxy.fleet.fanout import post_to_all
from kvproxy.sessions.identity import SKIP_SESSION_PARAMS, InjectionPlan
from kvproxy.sessions.lifecycle import (
    ABORTED_REQUESTS,
    CLOSE,
    CLOSE_FAILURE,
    CLOSED_FINAL,
    CLOSED_IDLE,
    CLOSING,
    DISCONNECT_ABORTS,
    EVICTED,
    INJECTED,
    INJECTION_SKIPPED,
    LIFECYCLE_ENABLED,
    OPEN,
    REJECTED_CLOSING,
    REJECTED_QUEUED,
    REOPENED,
    SessionClosed,
    SessionForbidden,
    SessionManager,
)

T = TypeVar("T")

# Timeouts here are what a hung engine costs a test; they are sized so that an engine
# that answers does so inside them on a loaded two-core CI host (0.3 s once did not).
CFG = SessionLifecycleConfig(enabled=True, close_timeout_s=1.0, check_engines=False)
FANOUT_TIMEOUT_S = 1.0

Log = list[tuple[str, str, dict[str, Any]]]  # (engine name, path, payload), in arrival order


class FakeEngine:
    """Records the POSTs it receives. kind: ok | hang | error."""

    def __init__(self, name: str, log: Log, release: asyncio.Event, kind: str = "ok") -> None:
        self.name = name
        self.kind = kind
        self.log = log
        self.release = release
        self.url = ""
        self.server_info: dict[str, Any] = {
            "enable_session_radix_cache": True,
            "radix_eviction_policy": "priority",
            "version": "0.5.23",
        }
        # rid -> event set when an /abort_request for it arrives.
        self.aborted: dict[str, asyncio.Event] = {}

    def posts(self, path: str) -> list[dict[str, Any]]:
        return [p for n, pa, p in self.log if n == self.name and pa == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        payload = orjson.loads(await request.read())
        self.log.append((self.name, request.path, payload))
        if request.path == "/abort_request" and payload.get("rid") in self.aborted:
            self.aborted[payload["rid"]].set()
        if self.kind == "hang":
            await self.release.wait()
        if self.kind == "error":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.Response(status=200)  # SGLang: 200, empty body

    async def info(self, _: web.Request) -> web.Response:
        return web.json_response(self.server_info)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/close_session", self.handle)
        app.router.add_post("/abort_request", self.handle)
        app.router.add_get("/server_info", self.info)
        return app


Factory = Callable[..., Awaitable[FakeEngine]]


@pytest.fixture
def log() -> Log:
    return []


@pytest.fixture
async def make_engine(aiohttp_server: Any, log: Log) -> AsyncIterator[Factory]:
    release = asyncio.Event()

    async def make(name: str, kind: str = "ok") -> FakeEngine:
        engine = FakeEngine(name, log, release, kind)
        server = await aiohttp_server(engine.app())
        engine.url = str(server.make_url("")).rstrip("/")
        return engine

    yield make
    release.set()  # let hanging handlers finish before the servers shut down


@pytest.fixture
def dead_url(unused_tcp_port: int) -> str:
    return f"http://127.0.0.1:{unused_tcp_port}"


async def bounded(aw: Awaitable[T], limit_s: float = 5.0) -> T:
    """Await ``aw`` but fail (rather than hang) if it takes longer than ``limit_s``."""
    return await asyncio.wait_for(aw, limit_s)


async def until(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll ``cond`` (bounded); fail if it does not hold within ``limit_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def manager(
    http: aiohttp.ClientSession,
    urls: list[str],
    cfg: SessionLifecycleConfig = CFG,
    clock: Callable[[], float] | None = None,
) -> SessionManager:
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    return SessionManager(cfg, all_engines=lambda: list(urls), http=http, **kwargs)


# -- fan-out -------------------------------------------------------------------


async def test_post_to_all_reports_ok_errors_and_timeouts(
    make_engine: Factory, http: aiohttp.ClientSession, dead_url: str
) -> None:
    good, bad, slow = (
        await make_engine("good"),
        await make_engine("bad", "error"),
        await make_engine("slow", "hang"),
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    res = await post_to_all(
        http,
        [good.url, good.url + "/", bad.url, slow.url, dead_url],
        "/close_session",
        {"session_id": "s"},
        timeout_s=FANOUT_TIMEOUT_S,
    )
    elapsed = loop.time() - t0
    # The hanging engine is cut at the timeout, not awaited (it answers only at the end
    # of the test); 5 s of slack for a busy host.
    assert elapsed < FANOUT_TIMEOUT_S + 5
    assert res.ok == [good.url], res.failed
    assert set(res.failed) == {bad.url, slow.url, dead_url}
    assert res.failed[bad.url].startswith("HTTP 500")
    assert "timeout" in res.failed[slow.url]
    assert good.posts("/close_session") == [{"session_id": "s"}]  # deduplicated
    empty = await post_to_all(http, [], "/x", {}, timeout_s=0.1)
    assert empty.ok == [] and empty.failed == {}


# -- close fan-out ---------------------------------------------------------------


async def test_close_fans_out_to_every_engine_including_dead_ones(
    make_engine: Factory, http: aiohttp.ClientSession, dead_url: str
) -> None:
    e1, e2, hung = await make_engine("e1"), await make_engine("e2"), await make_engine("h", "hang")
    mgr = manager(http, [e1.url, e2.url, dead_url, hung.url])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await mgr.close("s1", reason="api")
    assert loop.time() - t0 < CFG.close_timeout_s + 1.0  # answered within the timeout
    assert (result.engines_told, result.engines_failed) == (2, 2)
    assert set(result.failures) == {dead_url, hung.url}
    for engine in (e1, e2, hung):
        assert engine.posts("/close_session") == [{"session_id": "s1"}]
    stats = mgr.stats()
    assert stats[CLOSE] == 1.0 and stats[CLOSE_FAILURE] == 1.0
    body = result.to_json()
    assert body["engines_told"] == 2 and body["engines_failed"] == 2
    assert body["already_closed"] is False


async def test_close_with_all_engines_answering_is_not_a_failure(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url + "@0", e1.url + "@1"])  # dp-aware suffixes collapse
    result = await bounded(mgr.close("s", reason="api"))
    assert (result.engines_told, result.engines_failed) == (1, 0)
    assert mgr.stats()[CLOSE_FAILURE] == 0.0
    assert len(e1.posts("/close_session")) == 1


async def test_close_with_no_engines_counts_a_failure(http: aiohttp.ClientSession) -> None:
    mgr = manager(http, [])
    result = await bounded(mgr.close("s", reason="api"))
    assert result.engines_told == 0 and result.note == "no engines known"
    assert mgr.stats()[CLOSE_FAILURE] == 1.0


async def test_closing_twice_sends_once(make_engine: Factory, http: aiohttp.ClientSession) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url])
    first = await mgr.close("s", reason="api")
    second = await mgr.close("s", reason="api")
    assert not first.already_closed and second.already_closed
    assert second.engines_told == 0
    assert len(e1.posts("/close_session")) == 1
    assert mgr.stats()[CLOSE] == 1.0
    assert mgr.state("s") == "closed"


async def test_concurrent_closes_share_one_fanout(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1, e2 = await make_engine("e1"), await make_engine("e2")
    mgr = manager(http, [e1.url, e2.url])
    results = await asyncio.gather(*(mgr.close("s", reason=f"c{i}") for i in range(5)))
    assert all(r is results[0] for r in results)
    assert results[0].engines_told == 2 and not results[0].already_closed
    assert len(e1.posts("/close_session")) == 1 and len(e2.posts("/close_session")) == 1
    assert mgr.stats()[CLOSE] == 1.0


async def test_caller_cancellation_does_not_cancel_the_close(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    hung, e2 = await make_engine("h", "hang"), await make_engine("e2")
    mgr = manager(http, [hung.url, e2.url])
    caller = asyncio.create_task(mgr.close("s", reason="api"))
    await until(lambda: len(hung.posts("/close_session")) == 1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert mgr.state("s") == "closing"
    await until(lambda: mgr.state("s") == "closed")
    assert mgr.stats()[CLOSE] == 1.0 and mgr.stats()[CLOSE_FAILURE] == 1.0
    assert len(e2.posts("/close_session")) == 1


async def test_disabled_close_sends_nothing(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url], cfg=dataclasses.replace(CFG, enabled=False))
    result = await bounded(mgr.close("s", reason="api"))
    assert result.note and result.engines_told == 0
    assert e1.posts("/close_session") == []
    assert mgr.stats() == {}


# -- in-flight requests ----------------------------------------------------------


async def test_abort_mode_aborts_forwarded_before_close_session(
    make_engine: Factory, http: aiohttp.ClientSession, log: Log
) -> None:
    e1, e2 = await make_engine("e1"), await make_engine("e2")
    mgr = manager(http, [e1.url, e2.url])
    aborted = e1.aborted["rid-1"] = asyncio.Event()
    entered = asyncio.Event()

    async def request() -> None:
        async with mgr.track("s", "rid-1", close_after=False) as tr:
            tr.forwarded()
            entered.set()
            await aborted.wait()  # the engine ends the request once aborted ...
            await asyncio.sleep(0.1)  # ... and its final response takes a while to arrive
            log.append(("proxy", "request_done", {}))

    req = asyncio.create_task(request())
    await bounded(entered.wait())
    result = await bounded(mgr.close("s", reason="api"))
    await bounded(req)
    assert result.aborted == 1 and result.awaited == 0 and result.engines_told == 2
    paths = [(n, p) for n, p, _ in log]
    assert e1.posts("/abort_request") == [{"rid": "rid-1"}]
    assert e2.posts("/abort_request") == [{"rid": "rid-1"}]
    last_abort = max(i for i, (_, p) in enumerate(paths) if p == "/abort_request")
    first_close = min(i for i, (_, p) in enumerate(paths) if p == "/close_session")
    done = paths.index(("proxy", "request_done"))
    assert last_abort < done < first_close
    assert mgr.stats()[ABORTED_REQUESTS] == 1.0


async def test_abort_names_every_expanded_rid(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url], cfg=dataclasses.replace(CFG, wait_timeout_s=0.0))
    async with mgr.track("s", "r", close_after=False, abort_rids=["r", "r_0", "r_1"]) as tr:
        tr.forwarded()
        await mgr.close("s", reason="api")
    assert sorted(p["rid"] for p in e1.posts("/abort_request")) == ["r", "r_0", "r_1"]


async def test_wait_mode_lets_forwarded_requests_finish_first(
    make_engine: Factory, http: aiohttp.ClientSession, log: Log
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url], cfg=dataclasses.replace(CFG, on_close="wait", wait_timeout_s=10))
    finish = asyncio.Event()
    entered = asyncio.Event()

    async def request() -> None:
        async with mgr.track("s", "rid-1", close_after=False) as tr:
            tr.forwarded()
            entered.set()
            await finish.wait()
            log.append(("proxy", "request_done", {}))

    req = asyncio.create_task(request())
    await bounded(entered.wait())
    closer = asyncio.create_task(mgr.close("s", reason="api"))
    await until(lambda: mgr.state("s") == "closing")
    # While waiting, new requests of the session are refused.
    with pytest.raises(SessionClosed):
        async with mgr.track("s", "rid-2", close_after=False):
            pass
    finish.set()
    result = await bounded(closer)
    await bounded(req)
    assert result.awaited == 1 and result.aborted == 0
    assert e1.posts("/abort_request") == []
    assert [p for _, p, _ in log] == ["request_done", "/close_session"]
    assert mgr.stats()[REJECTED_CLOSING] == 1.0


async def test_wait_mode_aborts_leftovers_after_wait_timeout(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    aborted = e1.aborted["slow"] = asyncio.Event()
    mgr = manager(
        http, [e1.url], cfg=dataclasses.replace(CFG, on_close="wait", wait_timeout_s=0.05)
    )
    entered = asyncio.Event()

    async def request() -> None:
        async with mgr.track("s", "slow", close_after=False) as tr:
            tr.forwarded()
            entered.set()
            await aborted.wait()

    req = asyncio.create_task(request())
    await bounded(entered.wait())
    result = await bounded(mgr.close("s", reason="api"))
    await bounded(req)
    assert result.awaited == 0 and result.aborted == 1
    assert e1.posts("/abort_request") == [{"rid": "slow"}]
    assert e1.posts("/close_session") == [{"session_id": "s"}]


async def test_queued_requests_get_session_closed(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url])
    admission: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.Event()
    outcomes: list[str] = []

    async def queued_in_admission() -> None:
        async with mgr.track("s", "q1", close_after=False) as tr:
            waiting.set()
            try:
                await tr.until_forwarded(admission)
            except SessionClosed as exc:
                outcomes.append(exc.to_json()["error"]["type"])
                raise

    async def queued_before_forwarding(ready: asyncio.Event, go: asyncio.Event) -> None:
        async with mgr.track("s", "q2", close_after=False) as tr:
            ready.set()
            await go.wait()
            tr.forwarded()  # the close began meanwhile: must not go upstream
            outcomes.append("forwarded")

    ready, go = asyncio.Event(), asyncio.Event()
    t1 = asyncio.create_task(queued_in_admission())
    t2 = asyncio.create_task(queued_before_forwarding(ready, go))
    await bounded(waiting.wait())
    await ready.wait()
    result = await bounded(mgr.close("s", reason="api"))
    go.set()
    done, _ = await asyncio.wait((t1, t2), timeout=5.0)
    for task in (t1, t2):
        task.cancel()
    assert done == {t1, t2}, "queued requests were not released by the close"
    for task in (t1, t2):
        assert isinstance(task.exception(), SessionClosed)
    assert outcomes == ["session_closed"]
    assert admission.cancelled()  # the admission wait was cancelled
    assert result.rejected_queued == 2 and result.aborted == 0
    assert e1.posts("/abort_request") == []
    assert mgr.stats()[REJECTED_QUEUED] == 2.0


async def test_until_forwarded_returns_result_when_not_closing(http: aiohttp.ClientSession) -> None:
    mgr = manager(http, [])

    async def admit() -> str:
        return "lease-1"

    async with mgr.track("s", "r", close_after=False) as tr:
        assert await tr.until_forwarded(admit()) == "lease-1"
        tr.forwarded()
        assert mgr.stats()["agentic_kv/session/forwarded_requests"] == 1.0
    assert mgr.stats()["agentic_kv/session/forwarded_requests"] == 0.0


async def test_close_after_closes_once_the_request_completes(
    make_engine: Factory, http: aiohttp.ClientSession, log: Log
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url])
    async with mgr.track("s", "last", close_after=True) as tr:
        tr.forwarded()
        assert mgr.state("s") == "open"
        log.append(("proxy", "request_done", {}))
    await until(lambda: mgr.state("s") == "closed")
    assert [p for _, p, _ in log] == ["request_done", "/close_session"]
    assert e1.posts("/abort_request") == []  # it had already completed
    stats = mgr.stats()
    assert stats[CLOSED_FINAL] == 1.0 and stats[CLOSE] == 1.0


async def test_request_after_close_starts_a_new_session(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url])
    await mgr.close("s", reason="api")
    async with mgr.track("s", "r", close_after=False):
        assert mgr.state("s") == "open"
    assert mgr.stats()[REOPENED] == 1.0
    again = await mgr.close("s", reason="api")
    assert not again.already_closed
    assert len(e1.posts("/close_session")) == 2


async def test_disconnect_aborts_forwarded_request_once(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1, e2 = await make_engine("e1"), await make_engine("e2")
    mgr = manager(http, [e1.url, e2.url])
    async with mgr.track("s", "queued", close_after=False) as tr:
        tr.disconnected()  # never forwarded: nothing to abort
    async with mgr.track("s", "gone", close_after=False) as tr:
        tr.forwarded()
        tr.disconnected()
        tr.disconnected()
    await until(lambda: len(e1.posts("/abort_request")) + len(e2.posts("/abort_request")) == 2)
    assert e1.posts("/abort_request") == [{"rid": "gone"}]
    assert e2.posts("/abort_request") == [{"rid": "gone"}]
    assert mgr.stats()[DISCONNECT_ABORTS] == 1.0
    # Requests outside any session can be aborted the same way.
    mgr.abort_in_background(["lone"])
    await until(lambda: {"rid": "lone"} in e1.posts("/abort_request"))
    assert mgr.stats()[DISCONNECT_ABORTS] == 2.0
    await mgr.stop()


# -- idle timeout ----------------------------------------------------------------


async def test_idle_sweep_with_injected_clock(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    now = [0.0]
    mgr = manager(
        http, [e1.url], cfg=dataclasses.replace(CFG, idle_timeout_s=10.0), clock=lambda: now[0]
    )
    async with mgr.track("idle", "r1", close_after=False):
        pass
    async with mgr.track("busy", "r2", close_after=False) as tr:
        tr.forwarded()
        now[0] = 9.0
        assert mgr.reap_idle() == []
        now[0] = 100.0
        assert mgr.reap_idle() == ["idle"]  # "busy" has a request in flight
    result = await mgr.close("idle", reason="api")  # joins the idle close
    assert result.reason == "idle" and result.engines_told == 1
    assert e1.posts("/close_session") == [{"session_id": "idle"}]
    assert mgr.stats()[CLOSED_IDLE] == 1.0
    assert mgr.state("busy") == "open"


async def test_idle_reaper_task_closes_idle_sessions(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url], cfg=dataclasses.replace(CFG, idle_timeout_s=0.05))
    await mgr.start()
    try:
        async with mgr.track("s", "r", close_after=False):
            pass
        await until(lambda: mgr.state("s") == "closed")
        assert e1.posts("/close_session") == [{"session_id": "s"}]
        assert mgr.stats()[CLOSED_IDLE] == 1.0
    finally:
        await mgr.stop()


# -- bounds, stats, metrics, health --------------------------------------------------


async def test_table_cap_forgets_idle_sessions(http: aiohttp.ClientSession) -> None:
    mgr = manager(http, [], cfg=dataclasses.replace(CFG, max_sessions=2))
    for sid in ("a", "b", "c", "d"):
        async with mgr.track(sid, "r", close_after=False):
            pass
    stats = mgr.stats()
    assert stats[OPEN] == 2.0 and stats[EVICTED] == 2.0
    assert mgr.state("a") is None and mgr.state("d") == "open"


async def test_stats_window_and_prometheus(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url])
    mgr.note_injection(InjectionPlan(fields={"session_id": "s"}))
    mgr.note_injection(InjectionPlan(skip_reason=SKIP_SESSION_PARAMS))
    await mgr.close("s", reason="api")
    stats = mgr.stats(reset=True)
    assert stats[LIFECYCLE_ENABLED] == 1.0
    assert stats[CLOSE] == 1.0 and stats[CLOSE_FAILURE] == 0.0
    assert stats[INJECTED] == 1.0 and stats[INJECTION_SKIPPED] == 1.0
    assert stats[OPEN] == 0.0 and stats[CLOSING] == 0.0
    after = mgr.stats()
    assert after[CLOSE] == 0.0 and after[INJECTION_SKIPPED] == 0.0  # window restarted

    registry = CollectorRegistry()
    registry.register(mgr)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert "agentic_kv_session_lifecycle_enabled 1.0" in text
    assert "agentic_kv_session_close_total 1.0" in text  # cumulative, not windowed
    assert "agentic_kv_session_close_failure_total 0.0" in text
    assert "agentic_kv_session_injection_skipped_total 1.0" in text
    assert "agentic_kv_session_open 0.0" in text


async def test_health_reports_engine_modes_and_warnings(
    make_engine: Factory, http: aiohttp.ClientSession, dead_url: str
) -> None:
    good, plain = await make_engine("good"), await make_engine("plain")
    plain.server_info = {"radix_eviction_policy": "lru", "version": "0.5.23"}
    known: list[str] = []
    mgr = SessionManager(
        dataclasses.replace(CFG, check_engines=True), all_engines=lambda: list(known), http=http
    )
    await mgr.start()
    try:
        assert mgr.health().engine_check == "pending"
        known.extend([good.url, plain.url])  # engines become known after start
        await until(lambda: mgr.health().engine_check == "done")
        health = mgr.health()
        assert health.engines[good.url]["mode"] == "session_radix"
        assert health.engines[good.url]["as_assumed"] is True
        assert health.engines[plain.url]["mode"] == "none"
        assert any(
            plain.url in w and "neither the session radix cache" in w for w in health.warnings
        )
        assert not any(good.url in w for w in health.warnings)
        # An engine that cannot be read is reported, not fatal.
        known.append(dead_url)
        assert await mgr.check_engines() is False
        assert "error" in mgr.health().engines[dead_url]
    finally:
        await mgr.stop()
    off = manager(http, [], cfg=dataclasses.replace(CFG, enabled=False))
    assert not off.health().enabled
    assert off.health().to_json() == {"enabled": False}


async def test_reconfigure_enables_idle_reaper(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    e1 = await make_engine("e1")
    mgr = manager(http, [e1.url])
    await mgr.start()
    try:
        async with mgr.track("s", "r", close_after=False):
            pass
        assert mgr.state("s") == "open"
        await mgr.reconfigure(dataclasses.replace(CFG, idle_timeout_s=0.05))
        await until(lambda: mgr.state("s") == "closed")
        await mgr.reconfigure(dataclasses.replace(CFG, enabled=False))
        assert mgr.stats() == {}
    finally:
        await mgr.stop()


# -- bounded fan-out and sessions bound to a credential ------------------------


class CountingEngine:
    """Holds every /abort_request until released, counting how many are in at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0
        self.received = 0
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.in_flight += 1
        self.received += 1
        self.most = max(self.most, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        return web.Response(status=200)


async def test_abort_fan_out_is_bounded_by_fanout_concurrency(aiohttp_server: Any) -> None:
    engine = CountingEngine()
    app = web.Application()
    app.router.add_post("/abort_request", engine.handle)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    cfg = dataclasses.replace(CFG, fanout_concurrency=2, close_timeout_s=5.0)
    async with aiohttp.ClientSession() as http:
        mgr = manager(http, [url], cfg)
        await mgr.start()
        try:
            mgr.abort_in_background([f"{i:032d}" for i in range(10)])
            await until(lambda: engine.in_flight == 2)
            assert engine.received == 2  # the other eight wait for a slot
            engine.release.set()
            await until(lambda: engine.received == 10 and engine.in_flight == 0)
            assert engine.most == 2
        finally:
            engine.release.set()
            await mgr.stop()


async def test_a_bound_session_is_used_and_closed_only_with_its_credential(
    http: aiohttp.ClientSession,
) -> None:
    mgr = manager(http, [])
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    req = mgr.enter("s-bound", "r", ("r",), False, headers=alice)
    with pytest.raises(SessionForbidden):
        mgr.enter("s-bound", "r2", ("r2",), False, headers=bob)
    with pytest.raises(SessionForbidden):
        mgr.enter("s-bound", "r3", ("r3",), False, headers={})
    assert mgr.may_close("s-bound", alice)
    assert not mgr.may_close("s-bound", bob) and not mgr.may_close("s-bound", {})
    mgr.leave(req)
    # Opened without a credential: unbound, anyone may close it.
    mgr.leave(mgr.enter("s-open", "r", ("r",), False, headers={}))
    assert mgr.may_close("s-open", bob)
    mgr.leave(mgr.enter("s-open", "r", ("r",), False, headers=bob))  # joins, stays unbound
    # Binding off: nothing is checked.
    off = manager(http, [], dataclasses.replace(CFG, bind_credential=False))
    off.leave(off.enter("s", "r", ("r",), False, headers=alice))
    off.leave(off.enter("s", "r", ("r",), False, headers=bob))
    assert off.may_close("s", bob)
