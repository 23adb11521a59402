"""``GET /kvproxy/health``'s document: the fleet, the features and their warnings."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvproxy import __version__
from kvproxy.fleet.registry import legacy_warning
from kvproxy.keys import ADMISSION, CONFIG, FLEET, SESSIONS


def health_doc(app: web.Application) -> dict[str, Any]:
    live, fleet = app[CONFIG], app[FLEET]
    cfg = live.config
    fleet_health = fleet.health()
    sessions = app[SESSIONS].health()
    admission = app[ADMISSION].health()
    warnings: list[str] = []
    legacy = legacy_warning(fleet, cfg.session_lifecycle.enabled)
    if legacy:
        warnings.append(legacy)
    warnings.extend(sessions.warnings)
    state = app[SESSIONS].state_health()
    if state.get("store_up") is False:
        warnings.append("shared state store unavailable: this replica decides alone")
    if fleet_health.router_reachable is False:
        status = "router_unreachable"
    elif cfg.admission.enabled and admission.degraded:
        status = "degraded"
    else:
        status = "ok"
    return {
        "status": status,
        "version": __version__,
        "router_reachable": fleet_health.router_reachable,
        "legacy_router": fleet.engines.legacy,
        "engines_known": fleet_health.engines_known,
        "engines_healthy": fleet_health.engines_healthy,
        "features": {
            "session_lifecycle": cfg.session_lifecycle.enabled,
            "admission": cfg.admission.enabled,
        },
        "warnings": warnings,
        "fleet": fleet_health.to_json(),
        "sessions": sessions.to_json(),
        "admission": admission.to_json(),
        "state": state,
        "config_source": cfg.source,
        "reloads": live.reloads,
    }
