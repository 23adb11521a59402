"""The replication's engine preset and its two workloads, held against their sources.

Sources (docs/simulator.md and docs/workloads.md give each): the model's config
(48 layers, 4 KV heads of 128), the replication's vLLM log (2,237,040 tokens per pod,
max-num-batched-tokens 8192, max-model-len 262144), its step 06 (14.71M tokens
prefilled in 457.5 s with nothing cached) and its low-load inter-token latency; the
Weka traces' summary statistics (turns, mean prompt by turn index, outputs, gaps).
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from kvlab.sim.presets import PRESETS, cost_model, hicache_config, scheduler_config
from kvlab.workload.model import WorkloadError, parse_schedule
from kvlab.workload.plan import session_plans
from kvlab.workload.spec import workload_spec

PRESET = "qwen3-coder-30b-a3b-fp8-h100-tp2"


def _full_prefill_s(n: int, chunk: int = 8192) -> float:
    c = cost_model(PRESET)
    t, p = 0.0, 0
    while p < n:
        m = min(chunk, n - p)
        t += c.prefill_s([(m, p)])
        p += m
    return t


@pytest.mark.parametrize(
    ("what", "got", "want", "rel"),
    [
        # FP8 KV: 2 (K, V) x 48 layers x 4 KV heads x 128 dims x 1 byte = 48 KiB a token.
        ("kv bytes per token", PRESETS[PRESET].kv_bytes_per_token, 2 * 48 * 4 * 128, 0),
        ("layers", PRESETS[PRESET].num_layers, 48, 0),
        ("pool per pod (vLLM log)", PRESETS[PRESET].max_total_tokens, 2_237_040, 0),
        ("max-model-len", PRESETS[PRESET].context_length, 262_144, 0),
        ("max-num-batched-tokens", PRESETS[PRESET].chunked_prefill_size, 8192, 0),
        # tau_lin = 2 x 2.72B active non-embedding parameters / 600 TFLOP/s (the pod).
        ("tau_lin", cost_model(PRESET).tau_lin_s, 2 * 2.72e9 / 600e12, 0.01),
        # tau_att = 4 x 48 layers x 32 query heads x 128 / 1,100 TFLOP/s (the pod).
        ("tau_att", cost_model(PRESET).tau_att_s, 4 * 48 * 32 * 128 / 1.1e15, 0.01),
        # c = 24 KiB per token per GPU (2 of the 4 KV heads) / (0.8 x 3.35 TB/s).
        ("decode c", cost_model(PRESET).decode_c_s_per_token, 24_576 / (0.8 * 3.35e12), 0.01),
        # Step 06, default arm: 240 prompts of ~61.3k prefilled in 457.5 s (hit rate 0).
        ("step 06 prefill", 240 * _full_prefill_s(61_300), 457.5, 0.03),
        # Step 13 at 4 sessions per pod: ITL p50 10 ms, contexts ~84k.
        ("ITL, 4 running at 84k", cost_model(PRESET).decode_s(4, 4 * 84_000), 0.010, 0.05),
    ],
)
def test_preset_against_its_sources(what: str, got: float, want: float, rel: float) -> None:
    assert got == pytest.approx(want, rel=rel, abs=0), what


def test_preset_scales_and_hicache_uses_its_shape() -> None:
    cfg = scheduler_config(PRESET, 16)
    assert cfg.max_total_tokens == round(2_237_040 / 16)
    assert (cfg.chunked_prefill_size, cfg.max_prefill_tokens) == (512, 512)
    hi = hicache_config(PRESET, 16, ratio=3.9)
    # Two GPUs, each with its own PCIe Gen5 x16 link, move their halves of a token.
    assert (hi.kv_bytes_per_token, hi.num_layers, hi.host_link_gb_s) == (49_152, 48, 100.0)
    # 400 GiB of host memory over 48 KiB a token is 3.9x the pool.
    host_over_pool = 400 * 2**30 / 49_152 / 2_237_040
    assert host_over_pool == pytest.approx(3.9, rel=0.01)


def _claude_code_stats(sessions: int = 400, k: int = 16) -> dict[str, float]:
    # At token scale k (drawn counts keep their means), in real tokens.
    spec = workload_spec("claude-code", k)
    plans = list(itertools.islice(session_plans(spec, 0), sessions))
    buckets: dict[int, list[int]] = {0: [], 1: [], 2: [], 3: [], 4: []}
    outs: list[int] = []
    gaps: list[float] = []
    for plan in plans:
        prompt = 0
        for i, t in enumerate(plan.turns):
            fresh = i == 0 or t.reset
            prompt = len(t.new_input_ids) if fresh else prompt + len(t.new_input_ids)
            b = 0 if i <= 1 else 1 if i <= 4 else 2 if i <= 9 else 3 if i <= 19 else 4
            buckets[b].append(prompt * k)
            outs.append(t.max_new_tokens * k)
            if i < len(plan.turns) - 1:
                gaps.append(t.tool_latency_s)
            prompt += t.max_new_tokens
    turns = sorted(len(p.turns) for p in plans)
    out = {f"prompt_{b}": statistics.mean(v) for b, v in buckets.items()}
    out.update(
        turns_p50=turns[len(turns) // 2],
        turns_mean=statistics.mean(turns),
        turns_p90=turns[int(0.9 * len(turns))],
        output_p50=statistics.median(outs),  # (to within k)
        output_mean=statistics.mean(outs),
        gap_max=max(gaps),
    )
    return out


CLAUDE_CODE = _claude_code_stats()


@pytest.mark.parametrize(
    ("stat", "source", "rel"),
    [
        # 07-inference-perf-weka/REPORT.md: turns p50 64 / mean 93 / p90 219.
        ("turns_p50", 64, 0.10),
        ("turns_mean", 93, 0.12),
        ("turns_p90", 219, 0.12),
        # Mean prompt by turn index: 0-1, 2-4, 5-9, 10-19, 20+.
        ("prompt_0", 26_760, 0.05),
        ("prompt_1", 47_276, 0.05),
        ("prompt_2", 57_355, 0.05),
        ("prompt_3", 67_557, 0.05),
        ("prompt_4", 90_509, 0.05),
        # Output median 350, mean 557.
        ("output_p50", 350, 0.05),
        ("output_mean", 557, 0.05),
    ],
)
def test_claude_code_against_the_trace_statistics(stat: str, source: float, rel: float) -> None:
    assert CLAUDE_CODE[stat] == pytest.approx(source, rel=rel), (stat, CLAUDE_CODE[stat])


def test_claude_code_gaps_are_capped_at_10_s() -> None:
    assert CLAUDE_CODE["gap_max"] <= 10.0
    assert workload_spec("claude-code").cost_model == PRESET


def test_burst_is_step_06() -> None:
    spec = workload_spec("burst", 1)
    plans = list(itertools.islice(session_plans(spec, 0), 80))
    assert spec.sessions_per_engine == 80
    # 80 sessions started over 10 s.
    assert spec.start_stagger_s * 80 == pytest.approx(10.0)
    finals = []
    for p in plans:
        assert len(p.turns) == 3 and all(t.max_new_tokens == 80 for t in p.turns)
        assert [t.tool_latency_s for t in p.turns] == [0.3, 0.3, 0.0]
        finals.append(sum(len(t.new_input_ids) + t.max_new_tokens for t in p.turns))
    # ~61k unique tokens a session, 2.2x the pod's pool over 80 sessions.
    assert statistics.mean(finals) == pytest.approx(61_500, rel=0.02)
    assert sum(finals) / 2_237_040 == pytest.approx(2.2, rel=0.02)
    # No two sessions share a first token (no cross-session cache hits by construction).
    assert len({p.turns[0].new_input_ids[:8].__repr__() for p in plans}) == 80
    # Other bursts are --set away.
    other = workload_spec("burst", 1, turns_median=5, task_prompt_median=30_000)
    assert other.turns.median == 5 and other.task_prompt.median == 30_000


@pytest.mark.parametrize("bad", ["x", "0:5", "2:5,1:3", "1:-3", "1:inf", "1:5,"])
def test_schedule_errors(bad: str) -> None:
    with pytest.raises(WorkloadError, match="tool_output_schedule"):
        parse_schedule(bad)
    with pytest.raises(WorkloadError):
        workload_spec("claude-code", 1, tool_output_schedule=bad)


def test_schedule_and_compaction_are_off_for_the_other_presets() -> None:
    for name in ("swe", "rl", "subagents"):
        spec = workload_spec(name)
        assert spec.tool_output_schedule == "" and spec.compact_at == 0
    plans = list(itertools.islice(session_plans(workload_spec("swe", 16), 0), 50))
    assert not any(t.reset for p in plans for t in p.turns)


def test_compaction_restarts_below_the_threshold() -> None:
    spec = workload_spec("claude-code", 16)
    plans = list(itertools.islice(session_plans(spec, 0), 100))
    resets = 0
    for plan in plans:
        ctx = 0
        for i, t in enumerate(plan.turns):
            ctx = len(t.new_input_ids) if i == 0 or t.reset else ctx + len(t.new_input_ids)
            resets += t.reset
            assert ctx + t.max_new_tokens <= spec.compact_at or i == 0 or t.reset
            ctx += t.max_new_tokens
    assert resets > 20
