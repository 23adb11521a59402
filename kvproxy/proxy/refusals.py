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


# A control endpoint's body: JSON, at most this many bytes.
MAX_CONTROL_BODY = 64 * 1024


def json_content_type(content_type: str | None, has_body: bool) -> bool:
    """Whether a control request's Content-Type is acceptable: a body must be
    ``application/json`` (parameters allowed); an empty one may say anything. A body of
    another type (``text/plain``, a form: what a cross-origin page can send without a
    preflight) is refused."""
    if not has_body:
        return True
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


async def json_body(request: web.Request) -> bytes:
    """A control endpoint's body, refused unless JSON (415) and small (413)."""
    content_type = request.headers.get("Content-Type")
    has_body = request.body_exists
    if not json_content_type(content_type, has_body):
        raise Refused(
            ErrorType.UNSUPPORTED_MEDIA_TYPE,
            f"control endpoint: the body must be application/json (got {content_type!r})",
        )
    if not has_body:
        return b""
    too_large = Refused(ErrorType.BODY_TOO_LARGE, f"control body over {MAX_CONTROL_BODY} bytes")
    if request.content_length is not None:
        if request.content_length > MAX_CONTROL_BODY:
            raise too_large
        return await request.read()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > MAX_CONTROL_BODY:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def refusal_response(exc: Refused) -> web.Response:
    """The JSON error response for ``exc``."""
    return error_response(exc.refusal.kind, exc.refusal.message)


__all__ = ["Refused", "json_body", "json_content_type", "refusal_response"]
