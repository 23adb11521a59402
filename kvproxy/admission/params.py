"""Program admission's parameters, in seconds of wall time. Pure.

Built from :class:`~kvproxy.config.AdmissionConfig` and ``server.time_scale``: every
duration is multiplied by the time scale (wall seconds per simulated second), so a
run against engines simulated faster than real time keeps the same dynamics.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.admission.engagement import EngageRule
from kvproxy.config import AdmissionConfig


@dataclass(frozen=True, slots=True)
class ProgramParams:
    headroom: float = 0.90
    hold_continuing: bool = False
    pause: bool = True
    paused_max_wait_s: float = 30.0
    new_session_max_wait_s: float = 1800.0
    priority_steering: bool = False
    priority_unit_tokens: int = 4096
    priority_max: int = 9
    feedback: bool = True
    tick_s: float = 1.0
    idle_lease_s: float = 5.0
    idle_half_life_s: float = 10.0
    idle_ttl_s: float = 600.0
    pause_high: float = 0.95
    pause_low: float = 0.85
    target_start: float = 0.92
    target_min: float = 0.60
    target_max: float = 0.95
    target_cut: float = 0.8  # multiplicative decrease on thrash
    target_step: float = 0.02  # additive increase after quiet windows
    quiet_windows: int = 3
    gate_off_below: float = 0.75
    thrash_cached_fraction: float = 0.85
    min_feedback_turns: int = 3  # continuing turns a window needs to judge its cached fraction
    feedback_window_s: float = 5.0
    cut_interval_s: float = 10.0  # at most one cut per this long
    session_buffer_tokens: int = 100
    growth_alpha: float = 0.5  # EMA weight of the newest per-turn growth
    # Growth-aware admission of new sessions (docs/admission.md#growth-aware-admission-of-new-sessions).
    growth_reservation: bool = True
    growth_target: float = 0.92
    growth_quantile: float = 0.25
    growth_window: int = 256
    growth_min_closed: int = 16
    growth_horizon_turns: float = 16.0
    # Hold only where holding is measured to pay (kvproxy.admission.engagement).
    engage_on_thrash: bool = True
    engage_cost: float = 0.4
    engage_busy: float = 0.75
    decode_token_weight: float = 16.0
    release_busy: float = 0.5
    engage_windows: int = 2
    release_windows: int = 6
    # The cold start (kvproxy.admission.engagement): sessions on the engine, and their
    # expected peaks over its capacity.
    cold_start_sessions: int = 24
    cold_start_ratio: float = 1.5
    # Work conservation while engaged: an engine with fewer turns in flight takes the
    # next held turn.
    min_inflight: int = 3
    staleness_s: float = 6.0
    max_queue: int = 10_000
    max_sessions: int = 100_000

    @property
    def engage_rule(self) -> EngageRule:
        return EngageRule(
            engage_cost=self.engage_cost,
            engage_busy=self.engage_busy,
            release_busy=self.release_busy,
            engage_windows=self.engage_windows,
            release_windows=self.release_windows,
        )

    @classmethod
    def from_config(cls, cfg: AdmissionConfig, time_scale: float = 1.0) -> ProgramParams:
        k = time_scale
        return cls(
            headroom=cfg.headroom,
            hold_continuing=cfg.hold_continuing,
            pause=cfg.pause,
            paused_max_wait_s=cfg.paused_max_wait_s * k,
            new_session_max_wait_s=cfg.new_session_max_wait_s * k,
            priority_steering=cfg.priority_steering,
            priority_unit_tokens=cfg.priority_unit_tokens,
            priority_max=cfg.priority_max,
            feedback=cfg.feedback,
            tick_s=cfg.tick_s * k,
            idle_lease_s=cfg.idle_lease_s * k,
            idle_half_life_s=cfg.idle_half_life_s * k,
            idle_ttl_s=cfg.idle_ttl_s * k,
            pause_high=cfg.pause_high,
            pause_low=cfg.pause_low,
            target_start=cfg.target_start,
            target_min=cfg.target_min,
            target_max=cfg.target_max,
            gate_off_below=cfg.gate_off_below,
            thrash_cached_fraction=cfg.thrash_cached_fraction,
            feedback_window_s=cfg.feedback_window_s * k,
            cut_interval_s=2 * cfg.feedback_window_s * k,
            session_buffer_tokens=cfg.session_buffer_tokens,
            growth_reservation=cfg.growth_reservation,
            growth_target=cfg.growth_target,
            growth_quantile=cfg.growth_quantile,
            growth_window=cfg.growth_window,
            growth_min_closed=cfg.growth_min_closed,
            growth_horizon_turns=cfg.growth_horizon_turns,
            engage_on_thrash=cfg.engage_on_thrash,
            engage_cost=cfg.engage_cost,
            engage_busy=cfg.engage_busy,
            decode_token_weight=cfg.decode_token_weight,
            release_busy=cfg.release_busy,
            engage_windows=cfg.engage_windows,
            release_windows=cfg.release_windows,
            cold_start_sessions=cfg.cold_start_sessions,
            staleness_s=cfg.effective_staleness_s * k,
            max_queue=cfg.max_queue,
            max_sessions=cfg.max_sessions,
        )
