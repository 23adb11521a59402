"""The admin plane in front of aiohttp handlers: the shell of :mod:`kvproxy.plane`
(Host and Origin) and :mod:`kvproxy.admin.auth` (the admin token)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvproxy.admin.auth import COOKIE_NAME, NEEDS_TOKEN, Access, allowed
from kvproxy.config import LiveConfig
from kvproxy.keys import CONFIG
from kvproxy.plane import plane_problem
from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.responses import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_allowed(live: LiveConfig, request: web.Request, access: Access) -> bool:
    server = live.config.server
    return allowed(
        access,
        token=server.admin_token,
        public_stats=server.public_stats,
        authorization=request.headers.get("Authorization"),
        cookie=request.cookies.get(COOKIE_NAME),
        now=time.time(),
        cookie_max_age_s=server.cookie_max_age_s,
    )


def guarded(access: Access, handler: Handler) -> Handler:
    """``handler`` behind the admin token for ``access`` (401 unauthorized otherwise)."""

    async def guard(request: web.Request) -> web.StreamResponse:
        if not is_allowed(request.app[CONFIG], request, access):
            return error_response(ErrorType.UNAUTHORIZED, NEEDS_TOKEN)
        return await handler(request)

    return guard


def refused_by_plane(request: web.Request, *, check_origin: bool = True) -> web.Response | None:
    """The answer to a request the admin plane refuses before reading its credentials:
    403 for a foreign Host or Origin, 400 for a malformed dashboard cookie."""
    server = request.app[CONFIG].config.server
    problem = plane_problem(
        method=request.method,
        host_header=request.host,
        origin=request.headers.get("Origin") if check_origin else None,
        scheme=request.scheme,
        bound_host=server.host,
        admin_hosts=server.admin_hosts,
        admin_origins=server.admin_origins,
    )
    if problem is not None:
        return error_response(ErrorType.FORBIDDEN, problem)
    cookie = request.cookies.get(COOKIE_NAME)
    if cookie is not None and (not cookie.isascii() or len(cookie) > 256):
        return error_response(ErrorType.INVALID_REQUEST, "malformed dashboard cookie")
    return None


def on_plane(handler: Handler, *, check_origin: bool = True) -> Handler:
    """``handler`` behind the admin plane's Host, Origin and cookie checks. The sign-in
    form skips the Origin check: a browser sends ``Origin: null`` from a page with
    ``Referrer-Policy: no-referrer``, and a sign-in changes nothing without the token."""

    async def checked(request: web.Request) -> web.StreamResponse:
        refused = refused_by_plane(request, check_origin=check_origin)
        if refused is not None:
            return refused
        return await handler(request)

    return checked
