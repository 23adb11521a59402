"""The application factory: one place that wires config, state, tasks and routes.

Each resource lives on the application under its own typed ``web.AppKey``
(:mod:`kvproxy.keys`; no module globals, no object holding them all). Long-lived
resources are ``cleanup_ctx`` contexts, entered in order at start-up and left in
reverse at shutdown: the pooled client session, the fleet refresher, the session
manager, Dynamo (:mod:`kvproxy.dynamo`), the admission coordinator, the proxy's handlers
(given the resources they use), then the dashboard's sampler. The operator routes
are in :mod:`kvproxy.admin`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from kvproxy.admin import dashboard
from kvproxy.admin.routes import add_admin_routes
from kvproxy.admission.coordinator import AdmissionController
from kvproxy.config import Config, LiveConfig
from kvproxy.dynamo.control import Dynamo
from kvproxy.fleet.registry import Fleet, legacy_warning
from kvproxy.keys import (
    ADMISSION,
    CONFIG,
    DYNAMO,
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
from kvproxy.sessions.lifecycle import SessionManager
from kvproxy.state.redis_store import RedisStore
from kvproxy.state.shared import replica_name

if TYPE_CHECKING:
    from kvproxy.replication.sync import AdmissionSync

log = logging.getLogger(__name__)


class _FeatureCollector(Collector):
    """Exposes the features' own collectors through the app's registry."""

    def __init__(
        self, sessions: SessionManager, admission: AdmissionController, dynamo: Dynamo
    ) -> None:
        self._features = (sessions, admission, dynamo)

    def collect(self) -> Iterable[Any]:
        for feature in self._features:
            yield from feature.collect()


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


async def _sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    def closed(session_id: str) -> None:
        # A closed session's KV is no longer resident: admission stops counting it.
        # Admission and Dynamo start after the sessions, so they are looked up here.
        app[ADMISSION].end_session(session_id)
        app[DYNAMO].session_closed(session_id)

    fleet, config = app[FLEET], app[CONFIG].config
    sessions = app[SESSIONS] = SessionManager(
        config.session_lifecycle,
        all_engines=fleet.all_engines,
        http=app[HTTP],
        on_closed=closed,
        store=_shared_store(config),
        state=config.state,
    )
    await sessions.start()
    yield
    await sessions.stop()


def _shared_store(config: Config) -> RedisStore | None:
    """The store the session lifecycle shares with other replicas (state.backend:
    redis), or None: the state stays in this process."""
    if config.state.backend != "redis" or not config.session_lifecycle.enabled:
        return None
    return RedisStore(config.state)


async def _dynamo_ctx(app: web.Application) -> AsyncIterator[None]:
    live, sessions = app[CONFIG], app[SESSIONS]

    async def close(session_id: str) -> None:
        await sessions.close(session_id, reason="bind_timeout")

    def session_open(session_id: str) -> bool:
        return sessions.state(session_id) == "open"

    def pressure(engine: str | None) -> bool:
        # The session's engine's KV usage at or past the admission pressure threshold
        # (the fleet's highest when placement is unknown); known only with admission on.
        config = live.config.admission
        if not config.enabled:
            return False
        admission = app[ADMISSION]  # starts after Dynamo
        if engine is None:
            usage: float | None = admission.ledger.pressure
        else:
            usage = admission.engine_usage(engine)
        return usage is not None and usage >= config.pressure_threshold

    def engine_kv(engine: str) -> tuple[int | None, int | None]:
        # What program admission's scrape last read of the engine (capacity, and the
        # KV its streaming sessions hold); nothing when it does not run.
        program = app[ADMISSION].program if live.config.admission.enabled else None
        eng = program.ledger.engines.get(engine.rstrip("/")) if program else None
        if eng is None:
            return None, None
        return eng.max_total_num_tokens, eng.streaming_held

    dynamo = app[DYNAMO] = Dynamo(
        live.config,
        http=app[HTTP],
        router_base=live.router_base,
        ring_workers=app[FLEET].ring_workers,
        close_session=close,
        session_open=session_open,
        pressure=pressure,
        engine_kv=engine_kv,
    )
    await dynamo.start()
    yield
    await dynamo.stop()


async def _admission_ctx(app: web.Application) -> AsyncIterator[None]:
    config, fleet = app[CONFIG].config, app[FLEET]
    admission = app[ADMISSION] = AdmissionController(
        config.admission,
        healthy_engines=fleet.healthy_engines,
        http=app[HTTP],
        # The loop's clock, bound once: on Python 3.11 each get_running_loop() is a
        # getpid() system call, and admission reads the clock twice per request.
        clock=asyncio.get_running_loop().time,
        router_policy=config.router.policy,
        workers=fleet.ring_workers,
        time_scale=config.server.time_scale,
        token_scale=config.server.token_scale,
        router_metrics_url=config.router.metrics_url,
        router_url=config.router.url,
    )
    if config.admission.enabled:
        bytecount.load()  # the vectorised id count's import, not on the first big body
    await admission.start()
    app[REGISTRY].register(_FeatureCollector(app[SESSIONS], admission, app[DYNAMO]))
    sync = _admission_sync(config, admission)
    if sync is not None:
        await sync.start()
        app[REGISTRY].register(sync)
    yield
    if sync is not None:
        await sync.stop()
    await admission.stop()


def _admission_sync(config: Config, admission: AdmissionController) -> AdmissionSync | None:
    """Program admission's ledger shared with the other replicas (state.backend: redis,
    admission on), or None: it stays in this process."""
    if config.state.backend != "redis" or not config.admission.enabled:
        return None
    from kvproxy.replication.sync import AdmissionSync  # (only where it is shared)

    return AdmissionSync(
        config.state,
        RedisStore(config.state),
        admission.program,
        replica=replica_name(),
        drain=admission.drain_program,
        clock=asyncio.get_running_loop().time,
    )


async def _proxy_ctx(app: web.Application) -> AsyncIterator[None]:
    app[PROXY] = ProxyHandlers(
        live=app[CONFIG],
        http=app[HTTP],
        sessions=app[SESSIONS],
        admission=app[ADMISSION],
        dynamo=app[DYNAMO],
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
            _sessions_ctx,
            _dynamo_ctx,
            _admission_ctx,
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
