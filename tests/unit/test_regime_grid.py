"""scripts/regime_grid.py: which jobs run HiCache, and what --check judges over seeds and files."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import script_module


@pytest.fixture(scope="module")
def grid() -> Iterator[ModuleType]:
    with script_module("regime_grid") as module:
        yield module


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


def _runs(
    fleet: str, seed: int, off: float, both: float, ceiling: float
) -> list[dict[str, object]]:
    return [
        {
            "fleet": fleet,
            "policy": policy,
            "fault": "none",
            "seed": seed,
            "sessions_per_min": value,
            "ttft_p99_continuing_s": {"off": 10.0, "both": 13.0, "ceiling": 9.0}[policy],
            "first_turn_wait_p99_s": 100.0 * seed if policy == "both" else None,
        }
        for policy, value in (("off", off), ("both", both), ("ceiling", ceiling))
    ]


def test_judge_seeds_pairs_each_seed_with_its_own_off(grid: ModuleType) -> None:
    # Seed 1's off is slow: by medians of the values both / off would be 1.0 here, paired
    # by seed it is below 0.97x on seed 0 and the cell's median is 0.95 + 1.1 / 2.
    rows = [
        *_runs("subagents/long/8/1.5", 0, off=10.0, both=9.5, ceiling=15.0),
        *_runs("subagents/long/8/1.5", 1, off=5.0, both=5.5, ceiling=7.5),
        *_runs("swe/long/4/0.8", 0, off=10.0, both=10.0, ceiling=10.0),
        *_runs("swe/long/4/0.8", 1, off=10.0, both=10.0, ceiling=10.0),
    ]
    rows.append({**rows[1], "fault": "windows", "sessions_per_min": 1.0})  # a fault run: ignored
    j = grid.judge_seeds(rows, ["subagents/long/8/1.5", "swe/long/4/0.8"])
    assert j["seeds"] == [0, 1] and j["runs"] == 4
    assert j["runs_below"] == {"total": 1, "by_seed": {0: 1, 1: 0}}
    assert j["worst_run"] == {"ratio": 0.95, "cell": "subagents/long/8/1.5", "seed": 0}
    assert j["cells_median_below"] == []  # (0.95 + 1.1) / 2 = 1.025
    assert j["kv_bound_cells"] == 1
    assert j["kv_bound_median_both_over_off"] == pytest.approx(1.025)
    assert j["kv_bound_median_gap_closed"] == pytest.approx(0.025 / 0.5)
    # swe/long/4/0.8 is not KV-bound and both's tail is 1.3x off's on both seeds
    assert j["not_kv_bound_tail_over_1_2x"] == {"runs": 2, "cells_by_median": ["swe/long/4/0.8"]}
    assert j["first_turn_wait_p99_worst_s"] == 100.0


def test_judge_seeds_names_a_cell_whose_median_is_below(grid: ModuleType) -> None:
    rows = [
        *_runs("rl/long/8/1.5", 0, off=10.0, both=9.6, ceiling=10.5),
        *_runs("rl/long/8/1.5", 1, off=10.0, both=9.0, ceiling=10.5),
    ]
    for r in rows:
        r["output_tokens_per_s"] = r.pop("sessions_per_min")  # rl is judged on tokens
    j = grid.judge_seeds(rows, ["rl/long/8/1.5"])
    (cell,) = j["cells_median_below"]
    assert cell["cell"] == "rl/long/8/1.5" and cell["median"] == pytest.approx(0.93)
    assert j["runs_below"]["total"] == 2 and j["kv_bound_cells"] == 0


def test_merge_grids_refuses_a_run_twice_and_mixed_host_tiers(grid: ModuleType) -> None:
    a = {
        "seeds": [0],
        "pools": {"swe/long/4/0.8": {"pool_tokens": 1}},
        "rows": _runs("swe/long/4/0.8", 0, 1, 1, 1),
    }
    b = {
        "seeds": [1],
        "pools": {"swe/long/4/0.8": {"pool_tokens": 1}},
        "rows": _runs("swe/long/4/0.8", 1, 1, 1, 1),
    }
    rows, pools = grid.merge_grids([a, b])
    assert len(rows) == 6 and pools == {"swe/long/4/0.8": {"pool_tokens": 1}}
    with pytest.raises(ValueError, match="is in two of the grids"):
        grid.merge_grids([a, a])
    with pytest.raises(ValueError, match="host tiers differ"):
        grid.merge_grids([a, {**b, "hicache_ratio": 2.0}])
    with pytest.raises(ValueError, match="two pools"):
        grid.merge_grids([a, {**b, "pools": {"swe/long/4/0.8": {"pool_tokens": 2}}}])


def test_check_of_two_files_judges_their_seeds_together(
    grid: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for seed, both in ((0, 9.5), (1, 9.6)):
        doc = {
            "commit": "abc",
            "seeds": [seed],
            "admission": {},
            "pools": {},
            "rows": _runs("swe/long/48/2.5", seed, 10.0, both, 20.0),
        }
        path = tmp_path / f"grid{seed}.json"
        path.write_text(json.dumps(doc))
        paths.append(str(path))
    assert grid.main(["--check", *paths]) == 0
    out = capsys.readouterr().out
    assert f"{paths[1]}: commit abc, seeds 1, admission {{}}" in out
    judged = json.loads(out[out.index("{\n") :])
    assert judged["by_seed"]["runs_below"] == {"total": 2, "by_seed": {"0": 1, "1": 1}}
    assert judged["by_seed"]["cells_median_below"][0]["median"] == pytest.approx(0.955)
    with pytest.raises(SystemExit):
        grid.main(["--check", paths[0], paths[0]])


def test_check_reads_a_gzipped_grid_as_the_same_grid(
    grid: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = {
        "commit": "abc",
        "seeds": [0],
        "admission": {},
        "pools": {},
        "rows": _runs("swe/long/48/2.5", 0, 10.0, 9.5, 20.0),
    }
    plain = tmp_path / "grid.json"
    plain.write_text(json.dumps(doc))
    packed = tmp_path / "grid.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    outs = []
    for path in (plain, packed):
        assert grid.main(["--check", f"{path}:long"]) == 0
        out = capsys.readouterr().out
        outs.append(out[out.index("{\n") :])
    assert outs[0] == outs[1]
    assert json.loads(outs[1])["by_seed"]["runs_below"]["total"] == 1


def test_check_takes_one_context_of_a_file(
    grid: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A newer file of the long cells beside an older one of both contexts: the older
    # file's long rows are left out, so no run is counted twice.
    old = {
        "commit": "old",
        "seeds": [0],
        "pools": {"swe/long/8/1.5": {"pool_tokens": 1}, "swe/short/8/1.5": {"pool_tokens": 2}},
        "rows": [
            *_runs("swe/long/8/1.5", 0, 10.0, 9.0, 20.0),
            *_runs("swe/short/8/1.5", 0, 10.0, 10.0, 10.0),
        ],
    }
    new = {
        "commit": "new",
        "seeds": [0],
        "pools": {"swe/long/8/1.5": {"pool_tokens": 1}},
        "rows": _runs("swe/long/8/1.5", 0, 10.0, 15.0, 20.0),
    }
    old_path, new_path = tmp_path / "old:1.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(old))
    new_path.write_text(json.dumps(new))
    assert grid.check_arg(f"{old_path}:short") == (old_path, frozenset({"short"}))
    assert grid.check_arg(str(old_path)) == (old_path, None)  # ":1.json" names no context
    assert grid.main(["--check", str(new_path), f"{old_path}:short"]) == 0
    out = capsys.readouterr().out
    assert f"{old_path} (short contexts): commit old" in out
    judged = json.loads(out[out.index("{\n") :])
    assert judged["by_seed"]["runs"] == 2  # both: the new long run and the old short one
    assert judged["by_seed"]["runs_below"]["total"] == 0  # the old long run (0.9x) left out
    with pytest.raises(SystemExit):  # the old file whole repeats the long run
        grid.main(["--check", str(new_path), str(old_path)])


def test_compact_shows_the_median_of_the_paired_ratios(grid: ModuleType) -> None:
    rows = [
        *_runs("swe/long/48/2.5", 0, off=10.0, both=20.0, ceiling=25.0),
        *_runs("swe/long/48/2.5", 1, off=5.0, both=6.0, ceiling=12.5),
    ]
    cells = grid.cell_rows(rows)
    # medians of the values: both 13 / off 7.5 = 1.73; paired: (2.0 + 1.2) / 2 = 1.60
    assert "| 48 | = | = | 1.73 [2.50] | = |" in grid.compact(cells)
    assert "| 48 | = | = | 1.60 [2.50] | = |" in grid.compact(cells, grid.paired(rows))


def test_caps_are_distinct_fractions_below_the_fleet_and_whole_groups_for_rl(
    grid: ModuleType,
) -> None:
    swe = grid.Fleet("swe", "long", 48, 2.5)
    assert grid.caps_for(swe, [0.125, 0.25, 0.375, 0.5, 0.75]) == [6, 12, 18, 24, 36]
    assert grid.caps_for(grid.Fleet("swe", "long", 4, 1.5), [0.125, 0.25, 0.5]) == [1, 2]
    # rl runs GRPO groups of 8 over two engines: 4 per engine at the least
    assert grid.caps_for(grid.Fleet("rl", "long", 8, 2.5), [0.125, 0.25, 0.5, 0.75]) == [4]
    assert grid.caps_for(grid.Fleet("rl", "long", 4, 2.5), [0.25, 0.5]) == []
    (job,) = grid.cap_jobs([grid.Fleet("swe", "long", 8, 2.5)], [0.5], [3])
    cfg = job.config()
    # off with 4 live sessions per engine, the fleet's 32 sessions, the fleet's pool
    assert (cfg.policy, cfg.sessions_per_engine, cfg.sessions, cfg.seed) == ("off", 4, 32, 3)
    assert cfg.engine_overrides == {"max_total_tokens": job.fleet.pool()[0]}


def test_judge_seeds_reports_the_best_cap_of_the_kv_bound_cells(grid: ModuleType) -> None:
    rows = [
        *_runs("swe/long/48/2.5", 0, off=4.0, both=6.0, ceiling=10.0),
        *_runs("swe/long/48/2.5", 1, off=5.0, both=7.0, ceiling=11.0),
        *_runs("swe/long/8/1.5", 0, off=5.0, both=5.0, ceiling=10.0),
    ]
    caps = {("swe/long/48/2.5", 12): (6.0, 7.5), ("swe/long/48/2.5", 24): (8.0, 8.0)}
    caps[("swe/long/8/1.5", 4)] = (4.0, None)  # a cap that loses: off itself is best
    for (fleet, cap), values in caps.items():
        for seed, value in enumerate(values):
            if value is not None:
                rows.append(
                    {
                        "fleet": fleet,
                        "policy": "cap",
                        "cap_per_engine": cap,
                        "fault": "none",
                        "seed": seed,
                        "sessions_per_min": value,
                    }
                )
    j = grid.judge_seeds(rows, ["swe/long/48/2.5", "swe/long/8/1.5"])
    best = j["kv_bound_best_cap"]
    # swe 48: cap 24 gives 2.0x and 1.6x (median 1.8x), cap 12 1.5x and 1.5x; both 1.5x,
    # 1.4x; ceiling 2.5x, 2.2x (median 2.35x)
    assert best["cells"] == 2
    assert best["median_best_cap_over_off"] == pytest.approx((1.8 + 1.0) / 2)
    assert best["median_gap_closed"] == pytest.approx((0.8 / 1.35 + 0.0) / 2)
    assert best["median_both_over_off"] == pytest.approx((1.45 + 1.0) / 2)
    assert best["median_gap_closed_both"] == pytest.approx((0.45 / 1.35 + 0.0) / 2)
    assert best["best_cap_beats_both_by_10pct"] == ["swe/long/48/2.5: cap 24 1.80x, both 1.45x"]
    assert "kv_bound_best_cap" not in grid.judge_seeds(rows[:9], ["swe/long/48/2.5"])


def test_merge_grids_keeps_caps_of_one_seed_apart(grid: ModuleType) -> None:
    cap = {"fleet": "swe/long/8/2.5", "policy": "cap", "fault": "none", "seed": 0}
    rows, _ = grid.merge_grids(
        [{"rows": [{**cap, "cap_per_engine": 2}]}, {"rows": [{**cap, "cap_per_engine": 4}]}]
    )
    assert len(rows) == 2
    with pytest.raises(ValueError, match=r"swe/long/8/2\.5/cap/none/0/4 is in two"):
        grid.merge_grids([{"rows": [{**cap, "cap_per_engine": 4}]}] * 2)


def test_cap_jobs_carry_the_host_tier(grid: ModuleType) -> None:
    fleet = grid.Fleet("swe", "long", 16, 2.5)
    jobs = grid.cap_jobs(
        [fleet], [0.5], [0, 1], hicache_ratio=2.0, hicache_write_policy="write_back"
    )
    assert [(j.cap, j.seed) for j in jobs] == [(8, 0), (8, 1)]
    assert all(j.config().hicache_ratio == 2.0 for j in jobs)
    assert all(j.config().hicache_write_policy == "write_back" for j in jobs)
    assert all(j.config().hicache_ratio is None for j in grid.cap_jobs([fleet], [0.5], [0]))


def test_a_grid_runs_only_the_policies_asked_and_tool_hints_only_with_both(
    grid: ModuleType,
) -> None:
    fleet = grid.Fleet("swe", "long", 16, 2.5)
    jobs = grid.jobs_for(
        [fleet], ["none"], [0, 1], {"prefetch": True}, None, 2.0, policies=["both"], tool_hints=True
    )
    assert [(j.policy, j.seed) for j in jobs] == [("both", 0), ("both", 1)]
    assert all(
        j.config().tool_hints and j.config().admission_overrides == {"prefetch": True} for j in jobs
    )
    full = grid.jobs_for([fleet], ["none"], [0], {}, None, tool_hints=True)
    assert {j.policy: j.config().tool_hints for j in full} == {
        "off": False,
        "ceiling": False,
        "both": True,
    }


def test_peer_settings_reach_the_peers_runs_only(grid: ModuleType) -> None:
    fleet = grid.Fleet("subagents", "short", 4, 2.5)
    scope = {"decay_scope": "resume"}
    jobs = grid.jobs_for([fleet], ["none"], [0], {}, None, policies=["off", "thunder"], peer=scope)
    assert {j.policy: j.config().peer_overrides for j in jobs} == {"off": {}, "thunder": scope}


def test_thunder_runs_beside_both_and_is_judged_against_it(grid: ModuleType) -> None:
    fleet = grid.Fleet("swe", "long", 16, 2.5)
    jobs = grid.jobs_for([fleet], ["none"], [0], {}, None, policies=["off", "both", "thunder"])
    assert sorted(j.policy for j in jobs) == ["both", "off", "thunder"]
    assert {j.policy: j.config().policy for j in jobs}["thunder"] == "thunder"
    rows = [
        *_runs("swe/long/48/2.5", 0, off=4.0, both=6.0, ceiling=10.0),
        *_runs("swe/long/48/2.5", 1, off=5.0, both=7.0, ceiling=11.0),
        *_runs("swe/long/8/0.8", 0, off=5.0, both=5.0, ceiling=5.0),
    ]
    for fleet_key, seed, value, tail in (
        ("swe/long/48/2.5", 0, 8.0, 4.0),
        ("swe/long/48/2.5", 1, 5.0, 2.0),
        ("swe/long/8/0.8", 0, 5.0, 1.0),
    ):
        rows.append(
            {
                "fleet": fleet_key,
                "policy": "thunder",
                "fault": "none",
                "seed": seed,
                "sessions_per_min": value,
                "ttft_p99_continuing_s": tail,
            }
        )
    j = grid.judge_seeds(rows, ["swe/long/48/2.5", "swe/long/8/0.8"])
    cmp = j["both_vs_thunder"]
    # swe 48: both / thunder 6 / 8 = 0.75 (seed 0), 7 / 5 = 1.4 (seed 1): median 1.075
    assert cmp["cells"] == 2
    assert cmp["both_wins"] == ["swe/long/48/2.5 1.07x"]
    assert cmp["thunder_wins"] == []
    assert cmp["median_both_over_peer"] == pytest.approx((1.075 + 1.0) / 2)
    assert cmp["kv_bound_cells"] == 1
    assert cmp["kv_bound_median_both_over_peer"] == pytest.approx(1.075)
    assert "both_vs_thunder-origin" not in j


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("0", [0]), ("0,1", [0, 1]), ("0-7", list(range(8))), ("4-5,0,4", [4, 5, 0])],
)
def test_seeds_take_numbers_and_ranges(grid: ModuleType, text: str, seeds: list[int]) -> None:
    assert grid.seed_list(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "3-1", "0-x", "-1"])
def test_bad_seeds_are_a_usage_error_naming_the_form(
    grid: ModuleType, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        grid.main(["--seeds", text, "--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    assert "want numbers and ranges, e.g. 0,1 or 0-7" in capsys.readouterr().err
