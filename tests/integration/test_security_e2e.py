"""The security review's probes, through the real router (smg) and the simulated
engines: each answered as docs/security.md says with the default settings.

- the router's control plane (``POST /workers``, ``DELETE /workers/{id}``) is not
  reachable through kvproxy, with or without the admin token set;
- no path trick reaches the router uninspected;
- a session bound to a credential cannot be closed (its requests aborted) by another;
- kvproxy's own credentials never reach the router;
- rid lists are capped; control bodies are JSON only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvproxy.admin.auth import COOKIE_NAME, cookie_value
from kvproxy.keys import FLEET
from tests.helpers import new_marker, wait_until
from tests.integration.conftest import MakeProxy, Proxy, StartProxy, recorded, sim_state

TOKEN = "s3cret-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
LONG = 400  # tokens: long enough to be in flight while the test acts


async def _workers(http: aiohttp.ClientSession, router: stack.ManagedProcess) -> Any:
    async with http.get(router.url + "/workers") as resp:
        assert resp.status == 200
        return orjson.loads(await resp.read())


def _worker_urls(doc: Any) -> list[str]:
    return sorted(w["url"] for w in doc["workers"])


async def _raw(proxy: Proxy, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``target`` exactly as written (no client-side normalisation)."""
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_workers_cannot_be_added_or_removed_through_kvproxy(
    make_proxy: MakeProxy,
    router: stack.ManagedProcess,
    http: aiohttp.ClientSession,
    unused_tcp_port: int,
    token: str | None,
) -> None:
    proxy = await make_proxy(server={"admin_token": token})
    before = await _workers(http, router)
    worker_id = before["workers"][0]["id"]
    attacker = {"url": f"http://127.0.0.1:{unused_tcp_port}"}
    for method, path, body in (
        ("POST", "/workers", attacker),
        ("DELETE", f"/workers/{worker_id}", None),
        ("PUT", f"/workers/{worker_id}", attacker),
        ("POST", "/flush_cache", None),
        ("GET", "/workers", None),
    ):
        async with http.request(method, proxy.url + path, json=body) as resp:
            assert resp.status == 404, (method, path)
            assert (await resp.json())["error"]["type"] == "not_found"
    after = await _workers(http, router)
    assert _worker_urls(after) == _worker_urls(before)
    assert attacker["url"] not in _worker_urls(after)


async def test_control_plane_forwarding_is_opt_in_and_needs_the_admin_bearer(
    make_proxy: MakeProxy, router: stack.ManagedProcess, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN}, router={"forward_control_plane": True})
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with http.get(proxy.url + "/workers", headers=headers) as resp:
            assert resp.status == 404
    async with http.get(proxy.url + "/workers", headers=BEARER) as resp:
        assert resp.status == 200
        listed = orjson.loads(await resp.read())
    assert _worker_urls(listed) == _worker_urls(await _workers(http, router))
    # kvproxy's own paths are never forwarded, token or not.
    async with http.get(proxy.url + "/kvproxy/nope", headers=BEARER) as resp:
        assert resp.status == 404


@pytest.mark.parametrize(
    "target",
    [
        "/generate%3Fa=1",
        "/generate%3fa=1",
        "/generate%23",
        "/./generate",
        "/x/../generate",
        "/%2e/generate",
        "/x/%2E%2E/generate",
        "/sessions/s1/./generate",
        "//generate",
    ],
)
async def test_path_tricks_are_refused_and_never_forwarded(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str], target: str
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    marker = new_marker()
    body = orjson.dumps({"text": f"trick {marker}", "sampling_params": {"max_new_tokens": 2}})
    status, answer = await _raw(proxy, "POST", target, body)
    assert status == 400, (target, answer)
    assert orjson.loads(answer)["error"]["type"] == "invalid_path"
    assert [r for r in await recorded(http, engine_urls) if marker in r["body"]] == []


async def test_an_encoded_letter_is_routed_as_the_path_it_decodes_to_and_inspected(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    marker, sid = new_marker(), new_marker()
    body = orjson.dumps({"text": f"letter {marker}", "sampling_params": {"max_new_tokens": 2}})
    status, _ = await _raw(proxy, "POST", f"/sessions/{sid}/gen%65rate?x=%20y", body)
    assert status == 200
    got = [r for r in await recorded(http, engine_urls) if marker in r["body"]]
    assert len(got) == 1 and got[0]["path"] == "/generate"
    assert orjson.loads(got[0]["body"])["session_id"] == sid  # intercepted, not passed


async def _stream(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str]
) -> list[bytes]:
    chunks = []
    async with http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
    return chunks


