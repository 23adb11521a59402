"""The admission config as the controller applies it: token counts divided by the
engines' token scale, durations multiplied by the time scale. Pure.

``server.token_scale`` (K) runs simulated engines whose token counts are 1/K of a
real one's; ``server.time_scale`` multiplies every kvproxy timer, for stacks of
simulated engines running faster than real time. Program mode's own durations are
scaled by :meth:`kvproxy.admission.program.params.ProgramParams.from_config`.
"""

from __future__ import annotations

import dataclasses

from kvproxy.config import AdmissionConfig


def token_scaled(cfg: AdmissionConfig, k: int) -> AdmissionConfig:
    """``cfg`` with its token counts divided by the engines' token scale ``k`` (1: as is)."""
    if k == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        default_completion_tokens=max(1, round(cfg.default_completion_tokens / k)),
        expected_decode_cap=(
            None if cfg.expected_decode_cap is None else max(1, round(cfg.expected_decode_cap / k))
        ),
        priority_unit_tokens=max(1, round(cfg.priority_unit_tokens / k)),
        session_buffer_tokens=max(0, round(cfg.session_buffer_tokens / k)),
    )


def time_scaled(cfg: AdmissionConfig, k: float) -> AdmissionConfig:
    """``cfg`` with the fleet path's durations multiplied by the time scale ``k``."""
    if k == 1.0:
        return cfg
    return dataclasses.replace(
        cfg,
        max_wait_s=cfg.max_wait_s * k,
        poll_interval_s=cfg.poll_interval_s * k,
        staleness_s=None if cfg.staleness_s is None else cfg.staleness_s * k,
        lease_ttl_s=cfg.lease_ttl_s * k,
        session_idle_s=cfg.session_idle_s * k,
    )


def residency_of(cfg: AdmissionConfig) -> bool:
    """Session residency in the fleet ledger: configured, and not in request mode."""
    return cfg.session_residency and cfg.mode != "request"
