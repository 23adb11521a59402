"""``GET /kvproxy/health``'s document: the fleet, the features and their warnings."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvproxy import __version__
from kvproxy.fleet.registry import legacy_warning
from kvproxy.keys import ADMISSION, CONFIG, FLEET, SESSIONS


def health_doc(app: web.Application) -> dict[str, Any]:
    live, fleet_ = app[CONFIG], app[FLEET]
    cfg = live.config
    fleet = fleet_.health()
    warnings: list[str] = []
    legacy = legacy_warning(fleet_, cfg.session_lifecycle.enabled)
    if legacy:
        warnings.append(legacy)
    sessions = app[SESSIONS].health()
    warnings.extend(sessions.get("warnings", []))
    admission = app[ADMISSION].health()
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
        "legacy_router": fleet_.engines.legacy,
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
        "reloads": live.reloads,
    }
