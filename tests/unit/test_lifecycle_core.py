"""The session lifecycle's pure parts (kvproxy.sessions.lifecycle_core and
lifecycle_metrics), table-tested without an event loop."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.config import SessionLifecycleConfig
from kvproxy.sessions.lifecycle_core import (
    TaskPlan,
    WarnThrottle,
    base_urls,
    check_delays,
    reap_interval_s,
    reconfigure_plan,
    sessions_health,
    wants_checker,
    wants_reaper,
)
from kvproxy.sessions.lifecycle_metrics import (
    CLOSED_REMEMBERED,
    CLOSING,
    COUNTER_HELP,
    FORWARDED_REQUESTS,
    GAUGE_HELP,
    OPEN,
    QUEUED_REQUESTS,
    table_gauges,
)
from kvproxy.sessions.table import SessionTable

ON = SessionLifecycleConfig(enabled=True)
OFF = SessionLifecycleConfig(enabled=False)


def cfg(**changes: object) -> SessionLifecycleConfig:
    return dataclasses.replace(ON, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("urls", "expected"),
    [
        ([], []),
        (["http://a:1", "http://a:1/", "http://a:1@0", "http://a:1@1"], ["http://a:1"]),
        (["http://b:2", " ", "http://a:1", "http://b:2"], ["http://b:2", "http://a:1"]),
    ],
)
def test_base_urls_each_engine_once_in_first_seen_order(
    urls: list[str], expected: list[str]
) -> None:
    assert base_urls(urls) == expected


def _health(c: SessionLifecycleConfig, **kw: object) -> dict[str, object]:
    args: dict[str, object] = {
        "mode_docs": {},
        "mode_warnings": [],
        "probe_errors": {},
        "engines": [],
        "check_state": "pending",
        "open_count": 0,
        "closing_count": 0,
    }
    args.update(kw)
    return sessions_health(c, **args).to_json()  # type: ignore[arg-type]


def test_health_off_shows_only_that() -> None:
    assert _health(OFF, engines=["http://a"], probe_errors={"http://a": "x"}) == {"enabled": False}


@pytest.mark.parametrize(
    ("kw", "engines", "warnings"),
    [
        # Engines not read yet are listed as unchecked.
        ({"engines": ["http://a"]}, {"http://a": {"mode": "unchecked"}}, []),
        # A read engine shows its document and its warnings.
        (
            {
                "mode_docs": {"http://a": {"mode": "none"}},
                "mode_warnings": ["w"],
                "engines": ["http://a"],
            },
            {"http://a": {"mode": "none"}},
            ["w"],
        ),
        # One that could not be read shows the error, and a warning counts them.
        (
            {
                "mode_docs": {"http://a": {"mode": "none"}},
                "probe_errors": {"http://b": "refused"},
                "engines": ["http://a", "http://b"],
            },
            {"http://a": {"mode": "none"}, "http://b": {"mode": "unknown", "error": "refused"}},
            ["1 engine(s) did not answer /server_info: their session mode is unknown"],
        ),
        # The check finished and read nothing: the modes are unknown.
        (
            {"check_state": "incomplete", "probe_errors": {"http://b": "refused"}},
            {"http://b": {"mode": "unknown", "error": "refused"}},
            ["no engine answered /server_info: session modes unknown"],
        ),
        ({"check_state": "done"}, {}, ["no engine answered /server_info: session modes unknown"]),
    ],
)
def test_health_engines_and_warnings(
    kw: dict[str, object], engines: dict[str, object], warnings: list[str]
) -> None:
    out = _health(ON, **kw)
    assert out["engines"] == engines
    assert out["warnings"] == warnings


def test_health_without_the_check_lists_only_what_was_read() -> None:
    out = _health(cfg(check_engines=False), engines=["http://a"], check_state="not_started")
    assert out == {
        "enabled": True,
        "on_close": "abort",
        "sticky_routing": False,
        "idle_timeout_s": None,
        "engine_check": "not_started",
        "engines": {},
        "warnings": [],
        "open": 0,
        "closing": 0,
    }


@pytest.mark.parametrize(
    ("old", "new", "plan"),
    [
        # Nothing changed: nothing stopped or started.
        (ON, ON, TaskPlan(False, False, False, False)),
        # The idle timeout changes: the reaper restarts.
        (ON, cfg(idle_timeout_s=5.0), TaskPlan(True, False, True, False)),
        # Turned on: both may start; turned off: both stop.
        (OFF, ON, TaskPlan(True, False, True, True)),
        (ON, OFF, TaskPlan(True, True, True, False)),
        # The engine check turned off, then on again.
        (ON, cfg(check_engines=False), TaskPlan(False, True, False, False)),
        (cfg(check_engines=False), ON, TaskPlan(False, False, False, True)),
    ],
)
def test_reconfigure_plan(
    old: SessionLifecycleConfig, new: SessionLifecycleConfig, plan: TaskPlan
) -> None:
    assert reconfigure_plan(old, new) == plan


@pytest.mark.parametrize(
    ("c", "reaper", "checker"),
    [
        (OFF, False, False),
        (ON, False, True),
        (cfg(idle_timeout_s=1.0), True, True),
        (cfg(idle_timeout_s=1.0, check_engines=False), True, False),
        (dataclasses.replace(OFF, idle_timeout_s=1.0), False, False),
    ],
)
def test_which_background_tasks_a_config_wants(
    c: SessionLifecycleConfig, reaper: bool, checker: bool
) -> None:
    assert (wants_reaper(c), wants_checker(c)) == (reaper, checker)


@pytest.mark.parametrize(
    ("idle", "interval"), [(0.001, 0.01), (0.2, 0.05), (8.0, 2.0), (600.0, 5.0)]
)
def test_reap_interval_is_a_quarter_of_the_timeout_within_bounds(
    idle: float, interval: float
) -> None:
    assert reap_interval_s(idle) == pytest.approx(interval)


def test_check_delays_double_up_to_the_cap() -> None:
    assert check_delays(12, 0.5, 30.0) == (0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30, 30, 30)
    assert check_delays(0, 0.5, 30.0) == ()


def test_warn_throttle_lets_one_through_per_interval_and_counts_the_rest() -> None:
    w = WarnThrottle(interval_s=30.0, max_keys=2)
    a, b, c = ("http://a", "close_session"), ("http://b", "close_session"), ("x", "y")
    steps = [
        (a, 0.0, 0),  # first: through, nothing held back
        (a, 10.0, None),  # held back
        (a, 29.9, None),  # held back
        (b, 29.9, 0),  # another key: its own interval
        (a, 30.0, 2),  # through, telling the two held back
        (a, 31.0, None),
    ]
    for key, now, expected in steps:
        assert w.admit(key, now) == expected, (key, now)
    # A third key past max_keys restarts the table: the held-back count of a is lost.
    assert w.admit(c, 32.0) == 0
    assert len(w) == 1
    assert w.admit(a, 33.0) == 0


def test_table_gauges_count_sessions_and_requests_by_state() -> None:
    t = SessionTable(max_sessions=10, closed_ttl_s=60.0, idle_timeout_s=None)
    t.begin("s1", 0.0)
    queued = t.begin("s2", 0.0)
    forwarded = t.begin("s3", 0.0, ("r3",))
    assert queued.token is not None and forwarded.token is not None
    t.start_close("s1", 1.0)
    assert table_gauges(t) == {
        OPEN: 2.0,
        CLOSING: 1.0,
        CLOSED_REMEMBERED: 0.0,
        QUEUED_REQUESTS: 2.0,
        FORWARDED_REQUESTS: 1.0,
    }
    assert set(table_gauges(t)) <= set(GAUGE_HELP)
    assert all(name.startswith("agentic_kv/session/") for name in (*COUNTER_HELP, *GAUGE_HELP))
