"""scripts/regime_grid.py --hicache: which jobs run HiCache, and --check on such a file."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "regime_grid.py"


@pytest.fixture(scope="module")
def grid() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("regime_grid", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["regime_grid"] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("regime_grid", None)


def test_hicache_jobs_carry_the_ratio_and_ceiling_runs_without(grid: ModuleType) -> None:
    fleet = grid.Fleet("rl", "long", 4, 2.5)
    jobs = grid.jobs_for([fleet], ["none"], [0], {}, None, 2.0)
    assert {j.policy: j.hicache_ratio for j in jobs} == {"off": 2.0, "ceiling": 2.0, "both": 2.0}
    assert all(j.config().hicache_ratio == 2.0 for j in jobs)  # the lab skips ceiling
    plain = grid.jobs_for([fleet], ["none"], [0], {}, None)
    assert all(j.config().hicache_ratio is None for j in plain)
    fast = grid.jobs_for([fleet], ["none"], [0], {}, None, 2.0, 400.0)
    assert all(j.config().hicache_link_gb_s == 400.0 for j in fast)
    assert all(j.config().hicache_link_gb_s is None for j in jobs)  # the preset's link


def test_check_reads_a_hicache_grid(
    grid: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {
            "fleet": "swe/long/48/2.5",
            "policy": policy,
            "fault": "none",
            "seed": 0,
            "sessions_per_min": value,
            "ttft_p99_continuing_s": 1.0,
            "first_turn_wait_p99_s": None,
            "hicache": policy != "ceiling",
            "hicache_ratio": None if policy == "ceiling" else 2.0,
            "loaded_back_tokens": 0 if policy == "ceiling" else 1000,
        }
        for policy, value in (("off", 8.0), ("both", 8.5), ("ceiling", 10.0))
    ]
    doc = {"hicache_ratio": 2.0, "pools": {}, "rows": rows}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(doc))
    assert grid.main(["--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "HiCache on (off and both): --hicache-ratio 2" in out
    assert "| swe/long/48/2.5 | 8.00 | 8.50 | 10.00 |" in out
