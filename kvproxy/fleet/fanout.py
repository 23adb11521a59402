"""POST one JSON payload to every engine, in parallel, under one deadline.

The router does not proxy ``/abort_request``, ``/open_session`` or ``/close_session``
(it answers 404), so kvproxy sends them to each engine base URL itself. SGLang
answers both with 200 and an empty body whether or not the rid / session exists, so
a 2xx only says that the engine received the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvproxy.fleet.client import EngineHttp
from kvproxy.urls import unique_base_urls

_ERROR_BODY_CHARS = 200


@dataclass(slots=True)
class FanoutResult:
    ok: list[str] = field(default_factory=list)
    # url -> error text ("HTTP 500: ...", "timeout after 2.0 s", "ClientConnectorError: ...")
    failed: dict[str, str] = field(default_factory=dict)


_dedupe = unique_base_urls


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


async def _post_one(
    http: EngineHttp,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    client_timeout: aiohttp.ClientTimeout,
) -> str | None:
    """None on a 2xx answer, else the error text."""
    try:
        async with http.post(url, data=body, headers=headers, timeout=client_timeout) as resp:
            payload = await resp.read()
            if 200 <= resp.status < 300:
                return None
            snippet = payload[:_ERROR_BODY_CHARS].decode("utf-8", "replace").strip()
            return f"HTTP {resp.status}" + (f": {snippet}" if snippet else "")
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return f"timeout after {client_timeout.total} s"
    except Exception as exc:  # connection refused, DNS, payload errors, ...
        return _describe(exc)


async def _bounded(limit: asyncio.Semaphore | None, post: Awaitable[str | None]) -> str | None:
    if limit is None:
        return await post
    async with limit:
        return await post


async def post_to_all(
    http: EngineHttp,
    urls: Sequence[str],
    path: str,
    payload: Mapping[str, Any],
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    limit: asyncio.Semaphore | None = None,
) -> FanoutResult:
    """POST ``payload`` as JSON to ``{url}{path}`` for every url, in parallel (at most
    ``limit``'s value at once, shared by every fan-out holding the same semaphore).

    URLs are deduplicated (a trailing ``/`` is ignored). The whole fan-out ends by
    ``timeout_s``: engines that have not answered by then are cancelled and reported
    as failed. Never raises (except ``CancelledError`` when the caller is cancelled,
    after cancelling the outstanding POSTs).
    """
    result = FanoutResult()
    targets = _dedupe(urls)
    if not targets:
        return result
    body = orjson.dumps(payload)
    all_headers = {"Content-Type": "application/json"}
    if headers:
        all_headers.update(headers)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    tasks = {
        url: asyncio.create_task(
            _bounded(limit, _post_one(http, url + path, body, all_headers, timeout))
        )
        for url in targets
    }
    try:
        _, pending = await asyncio.wait(tasks.values(), timeout=timeout_s)
    finally:
        outstanding = [t for t in tasks.values() if not t.done()]
        for task in outstanding:
            task.cancel()
        if outstanding:
            await asyncio.gather(*outstanding, return_exceptions=True)
    for url, task in tasks.items():
        if task in pending or task.cancelled():
            result.failed[url] = f"timeout after {timeout_s} s"
            continue
        exc = task.exception()
        error = _describe(exc) if exc is not None else task.result()
        if error is None:
            result.ok.append(url)
        else:
            result.failed[url] = error
    return result
