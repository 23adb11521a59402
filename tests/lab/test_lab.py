"""Lab runs: determinism, every policy on a small scenario, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvlab.lab.runner import (
    POLICIES,
    LabConfig,
    LabError,
    format_table,
    median_row,
    run_lab,
    run_matrix,
)
from kvproxy.cli import main

# A short W1: 6 live sessions on 2 engines, 12 sessions of 3-8 turns, fast tools.
SMALL = LabConfig(
    workload="swe",
    engines=2,
    sessions_per_engine=3,
    sessions=12,
    token_scale=16,
    workload_overrides={
        "turns_median": 5,
        "turns_lo": 3,
        "turns_hi": 8,
        "tool_latency_slow_share": 0.0,
        "context_length": 12_288,
    },
)
TINY_POOL = {"max_total_tokens": 600}  # scaled tokens: below the live sessions' KV


def _turns(result: Any) -> list[tuple[Any, ...]]:
    return [
        (t.session_id, t.turn, t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.end_s)
        for t in result.workload.turns
    ]


@pytest.mark.parametrize("policy", ["off", "both"])
def test_same_seed_same_result_exactly(policy: str) -> None:
    cfg = dataclasses.replace(SMALL, policy=policy, engine_overrides=TINY_POOL)
    a, b = run_lab(cfg), run_lab(cfg)
    strip = ("wall_s", "speedup")
    assert {k: v for k, v in a.summary.items() if k not in strip} == {
        k: v for k, v in b.summary.items() if k not in strip
    }
    assert _turns(a) == _turns(b)
    assert a.engines == b.engines
    c = run_lab(dataclasses.replace(cfg, seed=1))
    assert _turns(c) != _turns(a)  # the seed matters


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_finishes_with_sane_numbers(policy: str) -> None:
    s = run_lab(dataclasses.replace(SMALL, policy=policy)).summary
    assert s["sessions"] == 12 and s["sessions_failed"] == 0
    assert s["turns"] >= 12 * 3
    assert 0.0 < s["cache_hit_rate"] < 1.0
    assert 0.0 <= s["recompute_share"] <= 1.0
    assert s["sessions_per_min"] > 0 and s["makespan_s"] > 0
    assert s["simulated_s"] >= s["makespan_s"]
    assert s["proxy_errors"] == {}
    if policy in ("admission", "both"):
        assert sum(s["admission_decisions"].values()) == s["requests"]
        assert s["first_turn_wait_p99_s"] is not None and s["first_turn_wait_p99_s"] >= 0
    else:
        assert s["admission_decisions"] == {}
        assert s["first_turn_wait_p99_s"] is None


def test_ceiling_evicts_nothing_and_off_under_a_tiny_pool_evicts() -> None:
    ceiling = run_lab(dataclasses.replace(SMALL, policy="ceiling")).summary
    assert ceiling["evicted_tokens"] == 0
    assert ceiling["recomputed_prefill_tokens"] == 0
    off = run_lab(dataclasses.replace(SMALL, policy="off", engine_overrides=TINY_POOL)).summary
    assert off["evicted_tokens"] > 0
    assert off["recomputed_prefill_tokens"] > 0
    assert off["cache_hit_rate"] < ceiling["cache_hit_rate"]
    assert off["sessions_per_min"] <= ceiling["sessions_per_min"]


def test_lifecycle_closes_sessions_on_every_engine() -> None:
    res = run_lab(dataclasses.replace(SMALL, policy="lifecycle"))
    # Every engine was told about every session close (fan-out), none is left tagged.
    for url in (e["url"] for e in res.engines):
        assert url.startswith("http://127.0.0.1:")
    assert res.summary["sessions"] == 12


def test_round_robin_placement_loses_the_cache_between_turns() -> None:
    hashed = run_lab(dataclasses.replace(SMALL, policy="ceiling")).summary
    rr = run_lab(dataclasses.replace(SMALL, policy="ceiling", router_policy="round_robin")).summary
    # Alternating engines: each turn finds at most the shared prefix and the turn
    # before last on its engine.
    assert rr["cache_hit_rate"] < hashed["cache_hit_rate"]


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(LabError, match="policy"):
        run_lab(dataclasses.replace(SMALL, policy="nope"))
    with pytest.raises(LabError, match="unknown workload"):
        run_lab(dataclasses.replace(SMALL, workload="nope"))
    with pytest.raises(LabError, match="engines"):
        run_lab(dataclasses.replace(SMALL, engines=0))


def test_median_over_seeds() -> None:
    rows = [
        {"seed": 0, "x": 1.0, "n": "a"},
        {"seed": 1, "x": 5.0, "n": "a"},
        {"seed": 2, "x": 2.0, "n": "a"},
    ]
    m = median_row(rows)
    assert m["x"] == 2.0 and m["n"] == "a" and m["seeds"] == [0, 1, 2]


def test_matrix_and_table() -> None:
    out = run_matrix(SMALL, ["off", "ceiling"], [0, 1])
    assert set(out) == {"off", "ceiling"}
    assert set(out["off"]["per_seed"]) == {0, 1}
    table = format_table({k: v["median"] for k, v in out.items()})
    assert "sessions/min" in table and "ceiling" in table


def test_hicache_loads_back_what_the_tiny_pool_evicts_and_ceiling_stays_without() -> None:
    off = run_lab(dataclasses.replace(SMALL, policy="off", engine_overrides=TINY_POOL)).summary
    hi_cfg = dataclasses.replace(SMALL, engine_overrides=TINY_POOL, hicache_ratio=4.0)
    hi = run_lab(dataclasses.replace(hi_cfg, policy="off")).summary
    assert (off["hicache"], hi["hicache"], hi["hicache_ratio"]) == (False, True, 4.0)
    assert hi["evicted_tokens"] > 0 and hi["loaded_back_tokens"] > 0
    assert hi["host_cached_tokens"] == hi["loaded_back_tokens"]
    assert hi["recomputed_prefill_tokens"] < off["recomputed_prefill_tokens"]
    assert hi["cache_hit_rate"] > off["cache_hit_rate"]
    ceiling = run_lab(dataclasses.replace(hi_cfg, policy="ceiling")).summary
    assert ceiling["hicache"] is False and ceiling["loaded_back_tokens"] == 0
    with pytest.raises(LabError, match="hicache ratio"):
        run_lab(dataclasses.replace(SMALL, hicache_ratio=0.0))


def test_the_host_link_sets_what_a_load_back_costs() -> None:
    hi_cfg = dataclasses.replace(SMALL, policy="off", engine_overrides=TINY_POOL, hicache_ratio=4.0)
    preset = run_lab(hi_cfg).summary
    slow = run_lab(dataclasses.replace(hi_cfg, hicache_link_gb_s=0.05)).summary
    free = run_lab(dataclasses.replace(hi_cfg, hicache_link_gb_s=1e6)).summary
    assert (preset["hicache_link_gb_s"], slow["hicache_link_gb_s"]) == (50.0, 0.05)
    assert min(slow["loaded_back_tokens"], free["loaded_back_tokens"]) > 0
    assert slow["makespan_s"] > preset["makespan_s"] >= free["makespan_s"]
    with pytest.raises(LabError, match="link bandwidth"):
        run_lab(dataclasses.replace(hi_cfg, hicache_link_gb_s=0.0))


def test_the_write_policy_reaches_the_engines() -> None:
    hi_cfg = dataclasses.replace(SMALL, policy="off", engine_overrides=TINY_POOL, hicache_ratio=4.0)
    through = run_lab(hi_cfg).summary
    back = run_lab(dataclasses.replace(hi_cfg, hicache_write_policy="write_back")).summary
    assert (through["hicache_write_policy"], back["hicache_write_policy"]) == (
        "write_through",
        "write_back",
    )
    # write-back copies only what the device evicts: the host never holds the device's KV
    # twice, so it keeps more, and loads more back than write-through's copies lose.
    assert back["evicted_tokens"] > 0 and back["loaded_back_tokens"] > 0
    assert back["recomputed_prefill_tokens"] <= through["recomputed_prefill_tokens"]
    both = run_lab(dataclasses.replace(hi_cfg, policy="both", hicache_write_policy="write_back"))
    assert both.summary["hicache_write_policy"] == "write_back"
    with pytest.raises(LabError, match="write policy"):
        run_lab(dataclasses.replace(hi_cfg, hicache_write_policy="write_sometimes"))


def test_cli_hicache_flag(tmp_path: Path) -> None:
    path = tmp_path / "lab.json"
    argv = ["lab", "--sessions-per-engine", "2", "--sessions", "4", "--policy", "off"]
    argv += ["--set", "turns_median=4", "--set", "turns_hi=6", "--json", str(path)]
    assert main([*argv, "--hicache"]) == 0
    doc = json.loads(path.read_text())
    assert doc["hicache_ratio"] == 2.0 and doc["policies"]["off"]["median"]["hicache"] is True
    assert main([*argv, "--hicache-ratio", "3"]) == 0
    assert json.loads(path.read_text())["hicache_ratio"] == 3.0
    assert main([*argv, "--hicache-link-gb-s", "400"]) == 0  # implies --hicache
    doc = json.loads(path.read_text())
    assert (doc["hicache_ratio"], doc["hicache_link_gb_s"]) == (2.0, 400.0)
    assert doc["policies"]["off"]["median"]["hicache_link_gb_s"] == 400.0
    assert main([*argv, "--hicache-write-policy", "write_back"]) == 0  # implies --hicache
    doc = json.loads(path.read_text())
    assert (doc["hicache_ratio"], doc["hicache_write_policy"]) == (2.0, "write_back")


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lab.json"
    rc = main(
        [
            "lab",
            "--workload",
            "swe",
            "--engines",
            "2",
            "--sessions-per-engine",
            "2",
            "--sessions",
            "4",
            "--policy",
            "off,ceiling",
            "--seeds",
            "0,1",
            "--set",
            "turns_median=4",
            "--set",
            "turns_hi=6",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    assert "cache hit rate" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    for policy in ("off", "ceiling"):
        row = doc["policies"][policy]["median"]
        for key in (
            "sessions_per_min",
            "cache_hit_rate",
            "recompute_share",
            "recomputed_prefill_tokens",
            "evicted_tokens",
            "ttft_p99_continuing_s",
            "makespan_s",
            "simulated_s",
            "wall_s",
            "sessions",
            "turns",
        ):
            assert key in row, key
        assert set(doc["policies"][policy]["per_seed"]) == {"0", "1"}


def test_cli_rejects_a_bad_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["lab", "--policy", "fast"])
    assert "policies must be" in capsys.readouterr().err


def test_cli_admission_overrides_reach_the_controller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lab.json"
    args = ["lab", "--sessions-per-engine", "2", "--sessions", "4", "--policy", "both"]
    args += ["--set", "turns_median=4", "--set", "turns_hi=6", "--json", str(path)]
    assert main([*args, "--admission", "ledger=fleet"]) == 0
    row = json.loads(path.read_text())["policies"]["both"]["median"]
    assert row["admission_counters"]["program_active"] == 0.0  # the fleet-wide path
    assert main(args) == 0
    row = json.loads(path.read_text())["policies"]["both"]["median"]
    assert row["admission_counters"]["program_active"] == 1.0  # per-engine ledgers
    assert main([*args, "--admission", "nope=1"]) == 2
    assert "unknown admission keys: nope" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--set", "--admission"])
def test_cli_refuses_an_override_without_a_name(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lab", "--sessions", "1", flag, "=3"]) == 2
    assert f"{flag} expects NAME=VALUE (got '=3')" in capsys.readouterr().err


def test_a_scrape_outage_releases_nobody_at_once() -> None:
    """/metrics failing 8 s of every minute while the gate holds work (engaged from the
    start): the answers keep the engines fresh; an engine silent on both goes one held
    turn per tick (1 s), never all at once."""
    cfg = dataclasses.replace(
        SMALL,
        policy="both",
        sessions=24,
        engine_overrides={"max_total_tokens": 800},
        signal_fault="periodic",
        admission_overrides={"engage_on_thrash": False},
        workload_overrides={**SMALL.workload_overrides, "turns_median": 8, "turns_hi": 12},
    )
    s = run_lab(cfg).summary
    assert s["signal_fault"] == "periodic" and s["sessions_failed"] == 0, s["errors"]
    assert s["simulated_s"] > 60.0  # an outage at least
    counters = s["admission_counters"]
    assert counters.get("decision_new_waited", 0) + counters.get("decision_resumed_waited", 0)
    outages = int(s["simulated_s"] // 60) + 1
    stale = counters.get("event_stale_release", 0)
    assert stale <= 8 * cfg.engines * outages, counters
    # Beyond those, as many went out for lack of a capacity reading as without the
    # outage (the first requests, before the first scrape).
    quiet = run_lab(dataclasses.replace(cfg, signal_fault="none")).summary["admission_counters"]
    bypassed = "decision_bypass_no_metrics"
    assert counters.get(bypassed, 0) - stale == quiet.get(bypassed, 0) <= 2, (counters, quiet)


def test_admission_stays_permissive_where_the_engines_are_not_busy() -> None:
    """A small fleet with a tiny pool recomputes a lot, but its engines idle most of
    the time: admission never engages and every turn goes at once, as with it off."""
    both = run_lab(dataclasses.replace(SMALL, policy="admission", engine_overrides=TINY_POOL))
    off = run_lab(dataclasses.replace(SMALL, policy="off", engine_overrides=TINY_POOL))
    counters = both.summary["admission_counters"]
    assert counters.get("event_engaged", 0) == 0, counters
    decisions = both.summary["admission_decisions"]
    assert set(decisions) <= {"admit:new_admitted", "admit:continuing_forwarded"}, decisions
    assert both.summary["sessions_per_min"] == pytest.approx(off.summary["sessions_per_min"])


def test_a_bad_signal_fault_is_a_clear_error() -> None:
    with pytest.raises(LabError, match="signal fault must be one of"):
        run_lab(dataclasses.replace(SMALL, signal_fault="flaky"))


def test_prefetches_with_tool_hints_reach_the_sessions_engines_through_the_placement() -> None:
    cfg = dataclasses.replace(
        SMALL,
        policy="both",
        engine_overrides=TINY_POOL,
        hicache_ratio=4.0,
        tool_hints=True,
        admission_overrides={"prefetch": True, "prefetch_lead_s": 0.25, "tick_s": 0.1},
    )
    r = run_lab(cfg)
    counters = r.summary["admission_counters"]
    sent = counters.get("event_prefetch_sent", 0)
    assert sent >= 1 and counters.get("prefetch_failed", 0) == 0
    assert counters["event_prefetch_planned"] >= sent
    # Every request an engine saw is a turn or a prefetch (one output token each).
    assert sum(e["requests"] for e in r.engines) == r.summary["turns"] + sent
    assert r.summary["tool_hints"] is True and r.summary["proxy_errors"] == {}
    # Without hints, timed by each session's own tool calls (the shortest of its last
    # four): fewer plans, as the tool calls are learnt one by one.
    own = run_lab(dataclasses.replace(cfg, tool_hints=False))
    learnt = own.summary["admission_counters"]
    assert 1 <= learnt["event_prefetch_planned"] < counters["event_prefetch_planned"]
    assert sum(e["requests"] for e in own.engines) == own.summary["turns"] + learnt.get(
        "event_prefetch_sent", 0
    )
