"""Program admission's parameters, in seconds of wall time. Pure.

:class:`ProgramParams` is :class:`~kvproxy.config.AdmissionConfig` (every
``admission.*`` key, written once there, with its default), scaled as the controller
applies it (:mod:`kvproxy.admission.scaling` names the durations and the token
counts), plus what program mode derives from the keys and the controller's own
constants, which are not keys (``target_cut``, ``target_step``, ``quiet_windows``,
``min_feedback_turns``, ``engage_min_turns``, ``growth_alpha``, ``cold_start_ratio``,
``min_inflight``, ``floor_room``, ``floor_room_host``, ``forecast_ratio``).
``ProgramParams()`` is ``ProgramParams.from_config(AdmissionConfig())``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvproxy.admission.program.engagement import EngageRule
from kvproxy.admission.program.forecast import ForecastRule
from kvproxy.admission.scaling import time_scaled
from kvproxy.config import AdmissionConfig

# The keys' defaults (kvproxy/config/admission.py), for the fields derived from them.
_D = AdmissionConfig()


# (soft bound, hard bound) pairs of AdmissionConfig's waits.
SOFT_BOUNDS = (
    ("paused_soft_wait_s", "paused_max_wait_s"),
    ("new_session_soft_wait_s", "new_session_max_wait_s"),
)


@dataclass(frozen=True, slots=True)
class ProgramParams(AdmissionConfig):
    """Every ``admission.*`` key (the fields of :class:`AdmissionConfig`, inherited:
    each key is written once, there), what program mode derives from them, and the
    controller's own constants below."""

    # -- derived from the keys (set by from_config; the defaults are the keys' own) ----
    # At most one target cut per this long: two feedback windows.
    cut_interval_s: float = 2 * _D.feedback_window_s
    # staleness_s, resolved (None in the config: from poll_interval_s).
    staleness_s: float = _D.effective_staleness_s
    # -- the controller's own constants ------------------------------------------------
    target_cut: float = 0.8  # multiplicative decrease on thrash
    target_step: float = 0.02  # additive increase after quiet windows
    quiet_windows: int = 3
    min_feedback_turns: int = 3  # continuing turns a window needs to judge its cached fraction
    # Answers a window needs before its recompute cost (and exposure) is judged: on a
    # thinner window one long recomputed prompt reads as thrash (docs/admission.md).
    engage_min_turns: int = 6
    growth_alpha: float = 0.5  # EMA weight of the newest per-turn growth
    # The cold start (kvproxy.admission.program.engagement): the expected peaks of the
    # engine's sessions over its capacity.
    cold_start_ratio: float = 1.5
    # The hold model (kvproxy.admission.program.forecast).
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
        """``cfg``'s keys at ``time_scale`` (its durations scaled), and what derives
        from them."""
        scaled = time_scaled(cfg, time_scale)
        keys = {f.name: getattr(scaled, f.name) for f in fields(AdmissionConfig)}
        # A soft bound never outlasts its hard one (paused_max_wait_s: 30 alone is the
        # fixed 30 s hold, as the key meant before the soft bound).
        for soft, hard in SOFT_BOUNDS:
            keys[soft] = min(getattr(scaled, soft), getattr(scaled, hard))
        keys["staleness_s"] = cfg.effective_staleness_s * time_scale
        return cls(**keys, cut_interval_s=2 * scaled.feedback_window_s)
