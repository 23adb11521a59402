"""The workload presets against calibration.md §4: parameters, statistics over a few
hundred seeded sessions, token scaling, overrides and determinism (pure, no I/O)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from kvlab.workload import PRESETS, WorkloadError, percentile, session_plans, workload_spec
from kvlab.workload.draw import draw_tokens, stochastic_round
from kvlab.workload.model import Dist, SessionPlan, lognormal
from kvlab.workload.spec import override_names


def _plans(name: str, n: int, k: int = 16, seed: int = 0, **over: object) -> list[SessionPlan]:
    return list(itertools.islice(session_plans(workload_spec(name, k, **over), seed), n))


def _stats(plans: list[SessionPlan], k: int) -> dict[str, float]:
    turns = [len(p.turns) for p in plans]
    final = [p.planned_context * k for p in plans]
    per_call: list[int] = []
    for p in plans:
        ctx = 0
        for t in p.turns:
            ctx += len(t.new_input_ids)
            per_call.append(ctx * k)
            ctx += t.max_new_tokens
    lat = [t.tool_latency_s for p in plans for t in p.turns[:-1] if not t.subagents]
    return {
        "turns_p50": percentile(turns, 50) or 0,
        "turns_p90": percentile(turns, 90) or 0,
        "exit_share": sum(p.exit_context for p in plans) / len(plans),
        "final_mean": statistics.mean(final),
        "final_p90": percentile(final, 90) or 0,
        "per_call": statistics.mean(per_call),
        "output_mean": statistics.mean(t.max_new_tokens * k for p in plans for t in p.turns),
        "tool_mean": statistics.mean(len(t.new_input_ids) * k for p in plans for t in p.turns[1:]),
        "lat_p50": percentile(lat, 50) or 0,
        "lat_mean": statistics.mean(lat),
        "lat_p99": percentile(lat, 99) or 0,
        "lat_lt1": sum(x < 1 for x in lat) / len(lat),
        "lat_lt10": sum(x < 10 for x in lat) / len(lat),
    }


def test_swe_statistics_match_calibration_w1() -> None:
    s = _stats(_plans("swe", 600), 16)
    # calibration.md §4.1 "result": turns p50 29 / p90 45, final context mean 26.8k
    # (p90 40.4k), 15.8k per call, ~19% end on the context limit; output mean 210,
    # tool output mean 670; tool latency median 0.43 s, mean 3.5 s, p99 79 s,
    # P(<1 s) 0.85, P(<10 s) 0.95.
    assert 27 <= s["turns_p50"] <= 31
    assert 42 <= s["turns_p90"] <= 48
    assert 0.13 <= s["exit_share"] <= 0.25
    assert s["final_mean"] == pytest.approx(26_800, rel=0.07)
    assert s["final_p90"] == pytest.approx(40_400, rel=0.05)
    assert s["per_call"] == pytest.approx(15_800, rel=0.07)
    assert s["output_mean"] == pytest.approx(210, rel=0.08)
    assert s["tool_mean"] == pytest.approx(670, rel=0.1)
    assert s["lat_p50"] == pytest.approx(0.43, abs=0.05)
    assert s["lat_mean"] == pytest.approx(3.5, rel=0.2)
    assert s["lat_p99"] == pytest.approx(79, rel=0.3)
    assert s["lat_lt1"] == pytest.approx(0.85, abs=0.03)
    assert s["lat_lt10"] == pytest.approx(0.95, abs=0.02)


def test_rl_statistics_match_calibration_w2() -> None:
    plans = _plans("rl", 640)
    s = _stats(plans, 16)
    # §4.2 "result": turns p50 14 / p90 22; final context mean 24.4k (p90 35.9k); 15.2k
    # per call; ~19% truncated; output mean 810; tool latency median 1.1 s, mean 4.1 s,
    # p99 ~60 s.
    assert 13 <= s["turns_p50"] <= 15
    assert 20 <= s["turns_p90"] <= 24
    assert 0.13 <= s["exit_share"] <= 0.26
    assert s["final_mean"] == pytest.approx(24_400, rel=0.07)
    assert s["final_p90"] == pytest.approx(35_900, rel=0.05)
    assert s["per_call"] == pytest.approx(15_200, rel=0.07)
    assert s["output_mean"] == pytest.approx(810, rel=0.1)
    assert s["lat_p50"] == pytest.approx(1.1, abs=0.12)
    assert s["lat_mean"] == pytest.approx(4.1, rel=0.2)
    assert s["lat_p99"] == pytest.approx(60, rel=0.3)
    assert all(p.planned_context <= 2304 for p in plans)


def test_rl_groups_of_eight_share_their_task_prompt() -> None:
    plans = _plans("rl", 24)
    groups = [plans[i : i + 8] for i in range(0, 24, 8)]
    for g in groups:
        assert len({p.group for p in g}) == 1 and g[0].group is not None
        assert len({p.session_id for p in g}) == 8
        first = {tuple(p.turns[0].new_input_ids) for p in g}
        assert len(first) == 1  # system + the group's task prompt
    assert groups[0][0].turns[0].new_input_ids != groups[1][0].turns[0].new_input_ids
    # ... while the members' own turns differ.
    assert len({p.turns[1].max_new_tokens for p in groups[0]} | {len(groups[0][0].turns)}) > 1


def test_subagents_statistics_match_calibration_w3() -> None:
    plans = _plans("subagents", 300)
    subs = [s for p in plans for t in p.turns for s in t.subagents]
    # §4.3 "result": ~6 subagents per program; final context lead 17k, subagent 19.6k.
    assert len(subs) / len(plans) == pytest.approx(6.0, rel=0.08)
    lead = statistics.mean(p.planned_context * 16 for p in plans)
    sub = statistics.mean(s.planned_context * 16 for s in subs)
    assert lead == pytest.approx(17_000, rel=0.08)
    assert sub == pytest.approx(19_600, rel=0.08)
    for p in plans:
        assert 6 <= len(p.turns) <= 12
        fan = [i for i, t in enumerate(p.turns) if t.subagents]
        # Always after turn 2 (index 1), sometimes after turn 5 (index 4).
        assert fan[0] == 1 and set(fan) <= {1, 4}
        for i in fan:
            assert 3 <= len(p.turns[i].subagents) <= 5
            assert p.turns[i].tool_latency_s == 0.0
            assert all(
                s.role == "subagent" and s.parent == p.session_id for s in p.turns[i].subagents
            )
    assert any(4 in [i for i, t in enumerate(p.turns) if t.subagents] for p in plans)
    # Subagents share their own system prompt, not the lead's.
    sub_sys = {tuple(s.turns[0].new_input_ids[:188]) for s in subs}
    assert len(sub_sys) == 1
    assert plans[0].turns[0].new_input_ids[:188] != subs[0].turns[0].new_input_ids[:188]


def test_token_scale_divides_tokens_and_keeps_times() -> None:
    one, k16 = workload_spec("swe", 1), workload_spec("swe", 16)
    assert (k16.context_length, k16.system_prompt_tokens) == (2560, 69)  # 40960/16; 1100/16 rounds
    assert workload_spec("rl", 16).system_prompt_tokens == 188  # 3000/16 = 187.5 rounds up
    assert workload_spec("rl", 16).context_length == 2304
    assert k16.output.median == pytest.approx(150 / 16)
    assert k16.task_prompt.lo == pytest.approx(100 / 16)
    assert k16.tool_latency_fast == one.tool_latency_fast
    assert k16.turns == one.turns
    # The workload's shape survives the scale: k=1 and k=16 agree on the means.
    a, b = _stats(_plans("swe", 200, k=1), 1), _stats(_plans("swe", 600, k=16), 16)
    for key in ("final_mean", "per_call", "output_mean", "tool_mean"):
        assert a[key] == pytest.approx(b[key], rel=0.08), key
    assert a["turns_p50"] == b["turns_p50"]


def test_stochastic_rounding_keeps_the_mean_and_outputs_are_at_least_one() -> None:
    import random

    rng = random.Random(0)
    draws = [stochastic_round(2.3, rng) for _ in range(4000)]
    assert set(draws) == {2, 3}
    assert statistics.mean(draws) == pytest.approx(2.3, abs=0.03)
    tiny = Dist("fixed", 0.2)
    assert {draw_tokens(tiny, rng) for _ in range(100)} == {1}
    plans = _plans("swe", 50, k=64)
    assert min(t.max_new_tokens for p in plans for t in p.turns) >= 1


def test_overrides_are_in_real_tokens_and_apply_before_scaling() -> None:
    spec = workload_spec("swe", 16, turns_median="20", output_hi=2048, context_length=32768)
    assert spec.turns.median == 20.0
    assert spec.output.hi == pytest.approx(2048 / 16)
    assert spec.context_length == 2048
    assert workload_spec("swe", 1, turns=lognormal(10, 0.1, 5, 15)).turns.median == 10
    assert workload_spec("rl", 1, step_mode="closed", group_size="4").group_size == 4
    assert workload_spec("swe", 1, close_sessions="false").close_sessions is False
    assert "turns_median" in override_names() and "tool_latency_slow_share" in override_names()


@pytest.mark.parametrize(
    ("name", "over", "match"),
    [
        ("nope", {}, "unknown workload 'nope'"),
        ("swe", {"turn_median": 3}, "unknown workload parameter 'turn_median'"),
        ("swe", {"turns_median": "many"}, "turns_median: expected a number"),
        ("swe", {"group_size": 0}, "group_size"),
        ("swe", {"group_size": 1.5}, "group_size: expected an integer"),
        ("swe", {"tool_latency_slow_share": 2}, "tool_latency_slow_share"),
        ("swe", {"step_mode": "async"}, "step_mode"),
        ("swe", {"output_kind": "normal"}, "output: kind"),
        ("swe", {"output_lo": 5000}, "output: need lo <= hi"),
        ("swe", {"name": "x"}, "cannot be overridden"),
        ("trace:", {}, "needs a path"),
        ("trace:/nonexistent/t.jsonl", {}, "cannot read trace"),
    ],
)
def test_bad_specs_are_rejected_with_a_clear_error(name: str, over: dict, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        workload_spec(name, 1, **over)


def test_bad_token_scale() -> None:
    for k in (0, -1, 1.5):
        with pytest.raises(WorkloadError, match="token_scale"):
            workload_spec("swe", k)  # type: ignore[arg-type]


def test_plans_are_deterministic_by_seed_for_every_preset() -> None:
    for name in PRESETS:
        a, b = _plans(name, 12, seed=5), _plans(name, 12, seed=5)
        assert a == b, name
        c = _plans(name, 12, seed=6)
        assert [p.turns[0].new_input_ids for p in a] != [p.turns[0].new_input_ids for p in c]


def test_plans_never_pass_the_context_length() -> None:
    for name in ("swe", "rl", "subagents"):
        spec = workload_spec(name, 16)
        for p in _plans(name, 150):
            ctx = 0
            for t in p.turns:
                assert ctx + len(t.new_input_ids) + t.max_new_tokens <= spec.context_length
                ctx += len(t.new_input_ids) + t.max_new_tokens
            assert p.exit_context == (len(p.turns) < p.turns_drawn)
