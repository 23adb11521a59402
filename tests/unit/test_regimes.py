"""kvlab.regimes: a grid cell from its name, and the pool it runs with."""

from __future__ import annotations

import pytest

from kvlab.regimes import CONTEXTS, Fleet, parse_fleet


def test_a_cell_is_named_workload_context_size_ratio() -> None:
    fleet = parse_fleet("swe/long/48/1.5")
    assert fleet == Fleet("swe", "long", 48, 1.5)
    assert fleet.key == "swe/long/48/1.5"
    assert parse_fleet("rl/short/4/4").key == "rl/short/4/4"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("swe/long/48", "workload/context/size/ratio"),
        ("swe/medium/48/1.5", "contexts"),
        ("bogus/long/8/2", "workloads"),
        ("swe/long/x/2", "size an integer"),
        ("swe/long/8/big", "ratio a number"),
        ("rl/long/0/2", "size at least 1"),
        ("rl/long/4/0", "ratio above 0"),
    ],
)
def test_a_bad_name_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_fleet(text)


def test_the_metric_is_output_tokens_for_rl_and_sessions_otherwise() -> None:
    assert parse_fleet("rl/long/16/1.5").metric() == "output_tokens_per_s"
    assert parse_fleet("subagents/long/16/2.5").metric() == "sessions_per_min"


def test_a_pool_below_the_longest_context_is_raised_to_hold_it() -> None:
    small = parse_fleet("swe/short/4/4")
    assert small.scenario().workload_overrides == {"context_length": CONTEXTS["short"]}
    longest = int(small.scenario().spec().context_length)  # scaled tokens
    assert small.scenario().pool() < longest  # 4x the pool would not hold one context
    pool, ratio = small.pool()
    assert pool == longest + 64
    assert ratio < 4.0  # so the cell runs at less than its nominal ratio
    for name in ("swe/short/4/0.8", "swe/long/48/2.5"):
        fleet = parse_fleet(name)
        pool, ratio = fleet.pool()
        assert pool == fleet.scenario().pool()
        assert ratio == pytest.approx(fleet.ratio, rel=0.01)


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("rl/long/16/2.5", "qwen3-32b-h200"),
        ("rl/short/4/0.8", "qwen3-32b-h200"),
        ("swe/long/48/1.5", "qwen3-8b-h100"),
        ("subagents/long/16/2.5", "qwen3-8b-h100"),
    ],
)
def test_the_real_stack_runs_a_cell_on_the_engines_the_lab_runs_it_on(
    name: str, preset: str
) -> None:
    # The lab takes the workload's own engine preset (kvlab.lab.runner); a cell built
    # for the real stack (scripts/bench_rollout.py) must name the same one.
    assert parse_fleet(name).scenario().cost_model == preset
