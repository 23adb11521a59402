"""Configuration of the simulated SGLang engine: one frozen dataclass.

Pure: no I/O. :func:`validate_sim_config` raises :class:`ValueError` naming the
offending field. The cost model lives in
``kvlab.sim.cost`` and the named presets in ``kvlab.sim.presets``; both are
described in docs/simulator.md ("Cost model").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvlab.sim.cost import CostModel, validate_cost_model

__all__ = [
    "CostModel",
    "FaultConfig",
    "HiCacheConfig",
    "SchedulerConfig",
    "SimConfig",
    "validate_faults",
    "validate_sim_config",
]

MODES = ("plain", "session-radix", "streaming")
EVICTION_POLICIES = ("lru", "priority")
METRICS_FAULTS = ("ok", "error", "garbage")
OUTPUT_LEN_DISTS = ("max", "uniform")
# SGLang's --hicache-write-policy choices (server_args.py); write_through is its default.
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# HiRadixCache.load_back_threshold (mem_cache/hiradix_cache.py): a host hit shorter than
# this many real tokens is recomputed rather than loaded back.
HICACHE_LOAD_BACK_THRESHOLD = 10


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """SGLang's hierarchical cache (``--enable-hierarchical-cache``): a host KV tier.

    ``ratio`` / ``size_gb`` / ``write_policy`` are SGLang's ``--hicache-ratio``,
    ``--hicache-size`` (GB; > 0 overrides the ratio) and ``--hicache-write-policy``.
    The rest describe the model and the host link (the preset fills them in): KV bytes
    per real token, the effective host<->device bandwidth in GB/s (1e9 bytes), the
    layer count (the load overlaps the prefill layer by layer) and the token scale K.
    """

    ratio: float = 2.0
    size_gb: int = 0
    write_policy: str = "write_through"
    kv_bytes_per_token: int = 147_456
    host_link_gb_s: float = 50.0
    num_layers: int = 36
    token_scale: int = 1

    def host_tokens(self, device_tokens: int) -> int:
        """Host pool size in simulated tokens (HostKVCache: GB // bytes per token, or
        ``int(device pool x ratio)``)."""
        if self.size_gb > 0:
            real = int(self.size_gb * 1e9 // self.kv_bytes_per_token)
            return max(1, round(real / self.token_scale))
        return int(device_tokens * self.ratio)

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move ``tokens`` simulated tokens of KV over the host link."""
        return tokens * self.token_scale * self.kv_bytes_per_token / (self.host_link_gb_s * 1e9)

    @property
    def load_back_threshold(self) -> int:
        return max(1, round(HICACHE_LOAD_BACK_THRESHOLD / self.token_scale))

    def to_server_args(self) -> dict[str, Any]:
        """The fields SGLang's /server_info reports for it (storage tier: none)."""
        return {
            "enable_hierarchical_cache": True,
            "hicache_ratio": self.ratio,
            "hicache_size": self.size_gb,
            "hicache_write_policy": self.write_policy,
            "hicache_io_backend": "kernel",
            "hicache_mem_layout": "layer_first",
            "hicache_storage_backend": None,
        }


