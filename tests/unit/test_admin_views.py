"""Dashboard banners and the redacted config view, from plain documents."""

from __future__ import annotations

from typing import Any

import pytest

from kvproxy.admin.views import (
    PROXY_ANSWERED,
    PROXY_UPSTREAM_FAILURES,
    RATE_SERIES,
    RATIO_SERIES,
    banners,
    config_view,
)
from kvproxy.admission import coordinator
from kvproxy.config import AdmissionConfig, SessionLifecycleConfig, from_mapping
from kvproxy.sessions import lifecycle


def health(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "router_reachable": True,
        "legacy_router": False,
        "warnings": [],
        "fleet": {
            "router_url": "http://r",
            "router_flavor": "smg",
            "engines": {"healthy": ["http://e1"], "unhealthy": []},
        },
        "admission": {"enabled": True, "degraded": False, "engines_stale": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "ids"),
    [
        (health(), []),
        (health(router_reachable=False), ["router-unreachable"]),
        (health(admission={"degraded": True}), ["ledger-degraded"]),
        # Admission off: a degraded ledger is not news (nothing is held anyway).
        (health(admission={"enabled": False, "degraded": True}), []),
        (health(admission={"engines_stale": 1}), ["engines-stale"]),
        # Degraded already says every engine is stale.
        (health(admission={"degraded": True, "engines_stale": 2}), ["ledger-degraded"]),
        (
            health(fleet={"engines": {"healthy": [], "unhealthy": ["http://e2"]}}),
            ["engines-unhealthy"],
        ),
        (
            health(legacy_router=True, fleet={"router_flavor": "sglang-router-0.3"}),
            ["legacy-router"],
        ),
        (health(warnings=["engine x runs lru"]), ["warning"]),
        (
            health(router_reachable=False, admission={"degraded": True}, warnings=["w"]),
            ["router-unreachable", "ledger-degraded", "warning"],
        ),
    ],
)
def test_banners(doc: dict[str, Any], ids: list[str]) -> None:
    got = banners(doc)
    assert [b["id"] for b in got] == ids
    assert all(b["level"] in ("error", "warning") and b["text"] for b in got)


def test_the_legacy_warning_is_shown_once() -> None:
    from kvproxy.fleet.registry import LEGACY_ROUTER_WARNING

    text = LEGACY_ROUTER_WARNING.format(flavor="legacy")
    got = banners(health(legacy_router=True, warnings=[text], fleet={"router_flavor": "legacy"}))
    assert [b["id"] for b in got] == ["legacy-router"]
    assert got[0]["text"] == text


def test_config_view_redacts_the_admin_token() -> None:
    cfg = from_mapping({"server": {"admin_token": "s3cret"}, "admission": {"enabled": True}})
    view = config_view(cfg)
    assert view["server"]["admin_token"] == "(set)"
    assert "s3cret" not in repr(view)
    assert view["admission"]["enabled"] is True
    assert config_view(from_mapping({}))["server"]["admin_token"] is None


def test_every_series_reads_a_counter_the_features_export() -> None:
    async def no_metrics(url: str) -> str:
        raise AssertionError("never polled")

    admission = coordinator.AdmissionController(
        AdmissionConfig(), healthy_engines=lambda: (), http=None, fetch_metrics=no_metrics
    )
    sessions = lifecycle.SessionManager(
        SessionLifecycleConfig(),
        all_engines=lambda: (),
        http=None,  # type: ignore[arg-type]
    )
    known = {*admission.totals(), *sessions.totals(), PROXY_ANSWERED, PROXY_UPSTREAM_FAILURES}
    for counter in RATE_SERIES.values():
        assert counter in known, counter
    for num, den in RATIO_SERIES.values():
        assert num in known and den in known
