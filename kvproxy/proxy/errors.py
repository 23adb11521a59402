"""Errors the proxy answers itself: one JSON shape, a stable ``type`` per cause.

``{"error": {"type": "<stable_type>", "message": "<human readable>"}}``. Clients and
dashboards match on ``type``; the message may change.

Pure (no aiohttp): the aiohttp response is built by
:func:`kvproxy.proxy.responses.error_response`.
"""

from __future__ import annotations

from enum import StrEnum

import orjson

# The response header naming the error type (also on the JSON body).
ERROR_HEADER = "X-KVProxy-Error"


class ErrorType(StrEnum):
    ROUTER_UNREACHABLE = "router_unreachable"  # 502
    ROUTER_TIMEOUT = "router_timeout"  # 504
    BODY_TOO_LARGE = "body_too_large"  # 413
    SHUTTING_DOWN = "shutting_down"  # 503
    INVALID_SESSION_ID = "invalid_session_id"  # 400
    SESSION_CLOSED = "session_closed"  # 409
    REQUEST_CANCELLED = "request_cancelled"  # 409
    INVALID_REQUEST = "invalid_request"  # 400
    INVALID_CONFIG = "invalid_config"  # 400
    UNAUTHORIZED = "unauthorized"  # 401
    SESSION_NOT_FOUND = "session_not_found"  # 404
    NOT_FOUND = "not_found"  # 404: a path kvproxy does not forward (router.forward_paths)
    INVALID_PATH = "invalid_path"  # 400: a path that is not canonical (kvproxy.proxy.paths)
    FORBIDDEN = "forbidden"  # 403: the session belongs to another credential
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # 415: a control body not JSON
    OVERLOADED = "overloaded"  # 503: kvproxy's connection or buffered-bytes budget is spent


STATUS: dict[ErrorType, int] = {
    ErrorType.ROUTER_UNREACHABLE: 502,
    ErrorType.ROUTER_TIMEOUT: 504,
    ErrorType.BODY_TOO_LARGE: 413,
    ErrorType.SHUTTING_DOWN: 503,
    ErrorType.INVALID_SESSION_ID: 400,
    ErrorType.SESSION_CLOSED: 409,
    ErrorType.REQUEST_CANCELLED: 409,
    ErrorType.INVALID_REQUEST: 400,
    ErrorType.INVALID_CONFIG: 400,
    ErrorType.UNAUTHORIZED: 401,
    ErrorType.SESSION_NOT_FOUND: 404,
    ErrorType.NOT_FOUND: 404,
    ErrorType.INVALID_PATH: 400,
    ErrorType.FORBIDDEN: 403,
    ErrorType.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorType.OVERLOADED: 503,
}


def error_body(kind: ErrorType, message: str) -> bytes:
    return orjson.dumps({"error": {"type": kind.value, "message": message}})
