"""The server layer drops slow clients within the bound; normal requests are unaffected.

kvproxy runs in-process behind :class:`GuardedAppRunner` (what ``kvproxy serve`` uses)
with small bounds, in front of a stand-in router. Slow clients are raw sockets on
127.0.0.1 sending one byte at a time; they stop as soon as the server closes on them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvproxy.app import create_app, slow_client_guard
from kvproxy.config import from_mapping
from kvproxy.proxy.slow_clients import GuardedAppRunner, RateLimitedLog, SlowClientGuard
from tests.helpers import wait_until

HEADER_S = 0.6
BODY_S = 0.8
SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine
BYTE_GAP_S = 0.05


@dataclass
class Proxy:
    url: str
    port: int


async def _upstream() -> TestServer:
    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": 3}})

    async def workers(request: web.Request) -> web.Response:
        return web.json_response({"workers": []})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/workers", workers)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    upstream = await _upstream()
    cfg = from_mapping(
        {
            "server": {"header_read_timeout_s": HEADER_S, "body_read_timeout_s": BODY_S},
            "router": {"url": str(upstream.make_url("")).rstrip("/")},
        }
    )
    app = create_app(cfg)
    runner = GuardedAppRunner(app, guard=slow_client_guard(app), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Proxy(f"http://127.0.0.1:{port}", port)
    finally:
        await runner.cleanup()
        await upstream.close()


async def _slow_client(
    port: int, data: bytes, *, prefix: bytes = b""
) -> tuple[float, bytes, float]:
    """Send ``prefix`` at once, then ``data`` a byte at a time until the server closes.

    Returns (seconds from the end of ``prefix`` to the close, what the server sent, the
    close's ``time.monotonic()``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = asyncio.ensure_future(reader.read(4096))
    if prefix:
        writer.write(prefix)
        await writer.drain()
    started = time.monotonic()
    try:
        for i in range(len(data)):  # bounded by the data
            if received.done():
                break
            writer.write(data[i : i + 1])
            try:
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(BYTE_GAP_S)  # the client's pace, not a synchronisation
        got = await asyncio.wait_for(received, timeout=HEADER_S + BODY_S + SLACK_S)
        closed_at = time.monotonic()
        # After a 408 the server closes: the next read is EOF.
        rest = await asyncio.wait_for(reader.read(4096), timeout=SLACK_S) if got else b""
        assert rest == b""
        return closed_at - started, got, closed_at
    finally:
        received.cancel()
        writer.close()


HEAD = b"GET /kvproxy/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
BODY_HEAD = (
    b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 400\r\n\r\n"
)


async def _metric(http: aiohttp.ClientSession, url: str, phase: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    m = re.search(rf'^kvproxy_slow_clients_dropped_total{{phase="{phase}"}} (\S+)$', text, re.M)
    assert m, text[:500]
    return float(m.group(1))


async def test_slow_clients_are_dropped_within_the_bound(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvproxy.server")
    async with aiohttp.ClientSession() as http:
        assert await _metric(http, proxy.url, "header") == 0
        assert await _metric(http, proxy.url, "body") == 0

        # Normal traffic alongside the slow clients: every request answered, and answered
        # while the slow clients still hold their connections.
        answered_at: list[float] = []

        async def normal_traffic() -> None:
            for i in range(40):  # bounded
                async with http.get(proxy.url + "/kvproxy/health") as resp:
                    assert resp.status == 200
                    await resp.read()
                body = b'{"input_ids":[1,2,3],"rid":"r%d"}' % i
                async with http.post(proxy.url + "/generate", data=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["text"] == "ok"
                answered_at.append(time.monotonic())
                await asyncio.sleep(0.02)

        slow_heads = [_slow_client(proxy.port, HEAD) for _ in range(5)]
        silent = [_slow_client(proxy.port, b"")]  # connects, sends nothing
        slow_bodies = [_slow_client(proxy.port, b"{" * 400, prefix=BODY_HEAD) for _ in range(3)]
        results = await asyncio.gather(normal_traffic(), *slow_heads, *silent, *slow_bodies)
        heads, bodies = results[1:7], results[7:]

        for elapsed, got, _ in heads:
            assert HEADER_S - 0.05 <= elapsed <= HEADER_S + SLACK_S, elapsed
            assert got.startswith(b"HTTP/1.1 408 Request Timeout"), got
        for elapsed, got, _ in bodies:
            # Counted from the end of the head (sent at once): the body bound.
            assert BODY_S - 0.05 <= elapsed <= BODY_S + SLACK_S, elapsed
            assert got == b""  # closed, nothing answered
        assert len(answered_at) == 40
        # Had the slow clients blocked the server (a read that waits on one connection, or
        # connections served one at a time), no request could be answered before the
        # first of them is dropped. Both times are this host's, so a slow host moves both.
        first_drop = min(closed_at for _, _, closed_at in results[1:])
        assert sum(t < first_drop for t in answered_at) >= 1, (answered_at[:5], first_drop)

        assert await _metric(http, proxy.url, "header") == 6
        assert await _metric(http, proxy.url, "body") == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "kvproxy.server"]
    # Rate-limited: the drops all fall into one log interval.
    assert 1 <= len(lines) <= 2, lines
    assert "dropped slow client 127.0.0.1:" in lines[0]
    assert "server.header_read_timeout_s" in lines[0] or "server.body_read_timeout_s" in lines[0]


async def test_idle_keep_alive_and_prompt_requests_are_not_dropped(proxy: Proxy) -> None:
    """The head bound runs from a request's first byte, not across idle keep-alive gaps."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        for _ in range(2):
            writer.write(b"GET /kvproxy/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), timeout=SLACK_S)
            assert status.startswith(b"HTTP/1.1 200"), status
            length = 0
            while True:  # bounded by the response head
                line = await asyncio.wait_for(reader.readline(), timeout=SLACK_S)
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                if line in (b"\r\n", b""):
                    break
            await reader.readexactly(length)
            # Idle longer than the head bound: the connection must stay usable.
            await asyncio.sleep(HEADER_S + 0.3)
        # A body sent promptly after its head is fine too.
        body = b'{"input_ids":[1]}'
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout=SLACK_S)
        assert status.startswith(b"HTTP/1.1 200"), status
    finally:
        writer.close()


async def test_a_request_slower_than_the_header_bound_is_answered() -> None:
    """A handler that takes longer than header_read_timeout_s (a held admission, a long
    decode) is not cut off: the head arrived long before."""
    header_s = 0.3

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(3 * header_s)  # the handler's own work, not synchronisation
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/slow", slow)
    drops: list[str] = []
    runner = GuardedAppRunner(
        app, guard=SlowClientGuard(lambda: (header_s, 5.0), on_drop=drops.append)
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            # Twice on one keep-alive connection, with a small and a larger body.
            for body in (b"x" * 100, b"x" * 70_000):
                async with http.post(f"http://127.0.0.1:{port}/slow", data=body) as resp:
                    assert resp.status == 200
                    assert await resp.text() == "ok"
    finally:
        await runner.cleanup()
    assert drops == []


async def test_connections_past_the_budget_get_a_json_503() -> None:
    upstream = await _upstream()
    cfg = from_mapping(
        {
            "server": {"max_connections": 2},
            "router": {"url": str(upstream.make_url("")).rstrip("/")},
        }
    )
    app = create_app(cfg)
    runner = GuardedAppRunner(app, guard=slow_client_guard(app), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), timeout=SLACK_S)  # then closed
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"X-KVProxy-Error: overloaded" in head
        assert b'"type":"overloaded"' in body
        # One held connection closes: a new one is served again.
        held.pop()[1].close()
        async with aiohttp.ClientSession() as http:

            async def served() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/kvproxy/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_until(served, timeout_s=5, what="a connection to be served")
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            # One refusal above, and any while the closed connection was being noticed.
            m = re.search(r"^kvproxy_connections_refused_total (\S+)$", text, re.M)
            assert m and float(m.group(1)) >= 1.0
    finally:
        for _, w in held:
            w.close()
        await runner.cleanup()
        await upstream.close()


def test_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    logger = logging.getLogger("kvproxy.test.ratelimit")
    rl = RateLimitedLog(10.0, logger=logger, now=lambda: clock[0])
    caplog.set_level(logging.WARNING, logger=logger.name)
    assert rl.event("drop %s", "a")
    clock[0] += 5
    assert not rl.event("drop %s", "b")
    assert not rl.event("drop %s", "c")
    clock[0] += 5
    assert rl.event("drop %s", "d")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["drop a", "drop d (2 more since the last report)"]
