"""The operator endpoints over HTTP: the admin token, the dashboard's data and its
sign-in, against a live kvproxy in front of the real router."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvproxy.admin.auth import COOKIE_NAME, cookie_valid, cookie_value

from .conftest import MakeProxy, Proxy

pytestmark = pytest.mark.usefixtures("router")

TOKEN = "s3cret-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
COOKIE = {"Cookie": f"{COOKIE_NAME}={cookie_value(TOKEN)}"}


async def status_of(
    http: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> tuple[int, bytes]:
    async with http.request(method, url, allow_redirects=False, **kwargs) as resp:
        return resp.status, await resp.read()


async def test_with_a_token_mutations_need_the_bearer_header(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN}, session_lifecycle={"enabled": True})
    u = proxy.url
    mutations = [
        ("POST", u + "/kvproxy/config/reload"),
        ("POST", u + "/kvproxy/sessions/adm-1/close"),
        ("GET", u + "/kvproxy/stats?reset=true"),
    ]
    for method, url in mutations:
        for headers in ({}, COOKIE, {"Authorization": "Bearer wrong"}):
            status, body = await status_of(http, method, url, headers=headers)
            assert status == 401, (url, headers)
            assert b'"type":"unauthorized"' in body
    # With the header they run (reload then fails for its own reason: no config file).
    status, body = await status_of(http, "POST", u + "/kvproxy/config/reload", headers=BEARER)
    assert status == 400 and b"no config file" in body
    status, _ = await status_of(http, "POST", u + "/kvproxy/sessions/adm-1/close", headers=BEARER)
    assert status == 200
    status, _ = await status_of(http, "GET", u + "/kvproxy/stats?reset=true", headers=BEARER)
    assert status == 200


async def test_with_a_token_reads_follow_public_stats(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    public = await make_proxy(server={"admin_token": TOKEN})
    private = await make_proxy(server={"admin_token": TOKEN, "public_stats": False})
    for path in ("/kvproxy/stats", "/metrics"):
        assert (await status_of(http, "GET", public.url + path))[0] == 200
        assert (await status_of(http, "GET", private.url + path))[0] == 401
        assert (await status_of(http, "GET", private.url + path, headers=BEARER))[0] == 200
        assert (await status_of(http, "GET", private.url + path, headers=COOKIE))[0] == 200
    # Health stays open for probes either way.
    assert (await status_of(http, "GET", private.url + "/kvproxy/health"))[0] == 200


async def test_dashboard_sign_in_sets_a_cookie_that_opens_the_data(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN})
    u = proxy.url
    status, page = await status_of(http, "GET", u + "/kvproxy/dashboard")
    assert status == 401 and b'action="/kvproxy/dashboard/sign-in"' in page
    assert (await status_of(http, "GET", u + "/kvproxy/dashboard/data"))[0] == 401
    # The page's assets carry no data and load without the token (the sign-in page uses the CSS).
    assert (await status_of(http, "GET", u + "/kvproxy/dashboard/static/dashboard.css"))[0] == 200

    status, page = await status_of(
        http, "POST", u + "/kvproxy/dashboard/sign-in", data={"token": "wrong"}
    )
    assert status == 401 and b"Wrong token" in page
    async with http.post(
        u + "/kvproxy/dashboard/sign-in", data={"token": TOKEN}, allow_redirects=False
    ) as resp:
        assert resp.status == 303 and resp.headers["Location"] == "/kvproxy/dashboard"
        set_cookie = resp.headers["Set-Cookie"]
    value = set_cookie.split(";")[0].removeprefix(f"{COOKIE_NAME}=")
    assert cookie_valid(TOKEN, value, now=time.time(), max_age_s=60)
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    assert TOKEN not in set_cookie

    status, _ = await status_of(http, "GET", u + "/kvproxy/dashboard", headers=COOKIE)
    assert status == 200
    status, _ = await status_of(http, "GET", u + "/kvproxy/dashboard/data", headers=BEARER)
    assert status == 200


async def test_sign_in_refuses_an_oversized_or_chunked_form(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN})
    status, _ = await status_of(
        http, "POST", proxy.url + "/kvproxy/dashboard/sign-in", data={"token": "x" * 10_000}
    )
    assert status == 400

    async def chunked() -> AsyncIterator[bytes]:
        yield b"token=" + b"x" * 10

    status, _ = await status_of(
        http,
        "POST",
        proxy.url + "/kvproxy/dashboard/sign-in",
        data=chunked(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert status == 400


async def _data(http: aiohttp.ClientSession, proxy: Proxy, since: str = "0") -> dict[str, Any]:
    async with http.get(proxy.url + "/kvproxy/dashboard/data", params={"since": since}) as resp:
        assert resp.status == 200
        assert resp.headers["Cache-Control"] == "no-store"
        doc: dict[str, Any] = await resp.json()
        return doc


async def test_dashboard_data_without_a_token_and_its_since_cursor(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    # mode request: no fallback banner (program mode behind a round_robin router says so).
    proxy = await make_proxy(admission={"enabled": True, "mode": "request"})
    async with http.get(proxy.url + "/kvproxy/dashboard") as resp:
        assert resp.status == 200
        csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "connect-src 'self'" in csp

    doc = await _data(http, proxy)
    assert doc["last_seq"] >= 1 and len(doc["samples"]) == doc["last_seq"]
    assert doc["config"]["admission"]["enabled"] is True
    assert doc["health"]["status"] == "ok" and doc["banners"] == []
    sample = doc["samples"][-1]
    assert {"waiting", "committed", "ceiling", "sessions_open"} <= set(sample["gauges"])
    assert {"admit", "wait", "requests", "bypass_degraded"} <= set(sample["rates"])
    # Nothing newer than the cursor: nothing sent again. A bad cursor means "all".
    newer = await _data(http, proxy, since=str(doc["last_seq"] + 1000))
    assert newer["samples"] == []
    assert len((await _data(http, proxy, since="nonsense"))["samples"]) >= 1


async def test_without_a_token_sign_in_just_redirects(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    status, _ = await status_of(http, "POST", proxy.url + "/kvproxy/dashboard/sign-in")
    assert status == 303
    assert (await status_of(http, "GET", proxy.url + "/kvproxy/dashboard/static/nope.js"))[0] == 404
