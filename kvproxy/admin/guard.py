"""The admin token in front of aiohttp handlers: the shell of :mod:`kvproxy.admin.auth`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from kvproxy.admin.auth import COOKIE_NAME, NEEDS_TOKEN, Access, allowed
from kvproxy.config import LiveConfig
from kvproxy.keys import CONFIG
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
    )


def guarded(access: Access, handler: Handler) -> Handler:
    """``handler`` behind the admin token for ``access`` (401 unauthorized otherwise)."""

    async def guard(request: web.Request) -> web.StreamResponse:
        if not is_allowed(request.app[CONFIG], request, access):
            return error_response(ErrorType.UNAUTHORIZED, NEEDS_TOKEN)
        return await handler(request)

    return guard
