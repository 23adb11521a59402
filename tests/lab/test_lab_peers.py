"""The peers in the lab: ThunderAgent (most-room and origin-only resume, and placed by
the router) and a fixed cap, on a small burst over-subscribing one or two engines (step 06
in miniature)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvlab.lab.runner import LabConfig, LabError, run_lab
from kvproxy.cli import main

# 12 sessions x 3 turns on a 30k-token unique preamble; pool 180k tokens per engine: the
# live working set is 2x the pool, as in the replication's step 06 (2.2x).
BURST = LabConfig(
    workload="burst",
    engines=1,
    sessions_per_engine=12,
    sessions=12,
    token_scale=16,
    workload_overrides={"task_prompt_median": 30_000},
    engine_overrides={"max_total_tokens": 180_000 // 16},
)


def _row(policy: str, **kw: object) -> dict[str, object]:
    return run_lab(dataclasses.replace(BURST, policy=policy, **kw)).summary  # type: ignore[arg-type]


def test_thunder_keeps_prefixes_that_off_loses_and_is_deterministic() -> None:
    off, thunder = _row("off"), _row("thunder")
    assert off["cache_hit_rate"] < 0.1  # type: ignore[operator]
    assert thunder["cache_hit_rate"] > 0.5  # type: ignore[operator]
    assert thunder["makespan_s"] < off["makespan_s"]  # type: ignore[operator]
    assert thunder["sessions"] == 12 and thunder["sessions_failed"] == 0
    counters = thunder["admission_counters"]
    assert isinstance(counters, dict) and counters["immediate"] >= 1
    assert thunder["admission_decisions"]["wait"] >= 1  # type: ignore[index]
    again = _row("thunder")
    strip = ("wall_s", "speedup")
    assert {k: v for k, v in again.items() if k not in strip} == {
        k: v for k, v in thunder.items() if k not in strip
    }


def test_most_room_migrates_and_origin_only_never_does() -> None:
    two = {"engines": 2, "sessions_per_engine": 8, "sessions": 16}
    most = _row("thunder", **two)
    origin = _row("thunder-origin", **two)
    assert most["sessions"] == origin["sessions"] == 16
    assert origin["admission_counters"]["migrations"] == 0  # type: ignore[index]
    assert most["admission_counters"]["resumes"] >= 0  # type: ignore[index]


def test_thunder_router_takes_the_routers_engines_as_kvproxy_must() -> None:
    """thunder-router places every session where the router does (off's split of the
    requests over the engines); thunder-origin places new programs itself."""
    two = {"engines": 2, "sessions_per_engine": 8, "sessions": 16}
    runs = {
        p: run_lab(dataclasses.replace(BURST, policy=p, **two))  # type: ignore[arg-type]
        for p in ("off", "thunder-router", "thunder-origin")
    }
    split = {p: [e["requests"] for e in r.engines] for p, r in runs.items()}
    assert split["thunder-router"] == split["off"]
    assert split["thunder-origin"] != split["off"]
    router = runs["thunder-router"].summary
    assert router["sessions"] == 16 and router["sessions_failed"] == 0
    assert router["cache_hit_rate"] > runs["off"].summary["cache_hit_rate"]
    assert router["admission_counters"]["migrations"] == 0


def test_cap_limits_live_sessions_per_engine() -> None:
    capped = _row("cap:4")
    assert capped["sessions"] == 12
    assert capped["admission_counters"] == {"admitted_from_fifo": 8.0}
    assert capped["cache_hit_rate"] > _row("off")["cache_hit_rate"]  # type: ignore[operator]


def test_peer_overrides_and_bad_names() -> None:
    no_decay = _row("thunder", peer_overrides={"acting_half_life_s": 0})
    assert no_decay["sessions"] == 12
    with pytest.raises(LabError, match="thunder configuration"):
        _row("thunder", peer_overrides={"resume_placement": "anywhere"})
    with pytest.raises(LabError, match="cap:N"):
        _row("cap:0")
    with pytest.raises(LabError, match="thunder-origin"):
        _row("thunderish")


def test_cli_runs_peers_beside_kvproxy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "lab",
            "--workload",
            "burst",
            "--engines",
            "1",
            "--sessions-per-engine",
            "6",
            "--sessions",
            "6",
            "--set",
            "task_prompt_median=6000",
            "--pool-tokens",
            "1200",
            "--policy",
            "off,both,thunder,thunder-origin,cap:3,ceiling",
            "--peer",
            "force_after_s=600",
            "--json",
            str(tmp_path / "peers.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("thunder", "thunder-origin", "cap:3", "both"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["lab", "--policy", "cap:none"])
    assert "cap:N" in capsys.readouterr().err


def test_a_deadline_is_a_measurement_window() -> None:
    cut = _row("thunder", deadline_s=20.0)
    assert cut["makespan_s"] == pytest.approx(20.0)
    assert cut["sessions_failed"] >= 1  # sessions still running at 20 s count as failed
    assert cut["sessions"] + cut["sessions_failed"] == 12
    with pytest.raises(LabError, match="deadline"):
        _row("off", deadline_s=0.0)
