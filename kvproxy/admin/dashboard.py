"""``GET /kvproxy/dashboard``: a live page of the fleet, the admission queue and the
sessions, served from the package with nothing to install or fetch.

- The page (``static/``) is plain HTML, CSS and JavaScript drawing SVG charts; its
  Content-Security-Policy allows this origin only, so it works air-gapped and never
  loads anything from elsewhere.
- ``GET /kvproxy/dashboard/data?since=SEQ`` returns the current health, banners and
  effective config, plus the timeline samples newer than ``SEQ``; the page polls it.
- A background task samples the runtime into a bounded :class:`Timeline` once per
  :data:`TICK_S`, so a page opened mid-rollout shows the last minutes at once.
- With ``server.admin_token`` set, the page and its data need the token: a browser
  enters it once on a sign-in page and gets a cookie (:mod:`kvproxy.admin.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from kvproxy import __version__
from kvproxy.admin.auth import COOKIE_NAME, Access, SignInLimiter, cookie_value, token_matches
from kvproxy.admin.guard import guarded, is_allowed, on_plane
from kvproxy.admin.health import health_doc
from kvproxy.admin.timeline import Reading, Timeline
from kvproxy.admin.views import (
    PROXY_ANSWERED,
    PROXY_UPSTREAM_FAILURES,
    RATE_SERIES,
    RATIO_SERIES,
    banners,
    config_view,
)
from kvproxy.admission.coordinator import AdmissionController
from kvproxy.keys import ADMISSION, CONFIG, PROXY_METRICS, SESSIONS
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.sessions.lifecycle import SessionManager

log = logging.getLogger(__name__)

TICK_S = 1.0  # one sample per second
HISTORY = 900  # samples kept: the last 15 minutes
_MAX_TOKEN_FORM_BYTES = 4096

# Same origin only: the page loads nothing from elsewhere and cannot be framed.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_ASSET_TYPES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}


@functools.cache
def _static(name: str) -> str:
    return resources.files("kvproxy.admin").joinpath("static", name).read_text("utf-8")


# ------------------------------------------------------------------ sampling
def read_features(
    admission: AdmissionController, sessions_: SessionManager, metrics: ProxyMetrics
) -> Reading:
    """One reading of the counters and gauges the dashboard plots."""
    ledger = admission.ledger
    counters: dict[str, float] = {
        **admission.totals(),
        **sessions_.totals(),
        PROXY_ANSWERED: float(metrics.answered),
        PROXY_UPSTREAM_FAILURES: float(metrics.upstream_failures),
    }
    sessions = sessions_.health()
    health = admission.health()
    gauges = {
        "waiting": float(health.waiting),
        "waiting_new": float(health.waiting_new),
        "waiting_continuing": float(health.waiting_continuing),
        "oldest_wait_s": admission.oldest_wait_s(),
        "ceiling": float(ledger.ceiling),
        "committed": float(ledger.committed),
        "reserved": float(ledger.reserved),
        "resident": float(ledger.resident_total),
        "sessions_open": float(sessions.open),
        "sessions_closing": float(sessions.closing),
    }
    engines = {e.url: e.token_usage for e in health.engines}
    return Reading(counters=counters, gauges=gauges, engines=engines)


def new_timeline() -> Timeline:
    return Timeline(HISTORY, rates=RATE_SERIES, ratios=RATIO_SERIES, origin=uuid.uuid4().hex[:12])


# The dashboard's recent history: its own resource, owned by :func:`timeline_ctx`.
TIMELINE = web.AppKey("timeline", Timeline)
# Failed sign-ins per client address, and their log (one line a minute at most).
SIGN_IN = web.AppKey("sign_in", SignInLimiter)


async def timeline_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: sample the features into ``app[TIMELINE]`` every :data:`TICK_S`."""
    admission, sessions, metrics = app[ADMISSION], app[SESSIONS], app[PROXY_METRICS]
    timeline = app[TIMELINE] = new_timeline()

    async def sample_forever() -> None:
        while True:
            try:
                timeline.record(
                    time.monotonic(), time.time(), read_features(admission, sessions, metrics)
                )
            except Exception:  # a bad reading must not end the sampler
                log.exception("dashboard sampling failed")
            await asyncio.sleep(TICK_S)

    task = asyncio.create_task(sample_forever(), name="kvproxy-dashboard-sampler")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# -------------------------------------------------------------------- routes
