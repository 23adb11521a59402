"""The doctor's pure checks: facts in, lines out."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.doctor.checks import (
    EngineFacts,
    Intent,
    Line,
    ProbeFacts,
    RouterFacts,
    Status,
    config_lines,
    engine_lines,
    fleet_lines,
    heap_lines,
    probe_lines,
    router_lines,
    speedup_lines,
    summary,
)
from kvproxy.fleet.discovery import EngineList, RouterFlavor

GOOD_INFO: dict[str, Any] = {
    "version": "0.5.23",
    "enable_session_radix_cache": True,
    "enable_streaming_session": False,
    "radix_eviction_policy": "priority",
    "enable_priority_scheduling": True,
    "disable_radix_cache": False,
    "enable_metrics": True,
    "max_total_num_tokens": 200000,
    "tp_size": 2,
    "dp_size": 1,
}
GOOD_METRICS = (
    "# HELP sglang:token_usage x\n"
    'sglang:token_usage{tp_rank="0"} 0.25\n'
    'sglang:max_total_num_tokens{tp_rank="0"} 200000\n'
)
URL = "http://e:1"


def _engine(info: dict[str, Any] | None = None, **kw: Any) -> EngineFacts:
    merged = {**GOOD_INFO, **(info or {})}
    base: dict[str, Any] = {"info": merged, "metrics_status": 200, "metrics_text": GOOD_METRICS}
    base.update(kw)
    return EngineFacts(url=URL, **base)


def _bad(lines: list[Line]) -> list[Line]:
    return [line for line in lines if line.status is not Status.OK]


def test_a_good_engine_is_all_ok_and_reports_pool_and_parallelism() -> None:
    lines = engine_lines(_engine(), Intent())
    assert _bad(lines) == []
    text = "\n".join(line.render() for line in lines)
    assert "SGLang 0.5.23" in text
    assert "KV pool tokens 200000, tp 2, dp 1" in text
    assert "token_usage 0.25 of 200000 tokens" in text


@pytest.mark.parametrize(
    ("facts", "status", "needle", "fix"),
    [
        (
            _engine({"enable_session_radix_cache": False}),
            Status.FAIL,
            "neither the session radix cache nor streaming",
            "--enable-session-radix-cache",
        ),
        (
            _engine({"enable_session_radix_cache": False, "enable_streaming_session": True}),
            Status.WARN,
            "streaming sessions only",
            "--enable-session-radix-cache",
        ),
        (
            _engine({"disable_radix_cache": True}),
            Status.FAIL,
            "--disable-radix-cache",
            "drop --disable-radix-cache",
        ),
        (
            _engine({"radix_eviction_policy": "lru"}),
            Status.WARN,
            "radix eviction policy lru",
            "--radix-eviction-policy priority",
        ),
        (
            _engine({"enable_priority_scheduling": False}),
            Status.WARN,
            "priority scheduling off",
            "--enable-priority-scheduling",
        ),
        (
            _engine({"version": "0.5.15"}),
            Status.FAIL,
            "SGLang 0.5.15 (< 0.5.16",
            "SGLang >= 0.5.16",
        ),
        (_engine({"version": None}), Status.WARN, "version not reported", "0.5.16"),
        (
            _engine({"enable_metrics": False}),
            Status.FAIL,
            "enable_metrics is false",
            "--enable-metrics",
        ),
        (
            _engine(metrics_status=404, metrics_text="Not Found"),
            Status.FAIL,
            "/metrics answered HTTP 404",
            "--enable-metrics",
        ),
        (
            _engine(metrics_status=500, metrics_text="boom"),
            Status.FAIL,
            "/metrics answered HTTP 500",
            "engine's log",
        ),
        (
            _engine(metrics_text="garbage {{{ not prometheus"),
            Status.FAIL,
            "not parseable as SGLang's (no sglang:token_usage and sglang:max_total_num_tokens)",
            "--enable-metrics",
        ),
        (
            _engine(metrics_status=None, metrics_text=None, metrics_error="timed out"),
            Status.FAIL,
            "/metrics did not answer (timed out)",
            "--enable-metrics",
        ),
        (
            EngineFacts(url=URL, error="ClientConnectorError: refused"),
            Status.FAIL,
            "not reachable (ClientConnectorError: refused)",
            "start the engine",
        ),
        (
            EngineFacts(url=URL, info=None, info_error="/server_info: HTTP 404"),
            Status.WARN,
            "no /server_info (/server_info: HTTP 404)",
            "0.5.16",
        ),
    ],
)
def test_each_bad_engine_setting_gives_its_line_and_fix(
    facts: EngineFacts, status: Status, needle: str, fix: str
) -> None:
    lines = engine_lines(facts, Intent())
    hits = [line for line in lines if needle in line.message]
    assert len(hits) == 1, [line.render() for line in lines]
    assert hits[0].status is status
    assert hits[0].fix is not None and fix in hits[0].fix
    assert hits[0].render().startswith(f"{status.value:<4}  engine {URL}: ")


def test_unrecognised_server_info_warns() -> None:
    facts = EngineFacts(url=URL, info={"version": "0.5.23"}, metrics_status=200, metrics_text="")
    lines = engine_lines(facts, Intent(lifecycle=False, admission=False))
    assert any("names no session settings" in line.message for line in _bad(lines))


@pytest.mark.parametrize(
    ("facts", "needle"),
    [
        (_engine({"enable_session_radix_cache": False}), "neither the session radix"),
        (_engine(metrics_status=404, metrics_text=""), "/metrics answered HTTP 404"),
        (_engine({"version": "0.5.10"}), "SGLang 0.5.10"),
    ],
)
def test_a_feature_not_asked_for_only_warns(facts: EngineFacts, needle: str) -> None:
    lines = engine_lines(facts, Intent(lifecycle=False, admission=False))
    (hit,) = [line for line in lines if needle in line.message]
    assert hit.status is Status.WARN


def _router(flavor: RouterFlavor, **kw: Any) -> RouterFacts:
    engines = EngineList(healthy=("http://a:1", "http://b:1"), flavor=flavor)
    return RouterFacts(url="http://r:1", engines=kw.pop("engines", engines), **kw)


def _line(lines: list[Line], needle: str) -> Line:
    hits = [line for line in lines if needle in line.message]
    assert len(hits) == 1, [line.render() for line in lines]
    return hits[0]


def test_router_smg_with_consistent_hashing_is_all_ok() -> None:
    lines = router_lines(
        _router(RouterFlavor.SMG, version="smg-1.13.0"),
        Intent(policy="consistent_hashing", sticky_routing=True),
    )
    assert _bad(lines) == []
    assert _line(lines, "package smg (smg-1.13.0)")
    assert _line(lines, "2 healthy workers")
    assert "attribute each session to its engine" in _line(lines, "policy").message


@pytest.mark.parametrize(
    ("facts", "intent", "needle", "status", "fix"),
    [
        (
            RouterFacts(url="http://r:1", error="ClientConnectorError: refused"),
            Intent(),
            "not reachable (ClientConnectorError: refused)",
            Status.FAIL,
            "--router-url",
        ),
        (
            _router(RouterFlavor.LEGACY_WORKERS),
            Intent(),
            "package sglang-router (sglang-router-0.3",
            Status.FAIL,
            "smg >= 1.5",
        ),
        (
            _router(RouterFlavor.LEGACY_LIST),
            Intent(lifecycle=False),
            "package sglang-router (sglang-router-0.2",
            Status.WARN,
            "smg >= 1.5",
        ),
        (
            _router(RouterFlavor.SMG, version="smg-1.4.0"),
            Intent(),
            "smg smg-1.4.0 (< 1.5",
            Status.FAIL,
            "smg >= 1.5",
        ),
        (
            RouterFacts(url="http://r:1", engines=None, listing_error="/workers: HTTP 404"),
            Intent(),
            "no worker list (/workers: HTTP 404)",
            Status.FAIL,
            "not at an engine",
        ),
        (
            _router(RouterFlavor.SMG, engines=EngineList(flavor=RouterFlavor.UNKNOWN)),
            Intent(),
            "lists no workers",
            Status.FAIL,
            "--worker-urls",
        ),
        (
            _router(
                RouterFlavor.SMG,
                engines=EngineList(
                    healthy=("http://a:1",), unhealthy=("http://b:1",), flavor=RouterFlavor.SMG
                ),
            ),
            Intent(),
            "1 healthy, 1 unhealthy workers (http://b:1)",
            Status.WARN,
            "check those engines",
        ),
        (
            _router(RouterFlavor.SMG),
            Intent(),
            "routing policy unknown",
            Status.WARN,
            "set router.policy",
        ),
        (
            _router(RouterFlavor.SMG),
            Intent(policy="round_robin"),
            "policy round_robin: admission cannot attribute placement",
            Status.WARN,
            "--policy consistent_hashing",
        ),
        (
            _router(RouterFlavor.SMG),
            Intent(policy="consistent_hashing", sticky_routing=False),
            "sticky_routing is off",
            Status.WARN,
            "sticky_routing: true",
        ),
    ],
)
def test_router_lines(
    facts: RouterFacts, intent: Intent, needle: str, status: Status, fix: str
) -> None:
    hit = _line(router_lines(facts, intent), needle)
    assert hit.status is status
    assert hit.fix is not None and fix in hit.fix


def test_round_robin_is_fine_without_admission() -> None:
    hit = _line(
        router_lines(_router(RouterFlavor.SMG), Intent(admission=False, policy="random")), "policy"
    )
    assert hit.status is Status.OK


def test_config_lines() -> None:
    (none,) = config_lines(None, None, None)
    assert none.status is Status.OK and "both features" in none.message
    (bad,) = config_lines("k.yaml", "admission.headroom: must be in (0, 1] (got 2.0)", None)
    assert bad.status is Status.FAIL
    assert "k.yaml is invalid: admission.headroom" in bad.message
    good = config_lines(
        "k.yaml",
        None,
        {"session_lifecycle": "on", "admission": "off"},
        config_router_url="http://r:1/",
        router_url="http://r:1",
    )
    assert [line.status for line in good] == [Status.OK]
    assert "session_lifecycle on, admission off" in good[0].message
    differ = config_lines(
        "k.yaml", None, {}, config_router_url="http://r:1", router_url="http://other:2"
    )
    assert differ[1].status is Status.WARN and "--router-url is http://other:2" in differ[1].message


def test_speedup_lines_warn_only_when_admission_would_use_numpy() -> None:
    (have,) = speedup_lines(True, Intent())
    assert have.status is Status.OK and "vectorised" in have.message
    (unused,) = speedup_lines(False, Intent(admission=False))
    assert unused.status is Status.OK and "only admission" in unused.message
    (missing,) = speedup_lines(False, Intent())
    assert missing.status is Status.WARN and missing.fix is not None
    assert "kvproxy[fast]" in missing.fix


def test_heap_lines_warn_only_when_glibc_would_hand_buffers_back() -> None:
    (kept,) = heap_lines(True, 64 << 20)
    assert kept.status is Status.OK and "64 MiB" in kept.message
    (off,) = heap_lines(True, 0)
    assert off.status is Status.WARN and off.fix is not None and "malloc_retain_bytes" in off.fix
    (other,) = heap_lines(False, 64 << 20)
    assert other.status is Status.OK and "not glibc" in other.message


def test_fleet_lines_flag_mixed_session_modes() -> None:
    same = [_engine(), _engine()]
    assert fleet_lines(same) == []
    mixed = [_engine(), _engine({"enable_session_radix_cache": False})]
    (line,) = fleet_lines(mixed)
    assert line.status is Status.WARN and "none, session_radix" in line.message


HOST_TIER = '\nsglang:hicache_host_total_tokens{tp_rank="0"} 400000.0\n'


@pytest.mark.parametrize(
    ("intent", "host", "expected"),
    [
        (Intent(), False, None),  # prefetch off: nothing said
        (Intent(prefetch=True, admission=False), False, None),  # admission off
        (Intent(prefetch=True), True, Status.OK),
        (Intent(prefetch=True), False, Status.WARN),
    ],
)
def test_fleet_lines_check_a_host_tier_only_with_prefetch_on(
    intent: Intent, host: bool, expected: Status | None
) -> None:
    metrics = GOOD_METRICS + (HOST_TIER if host else "")
    engines = [_engine(metrics_text=metrics), _engine(metrics_text=GOOD_METRICS)]
    lines = fleet_lines(engines, intent)
    if expected is None:
        assert lines == []
    else:
        (line,) = lines
        assert line.status is expected
        if expected is Status.WARN:
            assert line.fix is not None and "--enable-hierarchical-cache" in line.fix
        else:
            assert "1 of 2 report a host KV tier" in line.message


def _probe(status: int | None = 200, **recorded: list[str] | None) -> ProbeFacts:
    return ProbeFacts(
        session_id="sid-1",
        rid="rid-1",
        status=status,
        error=None if status else "timed out",
        recorded=recorded,
    )


def _body(**fields: Any) -> str:
    return orjson.dumps({"text": "x", **fields}).decode()


@pytest.mark.parametrize(
    ("facts", "status", "needle"),
    [
        (_probe(a=[_body(rid="other")], b=[_body(session_id="sid-1")]), Status.OK, "reached b"),
        (_probe(a=[_body(rid="rid-1")]), Status.FAIL, "reached a without its session_id"),
        (_probe(a=[_body(rid="other")], b=[]), Status.FAIL, "no engine recorded the probe"),
        (_probe(a=None, b=None), Status.OK, "cannot be read back"),
        (_probe(a=[], b=[]), Status.OK, "cannot be read back"),
        (_probe(a=["not json"]), Status.FAIL, "no engine recorded"),
        (_probe(503), Status.FAIL, "failed (HTTP 503)"),
        (_probe(None), Status.FAIL, "failed (timed out)"),
    ],
)
def test_probe_lines(facts: ProbeFacts, status: Status, needle: str) -> None:
    (line,) = probe_lines(facts)
    assert line.status is status
    assert needle in line.message


def test_summary_exit_code() -> None:
    ok = Line(Status.OK, "x", "fine")
    warn = Line(Status.WARN, "x", "meh", "do y")
    fail = Line(Status.FAIL, "x", "broken", "do z")
    assert summary([ok, warn]) == ("doctor: 1 ok, 1 warn, 0 fail", 0)
    assert summary([ok, warn, fail]) == ("doctor: 1 ok, 1 warn, 1 fail", 1)
    assert fail.render() == "fail  x: broken. Fix: do z"
    assert ok.render() == "ok    x: fine"