def validate_hicache(h: HiCacheConfig) -> None:
    if h.write_policy not in HICACHE_WRITE_POLICIES:
        raise ValueError(
            f"hicache write policy must be one of {HICACHE_WRITE_POLICIES}, got {h.write_policy!r}"
        )
    if not h.ratio > 0:
        raise ValueError(f"hicache ratio must be > 0, got {h.ratio!r}")
    if h.size_gb < 0:
        raise ValueError(f"hicache size must be >= 0 GB, got {h.size_gb!r}")
    if h.kv_bytes_per_token < 1 or not h.host_link_gb_s > 0 or h.num_layers < 1:
        raise ValueError("hicache: KV bytes per token, link bandwidth and layers must be > 0")
    if h.token_scale < 1:
        raise ValueError(f"hicache token scale must be >= 1, got {h.token_scale!r}")


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Fault knobs for reliability tests (also settable at run time via ``/sim/faults``)."""

    # "ok": normal /metrics; "error": HTTP 500; "garbage": 200 with unparsable text.
    metrics: str = "ok"
    # Extra latency added before every data-plane request is handled.
    latency_s: float = 0.0
    # Cut the TCP connection after this many SSE chunks of a streaming response.
    drop_stream_after_chunks: int | None = None
    # Hold a streaming response open this long (wall-clock seconds) after its
    # ``data: [DONE]`` before ending it, as a router may.
    hold_after_done_s: float = 0.0
    # Answer every data-plane request (and /health) with HTTP 503.
    status_503: bool = False
    # Report this sglang:token_usage (and full_token_usage) in /metrics instead of the
    # real value: pushes a proxy's pressure guard without filling the pool.
    token_usage: float | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the pure scheduler needs (a subset of :class:`SimConfig`)."""

    max_total_tokens: int = 200_000
    mode: str = "plain"
    eviction_policy: str = "lru"
    enable_priority_scheduling: bool = False
    # SGLang's --priority-scheduling-preemption-threshold: a waiting request preempts
    # running ones whose priority is lower by more than this (priority scheduling only).
    priority_scheduling_preemption_threshold: int = 10
    max_running_requests: int = 256
    # Token budget of one prefill batch; a longer prompt is split into chunks
    # of this size when chunked prefill is on (chunked_prefill_size > 0).
    max_prefill_tokens: int = 16_384
    chunked_prefill_size: int = 8_192
    context_length: int = 40_960
    cost: CostModel = field(default_factory=CostModel)
    # SGLang's admission estimate of how many of a request's max_new_tokens it
    # will really generate (SGLANG_INIT_NEW_TOKEN_RATIO etc.).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    # After a retraction, keep room for this many decode steps of the batch.
    retract_decode_steps: int = 20
    clip_max_new_tokens: int = 4096
    # "max": every request generates max_new_tokens; "uniform": 1..max_new_tokens
    # drawn from the rid hash, ending with a stop token.
    output_len_dist: str = "max"
    # Streaming sessions without their own timeout are reaped after this many idle
    # simulated seconds (None: never).
    streaming_session_timeout_s: float | None = None
    # SGLang's hierarchical cache (--enable-hierarchical-cache); None: off.
    hicache: HiCacheConfig | None = None
    # Decode requests ride in prefill steps (SGLang's --enable-mixed-chunk; vLLM's
    # chunked prefill always does): every ``mixed_decode_every``-th prefill step also
    # advances each running request by one token, at the decode step's marginal cost
    # (b B + c S, not a). At token scale k one simulated token is k real ones, so
    # presets set it to k: one simulated token per k chunks, as k real steps give k.
    enable_mixed_chunk: bool = False
    mixed_decode_every: int = 1


# The scheduler fields SimConfig accepts as keywords (and reads as attributes).
_SCHEDULER_FIELDS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig))


