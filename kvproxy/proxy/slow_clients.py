"""Bound slow clients in the server layer: a request head and body must arrive in time.

aiohttp's server has no such bound: a client that sends its request head one byte at a
time keeps its connection (and a file descriptor) until the keep-alive timeout, which
aiohttp re-arms only between requests. Here each connection's protocol object
(:class:`GuardedRequestHandler`, aiohttp's ``RequestHandler`` with two timers) enforces:

* **header**: the request head must be complete within ``header_read_timeout_s``,
  counted from the connection's start (first request) or from the first byte of a
  later request on a keep-alive connection. Past it the client gets
  ``408 Request Timeout`` and the connection is closed.
* **body**: the request body must have arrived in full within ``body_read_timeout_s``
  of the head's end. Past it the connection is closed (the handler reading the body
  sees the disconnect and cancels its upstream call).

Idle keep-alive connections stay governed by aiohttp's keep-alive timeout. A value of 0
disables a bound. Every drop is counted (``on_drop``) and logged, at most one line per
``log_interval_s`` with the number of drops since the previous line.

The limits are read when a phase starts (``limits()``), so a config reload applies to
the next request. :class:`GuardedAppRunner` is ``web.AppRunner`` building connections
with this handler; :func:`run_guarded_app` is ``web.run_app`` on top of it.

aiohttp internals relied on (pinned by tests/integration/test_slow_clients.py): the
``RequestHandler._messages`` queue that ``data_received`` appends parsed requests to,
and ``AppRunner._make_server`` / ``Server._kwargs`` to build the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("kvproxy.server")

PHASE_HEADER = "header"
PHASE_BODY = "body"
_TIMEOUT_KEYS = {
    PHASE_HEADER: "server.header_read_timeout_s",
    PHASE_BODY: "server.body_read_timeout_s",
}
_DESCRIPTIONS = {PHASE_HEADER: "request head", PHASE_BODY: "request body"}
_OVERLOADED_BODY = (
    b'{"error":{"type":"overloaded","message":"too many open connections '
    b'(server.max_connections)"}}'
)
_RESPONSE_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
    b"Content-Type: application/json\r\nX-KVProxy-Error: overloaded\r\nRetry-After: 1\r\n"
    + f"Content-Length: {len(_OVERLOADED_BODY)}\r\n\r\n".encode()
    + _OVERLOADED_BODY
)
_RESPONSE_408 = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 34\r\n\r\nrequest head not received in time\n"
)

OnDrop = Callable[[str], None]
Limits = Callable[[], tuple[float, float]]


class RateLimitedLog:
    """At most one log line per ``interval_s``, saying how many events it stands for.

    Pure apart from the logger call; ``now`` is injected for tests."""

    __slots__ = ("_last", "_now", "_suppressed", "interval_s", "logger")

    def __init__(
        self,
        interval_s: float = 10.0,
        *,
        logger: logging.Logger = log,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.logger = logger
        self._now = now
        self._last: float | None = None
        self._suppressed = 0

    def event(self, message: str, *args: Any) -> bool:
        """Log ``message`` unless a line went out less than ``interval_s`` ago."""
        now = self._now()
        if self._last is not None and now - self._last < self.interval_s:
            self._suppressed += 1
            return False
        extra = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        self.logger.warning(message + extra, *args)
        self._last = now
        self._suppressed = 0
        return True


class SlowClientGuard:
    """What the handlers share: the limits, the drop callback, the rate-limited log,
    and the count of open connections against ``max_connections()`` (0: no bound)."""

    __slots__ = ("_log", "_over_log", "limits", "max_connections", "on_drop", "on_refuse", "open")

    def __init__(
        self,
        limits: Limits,
        *,
        on_drop: OnDrop | None = None,
        log_interval_s: float = 10.0,
        now: Callable[[], float] = time.monotonic,
        max_connections: Callable[[], int] = lambda: 0,
        on_refuse: Callable[[], None] | None = None,
    ) -> None:
        self.limits = limits
        self.on_drop = on_drop
        self.on_refuse = on_refuse
        self.max_connections = max_connections
        self.open = 0
        self._log = RateLimitedLog(log_interval_s, now=now)
        self._over_log = RateLimitedLog(log_interval_s, now=now)

    def admit_connection(self) -> bool:
        """Count a new connection; False (not counted) past ``max_connections()``."""
        bound = self.max_connections()
        if bound and self.open >= bound:
            if self.on_refuse is not None:
                self.on_refuse()
            self._over_log.event(
                "refused a connection: %d open, server.max_connections is %d", self.open, bound
            )
            return False
        self.open += 1
        return True

    def timeout(self, phase: str) -> float:
        header, body = self.limits()
        return header if phase == PHASE_HEADER else body

    def dropped(self, phase: str, peer: Any, timeout: float) -> None:
        if self.on_drop is not None:
            self.on_drop(phase)
        self._log.event(
            "dropped slow client %s: %s not complete after %.1f s (%s)",
            _peer(peer),
            _DESCRIPTIONS[phase],
            timeout,
            _TIMEOUT_KEYS[phase],
        )


def _peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "?"


class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol with a header and a body deadline."""

    def __init__(self, manager: web.Server, *, guard: SlowClientGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._body: StreamReader | None = None
        self._counted = False  # this connection counts against server.max_connections

    # -- timers ----------------------------------------------------------------------
    def _arm(self, phase: str) -> None:
        self._disarm()
        timeout = self._guard.timeout(phase)
        if timeout <= 0:
            return
        self._phase = phase
        self._deadline = self._loop.call_later(timeout, self._expired, phase, timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = None

    def _body_done(self) -> None:
        if self._phase == PHASE_BODY:
            self._disarm()
        self._body = None

    def _expired(self, phase: str, timeout: float) -> None:
        self._deadline = None
        self._phase = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        self._guard.dropped(phase, peer, timeout)
        if phase == PHASE_HEADER:
            with contextlib.suppress(Exception):
                transport.write(_RESPONSE_408)
            transport.close()
        else:
            transport.abort()

    # -- protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._guard.admit_connection():
            # Past the budget: answered at once, before anything is read or parsed.
            with contextlib.suppress(Exception):
                transport.write(_RESPONSE_503)  # type: ignore[attr-defined]
            transport.close()
            return
        self._counted = True
        self._arm(PHASE_HEADER)  # the first request's head is due from the start

    def data_received(self, data: bytes) -> None:
        in_body = self._phase == PHASE_BODY
        queued = len(self._messages)
        super().data_received(data)
        if self.transport is None:
            return
        if len(self._messages) > queued:  # a request head was parsed
            payload = self._messages[-1][1]
            if isinstance(payload, StreamReader) and not payload.is_eof():
                self._arm(PHASE_BODY)
                self._body = payload
                payload.on_eof(self._body_done)
            else:
                self._disarm()
        elif data and self._phase is None and not in_body and self._body is None:
            # The first bytes of a keep-alive request's head. Only real bytes: aiohttp
            # (3.14: web_protocol._resume_reading_if_drained, base_protocol.resume_reading)
            # calls data_received(b"") to reparse buffered input while a request is being
            # handled; arming then answered 408 to any request slower than the bound.
            self._arm(PHASE_HEADER)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._body = None
        if self._counted:
            self._counted = False
            self._guard.open -= 1
        super().connection_lost(exc)


class GuardedServer(web.Server):
    """``web.Server`` whose connections are :class:`GuardedRequestHandler`."""

    def __init__(self, *args: Any, guard: SlowClientGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` serving ``app`` through a :class:`GuardedServer`."""

    def __init__(self, app: web.Application, *, guard: SlowClientGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # app start-up, freeze, handler kwargs
        return GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            guard=self.guard,
            **plain._kwargs,
        )


async def _serve_forever(
    runner: GuardedAppRunner,
    host: str,
    port: int,
    backlog: int,
    ready: Callable[[], None] | None,
    reuse_port: bool = False,
) -> None:
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=backlog, reuse_port=reuse_port or None)
    await site.start()
    if ready is not None:
        ready()
    try:
        await asyncio.Event().wait()  # until SIGINT / SIGTERM (GracefulExit) or cancellation
    finally:
        await runner.cleanup()


def run_guarded_app(
    app: web.Application,
    *,
    guard: SlowClientGuard,
    host: str,
    port: int,
    backlog: int = 128,
    shutdown_timeout: float = 60.0,
    keepalive_timeout: float = 75.0,
    loop: asyncio.AbstractEventLoop | None = None,
    ready: Callable[[], None] | None = None,
    reuse_port: bool = False,
) -> None:
    """``web.run_app`` with :class:`GuardedAppRunner`: serve until SIGINT / SIGTERM.
    ``reuse_port``: SO_REUSEPORT, so that several worker processes share the port."""
    runner = GuardedAppRunner(
        app,
        guard=guard,
        handle_signals=True,
        access_log=None,
        keepalive_timeout=keepalive_timeout,
        shutdown_timeout=shutdown_timeout,
        handler_cancellation=True,
    )
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve_forever(runner, host, port, backlog, ready, reuse_port))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError, web.GracefulExit):
            loop.run_until_complete(main)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)


__all__ = [
    "PHASE_BODY",
    "PHASE_HEADER",
    "GuardedAppRunner",
    "GuardedRequestHandler",
    "GuardedServer",
    "RateLimitedLog",
    "SlowClientGuard",
    "run_guarded_app",
]
