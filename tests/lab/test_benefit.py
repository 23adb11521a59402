"""CI guards the benefit: deterministic lab cells (fixed seeds, virtual time, seconds
each) in which program admission must beat off by a measured floor, and a control that
is not KV-bound in which it must do no harm.

The floors are the measured gains (docs/admission.md, "What the guard cells measure")
less a margin; a change that wiped out a headline gain fails here. Each cell's runs are
deterministic: the same seed gives the same numbers (tests/lab/test_lab.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from kvlab.lab.runner import LabConfig, run_lab
from kvproxy.config import AdmissionConfig

DEFAULTS = AdmissionConfig()

# Step 06 of the public ThunderAgent replication: one engine of its preset, 80 sessions
# of 3 turns and ~61k unique tokens started 0.125 s apart, 2.2x the pool; 80 output
# tokens a turn. Admission engages from the burst's first requests (the hold model).
BURST = LabConfig(
    workload="burst",
    engines=1,
    sessions_per_engine=80,
    sessions=80,
    cost_model="qwen3-coder-30b-a3b-fp8-h100-tp2",
)

# A deep fleet: 128 long sessions live on one engine (about 2.7x its pool of 2.24M
# tokens), SWE-shaped with Claude-Code-like prompts (22k first prompts, 350-token
# answers, tools under 10 s), 16 turns each.
DEEP = LabConfig(
    workload="swe",
    engines=1,
    sessions_per_engine=128,
    sessions=128,
    cost_model="llama3.1-8b-h100",
    engine_overrides={"max_total_tokens": 139_815},
    workload_overrides={
        "context_length": 131_072,
        "system_prompt_tokens": 1000,
        "task_prompt_median": 22_000,
        "task_prompt_sigma": 0.4,
        "task_prompt_lo": 2000,
        "task_prompt_hi": 80_000,
        "turns_median": 16,
        "turns_sigma": 0.5,
        "turns_lo": 8,
        "turns_hi": 200,
        "output_median": 350,
        "output_sigma": 0.8,
        "output_hi": 4000,
        "tool_output_median": 400,
        "tool_output_sigma": 1.0,
        "tool_latency_fast_median": 2.0,
        "tool_latency_fast_sigma": 0.6,
        "tool_latency_slow_median": 8.0,
        "tool_latency_slow_share": 0.1,
        "tool_latency_cap_s": 10.0,
    },
)

# W1 small: 24 live SWE sessions per engine on two engines, 96 in all, on a pool about
# 2.5x smaller than their working set.
W1_SMALL = LabConfig(
    workload="swe",
    engines=2,
    sessions_per_engine=24,
    sessions=96,
    engine_overrides={"max_total_tokens": 9000},
)

# Subagents that name their lead (X-Parent-Session-ID, as Dynamo's parent header and
# Claude Code's agent ids under a session do): 48 leads per engine, one wave, on the
# pool of the grid's subagents/long/48/2.5 cell. Sparing a lead from the pause while its
# subagents ran (before 07d5ab0) moved the pause onto them: 1.11x.
SUBAGENTS_PARENT = LabConfig(
    workload="subagents",
    engines=2,
    sessions_per_engine=48,
    sessions=96,
    engine_overrides={"max_total_tokens": 13349},
    workload_overrides={"subagent_identity": "parent"},
)

# The control: the same fleet on W1's own pool, which holds it (ceiling / off 1.07x):
# nothing to win, so nothing may be lost.
CONTROL = LabConfig(workload="swe", engines=2, sessions_per_engine=24, sessions=96)


def _run(cfg: LabConfig, policy: str) -> Mapping[str, Any]:
    return run_lab(dataclasses.replace(cfg, policy=policy, seed=0)).summary


def _metric(cfg: LabConfig) -> str:
    return "output_tokens_per_s" if cfg.workload == "burst" else "sessions_per_min"


@pytest.mark.parametrize(
    ("cfg", "gain_floor", "measured"),
    [
        pytest.param(BURST, 2.5, 2.79, id="burst"),
        pytest.param(DEEP, 1.85, 2.04, id="deep-fleet"),
        pytest.param(W1_SMALL, 1.35, 1.49, id="w1-small"),
        pytest.param(SUBAGENTS_PARENT, 1.3, 1.47, id="subagents-parent"),
    ],
)
def test_admission_wins_where_the_pool_is_oversubscribed(
    cfg: LabConfig, gain_floor: float, measured: float
) -> None:
    off, both = _run(cfg, "off"), _run(cfg, "both")
    key = _metric(cfg)
    gain = both[key] / off[key]
    assert gain >= gain_floor, f"both / off {gain:.3f} (measured {measured}x)"
    # No harm on the way: every session finished, no wait beyond its stated bound.
    assert both["sessions_completed"] == off["sessions_completed"] == cfg.sessions
    assert (both["first_turn_wait_p99_s"] or 0.0) <= DEFAULTS.new_session_max_wait_s + 1
    assert both["ttft_p99_continuing_s"] <= max(
        1.2 * off["ttft_p99_continuing_s"], DEFAULTS.paused_max_wait_s + 1
    )


def test_admission_does_no_harm_where_the_pool_holds_the_fleet() -> None:
    off, both = _run(CONTROL, "off"), _run(CONTROL, "both")
    assert both["sessions_per_min"] >= 0.97 * off["sessions_per_min"]
    assert both["ttft_p99_continuing_s"] <= 1.2 * off["ttft_p99_continuing_s"]
    assert both["sessions_completed"] == CONTROL.sessions
