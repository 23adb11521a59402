"""Per-application runtime state, shared by the app factory and the handlers.

It lives on the application under the typed key :data:`RUNTIME` (no module globals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.config import Config, SessionLifecycleConfig
from kvproxy.fleet.registry import Fleet
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.sessions.dynamo import AgentControl
from kvproxy.sessions.lifecycle import SessionManager


@dataclass
class Runtime:
    """Everything a request handler needs, owned by one application."""

    config: Config
    overrides: Mapping[str, Any]
    registry: CollectorRegistry
    metrics: ProxyMetrics
    router_base: str
    http: aiohttp.ClientSession = field(init=False)
    fleet: Fleet = field(init=False)
    sessions: SessionManager = field(init=False)
    admission: AdmissionController = field(init=False)
    agents: AgentControl = field(init=False)  # Dynamo's nvext (docs/dynamo.md)
    shutting_down: bool = False
    reloads: int = 0
    # The session-id sources with lifecycle semantics off: admission reads a request's
    # session from them even when the lifecycle feature is disabled.
    identity_only: SessionLifecycleConfig = field(init=False)

    def __post_init__(self) -> None:
        self.set_config(self.config)

    def set_config(self, config: Config) -> None:
        self.config = config
        self.identity_only = dataclasses.replace(config.session_lifecycle, enabled=True)


RUNTIME = web.AppKey("runtime", Runtime)
