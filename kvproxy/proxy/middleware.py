"""The one middleware of the proxy routes: response counting and error mapping.

A handler refuses a request by raising :class:`Refused` (the pure pipeline's
:class:`~kvproxy.proxy.pipeline.Refusal`, or an error type and message); the
middleware turns it into the JSON error response. Every response of a request whose
handler named a counted path (:func:`count_as`) is counted once, by that path and
its status, in ``kvproxy_requests_total``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.proxy.pipeline import Refusal
from kvproxy.proxy.responses import error_response

COUNTED_PATH = web.RequestKey("kvproxy_counted_path", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Refused(Exception):
    """Raised by a handler: answer ``refusal`` (counted like any other response)."""

    def __init__(self, kind: ErrorType, message: str) -> None:
        super().__init__(message)
        self.refusal = Refusal(kind, message)

    @classmethod
    def of(cls, refusal: Refusal) -> Refused:
        return cls(refusal.kind, refusal.message)


def count_as(request: web.Request, path: str) -> None:
    """Count this request's response under ``path`` (the path after ``/sessions/{id}``)."""
    request[COUNTED_PATH] = path


class CountingMiddleware:
    """Maps :class:`Refused` to its error response; counts responses by path and status."""

    __slots__ = ("_metrics",)
    # What ``@web.middleware`` marks: a new-style (request, handler) middleware.
    __middleware_version__ = 1

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except Refused as exc:
            response = error_response(exc.refusal.kind, exc.refusal.message)
        path = request.get(COUNTED_PATH)
        if path is not None:
            self._metrics.count(path, response.status)
        return response


__all__ = ["COUNTED_PATH", "CountingMiddleware", "Refused", "count_as"]
