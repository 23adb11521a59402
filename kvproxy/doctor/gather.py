"""The doctor's I/O: read the router and the engines into facts (see ``checks``).

Every request has its own timeout; engines are read concurrently. Nothing here
decides anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from kvproxy.config import StateConfig
from kvproxy.doctor.checks import EngineFacts, ProbeFacts, RouterFacts
from kvproxy.doctor.store_checks import StoreFacts
from kvproxy.fleet.discovery import (
    DiscoveryError,
    EngineList,
    parse_list_workers,
    parse_workers,
    static_engines,
)
from kvproxy.fleet.engine_info import SERVER_INFO_PATHS
from kvproxy.urls import base_url, join

# Longest /metrics or /sim/requests body read (a 0.5.23 /metrics is ~40 KB).
MAX_BODY_BYTES = 8 * 1024 * 1024


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


async def _read(resp: aiohttp.ClientResponse) -> bytes:
    """The whole body, or its first MAX_BODY_BYTES (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size >= MAX_BODY_BYTES:
            break
    return b"".join(chunks)[:MAX_BODY_BYTES]


async def _get(
    http: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[int, bytes, Mapping[str, str]]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await _read(resp), dict(resp.headers)


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


async def read_router(
    http: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    static: Sequence[str] = (),
) -> RouterFacts:
    base = base_url(url)
    try:
        status, body, _ = await _get(http, base + "/workers", timeout_s)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return RouterFacts(url=base, error=_describe(exc))
    engines: EngineList | None = None
    listing_error: str | None = None
    try:
        if status == 200:
            engines = parse_workers(_json(body))
        else:
            status2, body2, _ = await _get(http, base + "/list_workers", timeout_s)
            if status2 == 200:
                engines = parse_list_workers(_json(body2))
            else:
                listing_error = f"/workers: HTTP {status}, /list_workers: HTTP {status2}"
    except DiscoveryError as exc:
        listing_error = str(exc)
    except (aiohttp.ClientError, TimeoutError) as exc:
        listing_error = _describe(exc)
    if static:
        # router.engines overrides discovery in kvproxy; the doctor checks those engines.
        flavor = engines.flavor if engines is not None else None
        engines = static_engines(tuple(static))
        if flavor is not None:
            engines = EngineList(healthy=engines.healthy, flavor=flavor)
    version: str | None = None
    try:
        status, body, _ = await _get(http, base + "/get_loads", timeout_s)
        doc = _json(body) if status == 200 else None
        if isinstance(doc, dict) and isinstance(doc.get("version"), str):
            version = doc["version"]
    except (aiohttp.ClientError, TimeoutError):
        pass
    return RouterFacts(url=base, engines=engines, listing_error=listing_error, version=version)


async def read_engine(http: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineFacts:
    base = base_url(url)
    info: Mapping[str, Any] | None = None
    info_errors: list[str] = []
    for path in SERVER_INFO_PATHS:
        try:
            status, body, _ = await _get(http, base + path, timeout_s)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return EngineFacts(url=base, error=_describe(exc))
        doc = _json(body) if status == 200 else None
        if isinstance(doc, dict):
            info = doc
            break
        info_errors.append(f"{path}: HTTP {status}")
    try:
        status, body, _ = await _get(http, base + "/metrics", timeout_s)
        metrics_status: int | None = status
        metrics_text: str | None = body.decode("utf-8", "replace")
        metrics_error: str | None = None
    except (aiohttp.ClientError, TimeoutError) as exc:
        metrics_status, metrics_text, metrics_error = None, None, _describe(exc)
    return EngineFacts(
        url=base,
        info=info,
        info_error="; ".join(info_errors) or None,
        metrics_status=metrics_status,
        metrics_text=metrics_text,
        metrics_error=metrics_error,
    )


async def read_engines(
    http: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float
) -> list[EngineFacts]:
    return list(await asyncio.gather(*(read_engine(http, u, timeout_s) for u in urls)))


async def _recorded(http: aiohttp.ClientSession, url: str, timeout_s: float) -> list[str] | None:
    """The simulator's recorded request bodies; None on an engine without the record."""
    try:
        status, body, _ = await _get(http, join(url, "/sim/requests"), timeout_s)
    except (aiohttp.ClientError, TimeoutError):
        return None
    doc = _json(body) if status == 200 else None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        return None
    return [
        str(entry.get("body", ""))
        for entry in doc["requests"]
        if isinstance(entry, dict) and entry.get("path") == "/generate"
    ]


async def probe(
    http: aiohttp.ClientSession, router_url: str, engines: Sequence[str], timeout_s: float
) -> ProbeFacts:
    """A one-token ``/generate`` with a fresh session id through the router; then the
    engines' records are read and the probe session closed on every engine."""
    token = os.urandom(8).hex()
    session_id, rid = f"kvproxy-doctor-{token}", f"kvproxy-doctor-{token}"
    body = {
        "text": "kvproxy doctor probe",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "session_id": session_id,
        "rid": rid,
    }
    status: int | None = None
    error: str | None = None
    try:
        async with http.post(
            join(router_url, "/generate"),
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status = resp.status
            await _read(resp)
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = _describe(exc)
    records = await asyncio.gather(*(_recorded(http, u, timeout_s) for u in engines))

    async def close(url: str) -> None:
        try:
            async with http.post(
                join(url, "/close_session"),
                json={"session_id": session_id},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass

    await asyncio.gather(*(close(u) for u in engines))
    return ProbeFacts(
        session_id=session_id,
        rid=rid,
        status=status,
        error=error,
        recorded=dict(zip(engines, records, strict=True)),
    )


async def read_store(cfg: StateConfig, timeout_s: float) -> StoreFacts:
    """Ping the shared state store (``state.backend: redis``) and time it."""
    if cfg.backend != "redis":
        return StoreFacts(backend=cfg.backend)
    from kvproxy.state.redis_store import RedisStore, StoreUnavailable, password, redacted_url

    facts = StoreFacts(
        backend=cfg.backend,
        url=redacted_url(cfg.redis_url),
        password_env=cfg.redis_password_env,
        password_set=password(cfg) is not None,
    )
    try:
        store = RedisStore(cfg)
    except StoreUnavailable as exc:
        return dataclasses.replace(facts, error=str(exc))
    try:
        times: list[float] = []
        for _ in range(5):
            start = time.perf_counter()
            await asyncio.wait_for(store.ping(), timeout_s)
            times.append((time.perf_counter() - start) * 1000)
        info = await asyncio.wait_for(store.info("server"), timeout_s)
    except (StoreUnavailable, TimeoutError) as exc:
        return dataclasses.replace(facts, error=str(exc) or "timed out")
    finally:
        await store.close()
    return dataclasses.replace(
        facts, latency_ms=statistics.median(times), version=str(info.get("redis_version"))
    )
