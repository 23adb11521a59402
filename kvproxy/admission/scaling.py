"""The admission config as the controller applies it: token counts divided by the
engines' token scale, durations multiplied by the time scale. Pure.

``server.token_scale`` (K) runs simulated engines whose token counts are 1/K of a
real one's; ``server.time_scale`` multiplies every kvproxy timer, for stacks of
simulated engines running faster than real time. Which keys are durations and which
are token counts is written here only (:data:`TIME_SCALED`, :data:`TOKEN_SCALED`);
both modes take their values from the config these functions return (program mode's
through :meth:`kvproxy.admission.program.params.ProgramParams.from_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvproxy.config import AdmissionConfig

# The keys that are durations in seconds, multiplied by the time scale. Not
# metrics_timeout_s: an HTTP timeout against real sockets, in wall seconds.
TIME_SCALED: tuple[str, ...] = (
    # fleet mode, and the polls both modes share
    "max_wait_s",
    "poll_interval_s",
    "staleness_s",
    "lease_ttl_s",
    "session_idle_s",
    # program mode
    "paused_soft_wait_s",
    "paused_max_wait_s",
    "new_session_soft_wait_s",
    "new_session_max_wait_s",
    "tick_s",
    "idle_lease_s",
    "idle_half_life_s",
    "idle_ttl_s",
    "feedback_window_s",
    "prefetch_lead_s",
)
# The keys that are token counts, divided by the token scale: each with the least it
# may become (a count of 0 would mean "none", a buffer of 0 is one).
TOKEN_SCALED: Mapping[str, int] = {
    "default_completion_tokens": 1,
    "expected_decode_cap": 1,
    "priority_unit_tokens": 1,
    "session_buffer_tokens": 0,
}


def token_scaled(cfg: AdmissionConfig, k: int) -> AdmissionConfig:
    """``cfg`` with its token counts divided by the engines' token scale ``k`` (1: as is)."""
    if k == 1:
        return cfg
    changes: dict[str, int | None] = {}
    for name, least in TOKEN_SCALED.items():
        value: int | None = getattr(cfg, name)
        changes[name] = None if value is None else max(least, round(value / k))
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def time_scaled(cfg: AdmissionConfig, k: float) -> AdmissionConfig:
    """``cfg`` with its durations multiplied by the time scale ``k`` (1.0: as is)."""
    if k == 1.0:
        return cfg
    changes: dict[str, float | None] = {}
    for name in TIME_SCALED:
        value: float | None = getattr(cfg, name)
        changes[name] = None if value is None else value * k
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def residency_of(cfg: AdmissionConfig) -> bool:
    """Session residency in the fleet ledger: configured, and not in request mode."""
    return cfg.session_residency and cfg.mode != "request"
