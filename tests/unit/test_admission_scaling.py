"""The time and token scales: which keys they apply to (named once, in
kvproxy.admission.scaling) and program mode's parameters derived from the config."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.scaling import TIME_SCALED, TOKEN_SCALED, time_scaled, token_scaled
from kvproxy.config import AdmissionConfig

KEYS = {f.name for f in dataclasses.fields(AdmissionConfig)}
# An HTTP timeout against real sockets: wall seconds whatever the time scale.
WALL_CLOCK = {"metrics_timeout_s"}


def test_every_duration_key_is_time_scaled_and_every_named_key_exists() -> None:
    durations = {k for k in KEYS if k.endswith("_s")}
    assert set(TIME_SCALED) == durations - WALL_CLOCK
    assert set(TOKEN_SCALED) <= KEYS


@pytest.mark.parametrize("k", [1.0, 2.0, 0.25])
def test_time_scaled_multiplies_the_durations_and_nothing_else(k: float) -> None:
    cfg = AdmissionConfig(staleness_s=7.0, session_buffer_tokens=50)
    scaled = time_scaled(cfg, k)
    for name in KEYS:
        expected = getattr(cfg, name) * k if name in TIME_SCALED else getattr(cfg, name)
        assert getattr(scaled, name) == expected, name


def test_token_scaled_divides_the_counts_and_keeps_their_floor() -> None:
    cfg = AdmissionConfig(expected_decode_cap=10, session_buffer_tokens=3)
    scaled = token_scaled(cfg, 16)
    assert scaled.expected_decode_cap == 1 and scaled.session_buffer_tokens == 0
    assert scaled.default_completion_tokens == 256 and scaled.priority_unit_tokens == 256
    assert {n for n in KEYS if getattr(scaled, n) != getattr(cfg, n)} <= set(TOKEN_SCALED)


def test_program_params_carry_every_key_scaled_and_what_derives_from_them() -> None:
    cfg = AdmissionConfig(paused_soft_wait_s=90.0, paused_max_wait_s=60.0, tick_s=0.5)
    p = ProgramParams.from_config(cfg, 2.0)
    for name in KEYS - {"paused_soft_wait_s", "staleness_s"}:
        value = getattr(cfg, name)
        assert getattr(p, name) == (value * 2.0 if name in TIME_SCALED else value), name
    assert p.paused_soft_wait_s == 120.0  # clamped to the hard bound, then scaled
    assert p.staleness_s == cfg.effective_staleness_s * 2.0
    assert p.cut_interval_s == 2 * cfg.feedback_window_s * 2.0
    assert ProgramParams() == ProgramParams.from_config(AdmissionConfig())
