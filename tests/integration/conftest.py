"""Real components for integration tests.

Two simulated SGLang engines (subprocesses, session radix cache with priority
eviction, request recording on) and the real router (`smg`, subprocess) are started
once per test session and stopped by PID. Each test builds its own kvproxy in-process
with :func:`make_proxy` (real HTTP on 127.0.0.1, in front of the real router).

Tests share the engines, so each one uses its own session ids / rids and reads back
only the recorded requests that carry them.

A module that needs engines of another kind starts its own with
:func:`kvlab.stack.sim_engines` and ``kvlab.stack.start_router`` (a context
manager: stopped by PID on exit) in module-scoped fixtures, and its kvproxy with
:func:`start_proxy` from a whole config document.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvproxy.app import create_app
from kvproxy.config import from_mapping
from kvproxy.keys import ADMISSION
from tests.helpers import wait_until

__all__ = [
    "ENGINE_ARGS",
    "ENGINE_TOKENS",
    "MakeProxy",
    "Proxy",
    "RedisServer",
    "StartProxy",
    "recorded",
    "reset_faults",
    "set_faults",
    "sim_state",
    "wait_until",
]

ENGINE_TOKENS = 60_000
# Simulated time runs 20x faster than the cost model's wall-clock defaults.
ENGINE_ARGS = ("--time-scale", "0.05", "--record-requests", "512")


@pytest.fixture(scope="session")
def stack_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack-logs")


@pytest.fixture(scope="session")
def engines(stack_logs: Path) -> Iterator[list[stack.ManagedProcess]]:
    with stack.sim_engines(
        2,
        max_total_tokens=ENGINE_TOKENS,
        mode="session-radix",
        eviction_policy="priority",
        extra_args=ENGINE_ARGS,
        log_dir=stack_logs,
    ) as started:
        yield started


@pytest.fixture(scope="session")
def router(engines: list[stack.ManagedProcess], stack_logs: Path) -> Iterator[stack.ManagedProcess]:
    with stack.start_router([e.url for e in engines], log_dir=stack_logs) as proc:
        yield proc


@dataclass
class RedisServer:
    url: str
    password: str
    proc: stack.ManagedProcess


@pytest.fixture(scope="session")
def redis_server(stack_logs: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` on 127.0.0.1 with a password (stopped by PID). Fails, not
    skips, where redis-server is not installed (scripts/test.sh installs it)."""
    password = secrets.token_hex(16)
    with stack.start_redis(log_dir=stack_logs / "redis", password=password) as proc:
        yield RedisServer(url=proc.url, password=password, proc=proc)


@pytest.fixture
def engine_urls(engines: list[stack.ManagedProcess]) -> list[str]:
    return [e.url for e in engines]


@dataclass
class Proxy:
    url: str
    app: web.Application


StartProxy = Callable[..., Awaitable[Proxy]]
MakeProxy = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[StartProxy]:
    """``await start_proxy(doc, source=None)`` -> Proxy: kvproxy in-process for the config
    document ``doc`` (real HTTP on 127.0.0.1), closed after the test."""
    servers: list[TestServer] = []

    async def start(doc: Mapping[str, Any], *, source: str | None = None) -> Proxy:
        server = TestServer(create_app(from_mapping(doc, source=source)), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return Proxy(url=str(server.make_url("")).rstrip("/"), app=server.app)

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def make_proxy(router: stack.ManagedProcess, start_proxy: StartProxy) -> MakeProxy:
    """``await make_proxy(session_lifecycle={...}, admission={...}, ...)`` -> Proxy, in
    front of the session's router."""

    async def factory(*, source: str | None = None, **sections: dict[str, Any]) -> Proxy:
        doc: dict[str, Any] = {"router": {"url": router.url}, "server": {"log_level": "WARNING"}}
        for name, values in sections.items():
            doc.setdefault(name, {}).update(values)
        return await start_proxy(doc, source=source)

    return factory


@pytest.fixture(autouse=True)
async def _reset_engine_faults(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Tests that set simulator faults get them cleared afterwards."""
    yield
    if "engines" not in request.fixturenames:
        return
    await reset_faults([e.url for e in request.getfixturevalue("engines")])


# ------------------------------------------------------------------- helpers
async def recorded(
    http: aiohttp.ClientSession, engine_urls: Sequence[str], *, path: str | None = None
) -> list[dict[str, Any]]:
    """Requests the engines recorded (oldest first), optionally only one path."""
    out: list[dict[str, Any]] = []
    for url in engine_urls:
        async with http.get(f"{url}/sim/requests") as resp:
            assert resp.status == 200
            for entry in orjson.loads(await resp.read())["requests"]:
                if path is None or entry["path"] == path:
                    out.append(entry)
    return out


async def set_faults(http: aiohttp.ClientSession, engine_urls: list[str], **faults: Any) -> None:
    for url in engine_urls:
        async with http.post(f"{url}/sim/faults", json=faults) as resp:
            assert resp.status == 200, await resp.text()


async def reset_faults(engine_urls: Sequence[str]) -> None:
    """Back to the faults the engines started with (own client: for fixture teardown)."""
    async with aiohttp.ClientSession() as session:
        await set_faults(session, list(engine_urls), reset=True)


async def sim_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/sim/state") as resp:
        assert resp.status == 200
        return orjson.loads(await resp.read())


def program_ready(p: Proxy) -> Callable[[], Awaitable[bool]]:
    """For :func:`wait_until`: program admission is active and its ring mirror knows
    the router's workers (the proxy's router uses consistent hashing)."""

    async def ready() -> bool:
        h = p.app[ADMISSION].health().to_json()
        return bool(h["program_active"] and h["placement"]["available"])

    return ready
