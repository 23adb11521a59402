"""The calibrated cost model and its presets, pinned against the published points.

The reference points are calibration.md §3 (docs/simulator.md, "Validation"): what
each preset must give on the pure cost model at token scale 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.cost import CostModel
from kvlab.sim.presets import PRESET_NAMES, PRESETS, cost_model, scheduler_config

CHUNK = 8192


def prefill(preset: str, new: int, cached: int = 0) -> float:
    return cost_model(preset).prefill_tokens_s(new, cached, CHUNK)


# (preset, new tokens, cached tokens, expected seconds, relative tolerance)
PREFILL_POINTS = [
    # sglang PR #1060: 27,670 input tok/s for Llama-3.1-8B on H100 at 8k prompts
    # (0.296 s); the derived presets give 277 ms (qwen) and 273 ms (llama).
    ("qwen3-8b-h100", 1024, 0, 0.034, 0.03),
    ("qwen3-8b-h100", 8192, 0, 0.277, 0.01),
    ("llama3.1-8b-h100", 8192, 0, 0.273, 0.01),
    ("qwen3-8b-h100", 32768, 0, 1.64, 0.01),
    ("qwen3-8b-h100", 40960, 0, 2.26, 0.01),
    ("llama3.1-8b-h100", 32768, 0, 1.56, 0.01),
    # 900 new tokens on a cached prefix vs the full re-prefill.
    ("qwen3-8b-h100", 900, 4000, 0.035, 0.03),
    ("qwen3-8b-h100", 4900, 0, 0.157, 0.02),
    ("qwen3-8b-h100", 900, 16000, 0.049, 0.02),
    ("qwen3-8b-h100", 16900, 0, 0.672, 0.01),
    ("qwen3-8b-h100", 900, 32000, 0.068, 0.02),
    ("qwen3-8b-h100", 32900, 0, 1.65, 0.01),
    ("qwen3-32b-h200", 900, 4000, 0.126, 0.02),
    ("qwen3-32b-h200", 4900, 0, 0.62, 0.02),
    ("qwen3-32b-h200", 900, 16000, 0.176, 0.02),
    ("qwen3-32b-h200", 16900, 0, 2.6, 0.02),
    ("qwen3-32b-h200", 900, 32000, 0.243, 0.02),
    ("qwen3-32b-h200", 32900, 0, 6.3, 0.02),
]


@pytest.mark.parametrize(("preset", "new", "cached", "expected", "tol"), PREFILL_POINTS)
def test_prefill_validation_points(
    preset: str, new: int, cached: int, expected: float, tol: float
) -> None:
    got = prefill(preset, new, cached)
    assert got == pytest.approx(expected, rel=tol), got


@pytest.mark.parametrize(
    ("preset", "cached", "ratio"),
    [
        ("qwen3-8b-h100", 4000, 4.5),
        ("qwen3-8b-h100", 16000, 13.6),
        ("qwen3-8b-h100", 32000, 24.0),
        ("qwen3-32b-h200", 4000, 4.9),
        ("qwen3-32b-h200", 16000, 14.8),
        ("qwen3-32b-h200", 32000, 25.8),
    ],
)
def test_miss_vs_incremental_turn_ratio(preset: str, cached: int, ratio: float) -> None:
    miss = prefill(preset, cached + 900)
    hit = prefill(preset, 900, cached)
    assert miss / hit == pytest.approx(ratio, rel=0.03)


# (preset, batch size, mean context, published median ITL in seconds) at 10% tolerance.
DECODE_POINTS = [
    # ML.ENERGY leaderboard, Qwen3-8B on H100 (vLLM), GPQA.
    ("qwen3-8b-h100", 8, 5250, 0.00970),
    ("qwen3-8b-h100", 16, 5150, 0.01191),
    ("qwen3-8b-h100", 32, 5550, 0.01687),
    ("qwen3-8b-h100", 63, 5700, 0.02664),
    # sglang test_bench_one_batch: > 135 tok/s at batch 1 (< 7.4 ms).
    ("llama3.1-8b-h100", 1, 1000, 0.0070),
    # ML.ENERGY chat, Llama-3.1-8B on H100 (contexts 1-1.5k).
    ("llama3.1-8b-h100", 8, 1250, 0.00732),
    ("llama3.1-8b-h100", 32, 1250, 0.00891),
]


@pytest.mark.parametrize(("preset", "batch", "context", "itl"), DECODE_POINTS)
def test_decode_validation_points(preset: str, batch: int, context: int, itl: float) -> None:
    got = cost_model(preset).decode_s(batch, batch * context)
    assert got == pytest.approx(itl, rel=0.10), got


def test_llama_batch_one_is_faster_than_the_published_bound() -> None:
    assert cost_model("llama3.1-8b-h100").decode_s(1, 1000) < 0.0074


@pytest.mark.parametrize(
    ("preset", "lo", "hi"),
    [("qwen3-8b-h100", 0.0265, 0.0285), ("qwen3-8b-h200", 0.036, 0.0385)],
)
def test_decode_saturates_near_a_plus_c_times_pool(preset: str, lo: float, hi: float) -> None:
    c = cost_model(preset)
    pool = PRESETS[preset].max_total_tokens
    for batch in (16, 32, 64):
        assert lo <= c.decode_s(batch, pool) <= hi


def test_preset_engine_defaults() -> None:
    expected = {
        "qwen3-8b-h100": (367_000, 40_960),
        "qwen3-8b-h200": (805_000, 40_960),
        "qwen3-32b-h200": (265_000, 40_960),
        "llama3.1-8b-h100": (415_000, 131_072),
        "legacy": (200_000, 40_960),
        "qwen3-coder-30b-a3b-fp8-h100-tp2": (2_237_040, 262_144),
    }
    assert set(PRESET_NAMES) == set(expected)
    # vLLM's max-num-batched-tokens 8192 bounds every step of the replication's engine.
    steps = {"qwen3-coder-30b-a3b-fp8-h100-tp2": (8192, 8192)}
    for name, (pool, ctx) in expected.items():
        p = PRESETS[name]
        assert (p.max_total_tokens, p.context_length) == (pool, ctx)
        assert (p.chunked_prefill_size, p.max_prefill_tokens) == steps.get(name, (8192, 16384))
        cfg = scheduler_config(name)
        assert cfg.max_total_tokens == pool
        assert cfg.cost == p.cost
        assert (cfg.retract_decode_steps, cfg.new_token_ratio_decay_steps) == (20, 600)


# ---------------------------------------------------------------------- legacy


def test_legacy_reproduces_the_original_model_exactly() -> None:
    rng = random.Random(7)
    c = cost_model("legacy")
    assert c == CostModel() == SchedulerConfig().cost
    for _ in range(500):
        items = [(rng.randint(1, 8192), rng.randint(0, 40_000)) for _ in range(rng.randint(1, 6))]
        tokens = sum(n for n, _ in items)
        assert c.prefill_s(items) == 0.010 + 0.00005 * tokens
        b = rng.randint(1, 256)
        assert c.decode_s(b, rng.randint(0, 10**6)) == 0.012 + 0.0002 * b


def test_legacy_constructor_keeps_the_old_names() -> None:
    c = CostModel.legacy(prefill_base_s=0.02, decode_per_req_s=0.001)
    assert (c.prefill_base_s, c.prefill_per_token_s) == (0.02, 0.00005)
    assert (c.decode_base_s, c.decode_per_req_s) == (0.012, 0.001)
    assert c.kind == "legacy" and c.preset == "custom"
    assert CostModel.legacy().preset == "legacy"


# ---------------------------------------------------------------- token scale


@pytest.mark.parametrize("k", [2, 16, 64])
def test_token_scale_prefill_is_the_real_cost(k: int) -> None:
    real = cost_model("qwen3-8b-h100")
    scaled = cost_model("qwen3-8b-h100", k)
    for new, cached in itertools.product((k * 64, k * 500), (0, k * 1000, k * 2000)):
        items = [(new // k, cached // k)]
        assert scaled.prefill_s(items) == pytest.approx(real.prefill_s([(new, cached)]), rel=1e-9)


@pytest.mark.parametrize("k", [2, 16, 64])
def test_token_scale_decode_step_is_k_real_steps(k: int) -> None:
    real = cost_model("qwen3-32b-h200")
    scaled = cost_model("qwen3-32b-h200", k)
    batch, context = 24, 24 * 6000  # real tokens at the start of the macro-step
    k_real_steps = sum(real.decode_s(batch, context + j * batch) for j in range(k))
    # One macro-step reads the context at its start: it misses the k/2 steps' growth.
    got = scaled.decode_s(batch, context // k)
    assert got == pytest.approx(k_real_steps, rel=0.01)


def test_scheduler_config_divides_token_quantities() -> None:
    cfg = scheduler_config("qwen3-8b-h100", 16)
    assert cfg.max_total_tokens == round(367_000 / 16) == 22_938
    assert (cfg.chunked_prefill_size, cfg.max_prefill_tokens) == (512, 1024)
    assert cfg.context_length == 2560
    assert cfg.clip_max_new_tokens == 256
    assert cfg.retract_decode_steps == 1  # max(1, round(20 / 16))
    assert cfg.new_token_ratio_decay_steps == round(600 / 16)
    assert cfg.cost.token_scale == 16
    assert scheduler_config("qwen3-8b-h100", 4).retract_decode_steps == 5
    # Overrides are applied as given (simulated tokens), after scaling.
    over = scheduler_config("qwen3-8b-h100", 16, max_total_tokens=5000, mode="session-radix")
    assert (over.max_total_tokens, over.mode, over.chunked_prefill_size) == (
        5000,
        "session-radix",
        512,
    )


def test_bad_presets_and_scales_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown cost model 'gpt-9'"):
        cost_model("gpt-9")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="token_scale"):
            scheduler_config("legacy", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown SchedulerConfig fields"):
        scheduler_config("legacy", pool=5)
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(tau_att_s=-1.0)
    with pytest.raises(ValueError, match="kind"):
        CostModel(kind="gpu")


def test_to_dict_names_every_constant_with_its_unit() -> None:
    d = cost_model("qwen3-8b-h100", 16).to_dict()
    for key in (
        "t0_prefill_s",
        "tau_lin_s",
        "tau_att_s",
        "decode_a_s",
        "decode_b_s",
        "decode_c_s_per_token",
    ):
        assert key in d
    assert (d["preset"], d["kind"], d["token_scale"]) == ("qwen3-8b-h100", "calibrated", 16)
    assert d["tau_lin_s"] == pytest.approx(27.8e-6)
    assert d["decode_c_s_per_token"] == pytest.approx(0.0546e-6)
    assert d["scaled_decode_a_s"] == pytest.approx(16 * 0.007)
    assert d["scaled_tau_att_s_per_sim_pair"] == pytest.approx(256 * 1.311e-9)
    assert dataclasses.asdict(cost_model("legacy"))["kind"] == "legacy"
