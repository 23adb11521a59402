"""The least a Python HTTP hop costs: a forwarder on asyncio Protocols (uvloop), with no
HTTP framework.

A benchmark reference (target ``raw``), not kvproxy and not a general proxy. It frames
what an HTTP/1.1 proxy must frame and nothing more: each request's head and
``Content-Length`` body (what the benchmark sends; no chunked requests, no
``Expect``), each response by ``Content-Length`` or chunked encoding, relayed as its
bytes arrive (so streams keep their timing). Every client connection gets one upstream
keep-alive connection and its requests are relayed in order, one at a time. Headers are
forwarded as received: no hop-by-hop hygiene, no ``X-Forwarded-For``. Against the
aiohttp forwarder (``floor``) it says how much of a hop is the framework's.

The framing is pure (:func:`request_length`, :class:`ResponseEnd`); the protocols only
move bytes.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from typing import cast

_CRLF = b"\r\n"
_HEAD_END = b"\r\n\r\n"
_CONTENT_LENGTH = b"\r\ncontent-length:"
_CHUNKED = b"\r\ntransfer-encoding: chunked"


def request_length(buf: bytes | bytearray) -> int | None:
    """The length of the complete request at the start of ``buf`` (its head and its
    ``Content-Length`` body), or None while its head is incomplete."""
    end = buf.find(_HEAD_END)
    if end < 0:
        return None
    return end + 4 + _content_length(bytes(buf[: end + 2]).lower())


def _content_length(head: bytes) -> int:
    """``Content-Length`` of a lower-cased head (its last CRLF kept), else 0."""
    i = head.find(_CONTENT_LENGTH)
    if i < 0:
        return 0
    start = i + len(_CONTENT_LENGTH)
    return int(head[start : head.find(_CRLF, start)])


_HEAD, _BODY, _SIZE, _DATA, _TRAILER = range(5)  # where ResponseEnd is in a response


class ResponseEnd:
    """Where a response ends, found as its bytes arrive (no 1xx, 204 or 304 answers,
    no answers to HEAD: the benchmark's upstream sends none). :meth:`feed` each piece:
    it returns how many bytes of the piece complete the response, or None while the
    response goes on past the piece."""

    __slots__ = ("_left", "_line", "_state")

    def __init__(self) -> None:
        self._state = _HEAD
        self._line = b""  # the head or chunk line read so far, not yet complete
        self._left = 0  # body bytes, or chunk bytes and their CRLF, still to come

    def feed(self, data: bytes) -> int | None:
        pos = 0
        while True:
            if self._state in (_BODY, _DATA):
                take = min(self._left, len(data) - pos)
                pos += take
                self._left -= take
                if self._left:
                    return None
                if self._state == _BODY:
                    return self._done(pos)
                self._state = _SIZE
                continue
            # The head ends at an empty line; a chunk size or a trailer at a CRLF.
            seen = self._line + data[pos:]
            delimiter = _HEAD_END if self._state == _HEAD else _CRLF
            end = seen.find(delimiter)
            if end < 0:
                self._line = seen
                return None
            pos += end + len(delimiter) - len(self._line)
            self._line = b""
            if self._state == _HEAD:
                head = seen[: end + 2].lower()
                if _CHUNKED in head:
                    self._state = _SIZE
                else:
                    self._state, self._left = _BODY, _content_length(head)
            elif self._state == _SIZE:
                size = int(seen[:end].split(b";", 1)[0], 16)
                self._state, self._left = (_DATA, size + 2) if size else (_TRAILER, 0)
            elif end == 0:  # the empty line that ends the trailers
                return self._done(pos)

    def _done(self, used: int) -> int:
        self._state, self._line, self._left = _HEAD, b"", 0
        return used


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client = client
        self.end = ResponseEnd()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        client = self.client
        while data:
            used = self.end.feed(data)
            if used is None:
                client.send(data)
                return
            client.send(data[:used])
            client.answered()
            data = data[used:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost()


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.buf = bytearray()
        self.queue: deque[bytes] = deque()
        self.busy = False
        self.upstream: _Upstream | None = None
        self.connecting: asyncio.Future[None] | None = None  # the upstream's connection
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (n := request_length(self.buf)) is not None and len(self.buf) >= n:
            self.queue.append(bytes(self.buf[:n]))
            del self.buf[:n]
        self._next()

    def _next(self) -> None:
        if self.busy or not self.queue:
            return
        self.busy = True
        request = self.queue.popleft()
        up = self.upstream
        if up is not None and up.transport is not None:
            up.transport.write(request)
        else:
            self.connecting = asyncio.ensure_future(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: _Upstream(self), self.host, self.port)
        except OSError:
            self.close()
            return
        assert up.transport is not None
        if self.transport is None:  # the client left while it connected
            up.transport.close()
            return
        self.upstream = up
        up.transport.write(request)

    def send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def answered(self) -> None:
        self.busy = False
        self._next()

    def upstream_lost(self) -> None:
        self.upstream = None
        if self.busy:  # the answer was cut off: so is the client
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        up = self.upstream
        if up is not None and up.transport is not None:
            up.transport.close()


def forwarder_factory(upstream: str) -> Callable[[], asyncio.Protocol]:
    """The protocol factory of a raw forwarder in front of ``upstream`` (``http://host:port``),
    for ``loop.create_server``."""
    host, _, port = upstream.removeprefix("http://").rstrip("/").rpartition(":")
    return functools.partial(_Client, host, int(port))


def serve_raw(host: str, port: int, upstream: str) -> int:
    """Serve the raw forwarder on ``host:port`` in front of ``upstream`` until stopped."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(forwarder_factory(upstream), host, port, backlog=4096)
        await server.serve_forever()

    uvloop.run(main())
    return 0
