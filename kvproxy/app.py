"""The application factory: one place that wires config, state, tasks and routes.

Each resource lives on the application under its own typed ``web.AppKey``
(:mod:`kvproxy.keys`; no module globals). Long-lived resources are ``cleanup_ctx``
contexts, entered in order at start-up and left in reverse at shutdown: the pooled
client session, the fleet refresher, the features (the session manager, Dynamo and
the admission coordinator, built together by :class:`kvproxy.wiring.Features`, the
builder the lab uses too; with ``state.backend: redis``, admission's ledger shared with
the other replicas), the proxy's handlers (given the resources they use), then
the dashboard's sampler. The operator routes are in :mod:`kvproxy.admin`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from kvproxy.admin import dashboard
from kvproxy.admin.routes import add_admin_routes
from kvproxy.config import Config, LiveConfig
from kvproxy.fleet.registry import Fleet, legacy_warning
from kvproxy.keys import (
    ADMISSION,
    CONFIG,
    DYNAMO,
    FEATURES,
    FLEET,
    HTTP,
    PROXY,
    PROXY_METRICS,
    REGISTRY,
    SESSIONS,
    SHUTDOWN,
)
from kvproxy.proxy import bytecount
from kvproxy.proxy.handlers import INTERCEPTED_PATHS, ProxyHandlers, Shutdown
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.proxy.slow_clients import SlowClientGuard
from kvproxy.proxy.upstream import create_client_session
from kvproxy.state.redis_store import RedisStore
from kvproxy.wiring import Features

log = logging.getLogger(__name__)


class _FeatureCollector(Collector):
    """Exposes the features' own collectors through the app's registry."""

    def __init__(self, features: Features) -> None:
        self._features = features

    def collect(self) -> Iterable[Any]:
        return self._features.collect()


# ----------------------------------------------------------------------- contexts
async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    http = app[HTTP] = create_client_session(app[CONFIG].config.router)
    yield
    await http.close()


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG].config
    fleet = app[FLEET] = Fleet(config.router, app[HTTP])
    await fleet.start()
    warning = legacy_warning(fleet, config.session_lifecycle.enabled)
    if warning:
        log.warning("%s", warning)
    yield
    await fleet.stop()


async def _features_ctx(app: web.Application) -> AsyncIterator[None]:
    """The session lifecycle, Dynamo and admission, built together (:mod:`kvproxy.wiring`)
    and started in that order."""
    live = app[CONFIG]
    config = live.config
    features = app[FEATURES] = Features(
        live,
        http=app[HTTP],
        fleet=app[FLEET],
        # The loop's clock, bound once: on Python 3.11 each get_running_loop() is a
        # getpid() system call, and admission reads the clock twice per request.
        clock=asyncio.get_running_loop().time,
        store=_shared_store(config),
        admission_store=_admission_store(config),
    )
    app[SESSIONS], app[DYNAMO], app[ADMISSION] = (
        features.sessions,
        features.dynamo,
        features.admission,
    )
    if config.admission.enabled:
        bytecount.load()  # the vectorised id count's import, not on the first big body
    async with features.running():
        app[REGISTRY].register(_FeatureCollector(features))
        yield


def _shared_store(config: Config) -> RedisStore | None:
    """The store the session lifecycle shares with other replicas (state.backend:
    redis), or None: the state stays in this process."""
    if config.state.backend != "redis" or not config.session_lifecycle.enabled:
        return None
    return RedisStore(config.state)


def _admission_store(config: Config) -> RedisStore | None:
    """The store program admission shares its ledger through with the other replicas
    (state.backend: redis, admission on: :mod:`kvproxy.replication`), or None: it stays
    in this process."""
    if config.state.backend != "redis" or not config.admission.enabled:
        return None
    return RedisStore(config.state)


async def _proxy_ctx(app: web.Application) -> AsyncIterator[None]:
    features = app[FEATURES]
    app[PROXY] = ProxyHandlers(
        live=app[CONFIG],
        http=app[HTTP],
        sessions=features.sessions,
        admission=features.admission,
        dynamo=features.dynamo,
        metrics=app[PROXY_METRICS],
        shutdown=app[SHUTDOWN],
    )
    yield


async def _on_shutdown(app: web.Application) -> None:
    app[SHUTDOWN].started = True


# The routes reach the handlers through the app: they exist once the contexts have run.
async def _dispatch(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].dispatch(request)


async def _close_session_admin(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].close_session_admin(request)


# ------------------------------------------------------------------------ server layer
def slow_client_guard(app: web.Application) -> SlowClientGuard:
    """The server layer's bounds on slow clients and open connections, read from the
    running config (a reload applies to the next request or connection) and counted on
    ``/metrics``."""
    live = app[CONFIG]

    def limits() -> tuple[float, float]:
        server = live.config.server
        return server.header_read_timeout_s, server.body_read_timeout_s

    def max_connections() -> int:
        return live.config.server.max_connections

    return SlowClientGuard(
        limits,
        on_drop=app[PROXY_METRICS].slow_client_dropped,
        max_connections=max_connections,
        on_refuse=app[PROXY_METRICS].connection_refused,
    )


# ------------------------------------------------------------------------ factory
def create_app(config: Config, *, overrides: Mapping[str, Any] | None = None) -> web.Application:
    """Build the kvproxy application for ``config``."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    # No middleware: the proxy's routes map refusals and count responses themselves
    # (kvproxy.proxy.refusals), which spares every request two wrapped frames.
    app = web.Application(client_max_size=config.server.max_body_bytes)
    app[CONFIG] = LiveConfig(config, overrides=dict(overrides or {}))
    app[REGISTRY] = registry
    app[PROXY_METRICS] = metrics
    app[SHUTDOWN] = Shutdown()
    app.cleanup_ctx.extend(
        [
            _client_ctx,
            _fleet_ctx,
            _features_ctx,
            _proxy_ctx,
            dashboard.timeline_ctx,
        ]
    )
    app.on_shutdown.append(_on_shutdown)

    # The hot paths first: the router matches routes in registration order.
    for path in INTERCEPTED_PATHS:
        app.router.add_post(path, _dispatch)
    add_admin_routes(app, _close_session_admin)
    app.router.add_route("*", "/{tail:.*}", _dispatch)
    return app
