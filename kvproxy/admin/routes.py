"""The operator endpoints under ``/kvproxy/`` and ``/metrics``.

Health, stats and metrics read the features; reload and session close change it and
need the admin token when one is set (:mod:`kvproxy.admin.auth`). The dashboard's
own routes live in :mod:`kvproxy.admin.dashboard`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from kvproxy.admin import dashboard
from kvproxy.admin.auth import NEEDS_TOKEN, Access
from kvproxy.admin.guard import guarded, is_allowed, on_plane
from kvproxy.admin.health import health_doc
from kvproxy.admin.reload import reload_config
from kvproxy.admission.program.prefetch import tool_end_in_s
from kvproxy.config import ConfigError
from kvproxy.keys import ADMISSION, CONFIG, DYNAMO, REGISTRY, SESSIONS
from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.refusals import Refused, json_body, refusal_response
from kvproxy.proxy.responses import error_response
from kvproxy.sessions.listing import parse_limit

log = logging.getLogger(__name__)


def json_response(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    """The whole document with the token (or when none is set), else its status only:
    a probe needs no credential, and the fleet's URLs are not for everyone."""
    doc = health_doc(request.app)
    if is_allowed(request.app[CONFIG], request, Access.VIEW):
        return json_response(doc)
    return json_response({k: doc[k] for k in PUBLIC_HEALTH_KEYS})


# What GET /kvproxy/health shows without credentials when an admin token is set.
PUBLIC_HEALTH_KEYS = ("status", "router_reachable", "engines_known", "engines_healthy")


async def handle_stats(request: web.Request) -> web.Response:
    app = request.app
    live, sessions = app[CONFIG], app[SESSIONS]
    reset = request.query.get("reset", "").lower() in ("1", "true", "yes")
    # Reading is STATS access; closing the window changes state, so it is ADMIN.
    if not is_allowed(live, request, Access.ADMIN if reset else Access.STATS):
        return error_response(ErrorType.UNAUTHORIZED, NEEDS_TOKEN)
    stats: dict[str, float] = {}
    stats.update(sessions.stats(reset=reset))
    if live.config.session_lifecycle.enabled:
        stats.update(app[DYNAMO].stats(reset=reset))
    stats.update(app[ADMISSION].stats(reset=reset))
    return json_response(stats)


async def handle_metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=generate_latest(request.app[REGISTRY]),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def handle_reload(request: web.Request) -> web.Response:
    try:
        result = await reload_config(request.app)
    except ConfigError as exc:
        log.error("config reload rejected, keeping the running config: %s", exc)
        return error_response(
            ErrorType.INVALID_CONFIG, f"reload rejected, running config kept: {exc}"
        )
    return json_response(result)


async def handle_prefetch(request: web.Request) -> web.Response:
    """``POST /kvproxy/sessions/{session_id}/prefetch`` (body empty or ``{"in_s": s}``):
    the session's tool returns now or in ``in_s`` seconds; program admission plans its
    prefetch (docs/admission.md#prefetch-before-the-tool-returns). 202 with the plan,
    400 on a bad body or with prefetch off, 404 for a session it cannot plan for."""
    sid = request.match_info["session_id"]
    try:
        in_s = tool_end_in_s(await json_body(request))
    except Refused as refused:
        return refusal_response(refused)
    except ValueError as exc:
        return error_response(ErrorType.INVALID_REQUEST, str(exc))
    admission = request.app[ADMISSION]
    if not admission.prefetching:
        return error_response(
            ErrorType.INVALID_REQUEST,
            "prefetch is off (admission.prefetch: false, or program admission is not active)",
        )
    if not admission.expect_tool_end(sid, in_s):
        return error_response(
            ErrorType.SESSION_NOT_FOUND,
            f"session {sid!r}: not known to program admission, no answer yet, or a turn in flight",
        )
    return json_response({"session_id": sid, "in_s": in_s, "planned": True}, status=202)


async def handle_sessions(request: web.Request) -> web.Response:
    """``GET /kvproxy/sessions[?limit=N][&after=ID]``: one page of the session table,
    each session with its parent and children (docs/sessions.md, "Parent sessions");
    ``next`` is the ``after`` of the next page (None: the last page)."""
    try:
        limit = parse_limit(request.query.get("limit"))
    except ValueError:
        return error_response(ErrorType.INVALID_REQUEST, "limit must be an integer >= 1")
    after = request.query.get("after") or None
    return json_response(request.app[SESSIONS].listing(after=after, limit=limit))


def add_admin_routes(
    app: web.Application,
    close_session: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> None:
    """Register the operator endpoints (before the catch-all proxy route);
    ``close_session`` serves ``POST /kvproxy/sessions/{id}/close``."""
    app.router.add_get("/kvproxy/health", on_plane(handle_health))
    app.router.add_get("/kvproxy/stats", on_plane(handle_stats))
    app.router.add_get("/metrics", on_plane(guarded(Access.STATS, handle_metrics)))
    app.router.add_post("/kvproxy/config/reload", on_plane(guarded(Access.ADMIN, handle_reload)))
    app.router.add_get("/kvproxy/sessions", on_plane(guarded(Access.ADMIN, handle_sessions)))
    app.router.add_post(
        "/kvproxy/sessions/{session_id}/close",
        on_plane(guarded(Access.ADMIN, close_session)),
    )
    app.router.add_post(
        "/kvproxy/sessions/{session_id}/prefetch",
        on_plane(guarded(Access.ADMIN, handle_prefetch)),
    )
    dashboard.add_routes(app)
