"""Smoke test of ``kvproxy demo --quick``: the real stack (simulated engines, smg,
kvproxy) four ways, every process cleaned up, consistent results."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvproxy.config import from_mapping
from kvproxy.demo import (
    VARIANTS,
    ProxyTuning,
    bypasses,
    format_table,
    pid_alive,
    presets,
    proxy_config,
    working_set_tokens,
)

needs_smg = pytest.mark.skipif(
    importlib.util.find_spec("smg") is None, reason="the real router (smg) is not installed"
)

TIMEOUT_S = 90


# ------------------------------------------------------------- pure parts (fast)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_proxy_config_is_a_valid_kvproxy_config(variant, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    preset = presets()["default"]
    doc = proxy_config(
        variant,
        port=18100,
        router_url="http://127.0.0.1:18000",
        engine_urls=["http://127.0.0.1:18001", "http://127.0.0.1:18002"],
        tuning=ProxyTuning(session_idle_s=5.0),
        workload=preset.workload,
    )
    cfg = from_mapping(yaml.safe_load(yaml.safe_dump(doc)))
    assert cfg.session_lifecycle.enabled is variant.lifecycle
    assert cfg.admission.enabled is variant.admission
    assert cfg.admission.expected_decode_cap == preset.workload.max_new_tokens
    assert cfg.admission.session_idle_s == 5.0
    assert cfg.router.engines == ("http://127.0.0.1:18001", "http://127.0.0.1:18002")
    assert cfg.server.host == "127.0.0.1"


def test_presets_are_kv_bound() -> None:
    for name, preset in presets().items():
        mean, peak = working_set_tokens(preset.workload)
        pool = preset.stack.engines * preset.stack.max_total_tokens
        assert peak >= 1.5 * pool, name  # the live working set does not fit
        if name == "default":
            assert mean >= pool, name
        assert preset.stack.engines == 2
        assert preset.stack.mode == "session-radix"
        assert preset.stack.eviction_policy == "priority"


def test_working_set_counts_the_shared_prefix_once() -> None:
    w = presets()["default"].workload
    mean, peak = working_set_tokens(w)
    wider = working_set_tokens(dataclasses.replace(w, concurrency=2 * w.concurrency))
    prefix = w.system_prefix_tokens
    assert wider[1] - prefix == 2 * (peak - prefix)
    assert wider[0] - prefix == pytest.approx(2 * (mean - prefix), abs=2)
    longer = working_set_tokens(dataclasses.replace(w, system_prefix_tokens=prefix + 100))
    assert longer == (mean + 100, peak + 100)


def test_table_and_bypasses() -> None:
    base = {
        "sessions_completed": 4,
        "sessions_started": 4,
        "sessions_per_min": 12.5,
        "wall_s": 19.2,
        "prefill_tokens": 1000,
        "recomputed_prefill_tokens": 10,
        "cache_hit_rate": 0.5,
        "evicted_tokens": 0.0,
        "retractions": None,
        "ttft_p50_s": 0.012,
        "ttft_p99_s": 0.2,
        "admission_wait_p50_ms": None,
        "admission_wait_p99_ms": None,
    }
    stats = {
        "agentic_kv/admission/bypass_aged": 2.0,
        "agentic_kv/admission/bypass_degraded": 0.0,
        "agentic_kv/session/close": 4.0,
        "agentic_kv/session/close_failure": 1.0,
    }
    assert bypasses(stats) == {"aged": 2.0}
    assert bypasses(None) == {}
    table = format_table({"off": base, "both": {**base, "proxy_stats": stats}})
    lines = table.splitlines()
    assert lines[0].split() == ["off", "both"]
    row = next(line for line in lines if line.startswith("bypasses by reason"))
    assert row.split()[-2:] == ["-", "aged=2"]
    row = next(line for line in lines if line.startswith("session closes / failures"))
    assert row.endswith("4 / 1")
    row = next(line for line in lines if line.startswith("TTFT p99 (ms)"))
    assert row.split()[-2:] == ["200", "200"]


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert not pid_alive(proc.pid)


# ------------------------------------------------------------- the real stack


@needs_smg
def test_quick_demo_runs_clean(tmp_path: Path) -> None:
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

    # Every process the demo started is gone.
    pids = doc["pids"]
    expected_procs = len(VARIANTS) * (doc["stack"]["engines"] + 2)
    assert len(pids) == expected_procs
    assert [p for p in pids if pid_alive(p)] == []

    # Progress lines and the side-by-side table were printed.
    assert "sessions" in proc.stdout
    for v in VARIANTS:
        assert v.name in proc.stdout
    assert "recomputed prefill tokens" in proc.stdout

    configs = doc["configurations"]
    assert list(configs) == [v.name for v in VARIANTS]
    num_sessions = doc["workload"]["num_sessions"]
    for name, res in configs.items():
        s = res["summary"]
        assert s["sessions_started"] == num_sessions, name
        assert s["sessions_completed"] == s["sessions_started"], (name, s["errors"])
        assert s["sessions_failed"] == 0, name
        assert s["requests_failed"] == 0, name
        for key in (
            "prompt_tokens",
            "cached_tokens",
            "prefill_tokens",
            "recomputed_prefill_tokens",
            "completion_tokens",
        ):
            assert s[key] >= 0, (name, key)
        assert s["cached_tokens"] <= s["prompt_tokens"], name
        assert s["prefill_tokens"] == s["prompt_tokens"] - s["cached_tokens"], name
        assert s["recomputed_prefill_tokens"] <= s["prefill_tokens"], name
        assert 0.0 <= s["cache_hit_rate"] <= 1.0, name
        assert s["sessions_per_min"] > 0, name
        for key in ("evicted_tokens", "retractions", "engine_prompt_tokens"):
            assert s[key] is None or s[key] >= 0, (name, key)
        # The engines saw at least the prompts the driver sent.
        assert s["engine_prompt_tokens"] is not None and s["engine_prompt_tokens"] > 0, name
        # The proxy answered /kvproxy/stats after the run.
        assert isinstance(s.get("proxy_stats"), dict), name
        assert (out / f"kvproxy-{name}.yaml").is_file()

    # Lifecycle on: every session close went through the proxy and was fanned out.
    for name in ("lifecycle", "both"):
        stats = configs[name]["summary"]["proxy_stats"]
        assert stats.get("agentic_kv/session/close") == num_sessions, stats
        assert stats.get("agentic_kv/session/close_failure", 0) == 0, stats
    for name in ("off", "admission"):
        assert not configs[name]["summary"]["proxy_stats"].get("agentic_kv/session/close")

    if has_mpl:
        assert (out / "chart.png").stat().st_size > 1000
