"""Fixtures shared by the unit and integration suites (helpers live in tests/helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

# Every client request a test makes is bounded in time.
HTTP_TIMEOUT_S = 30.0


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """One pooled client session per test, each request bounded by HTTP_TIMEOUT_S."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    ) as session:
        yield session
