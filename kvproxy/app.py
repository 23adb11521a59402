"""The application factory: one place that wires config, state, tasks and routes.

State lives on the application under typed ``web.AppKey`` keys (no module globals).
Long-lived resources are ``cleanup_ctx`` contexts, entered in order at start-up and
left in reverse at shutdown: the pooled client session, then the fleet refresher,
then the session manager, then the admission coordinator, then the dashboard's
sampler. The operator routes are in :mod:`kvproxy.admin`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from kvproxy.admin import dashboard
from kvproxy.admin.routes import add_admin_routes
from kvproxy.admission.coordinator import AdmissionController
from kvproxy.config import Config
from kvproxy.fleet.registry import Fleet, legacy_warning
from kvproxy.proxy.handlers import INTERCEPTED_PATHS, ProxyHandlers
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.proxy.middleware import CountingMiddleware
from kvproxy.proxy.slow_clients import SlowClientGuard
from kvproxy.proxy.upstream import create_client_session
from kvproxy.runtime import RUNTIME, Runtime
from kvproxy.sessions.dynamo import AgentControl
from kvproxy.sessions.lifecycle import SessionManager
from kvproxy.urls import base_url

log = logging.getLogger(__name__)


class _FeatureCollector(Collector):
    """Exposes the features' own collectors through the app's registry."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt

    def collect(self) -> Iterable[Any]:
        yield from self._rt.sessions.collect()
        yield from self._rt.admission.collect()
        yield from self._rt.agents.collect()


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
        on_closed=lambda session_id: _session_closed(rt, session_id),
    )
    await rt.sessions.start()
    yield
    await rt.sessions.stop()


def _session_closed(rt: Runtime, session_id: str) -> None:
    rt.admission.end_session(session_id)
    rt.agents.session_closed(session_id)


async def _agents_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]

    async def close(session_id: str) -> None:
        await rt.sessions.close(session_id, reason="bind_timeout")

    def session_open(session_id: str) -> bool:
        return rt.sessions.state(session_id) == "open"

    def pressure(engine: str | None) -> bool:
        # The session's engine's KV usage at or past the admission pressure threshold
        # (the fleet's highest when placement is unknown); known only with admission on.
        if not rt.config.admission.enabled:
            return False
        if engine is None:
            usage: float | None = rt.admission.ledger.pressure
        else:
            usage = rt.admission.engine_usage(engine)
        return usage is not None and usage >= rt.config.admission.pressure_threshold

    def engine_kv(engine: str) -> tuple[int | None, int | None]:
        # What program admission's scrape last read of the engine (capacity, and the
        # KV its streaming sessions hold); nothing when it does not run.
        program = rt.admission.program if rt.config.admission.enabled else None
        eng = program.ledger.engines.get(engine.rstrip("/")) if program else None
        if eng is None:
            return None, None
        return eng.max_total_num_tokens, eng.streaming_held

    rt.agents = AgentControl(
        rt.config,
        http=rt.http,
        router_base=rt.router_base,
        ring_workers=rt.fleet.ring_workers,
        close_session=close,
        session_open=session_open,
        pressure=pressure,
        engine_kv=engine_kv,
    )
    await rt.agents.start()
    yield
    await rt.agents.stop()


async def _admission_ctx(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.admission = AdmissionController(
        rt.config.admission,
        healthy_engines=rt.fleet.healthy_engines,
        http=rt.http,
        router_policy=rt.config.router.policy,
        workers=rt.fleet.ring_workers,
        time_scale=rt.config.server.time_scale,
        token_scale=rt.config.server.token_scale,
        router_metrics_url=rt.config.router.metrics_url,
    )
    await rt.admission.start()
    rt.registry.register(_FeatureCollector(rt))
    yield
    await rt.admission.stop()


async def _on_shutdown(app: web.Application) -> None:
    app[RUNTIME].shutting_down = True


# ------------------------------------------------------------------------ server layer
def slow_client_guard(app: web.Application) -> SlowClientGuard:
    """The server layer's bounds on slow clients, read from the running config (a
    reload applies to the next request) and counted on ``/metrics``."""
    rt = app[RUNTIME]

    def limits() -> tuple[float, float]:
        server = rt.config.server
        return server.header_read_timeout_s, server.body_read_timeout_s

    return SlowClientGuard(limits, on_drop=rt.metrics.slow_client_dropped)


# ------------------------------------------------------------------------ factory
def create_app(config: Config, *, overrides: Mapping[str, Any] | None = None) -> web.Application:
    """Build the kvproxy application for ``config``."""
    registry = CollectorRegistry(auto_describe=True)
    rt = Runtime(
        config=config,
        overrides=dict(overrides or {}),
        registry=registry,
        metrics=ProxyMetrics(registry),
        router_base=base_url(config.router.url),
    )
    # One middleware maps refusals to error responses and counts every proxied response.
    app = web.Application(
        client_max_size=config.server.max_body_bytes,
        middlewares=[CountingMiddleware(rt.metrics)],
    )
    app[RUNTIME] = rt
    app.cleanup_ctx.extend(
        [
            _client_ctx,
            _fleet_ctx,
            _sessions_ctx,
            _agents_ctx,
            _admission_ctx,
            dashboard.timeline_ctx,
        ]
    )
    app.on_shutdown.append(_on_shutdown)

    handlers = ProxyHandlers(rt)
    # The hot paths first: the router matches routes in registration order.
    for path in INTERCEPTED_PATHS:
        app.router.add_post(path, handlers.dispatch)
    add_admin_routes(app, handlers)
    app.router.add_route("*", "/{tail:.*}", handlers.dispatch)
    return app