@dataclass(frozen=True, slots=True, init=False)
class SimConfig:
    """The simulated engine: its :class:`SchedulerConfig` plus what the HTTP server adds.

    ``SimConfig(max_total_tokens=..., mode=..., time_scale=...)`` takes any scheduler
    field as a keyword (applied on top of ``scheduler``, or of the defaults), and reads
    them back as attributes (``cfg.mode``), so the scheduler's fields are declared once.
    """

    scheduler: SchedulerConfig
    host: str
    port: int
    tp_size: int
    dp_size: int
    # Wall seconds per simulated second: 1.0 runs in real time, 0.01 runs 100x
    # faster with the same dynamics, 0 runs as fast as the CPU allows.
    time_scale: float
    model_name: str
    # Reported as model_path / tokenizer_path; created if missing. None: a
    # directory under the system temp dir.
    model_path: str | None
    faults: FaultConfig
    # Keep the last N data-plane requests (path, headers, raw body) for GET /sim/requests.
    record_requests: int
    log_level: str

    def __init__(
        self,
        *,
        scheduler: SchedulerConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 30000,
        tp_size: int = 1,
        dp_size: int = 1,
        time_scale: float = 1.0,
        model_name: str = "kvproxy/sim-model",
        model_path: str | None = None,
        faults: FaultConfig | None = None,
        record_requests: int = 0,
        log_level: str = "WARNING",
        **scheduler_fields: Any,
    ) -> None:
        unknown = set(scheduler_fields) - _SCHEDULER_FIELDS
        if unknown:
            raise TypeError(f"SimConfig got unexpected keyword arguments: {sorted(unknown)}")
        sched = scheduler if scheduler is not None else SchedulerConfig()
        if scheduler_fields:
            sched = dataclasses.replace(sched, **scheduler_fields)
        own = {
            "scheduler": sched,
            "host": host,
            "port": port,
            "tp_size": tp_size,
            "dp_size": dp_size,
            "time_scale": time_scale,
            "model_name": model_name,
            "model_path": model_path,
            "faults": faults if faults is not None else FaultConfig(),
            "record_requests": record_requests,
            "log_level": log_level,
        }
        for name, value in own.items():
            object.__setattr__(self, name, value)

    # -- the scheduler's fields, read through (declared once, in SchedulerConfig) --------
    @property
    def max_total_tokens(self) -> int:
        return self.scheduler.max_total_tokens

    @property
    def mode(self) -> str:
        return self.scheduler.mode

    @property
    def eviction_policy(self) -> str:
        return self.scheduler.eviction_policy

    @property
    def enable_priority_scheduling(self) -> bool:
        return self.scheduler.enable_priority_scheduling

    @property
    def priority_scheduling_preemption_threshold(self) -> int:
        return self.scheduler.priority_scheduling_preemption_threshold

    @property
    def max_running_requests(self) -> int:
        return self.scheduler.max_running_requests

    @property
    def max_prefill_tokens(self) -> int:
        return self.scheduler.max_prefill_tokens

    @property
    def chunked_prefill_size(self) -> int:
        return self.scheduler.chunked_prefill_size

    @property
    def context_length(self) -> int:
        return self.scheduler.context_length

    @property
    def cost(self) -> CostModel:
        return self.scheduler.cost

    @property
    def output_len_dist(self) -> str:
        return self.scheduler.output_len_dist

    @property
    def streaming_session_timeout_s(self) -> float | None:
        return self.scheduler.streaming_session_timeout_s

    @property
    def hicache(self) -> HiCacheConfig | None:
        return self.scheduler.hicache

    @property
    def new_token_ratio_decay_steps(self) -> int:
        return self.scheduler.new_token_ratio_decay_steps

    @property
    def retract_decode_steps(self) -> int:
        return self.scheduler.retract_decode_steps

    @property
    def clip_max_new_tokens(self) -> int:
        return self.scheduler.clip_max_new_tokens

    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with ``changes`` (own or scheduler fields) applied."""
        return dataclasses.replace(self, **changes)


def validate_faults(f: FaultConfig) -> None:
    if f.metrics not in METRICS_FAULTS:
        raise ValueError(f"faults.metrics must be one of {METRICS_FAULTS}, got {f.metrics!r}")
    if not f.latency_s >= 0:
        raise ValueError(f"faults.latency_s must be >= 0, got {f.latency_s!r}")
    if f.drop_stream_after_chunks is not None and f.drop_stream_after_chunks < 0:
        raise ValueError("faults.drop_stream_after_chunks must be >= 0 or null")
    if (
        isinstance(f.hold_after_done_s, bool)
        or not isinstance(f.hold_after_done_s, int | float)
        or not 0 <= f.hold_after_done_s <= 60
    ):
        raise ValueError(
            f"faults.hold_after_done_s must be in [0, 60], got {f.hold_after_done_s!r}"
        )
    if f.token_usage is not None and (
        isinstance(f.token_usage, bool)
        or not isinstance(f.token_usage, int | float)
        or not 0 <= f.token_usage <= 1
    ):
        raise ValueError(f"faults.token_usage must be in [0, 1] or null, got {f.token_usage!r}")


def validate_sim_config(cfg: SimConfig) -> None:
    def check(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    check(
        0 <= cfg.record_requests <= 100_000,
        f"record_requests must be in [0, 100000], got {cfg.record_requests}",
    )

    check(cfg.max_total_tokens >= 16, "max_total_tokens must be >= 16")
    check(cfg.mode in MODES, f"mode must be one of {MODES}")
    check(
        cfg.eviction_policy in EVICTION_POLICIES,
        f"eviction_policy must be one of {EVICTION_POLICIES}",
    )
    check(cfg.tp_size >= 1, "tp_size must be >= 1")
    check(cfg.dp_size >= 1, "dp_size must be >= 1")
    check(cfg.time_scale >= 0, "time_scale must be >= 0")
    check(cfg.max_running_requests >= 1, "max_running_requests must be >= 1")
    check(cfg.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1")
    check(cfg.context_length >= 2, "context_length must be >= 2")
    check(
        cfg.output_len_dist in OUTPUT_LEN_DISTS,
        f"output_len_dist must be one of {OUTPUT_LEN_DISTS}",
    )
    check(cfg.new_token_ratio_decay_steps >= 1, "new_token_ratio_decay_steps must be >= 1")
    check(cfg.retract_decode_steps >= 1, "retract_decode_steps must be >= 1")
    check(cfg.clip_max_new_tokens >= 1, "clip_max_new_tokens must be >= 1")
    validate_cost_model(cfg.cost)
    validate_faults(cfg.faults)
    if cfg.hicache is not None:
        validate_hicache(cfg.hicache)
