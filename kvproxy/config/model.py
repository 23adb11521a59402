"""The whole configuration: :class:`Config` (one frozen dataclass per YAML section),
:func:`validate` (one validator per section), and the running :class:`LiveConfig`. Pure.

A feature's constraints are only checked when that feature is enabled, so a
half-filled ``admission:`` block never stops a proxy that runs with admission off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvproxy.config.admission import AdmissionConfig, validate_admission
from kvproxy.config.errors import check
from kvproxy.config.router import RouterConfig, validate_router
from kvproxy.config.server import ServerConfig, validate_server
from kvproxy.config.session_lifecycle import SessionLifecycleConfig, validate_session_lifecycle
from kvproxy.config.state import StateConfig, validate_state
from kvproxy.urls import base_url


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    session_lifecycle: SessionLifecycleConfig = field(default_factory=SessionLifecycleConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    state: StateConfig = field(default_factory=StateConfig)
    source: str | None = None  # path of the YAML file this came from

    def replace(self, section: str, **changes: Any) -> Config:
        return dataclasses.replace(
            self, **{section: dataclasses.replace(getattr(self, section), **changes)}
        )


# YAML section name -> its dataclass (the fields of Config above, but ``source``).
SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "router": RouterConfig,
    "session_lifecycle": SessionLifecycleConfig,
    "admission": AdmissionConfig,
    "state": StateConfig,
}


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first key out of range."""
    validate_server(cfg.server)
    validate_router(cfg.router)
    check(
        not cfg.router.forward_control_plane or cfg.server.admin_token is not None,
        "router.forward_control_plane: needs server.admin_token (the router's control plane "
        "is forwarded only to requests carrying it)",
    )
    if cfg.session_lifecycle.enabled:
        validate_session_lifecycle(cfg.session_lifecycle)
    if cfg.admission.enabled:
        validate_admission(cfg.admission)
    validate_state(cfg.state)


@dataclass
class LiveConfig:
    """The running config of one application: a reload swaps :attr:`config` in place
    (:mod:`kvproxy.admin.reload`), so every reader sees the new one on its next request."""

    config: Config
    # The CLI overrides, re-applied on every reload.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    reloads: int = 0
    # router.url is restart-only, so its base is fixed for the application's life.
    router_base: str = field(init=False)

    def __post_init__(self) -> None:
        self.router_base = base_url(self.config.router.url)
