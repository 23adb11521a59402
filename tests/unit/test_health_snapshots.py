"""The features' typed health snapshots: what GET /kvproxy/health shows of each."""

from __future__ import annotations

from kvproxy.fleet.registry import FleetHealth
from kvproxy.sessions.lifecycle import SessionsHealth


def test_fleet_health_counts_the_healthy_engines_it_lists() -> None:
    health = FleetHealth(
        router_url="http://r:30000",
        router_reachable=True,
        router_flavor="workers",
        engines_known=3,
        healthy=("http://a", "http://b"),
        unhealthy=("http://c",),
        last_refresh_age_s=0.5,
        last_error=None,
    )
    assert health.engines_healthy == 2
    assert health.to_json() == {
        "router_url": "http://r:30000",
        "router_reachable": True,
        "router_flavor": "workers",
        "engines_known": 3,
        "engines_healthy": 2,
        "engines": {"healthy": ["http://a", "http://b"], "unhealthy": ["http://c"]},
        "last_refresh_age_s": 0.5,
        "last_error": None,
        "engines_refused": 0,
    }


def test_sessions_health_off_shows_only_that_it_is_off() -> None:
    off = SessionsHealth(enabled=False)
    assert off.to_json() == {"enabled": False}
    # The dashboard reads the counts whether or not the feature is on.
    assert (off.open, off.closing, off.warnings) == (0, 0, ())


def test_sessions_health_on_lists_warnings_and_counts() -> None:
    on = SessionsHealth(
        enabled=True,
        on_close="abort",
        sticky_routing=True,
        idle_timeout_s=None,
        engine_check="done",
        engines={"http://a": {"mode": "none"}},
        warnings=("w",),
        open=2,
        closing=1,
    )
    doc = on.to_json()
    assert doc["warnings"] == ["w"] and doc["open"] == 2 and doc["closing"] == 1
    assert doc["engines"] == {"http://a": {"mode": "none"}}
    assert list(doc) == [
        "enabled",
        "on_close",
        "sticky_routing",
        "idle_timeout_s",
        "engine_check",
        "engines",
        "warnings",
        "open",
        "closing",
    ]
