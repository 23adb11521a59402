"""``kvproxy sim-engine`` flags: cost-model presets, token scale, overrides."""

from __future__ import annotations

import argparse

import pytest

from kvlab.sim.cli import add_arguments, config_from_args
from kvlab.sim.config import SimConfig
from kvlab.sim.cost import CostModel
from kvlab.sim.presets import cost_model, scheduler_config


def parse(*argv: str) -> SimConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_defaults_are_the_legacy_engine_unchanged() -> None:
    cfg = parse()
    d = SimConfig()
    assert cfg.cost == CostModel() == cost_model("legacy")
    assert (cfg.max_total_tokens, cfg.chunked_prefill_size) == (d.max_total_tokens, 8192)
    assert (cfg.max_prefill_tokens, cfg.context_length) == (16384, 40960)
    assert (cfg.retract_decode_steps, cfg.new_token_ratio_decay_steps) == (20, 600)
    assert cfg.priority_scheduling_preemption_threshold == 10


def test_preset_sets_pool_chunk_prefill_and_context_scaled_by_k() -> None:
    cfg = parse("--cost-model", "qwen3-8b-h100", "--token-scale", "16")
    assert cfg.cost == cost_model("qwen3-8b-h100", 16)
    assert (cfg.max_total_tokens, cfg.chunked_prefill_size) == (22_938, 512)
    assert (cfg.max_prefill_tokens, cfg.context_length) == (1024, 2560)
    assert (cfg.retract_decode_steps, cfg.new_token_ratio_decay_steps) == (1, 38)
    assert cfg.clip_max_new_tokens == 256
    llama = parse("--cost-model", "llama3.1-8b-h100")
    assert (llama.max_total_tokens, llama.context_length) == (415_000, 131_072)


def test_preset_mixed_chunk_reaches_the_http_engine() -> None:
    """The replication's preset runs decode inside prefill steps in the lab
    (scheduler_config); the HTTP engine built from the same flags runs it too, or a
    burst's first turns all answer together after the last prefill."""
    preset = "qwen3-coder-30b-a3b-fp8-h100-tp2"
    cfg = parse("--cost-model", preset, "--token-scale", "16")
    lab = scheduler_config(preset, 16)
    assert lab.enable_mixed_chunk and lab.mixed_decode_every == 16
    assert (cfg.scheduler.enable_mixed_chunk, cfg.scheduler.mixed_decode_every) == (True, 16)
    assert not parse(
        "--cost-model", "qwen3-8b-h100", "--token-scale", "16"
    ).scheduler.enable_mixed_chunk


def test_flags_override_the_preset() -> None:
    cfg = parse(
        "--cost-model",
        "qwen3-32b-h200",
        "--token-scale",
        "16",
        "--max-total-tokens",
        "9000",
        "--chunked-prefill-size",
        "0",
        "--context-length",
        "3000",
        "--max-prefill-tokens",
        "2000",
        "--enable-priority-scheduling",
        "--priority-scheduling-preemption-threshold",
        "3",
    )
    assert (cfg.max_total_tokens, cfg.chunked_prefill_size) == (9000, 0)
    assert (cfg.context_length, cfg.max_prefill_tokens) == (3000, 2000)
    assert cfg.enable_priority_scheduling and cfg.priority_scheduling_preemption_threshold == 3
    assert cfg.cost.preset == "qwen3-32b-h200" and cfg.cost.token_scale == 16


def test_legacy_constant_flags() -> None:
    cfg = parse("--prefill-base-s", "0.02", "--decode-per-req-s", "0.001")
    assert (cfg.cost.prefill_base_s, cfg.cost.prefill_per_token_s) == (0.02, 0.00005)
    assert (cfg.cost.decode_base_s, cfg.cost.decode_per_req_s) == (0.012, 0.001)
    with pytest.raises(ValueError, match="--prefill-base-s apply to --cost-model legacy only"):
        parse("--cost-model", "qwen3-8b-h100", "--prefill-base-s", "0.02")


def test_bad_values_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="token_scale"):
        parse("--token-scale", "0")
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--cost-model", "gpt-9"])
    assert "invalid choice: 'gpt-9'" in capsys.readouterr().err


def test_run_reports_a_bad_flag_combination(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.sim.cli import run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--cost-model", "qwen3-8b-h100", "--token-scale", "100000"])
    assert run(args) == 2
    assert "token_scale must be an integer in [1, 1024]" in capsys.readouterr().err


def test_sim_config_is_composed_of_the_scheduler_config() -> None:
    from kvlab.sim.config import SchedulerConfig

    cfg = SimConfig(max_total_tokens=1234, mode="session-radix", time_scale=0.0)
    assert cfg.scheduler == SchedulerConfig(max_total_tokens=1234, mode="session-radix")
    assert cfg.scheduler_config() is cfg.scheduler
    assert (cfg.max_total_tokens, cfg.mode, cfg.time_scale) == (1234, "session-radix", 0.0)
    moved = cfg.replace(mode="plain", port=1)
    assert (moved.mode, moved.max_total_tokens, moved.port) == ("plain", 1234, 1)
    base = SchedulerConfig(init_new_token_ratio=0.5)
    assert SimConfig(scheduler=base, context_length=99).scheduler == SchedulerConfig(
        init_new_token_ratio=0.5, context_length=99
    )
    with pytest.raises(TypeError, match="no_such_field"):
        SimConfig(no_such_field=1)


def test_hicache_flags_use_sglang_names_and_are_off_by_default() -> None:
    assert parse().hicache is None
    assert parse("--hicache-ratio", "3").hicache is None  # without the enable flag: ignored
    cfg = parse(
        "--cost-model",
        "qwen3-32b-h200",
        "--token-scale",
        "16",
        "--enable-hierarchical-cache",
        "--hicache-size",
        "100",
        "--hicache-write-policy",
        "write_back",
    )
    h = cfg.hicache
    assert h is not None
    assert (h.size_gb, h.write_policy, h.token_scale) == (100, "write_back", 16)
    assert (h.kv_bytes_per_token, h.num_layers) == (262_144, 64)
    assert parse("--enable-hierarchical-cache").hicache.ratio == 2.0  # type: ignore[union-attr]
    with pytest.raises(SystemExit):
        parse("--enable-hierarchical-cache", "--hicache-write-policy", "write_around")
