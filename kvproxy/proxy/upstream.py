"""The one pooled client session to the router, and the payload of a body sent as parts.

Header hygiene for forwarding is :mod:`kvproxy.headers`."""

from __future__ import annotations

import aiohttp
import orjson

from kvproxy.config import RouterConfig


class PartsPayload(aiohttp.payload.Payload):
    """A request body sent as its parts, in order, never joined into one copy (a big
    body with fields spliced at its head: :func:`kvproxy.proxy.body.splice_parts`; one
    forwarded as received: :func:`kvproxy.proxy.body.unjoined`). Each part is handed to
    the connection's writer as it is. ``content_type`` is not sent: the client session
    skips the automatic header, and the client's own ``Content-Type`` is forwarded."""

    _value: tuple[bytes | memoryview, ...]

    def __init__(
        self, parts: tuple[bytes | memoryview, ...], content_type: str = "application/octet-stream"
    ) -> None:
        super().__init__(parts, content_type=content_type)
        self._size = sum(len(p) for p in parts)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        for part in self._value:
            await writer.write(part)

    async def write_with_length(
        self, writer: aiohttp.abc.AbstractStreamWriter, content_length: int | None
    ) -> None:
        if content_length is None:
            return await self.write(writer)
        left = content_length
        for part in self._value:
            if left <= 0:
                return
            await writer.write(part[:left] if len(part) > left else part)
            left -= len(part)


def client_timeout(cfg: RouterConfig) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=cfg.request_timeout_s or None,
        connect=cfg.connect_timeout_s,
        sock_read=cfg.read_timeout_s or None,
    )


def create_client_session(cfg: RouterConfig) -> aiohttp.ClientSession:
    """Keep-alive pool to the router. Bytes pass through untouched: no decompression,
    no cookie jar, no automatic headers beyond what the client sent."""
    connector = aiohttp.TCPConnector(
        limit=cfg.max_connections,
        limit_per_host=0,
        ttl_dns_cache=300,
        keepalive_timeout=30,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=client_timeout(cfg),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        json_serialize=lambda obj: orjson.dumps(obj).decode(),
    )
