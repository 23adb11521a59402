"""``kvproxy demo``: the pure parts (configs, scenario sizing, ratios and verdicts, the
lab table) and a smoke run of ``--quick`` through the real stack (simulated engines,
smg consistent_hashing, kvproxy) that checks what reached the engines."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvlab.demo import add_arguments, gap_closed, lab_policies, run_lab_table, scenario_from_args
from kvlab.lab.runner import POLICIES
from kvlab.rollout import (
    DEMO_W1,
    QUICK_W1,
    VARIANTS,
    VARIANTS_BY_NAME,
    format_table,
    lab_routing_keys,
    pid_alive,
    proxy_config,
    ratio,
    report_lines,
    run_scenario,
    to_simulated,
    verdict,
)
from kvproxy.config import AdmissionConfig, SessionLifecycleConfig, from_mapping

needs_smg = pytest.mark.skipif(
    importlib.util.find_spec("smg") is None, reason="the real router (smg) is not installed"
)

TIMEOUT_S = 360  # two runs of at most 144 s (run_timeout_sim_s x time scale), about 30 s each


# ------------------------------------------------------------- pure parts (fast)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_proxy_config_is_the_documented_defaults_plus_the_features_switches(variant) -> None:  # type: ignore[no-untyped-def]
    doc = proxy_config(
        variant,
        port=18100,
        router_url="http://127.0.0.1:18000",
        engine_urls=["http://127.0.0.1:18001", "http://127.0.0.1:18002"],
        router_policy="consistent_hashing",
        time_scale=0.2,
        token_scale=16,
    )
    cfg = from_mapping(yaml.safe_load(yaml.safe_dump(doc)))
    # Nothing but the features' switches differs from the documented defaults.
    assert cfg.admission == dataclasses.replace(
        AdmissionConfig(), enabled=variant.admission, prefetch=variant.prefetch
    )
    assert cfg.session_lifecycle == dataclasses.replace(
        SessionLifecycleConfig(), enabled=variant.lifecycle
    )
    assert cfg.router.policy == "consistent_hashing"
    assert (cfg.server.time_scale, cfg.server.token_scale) == (0.2, 16)
    assert cfg.router.engines == ("http://127.0.0.1:18001", "http://127.0.0.1:18002")
    assert set(doc["admission"]) == ({"enabled", "prefetch"} if variant.prefetch else {"enabled"})
    assert set(doc["session_lifecycle"]) == {"enabled"}


@pytest.mark.parametrize(
    ("scenario", "ratio"), [(DEMO_W1, 2.0), (QUICK_W1, 2.0)], ids=["w1", "quick"]
)
def test_demo_scenarios_are_kv_bound_w1(scenario, ratio) -> None:  # type: ignore[no-untyped-def]
    scenario.check()
    d = scenario.describe()
    assert ratio - 0.2 <= d["working_set_over_pool"] <= ratio + 0.2
    # More sessions than one wave: a run is not one wave's longest session.
    assert scenario.total_sessions > scenario.concurrency
    assert scenario.workload == "swe"
    assert scenario.cost_model == "qwen3-8b-h100"
    assert scenario.token_scale == 16
    assert scenario.engines == 2
    assert scenario.router_policy == "consistent_hashing"
    # A request can never be larger than the pool.
    assert scenario.spec().context_length <= scenario.pool()


def test_scenario_sizing_and_checks() -> None:
    half = dataclasses.replace(DEMO_W1, pool_ratio=1.0)
    assert half.pool() == pytest.approx(2 * DEMO_W1.pool(), abs=2)
    assert dataclasses.replace(DEMO_W1, pool_tokens=5000).pool() == 5000
    # Context larger than the pool: a clear error, not failed sessions.
    too_small = dataclasses.replace(DEMO_W1, workload_overrides={}, pool_tokens=1000)
    with pytest.raises(ValueError, match="context length"):
        too_small.check()
    with pytest.raises(ValueError, match="time scale"):
        dataclasses.replace(DEMO_W1, time_scale=0).check()


def test_to_simulated_divides_durations_and_multiplies_rates() -> None:
    wall = {
        "makespan_s": 10.0,
        "ttft_p99_continuing_s": 0.5,
        "admission_wait_p99_ms": 100.0,
        "sessions_per_min": 30.0,
        "output_tokens_per_s": 8.0,
        "recomputed_prefill_tokens": 123,
        "cache_hit_rate": 0.5,
    }
    sim = to_simulated(wall, 0.25)
    assert sim["makespan_s"] == 40.0
    assert sim["ttft_p99_continuing_s"] == 2.0
    assert sim["admission_wait_p99_ms"] == 400.0
    assert sim["sessions_per_min"] == 7.5
    assert sim["output_tokens_per_s"] == 2.0
    assert sim["recomputed_prefill_tokens"] == 123
    assert sim["cache_hit_rate"] == 0.5


def _row(spm: float, rec: float, tail: float) -> dict[str, float]:
    return {
        "sessions_per_min": spm,
        "recomputed_prefill_tokens": rec,
        "ttft_p99_continuing_s": tail,
    }


def test_verdicts_come_from_the_numbers() -> None:
    off = _row(10.0, 1000.0, 2.0)
    assert verdict("admission", _row(23.0, 200.0, 1.6), off) == (
        "admission: 2.30x sessions/min, 0.20x recompute, continuing-turn TTFT p99 0.80x -> faster"
    )
    assert verdict("lifecycle", _row(7.0, 300.0, 3.0), off).endswith(
        "0.70x sessions/min, 0.30x recompute, continuing-turn TTFT p99 1.50x -> slower"
    )
    # Admission slower than off is reported as a defect, not as a verdict.
    assert verdict("both", _row(7.0, 300.0, 3.0), off).endswith(
        "-> slower: a defect, please report it with results.json (docs/admission.md)"
    )
    assert verdict("x", _row(12.0, 900.0, 4.0), off).endswith("-> faster, with a worse tail")
    assert verdict("x", _row(10.0, 500.0, 2.0), off).endswith("-> same throughput, less recompute")
    assert verdict("x", _row(10.1, 1000.0, 2.0), off).endswith("-> no measurable difference")
    assert ratio(0, 0) == 1.0
    assert ratio(1, 0) is None
    assert ratio(None, 1) is None


def test_table_has_a_ratio_column_and_a_verdict_per_feature() -> None:
    meds = {"off": _row(10.0, 1000.0, 2.0), "both": _row(20.0, 100.0, 1.0)}
    table = format_table(meds)
    header = table.splitlines()[0].split()
    assert header == ["off", "both", "both/off"]
    spm = next(line for line in table.splitlines() if line.startswith("sessions/min"))
    assert spm.split()[-3:] == ["10.00", "20.00", "2.00x"]
    lines = report_lines(meds)
    assert lines[-1].startswith("both: 2.00x sessions/min, 0.10x recompute")


def test_gap_closed() -> None:
    meds = {"off": _row(4.0, 0, 0), "both": _row(7.0, 0, 0), "ceiling": _row(8.0, 0, 0)}
    assert gap_closed(meds) == {"both": 0.75}
    assert gap_closed({"off": _row(4.0, 0, 0), "both": _row(7.0, 0, 0)}) == {}
    assert gap_closed({**meds, "ceiling": _row(4.0, 0, 0)}) == {}


def test_lab_table_runs_every_policy_of_the_lab() -> None:
    assert lab_policies()[: len(POLICIES)] == list(POLICIES)
    text, doc = run_lab_table([0], quick=True, policies=["off", "both"])
    assert text.splitlines()[0].split() == ["off", "both"]
    assert "both:" in text and "sessions/min" in text
    assert set(doc["policies"]) == {"off", "both"}
    # --lab --quick runs the quick demo's W1 in the lab.
    assert doc["policies"]["off"]["median"]["sessions"] == QUICK_W1.total_sessions


def test_lab_routing_keys_place_every_session_as_the_lab_does() -> None:
    from kvlab.lab.runner import LabConfig, engine_urls
    from kvproxy.fleet.ring import HashRing

    lab = HashRing(engine_urls(LabConfig(engines=2)))
    ids = [f"s{i}" for i in range(200)]
    for ports in [(30001, 30002), (41234, 52345), (52345, 41234)]:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        key = lab_routing_keys(urls)
        real = HashRing(urls)
        keys = [key(sid) for sid in ids]
        # Every session reaches the engine of the lab's index, under a key of its own.
        assert [urls.index(real.owner(k) or "") for k in keys] == [
            lab.urls.index(lab.owner(sid) or "") for sid in ids
        ]
        assert len(set(keys)) == len(ids)
        assert all(k == sid or k.startswith(f"{sid}~") for k, sid in zip(keys, ids, strict=True))
        assert [key(sid) for sid in ids] == keys  # stable
    # On the lab's own URLs every key is the session id itself.
    same = lab_routing_keys(list(lab.urls))
    assert [same(sid) for sid in ids] == ids


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert not pid_alive(proc.pid)


# ------------------------------------------------------------- the real stack


@needs_smg
def test_quick_demo_runs_clean_and_both_features_reach_the_engines(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    cmd = [sys.executable, "-m", "kvproxy", "demo", "--quick", "--out", str(out)]
    if not has_mpl:
        cmd.append("--json-only")
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())

    # Every process the demo started (2 engines, smg, kvproxy per run) is gone.
    runs = doc["runs"]
    assert list(runs) == ["off", "both"]
    assert len(doc["pids"]) == 2 * (QUICK_W1.engines + 2)
    assert [p for p in doc["pids"] if pid_alive(p)] == []

    # The medians, the ratio column and a verdict for "both" were printed.
    assert "both/off" in proc.stdout
    assert "both: " in proc.stdout and "x sessions/min" in proc.stdout
    assert "engine clock overrun" in proc.stdout

    sessions = QUICK_W1.total_sessions
    for name, per in runs.items():
        (res,) = per.values()
        s = res["summary"]
        assert s["sessions_started"] == sessions, name
        assert s["sessions_failed"] == 0, (name, s["errors"])
        assert s["cached_tokens"] <= s["prompt_tokens"], name
        assert 0 <= s["recomputed_prefill_tokens"] <= s["prefill_tokens"] <= s["prompt_tokens"]
        assert 0.0 <= s["cache_hit_rate"] <= 1.0, name
        # Every configuration used the same router policy and time scale.
        cfg = res["proxy_config"]
        assert cfg["router"]["policy"] == "consistent_hashing", name
        assert cfg["server"]["time_scale"] == QUICK_W1.time_scale, name
        clock = res["engine_clock"]
        assert len(clock) == QUICK_W1.engines and all(c is not None for c in clock), name
        seen = res["reached_engines"]
        assert seen["generate"] == s["requests"], name
        # The routing key reached the engines on every request, and consistent hashing
        # kept every session on one engine.
        assert seen["routing_key"] == seen["generate"], name
        assert seen["sessions_seen"] == sessions, name
        assert seen["sessions_on_two_engines"] == 0, name

    off = runs["off"]["0"]["reached_engines"]
    both = runs["both"]["0"]["reached_engines"]
    # Features off: kvproxy adds nothing to the body and no close reaches an engine.
    assert off["session_id"] == 0 and off["priority"] == 0
    assert off["close_session"] == 0
    # Both on: every request tagged with its session, no priority injected (priority
    # steering is off by default: docs/admission.md#defaults), and every session closed on
    # every engine (fan-out).
    assert both["session_id"] == both["generate"] > 0
    assert both["priority"] == 0
    assert both["close_session"] == sessions * QUICK_W1.engines
    stats = runs["both"]["0"]["summary"]["proxy_stats"]
    assert stats.get("agentic_kv/session/close") == sessions, stats
    assert not stats.get("agentic_kv/session/close_failure"), stats
    # Admission ran in program mode (placement mirrored from consistent_hashing).
    assert stats.get("agentic_kv/admission/program_active") == 1, stats
    assert stats.get("agentic_kv/admission/decision_continuing_forwarded", 0) > 0, stats

    if has_mpl:
        assert (out / "chart.png").stat().st_size > 1000


# A few short sessions: a run of a second or two of wall time.
TINY = dataclasses.replace(
    QUICK_W1,
    name="tiny",
    sessions_per_engine=2,
    sessions=6,
    pool_ratio=None,
    pool_tokens=4000,
    time_scale=0.05,
    workload_overrides={"turns_median": 3, "turns_lo": 2, "turns_hi": 4, "tool_latency_cap_s": 2},
    record_requests=0,
)


def _shape(doc: object) -> object:
    """The structure of a document: its keys and value types, not its numbers (nor
    which engine URLs, the keys of ``engine_deltas``)."""
    if isinstance(doc, dict):
        return {("<url>" if k.startswith("http") else k): _shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_shape(v) for v in doc[:1]]
    return type(doc).__name__ if doc is not None else None


@needs_smg
def test_hicache_reaches_the_engines(tmp_path: Path) -> None:
    hicache = dataclasses.replace(TINY, hicache_ratio=2.0, hicache_write_policy="write_back")
    pids: list[int] = []
    doc = run_scenario(
        hicache,
        [VARIANTS_BY_NAME["off"]],
        [0],
        out_dir=tmp_path,
        pids=pids,
        progress=lambda line: None,
        side_by_side=False,
    )
    run = doc["runs"]["off"]["0"]
    assert run["summary"]["sessions_failed"] == 0, run["summary"]["errors"]
    # Only an engine with --enable-hierarchical-cache exports SGLang's load-back counter.
    deltas = run["engine_deltas"]
    assert len(deltas) == TINY.engines
    assert all("load_back_tokens_total" in d for d in deltas.values()), deltas
    # The write policy reached every engine, as SGLang's /server_info reports it.
    tier = {"enable_hierarchical_cache": True, "hicache_ratio": 2.0}
    assert run["engine_hicache"] == [{**tier, "hicache_write_policy": "write_back"}] * TINY.engines
    assert [p for p in pids if pid_alive(p)] == []


@pytest.mark.parametrize(
    ("ratio", "policy", "error"),
    [
        (0.0, None, "hicache ratio must be > 0"),
        (None, "write_back", "needs the hicache on"),
        (2.0, "write_around", "hicache write policy must be one of"),
    ],
)
def test_a_bad_hicache_scenario_is_refused(
    ratio: float | None, policy: str | None, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        dataclasses.replace(TINY, hicache_ratio=ratio, hicache_write_policy=policy).check()


def test_the_write_policy_flag_turns_the_hicache_on() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    scenario = scenario_from_args(
        parser.parse_args(["--quick", "--hicache-write-policy", "write_back"])
    )
    assert (scenario.hicache_ratio, scenario.hicache_write_policy) == (2.0, "write_back")
    plain = scenario_from_args(parser.parse_args(["--quick", "--hicache"]))
    assert (plain.hicache_ratio, plain.hicache_write_policy) == (2.0, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--hicache-write-policy", "write_around"])


@needs_smg
def test_side_by_side_runs_each_configuration_on_its_own_stack(tmp_path: Path) -> None:
    variants = [VARIANTS_BY_NAME["off"], VARIANTS_BY_NAME["both"]]
    lines: list[str] = []
    docs = {}
    pids: dict[bool, list[int]] = {}
    for side in (False, True):
        pids[side] = []
        docs[side] = run_scenario(
            TINY,
            variants,
            [0],
            out_dir=tmp_path / str(side),
            pids=pids[side],
            progress=lines.append,
            side_by_side=side,
        )
    one, two = docs[False], docs[True]
    assert (one["side_by_side"], two["side_by_side"]) == (False, True)
    # Every process each started (2 engines, smg, kvproxy per run) was stopped.
    for started in pids.values():
        assert len(started) == 2 * (TINY.engines + 2)
        assert [p for p in started if pid_alive(p)] == []
    for doc in (one, two):
        for name in ("off", "both"):
            s = doc["runs"][name]["0"]["summary"]
            assert s["sessions_started"] == TINY.total_sessions, (name, s)
            assert s["sessions_failed"] == 0, (name, s["errors"])
    # The same results document either way (its numbers aside) ...
    assert _shape({k: v for k, v in one.items() if k != "side_by_side"}) == _shape(
        {k: v for k, v in two.items() if k != "side_by_side"}
    )
    # ... but side by side, the two stacks ran on different engines at the same time.
    off, both = (two["runs"][n]["0"] for n in ("off", "both"))
    assert set(off["proxy_config"]["router"]["engines"]).isdisjoint(
        both["proxy_config"]["router"]["engines"]
    )
    seq = [one["runs"][n]["0"]["proxy_config"]["router"]["engines"] for n in ("off", "both")]
    assert seq[0] == seq[1]
    assert any("side by side" in line for line in lines)
    assert any(line.startswith("  [off-s0]") for line in lines)
