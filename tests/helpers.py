"""Helpers the unit and integration suites share (plain functions, import them)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any


def seq(start: int, n: int) -> list[int]:
    """``n`` consecutive token ids from ``start``."""
    return list(range(start, start + n))


def new_marker() -> str:
    """A unique string a test tags its requests with, to find them among others'."""
    return uuid.uuid4().hex


def header_of(entry: Mapping[str, Any], name: str) -> str | None:
    """Header ``name`` (case-insensitive) of a request the simulator recorded."""
    for key, value in entry["headers"].items():
        if key.lower() == name.lower():
            return str(value)
    return None


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` (bounded in time and count) until it holds."""
    deadline = time.monotonic() + timeout_s
    for _ in range(10_000):
        if await predicate():
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
