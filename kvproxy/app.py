"""The application factory: one place that wires config, state, tasks and routes.

State lives on the application under typed ``web.AppKey`` keys (no module globals).
Long-lived resources are ``cleanup_ctx`` contexts, entered in order at start-up and
left in reverse at shutdown: the pooled client session, then the fleet refresher,
then the session manager, then the admission coordinator.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from kvproxy import __version__
from kvproxy.admission.coordinator import AdmissionController
from kvproxy.config import (
    Config,
    ConfigError,
    apply_overrides,
    load_config,
)
from kvproxy.fleet.registry import Fleet, legacy_warning
from kvproxy.proxy.dashboard import DASHBOARD_HTML
from kvproxy.proxy.errors import ErrorType, error_response
from kvproxy.proxy.handlers import INTERCEPTED_PATHS, ProxyHandlers
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.proxy.upstream import create_client_session
from kvproxy.runtime import RUNTIME, Runtime
from kvproxy.sessions.lifecycle import SessionManager

log = logging.getLogger(__name__)

# Keys whose change needs a restart; everything else applies on reload.
RESTART_ONLY = (
    "server.host",
    "server.port",
    "server.max_body_bytes",
    "server.backlog",
    "router.url",
    "router.max_connections",
)


class _FeatureCollector(Collector):
    """Exposes the features' own collectors through the app's registry."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt

    def collect(self) -> Iterable[Any]:
        yield from self._rt.sessions.collect()
        yield from self._rt.admission.collect()


# ----------------------------------------------------------------------- contexts
async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.http = create_client_session(rt.config.router)
    yield
    await rt.http.close()


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.fleet = Fleet(rt.config.router, rt.http)
    await rt.fleet.start()
    warning = legacy_warning(rt.fleet, rt.config.session_lifecycle.enabled)
    if warning:
        log.warning("%s", warning)
    yield
    await rt.fleet.stop()


async def _sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.sessions = SessionManager(
        rt.config.session_lifecycle,
        all_engines=rt.fleet.all_engines,
        http=rt.http,
        # A closed session's KV is no longer resident: admission stops counting it.
        on_closed=lambda session_id: rt.admission.end_session(session_id),
    )
    await rt.sessions.start()
    yield
    await rt.sessions.stop()


async def _admission_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.admission = AdmissionController(
        rt.config.admission, healthy_engines=rt.fleet.healthy_engines, http=rt.http
    )
    await rt.admission.start()
    rt.registry.register(_FeatureCollector(rt))
    yield
    await rt.admission.stop()


async def _on_shutdown(app: web.Application) -> None:
    app[RUNTIME].shutting_down = True


# ------------------------------------------------------------------ admin routes
def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def _authorised(rt: Runtime, request: web.Request) -> bool:
    token = rt.config.server.admin_token
    return token is None or request.headers.get("Authorization") == f"Bearer {token}"


def health_doc(rt: Runtime) -> dict[str, Any]:
    cfg = rt.config
    fleet = rt.fleet.health()
    warnings: list[str] = []
    legacy = legacy_warning(rt.fleet, cfg.session_lifecycle.enabled)
    if legacy:
        warnings.append(legacy)
    sessions = rt.sessions.health()
    warnings.extend(sessions.get("warnings", []))
    admission = rt.admission.health()
    if fleet["router_reachable"] is False:
        status = "router_unreachable"
    elif cfg.admission.enabled and admission.get("degraded"):
        status = "degraded"
    else:
        status = "ok"
    return {
        "status": status,
        "version": __version__,
        "router_reachable": fleet["router_reachable"],
        "engines_known": fleet["engines_known"],
        "engines_healthy": fleet["engines_healthy"],
        "features": {
            "session_lifecycle": cfg.session_lifecycle.enabled,
            "admission": cfg.admission.enabled,
        },
        "warnings": warnings,
        "fleet": fleet,
        "sessions": sessions,
        "admission": admission,
        "config_source": cfg.source,
        "reloads": rt.reloads,
    }


async def handle_health(request: web.Request) -> web.Response:
    return _json(health_doc(request.app[RUNTIME]))


