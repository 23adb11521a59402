"""scripts/bench_rollout.py: which cells it takes, and a grid cell is the lab's cell."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from types import ModuleType

import pytest

from kvlab.regimes import parse_fleet
from tests.helpers import script_module


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with script_module("bench_rollout") as module:
        yield module


def test_named_and_grid_cells_are_taken(bench: ModuleType) -> None:
    assert bench._cells("w1,swe/short/4/2.5") == ["w1", "swe/short/4/2.5"]
    assert bench._cells("all") == list(bench.CELLS)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("w9", "neither one of"),
        ("swe/short/4", "workload/context/size/ratio"),
        ("swe/medium/4/2.5", "contexts"),
        (",", "'all' or a subset"),
    ],
)
def test_a_bad_cell_says_why(bench: ModuleType, text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        bench._cells(text)


def test_a_grid_cell_runs_the_labs_pool_and_placement(bench: ModuleType) -> None:
    small = bench.scenario_for("swe/short/4/4")
    fleet = parse_fleet("swe/short/4/4")
    assert small.pool_tokens == fleet.pool()[0]  # raised to hold the longest context
    assert small.lab_placement
    assert small.sessions_per_engine == 4
    assert small.workload_overrides == {"context_length": 5_120}
    assert small.time_scale == 0.25
    assert bench.scenario_for("rl/long/16/1.5").time_scale == 0.05
    assert bench.headline("rl/long/16/1.5") == ("output_tokens_per_s", 0.97)
    assert bench.headline("w1") == ("sessions_per_min", 2.0)
    assert bench.scenario_for("w1") is bench.CELLS["w1"]


def test_a_cell_with_the_host_tier_and_another_time_scale(bench: ModuleType) -> None:
    plain = bench.configure("swe/long/32/4")
    assert plain.hicache_ratio is None and plain.time_scale == 0.05
    hi = bench.configure("swe/long/32/4", time_scale=0.1, hicache=True)
    assert (hi.hicache_ratio, hi.hicache_write_policy, hi.time_scale) == (2.0, None, 0.1)
    assert hi.pool_tokens == plain.pool_tokens  # the same cell, the host tier added
    back = bench.configure("w1", hicache=True, hicache_write_policy="write_back")
    assert (back.hicache_ratio, back.hicache_write_policy) == (2.0, "write_back")
    with pytest.raises(ValueError, match="time"):
        bench.configure("w1", time_scale=0.0)


def test_a_cell_whose_subagents_name_their_lead(bench: ModuleType) -> None:
    plain = bench.configure("subagents/long/48/2.5")
    assert "subagent_identity" not in plain.workload_overrides
    linked = bench.configure("subagents/long/48/2.5", subagent_identity="parent")
    assert linked.workload_overrides["subagent_identity"] == "parent"
    assert linked.spec().subagent_identity == "parent"
    assert linked.pool_tokens == plain.pool_tokens  # the same cell, the links added


def test_the_burst_cell_is_the_replications_step_06(bench: ModuleType) -> None:
    """One engine on the replication's preset and pool, its 80 sessions in one burst:
    the lab's experiment 06 (scripts/replication.py) through the real stack."""
    with script_module("replication") as rep:
        (exp,) = [e for e in rep.EXPERIMENTS if e.name == "06"]
    sc = bench.configure("burst")
    assert (sc.workload, sc.engines, sc.sessions_per_engine) == (
        exp.workload,
        exp.engines,
        exp.per_engine,
    )
    assert sc.total_sessions == exp.per_engine  # one burst, no second wave
    assert (sc.cost_model, sc.token_scale) == (rep.PRESET, rep.K)
    assert sc.pool() * sc.token_scale == pytest.approx(rep.POOL, rel=0.01)  # the preset's pool
    assert sc.describe()["working_set_over_pool"] == pytest.approx(exp.ws_over_pool, abs=0.05)
    assert bench.headline("burst") == ("output_tokens_per_s", 1.4)
