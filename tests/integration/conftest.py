"""Real components for integration tests.

Two simulated SGLang engines (subprocesses, session radix cache with priority
eviction, request recording on) and the real router (`smg`, subprocess) are started
once per test session and stopped by PID. Each test builds its own kvproxy in-process
with :func:`make_proxy` (real HTTP on 127.0.0.1, in front of the real router).

Tests share the engines, so each one uses its own session ids / rids and reads back
only the recorded requests that carry them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvproxy import stack
from kvproxy.app import create_app
from kvproxy.config import from_mapping
from tests.helpers import wait_until

__all__ = [
    "ENGINE_ARGS",
    "ENGINE_TOKENS",
    "MakeProxy",
    "Proxy",
    "recorded",
    "set_faults",
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
    started: list[stack.ManagedProcess] = []
    try:
        for _ in range(2):
            started.append(
                stack.start_sim_engine(
                    max_total_tokens=ENGINE_TOKENS,
                    mode="session-radix",
                    eviction_policy="priority",
                    extra_args=ENGINE_ARGS,
                    log_dir=stack_logs,
                )
            )
        yield started
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="session")
def router(engines: list[stack.ManagedProcess], stack_logs: Path) -> Iterator[stack.ManagedProcess]:
    proc = stack.start_router([e.url for e in engines], log_dir=stack_logs)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def engine_urls(engines: list[stack.ManagedProcess]) -> list[str]:
    return [e.url for e in engines]


@dataclass
class Proxy:
    url: str
    app: web.Application


MakeProxy = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def make_proxy(router: stack.ManagedProcess) -> AsyncIterator[MakeProxy]:
    """``await make_proxy(session_lifecycle={...}, admission={...}, ...)`` -> Proxy."""
    servers: list[TestServer] = []

    async def factory(*, source: str | None = None, **sections: dict[str, Any]) -> Proxy:
        doc: dict[str, Any] = {"router": {"url": router.url}, "server": {"log_level": "WARNING"}}
        for name, values in sections.items():
            doc.setdefault(name, {}).update(values)
        cfg = from_mapping(doc, source=source)
        server = TestServer(create_app(cfg), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return Proxy(url=str(server.make_url("")).rstrip("/"), app=server.app)

    yield factory
    for server in servers:
        await server.close()


@pytest.fixture(autouse=True)
async def _reset_engine_faults(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Tests that set simulator faults get them cleared afterwards."""
    yield
    if "engines" not in request.fixturenames:
        return
    urls = [e.url for e in request.getfixturevalue("engines")]
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(f"{url}/sim/faults", json={"reset": True}) as resp:
                assert resp.status == 200


# ------------------------------------------------------------------- helpers
async def recorded(
    http: aiohttp.ClientSession, engine_urls: list[str], *, path: str | None = None
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


async def sim_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/sim/state") as resp:
        assert resp.status == 200
        return orjson.loads(await resp.read())
