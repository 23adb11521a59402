"""Helpers the unit and integration suites share (plain functions, import them)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@contextmanager
def script_module(name: str, *also: str) -> Iterator[ModuleType]:
    """``scripts/<name>.py`` imported as module ``name``, registered in ``sys.modules``
    while in use (dataclasses look their module up there); afterwards it and the modules
    named in ``also`` (ones the script registers itself) are unregistered."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for registered in (name, *also):
            sys.modules.pop(registered, None)


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
