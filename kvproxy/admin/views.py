"""What the dashboard shows, computed from plain data: no I/O, no runtime objects.

- :data:`RATE_SERIES` / :data:`RATIO_SERIES`: which cumulative counters the
  dashboard's timeline turns into per-second rates (and one ratio).
- :func:`banners`: the warnings an operator must not miss, from a health document.
- :func:`config_view`: the effective configuration, secrets redacted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvproxy.admission import catalogue as adm
from kvproxy.config import Config
from kvproxy.fleet.registry import LEGACY_ROUTER_WARNING
from kvproxy.sessions import lifecycle as ses

# Counter keys the proxy plumbing contributes to a reading (see ProxyMetrics).
PROXY_ANSWERED = "kvproxy/answered"
PROXY_UPSTREAM_FAILURES = "kvproxy/upstream_failures"

# Series name -> the cumulative counter whose per-second increase it plots.
RATE_SERIES: Mapping[str, str] = {
    "requests": PROXY_ANSWERED,
    "upstream_errors": PROXY_UPSTREAM_FAILURES,
    "admit": adm.C_ADMIT,
    "wait": adm.C_WAIT,
    "bypass_protected": adm.C_BYPASS_PROTECTED,
    "bypass_degraded": adm.C_BYPASS_DEGRADED,
    "bypass_aged": adm.C_BYPASS_AGED,
    "bypass_oversized": adm.C_BYPASS_OVERSIZED,
    "bypass_queue_full": adm.C_BYPASS_QUEUE_FULL,
    "bypass_disabled": adm.C_BYPASS_DISABLED,
    "cancelled": adm.C_CANCELLED,
    "scrape_failures": adm.C_SCRAPE_FAILURE,
    "sessions_started": ses.STARTED,
    "sessions_closed": ses.CLOSE,
    "close_failures": ses.CLOSE_FAILURE,
    "aborted_requests": ses.ABORTED_REQUESTS,
}

# Series name -> (numerator, denominator): the ratio of their increases.
RATIO_SERIES: Mapping[str, tuple[str, str]] = {
    # Mean FIFO wait of the requests granted after waiting, in each interval.
    "wait_mean_s": (adm.C_WAIT_SECONDS_SUM, adm.C_WAIT_GRANTED),
}


def banners(health: Mapping[str, Any]) -> list[dict[str, str]]:
    """Banners for a health document (see ``kvproxy.admin.routes.health_doc``), most
    severe first. Each has a stable ``id`` (for styling and tests), a ``level``
    (``error`` | ``warning``) and a ``text``."""
    out: list[dict[str, str]] = []
    fleet = health.get("fleet", {})
    admission = health.get("admission", {})
    if health.get("router_reachable") is False:
        out.append(
            {
                "id": "router-unreachable",
                "level": "error",
                "text": f"The router at {fleet.get('router_url', '?')} is unreachable: "
                "requests are answered 502 router_unreachable.",
            }
        )
    if admission.get("enabled") and admission.get("degraded"):
        out.append(
            {
                "id": "ledger-degraded",
                "level": "error",
                "text": "Admission ledger degraded: no engine has fresh metrics, so requests "
                "go through without being held (fail open). Check the engines' /metrics.",
            }
        )
    if admission.get("enabled") and admission.get("fallback"):
        out.append(
            {
                "id": "admission-fallback",
                "level": "warning",
                "text": f"Program admission without per-engine ledgers: {admission['fallback']}.",
            }
        )
    legacy = None
    if health.get("legacy_router"):
        legacy = LEGACY_ROUTER_WARNING.format(flavor=fleet.get("router_flavor", "?"))
        out.append({"id": "legacy-router", "level": "warning", "text": legacy})
    for warning in health.get("warnings", []):
        if warning != legacy:
            out.append({"id": "warning", "level": "warning", "text": str(warning)})
    unhealthy = fleet.get("engines", {}).get("unhealthy", [])
    if unhealthy:
        out.append(
            {
                "id": "engines-unhealthy",
                "level": "warning",
                "text": f"{len(unhealthy)} engine(s) unhealthy in the router: "
                + ", ".join(unhealthy),
            }
        )
    stale = admission.get("engines_stale", 0) if admission.get("enabled") else 0
    if stale and not admission.get("degraded"):
        out.append(
            {
                "id": "engines-stale",
                "level": "warning",
                "text": f"{stale} engine(s) have stale metrics and are left out of the budget.",
            }
        )
    return out


def config_view(config: Config) -> dict[str, Any]:
    """The effective configuration as plain data, ``server.admin_token`` redacted."""
    doc: dict[str, Any] = {
        section: dataclasses.asdict(getattr(config, section))
        for section in ("server", "router", "session_lifecycle", "admission")
    }
    if doc["server"].get("admin_token") is not None:
        doc["server"]["admin_token"] = "(set)"
    doc["source"] = config.source
    return doc
