"""``GET /kvproxy/health``'s document: the fleet, the features and their warnings."""

from __future__ import annotations

from typing import Any

from kvproxy import __version__
from kvproxy.fleet.registry import legacy_warning
from kvproxy.runtime import Runtime


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
        "legacy_router": rt.fleet.engines.legacy,
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
