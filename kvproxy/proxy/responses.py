"""aiohttp responses for the errors the proxy answers itself (the shell of :mod:`.errors`)."""

from __future__ import annotations

from aiohttp import web

from kvproxy.proxy.errors import ERROR_HEADER, STATUS, ErrorType, error_body


def error_response(kind: ErrorType, message: str) -> web.Response:
    """``kind``'s status, the JSON error body and the ``X-KVProxy-Error`` header."""
    return web.Response(
        status=STATUS[kind],
        body=error_body(kind, message),
        content_type="application/json",
        headers={ERROR_HEADER: kind.value},
    )
