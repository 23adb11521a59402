"""Program admission's parameters, in seconds of wall time. Pure.

Built from :class:`~kvproxy.config.AdmissionConfig` and ``server.time_scale``: every
duration is multiplied by the time scale (wall seconds per simulated second), so a
run against engines simulated faster than real time keeps the same dynamics.

The defaults are not written here: a parameter that is a config key takes its default
from :class:`~kvproxy.config.AdmissionConfig` (``ProgramParams()`` is
``ProgramParams.from_config(AdmissionConfig())``); only the controller's own constants
(``target_cut``, ``target_step``, ``quiet_windows``, ``min_feedback_turns``,
``engage_min_turns``, ``growth_alpha``, ``cold_start_ratio``, ``min_inflight``,
``floor_room``, ``floor_room_host``, ``forecast_ratio``) are set here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.admission.program.engagement import EngageRule
from kvproxy.admission.program.forecast import ForecastRule
from kvproxy.config import AdmissionConfig

# The one place program admission's defaults are written (kvproxy/config/admission.py).
_D = AdmissionConfig()


@dataclass(frozen=True, slots=True)
class ProgramParams:
    headroom: float = _D.headroom
    hold_continuing: bool = _D.hold_continuing
    pause: bool = _D.pause
    paused_soft_wait_s: float = _D.paused_soft_wait_s
    paused_max_wait_s: float = _D.paused_max_wait_s
    new_session_max_wait_s: float = _D.new_session_max_wait_s
    priority_steering: bool = _D.priority_steering
    priority_unit_tokens: int = _D.priority_unit_tokens
    priority_max: int = _D.priority_max
    feedback: bool = _D.feedback
    tick_s: float = _D.tick_s
    idle_lease_s: float = _D.idle_lease_s
    idle_half_life_s: float = _D.idle_half_life_s
    idle_ttl_s: float = _D.idle_ttl_s
    pause_high: float = _D.pause_high
    pause_low: float = _D.pause_low
    target_start: float = _D.target_start
    target_min: float = _D.target_min
    target_max: float = _D.target_max
    target_cut: float = 0.8  # multiplicative decrease on thrash
    target_step: float = 0.02  # additive increase after quiet windows
    quiet_windows: int = 3
    gate_off_below: float = _D.gate_off_below
    thrash_cached_fraction: float = _D.thrash_cached_fraction
    min_feedback_turns: int = 3  # continuing turns a window needs to judge its cached fraction
    # Answers a window needs before its recompute cost (and exposure) is judged: on a
    # thinner window one long recomputed prompt reads as thrash (docs/admission.md).
    engage_min_turns: int = 6
    feedback_window_s: float = _D.feedback_window_s
    cut_interval_s: float = 2 * _D.feedback_window_s  # at most one cut per this long
    session_buffer_tokens: int = _D.session_buffer_tokens
    growth_alpha: float = 0.5  # EMA weight of the newest per-turn growth
    # Growth-aware admission of new sessions (docs/admission.md#growth-aware-admission-of-new-sessions).
    growth_reservation: bool = _D.growth_reservation
    growth_target: float = _D.growth_target
    growth_quantile: float = _D.growth_quantile
    growth_window: int = _D.growth_window
    growth_min_closed: int = _D.growth_min_closed
    growth_horizon_turns: float = _D.growth_horizon_turns
    # Hold only where holding is measured to pay (kvproxy.admission.program.engagement).
    engage_on_thrash: bool = _D.engage_on_thrash
    engage_cost: float = _D.engage_cost
    engage_busy: float = _D.engage_busy
    decode_token_weight: float = _D.decode_token_weight
    release_busy: float = _D.release_busy
    engage_windows: int = _D.engage_windows
    release_windows: int = _D.release_windows
    # The cold start (kvproxy.admission.program.engagement): sessions on the engine, and their
    # expected peaks over its capacity.
    cold_start_sessions: int = _D.cold_start_sessions
    cold_start_ratio: float = 1.5
    # The hold model (kvproxy.admission.program.forecast).
    engage_on_forecast: bool = _D.engage_on_forecast
    forecast_ratio: float = 1.0  # known contexts over the room that engage
    # Work conservation while engaged: an engine with fewer turns in flight takes the
    # next held turn.
    min_inflight: int = 3
    # How many times the floor's contexts (min_inflight of those its continuing turns
    # come back to) the engine's KV room must hold for a window to count as hot: the
    # floor keeps its turns running whatever is held, so where their contexts alone
    # overflow the room, holding delays work and cannot stop the eviction. 3 (the pool
    # holds 9 such contexts) over 2: losing runs on the grid's 8 seeds 8 -> 1, swe's small
    # fleets' gains kept; 4 lost them (docs/benchmarks.md, "A pool the floor overflows").
    floor_room: float = 3.0
    # The same on an engine with a host tier, whose room counts the host (what the floor's
    # turns push out comes back by a load): 3 there added losing runs (swe 16 per engine at
    # 2.5x and 4x the pool, 0.95x and 0.91x) and lost subagent fleets' gains, so 2.
    floor_room_host: float = 2.0
    staleness_s: float = _D.effective_staleness_s
    max_queue: int = _D.max_queue
    max_sessions: int = _D.max_sessions
    prefetch: bool = _D.prefetch
    pressure_threshold: float = _D.pressure_threshold
    prefetch_lead_s: float = _D.prefetch_lead_s
    prefetch_max_in_flight: int = _D.prefetch_max_in_flight

    @property
    def engage_rule(self) -> EngageRule:
        return EngageRule(
            engage_cost=self.engage_cost,
            engage_busy=self.engage_busy,
            release_busy=self.release_busy,
            engage_windows=self.engage_windows,
            release_windows=self.release_windows,
        )

    @property
    def forecast_rule(self) -> ForecastRule:
        return ForecastRule(
            demand_ratio=self.forecast_ratio,
            expected_ratio=self.cold_start_ratio,
            exposure=self.engage_rule.cold_exposure,
            decode_token_weight=self.decode_token_weight,
            min_inflight=self.min_inflight,
            floor_room=self.floor_room,
            min_returns=self.engage_min_turns,
            min_sessions=self.cold_start_sessions,
        )

    @classmethod
    def from_config(cls, cfg: AdmissionConfig, time_scale: float = 1.0) -> ProgramParams:
        k = time_scale
        return cls(
            headroom=cfg.headroom,
            hold_continuing=cfg.hold_continuing,
            pause=cfg.pause,
            # The soft bound never outlasts the hard one (paused_max_wait_s: 30 alone
            # is the fixed 30 s hold, as the key meant before the soft bound).
            paused_soft_wait_s=min(cfg.paused_soft_wait_s, cfg.paused_max_wait_s) * k,
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
            engage_on_forecast=cfg.engage_on_forecast,
            staleness_s=cfg.effective_staleness_s * k,
            max_queue=cfg.max_queue,
            max_sessions=cfg.max_sessions,
            prefetch=cfg.prefetch,
            pressure_threshold=cfg.pressure_threshold,
            prefetch_lead_s=cfg.prefetch_lead_s * k,
            prefetch_max_in_flight=cfg.prefetch_max_in_flight,
        )