def data_doc(app: web.Application, timeline: Timeline, since: int) -> dict[str, Any]:
    health = health_doc(app)
    return {
        "version": __version__,
        "tick_s": TICK_S,
        "history": HISTORY,
        "health": health,
        "banners": banners(health),
        "config": config_view(app[CONFIG].config),
        "timeline": timeline.origin,
        "last_seq": timeline.last_seq,
        "samples": timeline.since(since),
    }


async def handle_data(request: web.Request) -> web.Response:
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        since = 0
    return web.Response(
        body=orjson.dumps(data_doc(request.app, request.app[TIMELINE], since)),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _page(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", headers=_PAGE_HEADERS)


def _sign_in_page(message: str, status: int) -> web.Response:
    return _page(_static("sign-in.html").replace("{{message}}", message), status)


async def handle_page(request: web.Request) -> web.Response:
    if not is_allowed(request.app[CONFIG], request, Access.VIEW):
        return _sign_in_page("This kvproxy has an admin token: enter it to see the dashboard.", 401)
    return _page(_static("dashboard.html"))


async def handle_sign_in(request: web.Request) -> web.Response:
    """The sign-in form's POST: a matching token gets the dashboard cookie. Failed
    attempts are bounded per client address (server.sign_in_attempts_per_minute)."""
    server = request.app[CONFIG].config.server
    token = server.admin_token
    if token is None:
        raise web.HTTPSeeOther("/kvproxy/dashboard")
    limiter, client, now = request.app[SIGN_IN], request.remote or "?", time.monotonic()
    if limiter.blocked(client, now, server.sign_in_attempts_per_minute):
        return _sign_in_page("Too many wrong tokens: wait a minute.", 429)
    # Browsers send a form with its length; a chunked or oversized body is refused
    # before it is read (request.post() would read up to server.max_body_bytes).
    if request.content_length is None or request.content_length > _MAX_TOKEN_FORM_BYTES:
        return _sign_in_page("That token is far too long.", 400)
    form = await request.post()
    submitted = form.get("token")
    if not isinstance(submitted, str) or not token_matches(token, submitted.strip()):
        limiter.failed(client, now)
        if limiter.log_due(now):
            log.warning(
                "dashboard sign-in: %d wrong token(s) since the last such line, the latest from %s",
                limiter.unlogged,
                client,
            )
            limiter.unlogged = 0
        return _sign_in_page("Wrong token.", 401)
    response = web.HTTPSeeOther("/kvproxy/dashboard")
    response.set_cookie(
        COOKIE_NAME,
        cookie_value(token),
        path="/kvproxy/",
        httponly=True,
        samesite="Strict",
        secure=request.secure if server.cookie_secure is None else server.cookie_secure,
        max_age=server.cookie_max_age_s,
    )
    raise response


async def handle_asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    content_type = _ASSET_TYPES.get(name)
    if content_type is None:
        raise web.HTTPNotFound()
    return web.Response(
        text=_static(name),
        content_type=content_type,
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
    )


def add_routes(app: web.Application) -> None:
    app[SIGN_IN] = SignInLimiter()
    app.router.add_get("/kvproxy/dashboard", on_plane(handle_page))
    app.router.add_get("/kvproxy/dashboard/data", on_plane(guarded(Access.VIEW, handle_data)))
    app.router.add_post("/kvproxy/dashboard/sign-in", on_plane(handle_sign_in, check_origin=False))
    app.router.add_get("/kvproxy/dashboard/static/{name}", on_plane(handle_asset))
