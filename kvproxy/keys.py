"""The application's resources: one typed ``web.AppKey`` each.

Each is set by a ``cleanup_ctx`` in :mod:`kvproxy.app` (in this order; left in
reverse at shutdown; the features' context sets ``FEATURES`` and each feature's own
key), except the live config, the registry, the proxy's metrics and the shutdown flag,
which the factory sets before the server starts. A handler reads only the keys it uses
(``request.app[SESSIONS]``); the proxy's handlers are given theirs as constructor
arguments (:class:`kvproxy.proxy.handlers.ProxyHandlers`).
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.config import LiveConfig
from kvproxy.dynamo.control import Dynamo
from kvproxy.fleet.registry import Fleet
from kvproxy.proxy.handlers import ProxyHandlers, Shutdown
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.sessions.lifecycle import SessionManager
from kvproxy.wiring import Features

# Set by the factory.
CONFIG = web.AppKey("config", LiveConfig)
REGISTRY = web.AppKey("registry", CollectorRegistry)
PROXY_METRICS = web.AppKey("proxy_metrics", ProxyMetrics)
SHUTDOWN = web.AppKey("shutdown", Shutdown)
# Set by their cleanup_ctx, in this order.
HTTP = web.AppKey("http", aiohttp.ClientSession)
FLEET = web.AppKey("fleet", Fleet)
# The features, built together (kvproxy.wiring), and each of them on its own key.
FEATURES = web.AppKey("features", Features)
SESSIONS = web.AppKey("sessions", SessionManager)
DYNAMO = web.AppKey("dynamo", Dynamo)  # Dynamo's nvext (docs/dynamo.md)
ADMISSION = web.AppKey("admission", AdmissionController)
PROXY = web.AppKey("proxy", ProxyHandlers)