async def handle_stats(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    reset = request.query.get("reset", "").lower() in ("1", "true", "yes")
    stats: dict[str, float] = {}
    stats.update(rt.sessions.stats(reset=reset))
    stats.update(rt.admission.stats(reset=reset))
    return _json(stats)


async def handle_metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    return web.Response(
        body=generate_latest(rt.registry),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def handle_dashboard(request: web.Request) -> web.Response:
    return web.Response(text=DASHBOARD_HTML, content_type="text/html")


def _changed_keys(old: Config, new: Config) -> list[str]:
    changed = []
    for section in ("server", "router", "session_lifecycle", "admission"):
        a, b = getattr(old, section), getattr(new, section)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                changed.append(f"{section}.{f.name}")
    return changed


async def reload_config(rt: Runtime) -> dict[str, Any]:
    """Re-read the YAML (CLI overrides re-applied) and apply it. Raises ConfigError."""
    if rt.config.source is None:
        raise ConfigError("no config file to reload (kvproxy was started without --config)")
    new = apply_overrides(load_config(rt.config.source), rt.overrides)
    changed = _changed_keys(rt.config, new)
    pending = [k for k in changed if k in RESTART_ONLY]
    # Keep restart-only values as they are running now.
    new = dataclasses.replace(
        new,
        server=dataclasses.replace(
            new.server,
            host=rt.config.server.host,
            port=rt.config.server.port,
            max_body_bytes=rt.config.server.max_body_bytes,
            backlog=rt.config.server.backlog,
        ),
        router=dataclasses.replace(
            new.router, url=rt.config.router.url, max_connections=rt.config.router.max_connections
        ),
    )
    rt.set_config(new)
    rt.fleet.reconfigure(new.router)
    await rt.sessions.reconfigure(new.session_lifecycle)
    await rt.admission.reconfigure(new.admission)
    logging.getLogger("kvproxy").setLevel(new.server.log_level.upper())
    rt.reloads += 1
    applied = [k for k in changed if k not in RESTART_ONLY]
    log.warning("config reloaded from %s; applied: %s", new.source, ", ".join(applied) or "nothing")
    if pending:
        log.warning("config keys that need a restart to change: %s", ", ".join(pending))
    return {"status": "reloaded", "applied": applied, "restart_required": pending}


async def handle_reload(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    if not _authorised(rt, request):
        return error_response(
            ErrorType.UNAUTHORIZED,
            "admin endpoint: send Authorization: Bearer <server.admin_token>",
        )
    try:
        result = await reload_config(rt)
    except ConfigError as exc:
        log.error("config reload rejected, keeping the running config: %s", exc)
        return error_response(
            ErrorType.INVALID_CONFIG, f"reload rejected, running config kept: {exc}"
        )
    return _json(result)


# ------------------------------------------------------------------------ factory
def create_app(config: Config, *, overrides: Mapping[str, Any] | None = None) -> web.Application:
    """Build the kvproxy application for ``config``."""
    registry = CollectorRegistry(auto_describe=True)
    rt = Runtime(
        config=config,
        overrides=dict(overrides or {}),
        registry=registry,
        metrics=ProxyMetrics(registry),
        router_base=config.router.url.rstrip("/"),
    )
    app = web.Application(client_max_size=config.server.max_body_bytes)
    app[RUNTIME] = rt
    app.cleanup_ctx.extend([_client_ctx, _fleet_ctx, _sessions_ctx, _admission_ctx])
    app.on_shutdown.append(_on_shutdown)

    handlers = ProxyHandlers(rt)

    async def handle_session_close(request: web.Request) -> web.Response:
        if not _authorised(rt, request):
            return error_response(
                ErrorType.UNAUTHORIZED,
                "admin endpoint: send Authorization: Bearer <server.admin_token>",
            )
        return await handlers.close_session_admin(request)

    # The hot paths first: the router matches routes in registration order.
    for path in INTERCEPTED_PATHS:
        app.router.add_post(path, handlers.dispatch)
    app.router.add_get("/kvproxy/health", handle_health)
    app.router.add_get("/kvproxy/stats", handle_stats)
    app.router.add_get("/kvproxy/dashboard", handle_dashboard)
    app.router.add_post("/kvproxy/config/reload", handle_reload)
    app.router.add_post("/kvproxy/sessions/{session_id}/close", handle_session_close)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_route("*", "/{tail:.*}", handlers.dispatch)
    return app