async def test_another_credential_cannot_close_a_session_or_abort_its_request(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True, "on_close": "abort"})
    sid, rid = new_marker(), new_marker()  # a 32-character rid: abortable by name
    alice = {"Authorization": "Bearer alice", "X-Session-ID": sid}
    body = {
        "input_ids": list(range(5, 45)),
        "rid": rid,
        "sampling_params": {"max_new_tokens": LONG},
    }
    request = asyncio.create_task(_post_json(http, proxy.url + "/generate", body, alice))

    async def running() -> bool:
        for url in engine_urls:
            if rid in (await sim_state(http, url))["ranks"][0]["running"]:
                return True
        return False

    await wait_until(running, timeout_s=10, what="alice's request to run")
    closes = (
        ("/close_session", {"session_id": sid}),
        (f"/sessions/{sid}/close_session", None),
        (f"/kvproxy/sessions/{sid}/close", None),
    )
    for path, payload in closes:
        for headers in ({"Authorization": "Bearer mallory"}, {"x-api-key": "mallory"}, {}):
            async with http.post(proxy.url + path, json=payload, headers=headers) as resp:
                assert resp.status == 403, (path, headers)
                assert (await resp.json())["error"]["type"] == "forbidden"
    # A turn of the session under another credential is refused too (it could close it).
    mallory = {"Authorization": "Bearer mallory", "X-Session-ID": sid, "X-Session-Final": "1"}
    async with http.post(proxy.url + "/generate", json={"text": "x"}, headers=mallory) as resp:
        assert resp.status == 403
    status, doc = await request
    assert status == 200
    assert doc["meta_info"]["finish_reason"]["type"] == "length"  # never aborted
    aborts = await recorded(http, engine_urls, path="/abort_request")
    assert [a for a in aborts if rid in a["body"]] == []
    assert [
        c for c in await recorded(http, engine_urls, path="/close_session") if sid in c["body"]
    ] == []
    # Alice's own credential closes it.
    async with http.post(
        proxy.url + "/close_session",
        json={"session_id": sid},
        headers={"Authorization": "Bearer alice"},
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["engines_told"] == 2


async def _post_json(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str]
) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_the_admin_token_closes_any_session(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN}, session_lifecycle={"enabled": True})
    sid = new_marker()
    headers = {"Authorization": "Bearer alice", "X-Session-ID": sid}
    status, _ = await _post_json(http, proxy.url + "/generate", {"text": "hi"}, headers)
    assert status == 200
    async with http.post(proxy.url + "/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 403
    async with http.post(proxy.url + f"/kvproxy/sessions/{sid}/close", headers=BEARER) as resp:
        assert resp.status == 200


async def test_control_bodies_must_be_json(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = new_marker()
    body = orjson.dumps({"session_id": sid})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        async with http.post(
            proxy.url + "/close_session", data=body, headers={"Content-Type": content_type}
        ) as resp:
            assert resp.status == 415, content_type
            assert (await resp.json())["error"]["type"] == "unsupported_media_type"
    async with http.post(proxy.url + "/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200


async def test_a_rid_list_over_the_cap_is_refused(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True, "max_rids_per_request": 4})
    marker = new_marker()
    body = {"text": [f"{marker} {i}" for i in range(5)], "rid": [new_marker() for _ in range(5)]}
    status, doc = await _post_json(http, proxy.url + "/generate", body, {})
    assert status == 400 and "max_rids_per_request" in doc["error"]["message"]
    assert [r for r in await recorded(http, engine_urls) if marker in r["body"]] == []


# ------------------------------------------------ what reaches the router: a capture
class Capture:
    """A stand-in router on loopback that records each request's path and headers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, list[str]]]] = []
        self.hold: asyncio.Event | None = None  # when set, answers wait for it

    async def handle(self, request: web.Request) -> web.Response:
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        if request.raw_path != "/health":  # kvproxy's own probe of the router
            self.seen.append((request.method, request.raw_path, headers))
        await request.read()
        if self.hold is not None and request.raw_path != "/health":
            await asyncio.wait_for(self.hold.wait(), 10)
        return web.json_response({"ok": True, "meta_info": {}})


@pytest.fixture
async def capture() -> AsyncIterator[tuple[Capture, str]]:
    cap = Capture()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", cap.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield cap, str(server.make_url("")).rstrip("/")
    await server.close()


async def test_kvproxy_credentials_never_reach_the_router(
    start_proxy: StartProxy, capture: tuple[Capture, str], http: aiohttp.ClientSession
) -> None:
    cap, url = capture
    proxy = await start_proxy(
        {
            "router": {"url": url, "engines": ["http://127.0.0.1:9"]},
            "server": {"admin_token": TOKEN, "log_level": "WARNING"},
            "session_lifecycle": {"enabled": True, "check_engines": False},
        }
    )
    own = {
        **BEARER,
        "Cookie": f"theme=dark; {COOKIE_NAME}={cookie_value(TOKEN)}",
        "X-Session-ID": new_marker(),
    }
    for method, path in (
        ("POST", "/generate"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/kvproxy/nope"),
        ("GET", "/workers"),
    ):
        async with http.request(method, proxy.url + path, json={"text": "x"}, headers=own) as resp:
            await resp.read()
    assert [p for _, p, _ in cap.seen] == ["/generate", "/v1/chat/completions", "/v1/models"]
    for _, path, headers in cap.seen:
        assert "authorization" not in headers, path
        assert headers["cookie"] == ["theme=dark"], path
        assert all(TOKEN not in v for values in headers.values() for v in values), path
    # A data-plane credential (the router's or the engines' own key) still goes through.
    cap.seen.clear()
    async with http.post(
        proxy.url + "/generate", json={"text": "x"}, headers={"Authorization": "Bearer sk-router"}
    ) as resp:
        assert resp.status == 200
    assert cap.seen[0][2]["authorization"] == ["Bearer sk-router"]


async def test_the_path_forwarded_is_the_path_routed(
    start_proxy: StartProxy, capture: tuple[Capture, str]
) -> None:
    cap, url = capture
    proxy = await start_proxy(
        {
            "router": {"url": url, "engines": ["http://127.0.0.1:9"]},
            "server": {"log_level": "WARNING"},
        }
    )
    for target in ("/v1/responses/r%201/input_items?x=%20y&z=%2F", "/gen%65rate"):
        status, _ = await _raw(proxy, "POST" if "gen" in target else "GET", target, b"{}")
        assert status == 200, target
    assert [p for _, p, _ in cap.seen] == [
        "/v1/responses/r%201/input_items?x=%20y&z=%2F",  # encoded as routed; query as received
        "/generate",
    ]


# ---------------------------------------------------------------- the admin plane
async def _raw_head(proxy: Proxy, head: bytes) -> tuple[int, bytes]:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def test_health_without_credentials_is_its_status_only(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN})
    async with http.get(proxy.url + "/kvproxy/health") as resp:
        assert resp.status == 200
        public = await resp.read()
    assert set(orjson.loads(public)) == {
        "status",
        "router_reachable",
        "engines_known",
        "engines_healthy",
    }
    assert all(url.encode() not in public for url in engine_urls)
    async with http.get(proxy.url + "/kvproxy/health", headers=BEARER) as resp:
        full = await resp.json()
    assert set(full["fleet"]["engines"]["healthy"]) == set(engine_urls)


async def test_a_malformed_dashboard_cookie_is_400_not_500(
    make_proxy: MakeProxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN})
    host = proxy.url.removeprefix("http://")
    head = (
        f"GET /kvproxy/dashboard/data HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n".encode()
        + f"Cookie: {COOKIE_NAME}=".encode()
        + "\u00e9t\u00e9".encode()
        + b"\r\n\r\n"
    )
    status, body = await _raw_head(proxy, head)
    assert status == 400 and orjson.loads(body)["error"]["type"] == "invalid_request"
    assert "Traceback" not in caplog.text


async def test_sign_in_is_rate_limited_and_logged_once(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy(
        server={"admin_token": TOKEN, "sign_in_attempts_per_minute": 3, "log_level": "INFO"}
    )
    url = proxy.url + "/kvproxy/dashboard/sign-in"
    statuses = []
    for _ in range(5):
        async with http.post(url, data={"token": "wrong"}, allow_redirects=False) as resp:
            statuses.append(resp.status)
    assert statuses == [401, 401, 401, 429, 429]
    # Even the right token waits out the minute once the attempts are spent.
    async with http.post(url, data={"token": TOKEN}, allow_redirects=False) as resp:
        assert resp.status == 429
    lines = [r for r in caplog.records if "dashboard sign-in" in r.getMessage()]
    assert len(lines) == 1


async def test_the_cookie_has_max_age_and_can_be_secure(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    for secure in (None, True):
        proxy = await make_proxy(
            server={"admin_token": TOKEN, "cookie_secure": secure, "cookie_max_age_s": 600}
        )
        async with http.post(
            proxy.url + "/kvproxy/dashboard/sign-in", data={"token": TOKEN}, allow_redirects=False
        ) as resp:
            assert resp.status == 303
            cookie = resp.headers["Set-Cookie"]
        assert "Max-Age=600" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert ("Secure" in cookie) is bool(secure)


async def test_foreign_hosts_and_origins_are_refused_on_the_admin_plane(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN}, session_lifecycle={"enabled": True})
    # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends its own Host.
    async with http.get(proxy.url + "/kvproxy/stats", headers={"Host": "evil.example"}) as resp:
        assert resp.status == 403 and (await resp.json())["error"]["type"] == "forbidden"
    evil = {**BEARER, "Origin": "https://evil.example"}
    async with http.post(proxy.url + "/kvproxy/config/reload", headers=evil) as resp:
        assert resp.status == 403
    async with http.post(
        proxy.url + "/close_session", json={"session_id": "s"}, headers=evil
    ) as resp:
        assert resp.status == 403
    own = {**BEARER, "Origin": proxy.url}
    async with http.post(proxy.url + "/kvproxy/sessions/s/close", headers=own) as resp:
        assert resp.status == 200


async def test_buffered_bodies_have_a_global_budget(
    start_proxy: StartProxy, capture: tuple[Capture, str], http: aiohttp.ClientSession
) -> None:
    cap, url = capture
    cap.hold = asyncio.Event()
    limit = 64 * 1024
    proxy = await start_proxy(
        {
            "router": {"url": url, "engines": ["http://127.0.0.1:9"]},
            "server": {"max_body_bytes": limit, "max_buffered_bytes": limit},
        }
    )
    body = {"text": "x" * (40 * 1024)}
    first = asyncio.create_task(_post_json(http, proxy.url + "/generate", body, {}))
    await wait_until(_seen(cap, 1), timeout_s=5, what="the first request to be held upstream")
    status, doc = await _post_json(http, proxy.url + "/generate", body, {})
    assert status == 503 and doc["error"]["type"] == "overloaded"
    cap.hold.set()
    assert (await first)[0] == 200
    status, _ = await _post_json(http, proxy.url + "/generate", body, {})  # room again
    assert status == 200


def _seen(cap: Capture, n: int) -> Any:
    async def seen() -> bool:
        return len(cap.seen) >= n

    return seen


async def test_engine_urls_from_the_router_are_checked(
    start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    listed = [
        {"url": "http://127.0.0.1:9", "is_healthy": True, "labels": {}},
        {"url": "http://10.9.9.9:9", "is_healthy": True, "labels": {}},  # not in engine_hosts
        {"url": "file:///etc/passwd", "is_healthy": True, "labels": {}},
        {"url": "http://user:pw@127.0.0.1:9", "is_healthy": True, "labels": {}},
    ]

    async def workers(_: web.Request) -> web.Response:
        return web.json_response({"workers": listed})

    app = web.Application()
    app.router.add_get("/workers", workers)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await start_proxy(
            {
                "router": {
                    "url": str(server.make_url("")).rstrip("/"),
                    "engine_hosts": ["127.0.0.0/8"],
                },
                "server": {"log_level": "WARNING"},
            }
        )
        fleet = proxy.app[FLEET]
        assert fleet.all_engines() == ("http://127.0.0.1:9",)
        assert fleet.health().engines_refused == 3
        await fleet.refresh()  # the same refusals again: counted and logged once each
        assert fleet.health().engines_refused == 3
        refused = [r for r in caplog.records if "engine URL from the router refused" in r.message]
        assert len(refused) == 3
        assert not any("pw" in r.getMessage() for r in refused)  # user info never logged
    finally:
        await server.close()
