"""The HTTP client the control plane calls engines and the router with, as a protocol.

The server passes its pooled ``aiohttp.ClientSession``; the in-process lab passes a
stand-in that delivers the calls to its simulated engines. Only what the callers use
is named here: ``post`` (the fan-out of ``/close_session`` and ``/abort_request``,
:mod:`kvproxy.fleet.fanout`) and ``get`` (``/server_info`` and ``/metrics``), each an
``async with`` whose response gives its status and body.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import aiohttp


class EngineResponse(Protocol):
    """The part of ``aiohttp.ClientResponse`` the control plane reads."""

    @property
    def status(self) -> int: ...

    async def read(self) -> bytes: ...

    async def text(self, encoding: str | None = None, errors: str = "strict") -> str: ...

    def raise_for_status(self) -> None: ...


class EngineHttp(Protocol):
    """The part of ``aiohttp.ClientSession`` the control plane calls."""

    def post(
        self,
        url: str,
        *,
        data: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> AbstractAsyncContextManager[EngineResponse]: ...

    def get(
        self, url: str, *, timeout: aiohttp.ClientTimeout | None = None
    ) -> AbstractAsyncContextManager[EngineResponse]: ...


__all__ = ["EngineHttp", "EngineResponse"]
