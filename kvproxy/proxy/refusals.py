"""Refusals: a handler refuses a request by raising :class:`Refused`.

:class:`Refused` carries the pure pipeline's :class:`~kvproxy.proxy.pipeline.Refusal`
(an error type and message); the route that catches it answers
:func:`refusal_response`, the JSON error response. The proxy's catch-all route
(:meth:`kvproxy.proxy.handlers.ProxyHandlers.dispatch`) catches it and counts every
response once, by path and status, in ``kvproxy_requests_total``. This used to be an
aiohttp middleware; a middleware costs every request two more wrapped coroutine
frames (aiohttp adds its own current-app middleware next to it), so the routes that
raise :class:`Refused` catch it themselves.
"""

from __future__ import annotations

from aiohttp import web

from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.pipeline import Refusal
from kvproxy.proxy.responses import error_response


class Refused(Exception):
    """Raised by a handler: answer ``refusal`` (counted like any other response)."""

    def __init__(self, kind: ErrorType, message: str) -> None:
        super().__init__(message)
        self.refusal = Refusal(kind, message)

    @classmethod
    def of(cls, refusal: Refusal) -> Refused:
        return cls(refusal.kind, refusal.message)


def refusal_response(exc: Refused) -> web.Response:
    """The JSON error response for ``exc``."""
    return error_response(exc.refusal.kind, exc.refusal.message)


__all__ = ["Refused", "refusal_response"]
