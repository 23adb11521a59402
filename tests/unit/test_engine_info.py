"""Engine session-mode parsing, warnings, and the /server_info probe."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvproxy.fleet.engine_info import (
    EngineProbeError,
    EngineSessionMode,
    mode_warnings,
    parse_server_info,
    parse_version,
    probe,
)

U = "http://e1:30000"

RADIX_PRIORITY = {
    "enable_session_radix_cache": True,
    "radix_eviction_policy": "priority",
    "enable_streaming_session": False,
    "enable_priority_scheduling": True,
    "disable_radix_cache": False,
    "version": "0.5.23",
    "served_model_name": "Qwen/Qwen3-8B",
}


@pytest.mark.parametrize(
    ("info", "mode", "as_assumed"),
    [
        (RADIX_PRIORITY, "session_radix", True),
        ({**RADIX_PRIORITY, "radix_eviction_policy": "lru"}, "session_radix", False),
        ({**RADIX_PRIORITY, "radix_eviction_policy": "PRIORITY"}, "session_radix", True),
        ({**RADIX_PRIORITY, "disable_radix_cache": True}, "session_radix", False),
        (
            {
                **RADIX_PRIORITY,
                "enable_session_radix_cache": False,
                "enable_streaming_session": True,
            },
            "streaming",
            False,
        ),
        ({**RADIX_PRIORITY, "enable_streaming_session": True}, "session_radix+streaming", True),
        ({"radix_eviction_policy": "lru", "version": "0.5.7"}, "none", False),
        # String flags (as some gateways relay them) are understood.
        (
            {"enable_session_radix_cache": "true", "radix_eviction_policy": "priority"},
            "session_radix",
            True,
        ),
        ({"enable_session_radix_cache": "0", "enable_streaming_session": 1}, "streaming", False),
        # Nothing session-related: not recognised.
        ({"router_manager": True, "workers_count": 2}, "unknown", False),
    ],
)
def test_parse_server_info(info: dict[str, Any], mode: str, as_assumed: bool) -> None:
    m = parse_server_info(U, info)
    assert m.mode == mode
    assert m.as_assumed is as_assumed
    assert m.to_json()["mode"] == mode


def test_parse_fields() -> None:
    m = parse_server_info(U, RADIX_PRIORITY)
    assert m == EngineSessionMode(
        url=U,
        session_radix=True,
        streaming=False,
        eviction_policy="priority",
        priority_scheduling=True,
        radix_disabled=False,
        version="0.5.23",
        model="Qwen/Qwen3-8B",
    )


@pytest.mark.parametrize(
    ("fields", "policy"),
    [
        ({}, None),  # no host tier
        ({"enable_hierarchical_cache": False, "hicache_write_policy": "write_back"}, None),
        ({"enable_hierarchical_cache": True}, "write_through"),  # SGLang's default
        ({"enable_hierarchical_cache": True, "hicache_write_policy": "write_back"}, "write_back"),
        (
            {"enable_hierarchical_cache": "true", "hicache_write_policy": " Write_Back "},
            "write_back",
        ),
        (
            {"enable_hierarchical_cache": True, "hicache_write_policy": "write_through_selective"},
            "write_through_selective",
        ),
    ],
)
def test_the_host_tiers_write_policy_is_read_only_where_the_tier_is_on(
    fields: dict[str, Any], policy: str | None
) -> None:
    m = parse_server_info(U, {**RADIX_PRIORITY, **fields})
    assert m.hicache_write_policy == policy
    assert m.to_json()["hicache_write_policy"] == policy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5.23", (0, 5, 23)),
        ("0.5.15.post1", (0, 5, 15)),
        ("v0.5.16rc1", (0, 5, 16)),
        ("1.2", (1, 2, 0)),
        ("dev", None),
        (None, None),
    ],
)
def test_parse_version(text: str | None, expected: tuple[int, ...] | None) -> None:
    assert parse_version(text) == expected


def mode(**changes: Any) -> EngineSessionMode:
    return parse_server_info(changes.pop("url", U), {**RADIX_PRIORITY, **changes})


@pytest.mark.parametrize(
    ("modes", "fragments"),
    [
        ([mode()], []),
        (
            [mode(radix_eviction_policy="lru")],
            ["without --radix-eviction-policy priority (policy lru)"],
        ),
        (
            [mode(enable_session_radix_cache=False)],
            ["neither the session radix cache nor streaming sessions", "will not free KV"],
        ),
        (
            [mode(enable_session_radix_cache=False, enable_streaming_session=True)],
            ["streaming sessions but not the session radix cache"],
        ),
        ([mode(version="0.5.10")], ["< 0.5.16"]),
        ([mode(disable_radix_cache=True)], ["--disable-radix-cache"]),
        ([parse_server_info(U, {"foo": 1})], ["no session settings"]),
        (
            [mode(), mode(url="http://e2:1", enable_session_radix_cache=False)],
            ["engine http://e2:1 runs neither", "different session modes"],
        ),
    ],
)
def test_mode_warnings(modes: list[EngineSessionMode], fragments: list[str]) -> None:
    warnings = mode_warnings(modes)
    joined = "\n".join(warnings)
    for fragment in fragments:
        assert fragment in joined
    if not fragments:
        assert warnings == []


# -- probe ---------------------------------------------------------------------


async def _server(aiohttp_server: Any, routes: dict[str, Any]) -> str:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_probe_server_info(aiohttp_server: Any) -> None:
    async def info(_: web.Request) -> web.Response:
        return web.json_response(RADIX_PRIORITY)

    url = await _server(aiohttp_server, {"/server_info": info})
    async with aiohttp.ClientSession() as http:
        m = await probe(http, url + "/", 2.0)
    assert m.url == url and m.as_assumed


async def test_probe_falls_back_to_get_server_info(aiohttp_server: Any) -> None:
    seen: list[str] = []

    async def legacy(req: web.Request) -> web.Response:
        seen.append(req.path)
        # Older engines / gateways answer with a non-JSON content type.
        return web.Response(text='{"enable_streaming_session": true}', content_type="text/plain")

    url = await _server(aiohttp_server, {"/get_server_info": legacy})
    async with aiohttp.ClientSession() as http:
        m = await probe(http, url, 2.0)
    assert seen == ["/get_server_info"] and m.mode == "streaming"


async def test_probe_errors(aiohttp_server: Any, unused_tcp_port: int) -> None:
    async def not_json(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    url = await _server(aiohttp_server, {"/server_info": not_json})
    async with aiohttp.ClientSession() as http:
        with pytest.raises(EngineProbeError, match="not a JSON object"):
            await probe(http, url, 2.0)
        with pytest.raises(EngineProbeError, match=str(unused_tcp_port)):
            await probe(http, f"http://127.0.0.1:{unused_tcp_port}", 2.0)
