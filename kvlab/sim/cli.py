"""``kvproxy sim-engine``: run a simulated SGLang engine (no GPU needed).

Heavy imports (aiohttp, the simulator) happen inside :func:`run`.
"""

from __future__ import annotations

import argparse

from kvlab.sim.config import (
    EVICTION_POLICIES,
    HICACHE_WRITE_POLICIES,
    METRICS_FAULTS,
    MODES,
    OUTPUT_LEN_DISTS,
    FaultConfig,
    HiCacheConfig,
    SimConfig,
)
from kvlab.sim.cost import CostModel
from kvlab.sim.presets import (
    DEFAULT_PRESET,
    PRESET_NAMES,
    get_preset,
    hicache_config,
    scheduler_config,
)

_D = SimConfig()
_C = CostModel()
_H = HiCacheConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``kvproxy sim-engine``, one argument group at a time."""
    _add_server(parser)
    _add_kv_and_scheduling(parser)
    _add_hicache(parser)
    _add_time_and_cost(parser)
    _add_faults(parser)


def _add_server(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=_D.host, help="bind address (default: %(default)s)")
    g.add_argument("--port", type=int, default=_D.port, help="port (default: %(default)s)")
    g.add_argument(
        "--model-name", default=_D.model_name, help="served_model_name (default: %(default)s)"
    )
    g.add_argument(
        "--model-path",
        default=None,
        help="local directory reported as model_path (created if missing; default: a "
        "directory under the system temp dir)",
    )
    g.add_argument("--log-level", default=_D.log_level, help="default: %(default)s")


def _add_kv_and_scheduling(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV cache and scheduling")
    g.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in (simulated) tokens, SGLang's max_total_num_tokens (default: "
        "the cost model preset's pool divided by --token-scale; legacy: 200000)",
    )
    g.add_argument(
        "--mode",
        choices=MODES,
        default=_D.mode,
        help="plain radix cache; session-radix = --enable-session-radix-cache; streaming = "
        "--enable-streaming-session (default: %(default)s)",
    )
    g.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default=_D.eviction_policy)
    g.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="waiting queue by priority (larger first), with preemption of running requests",
    )
    g.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=_D.priority_scheduling_preemption_threshold,
        help="a waiting request preempts running ones whose priority is lower by more than "
        "this (default: %(default)s)",
    )
    g.add_argument("--tp-size", type=int, default=_D.tp_size, help="repeats gauges per tp_rank")
    g.add_argument("--dp-size", type=int, default=_D.dp_size, help="independent schedulers")
    g.add_argument("--max-running-requests", type=int, default=_D.max_running_requests)
    g.add_argument("--max-prefill-tokens", type=int, default=None, help="default: the preset's / K")
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prefill chunk size in tokens; <= 0 disables chunking (default: the preset's / K)",
    )
    g.add_argument("--context-length", type=int, default=None, help="default: the preset's / K")
    g.add_argument(
        "--output-len-dist",
        choices=OUTPUT_LEN_DISTS,
        default=_D.output_len_dist,
        help="max: every request generates max_new_tokens; uniform: 1..max_new_tokens from "
        "the rid, ending with a stop token (default: %(default)s)",
    )
    g.add_argument(
        "--streaming-session-timeout",
        type=float,
        default=None,
        help="idle seconds after which a streaming session is reaped (default: never)",
    )


def _add_hicache(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hierarchical cache (SGLang's HiCache: a host KV tier)")
    g.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep evicted KV in host memory and load it back instead of recomputing it",
    )
    g.add_argument(
        "--hicache-ratio",
        type=float,
        default=_H.ratio,
        help="host pool size / device pool size (default: %(default)s)",
    )
    g.add_argument(
        "--hicache-size",
        type=int,
        default=_H.size_gb,
        help="host pool size in GB (real tokens' bytes); overrides --hicache-ratio if > 0 "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--hicache-write-policy",
        choices=HICACHE_WRITE_POLICIES,
        default=_H.write_policy,
        help="when device KV is copied to the host (default: %(default)s)",
    )


def _add_time_and_cost(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("time and cost model (simulated seconds)")
    g.add_argument(
        "--cost-model",
        choices=PRESET_NAMES,
        default=DEFAULT_PRESET,
        help="engine preset: step-time constants plus the pool, chunked prefill, max "
        "prefill and context length SGLang would use (default: %(default)s)",
    )
    g.add_argument(
        "--token-scale",
        type=int,
        default=1,
        metavar="K",
        help="one simulated token stands for K real ones: the preset's token quantities "
        "are divided by K and the costs scaled to match (default: %(default)s)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=_D.time_scale,
        help="wall seconds per simulated second; 0.01 runs 100x faster, 0 as fast as the "
        "CPU allows (default: %(default)s)",
    )
    legacy_help = "legacy cost model only (default: %s)"
    g.add_argument(
        "--prefill-base-s", type=float, default=None, help=legacy_help % _C.prefill_base_s
    )
    g.add_argument(
        "--prefill-per-token-s",
        type=float,
        default=None,
        help=legacy_help % _C.prefill_per_token_s,
    )
    g.add_argument("--decode-base-s", type=float, default=None, help=legacy_help % _C.decode_base_s)
    g.add_argument(
        "--decode-per-req-s", type=float, default=None, help=legacy_help % _C.decode_per_req_s
    )


def _add_faults(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault injection (also POST /sim/faults at run time)")
    g.add_argument("--fault-metrics", choices=METRICS_FAULTS, default="ok")
    g.add_argument("--fault-latency-s", type=float, default=0.0)
    g.add_argument("--fault-drop-stream-after-chunks", type=int, default=None)
    g.add_argument("--fault-503", action="store_true", help="answer 503 to data-plane and health")
    g.add_argument(
        "--fault-token-usage",
        type=float,
        default=None,
        help="report this sglang:token_usage in /metrics instead of the real value",
    )
    g.add_argument(
        "--record-requests",
        type=int,
        default=0,
        metavar="N",
        help="keep the last N data-plane requests as received, for GET /sim/requests",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Raises ValueError for a bad combination of flags."""
    preset = get_preset(args.cost_model)
    legacy_flags = {
        "prefill_base_s": args.prefill_base_s,
        "prefill_per_token_s": args.prefill_per_token_s,
        "decode_base_s": args.decode_base_s,
        "decode_per_req_s": args.decode_per_req_s,
    }
    given = {k: v for k, v in legacy_flags.items() if v is not None}
    if given and preset.name != "legacy":
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags} apply to --cost-model legacy only")
    # Explicit flags are in simulated tokens and override the preset's scaled values.
    overrides = {
        k: v
        for k, v in (
            ("max_total_tokens", args.max_total_tokens),
            ("max_prefill_tokens", args.max_prefill_tokens),
            ("chunked_prefill_size", args.chunked_prefill_size),
            ("context_length", args.context_length),
        )
        if v is not None
    }
    sc = scheduler_config(preset.name, args.token_scale, **overrides)
    cost = sc.cost
    if given:
        cost = CostModel.legacy(**given, token_scale=args.token_scale)
    return SimConfig(
        host=args.host,
        port=args.port,
        max_total_tokens=sc.max_total_tokens,
        mode=args.mode,
        eviction_policy=args.eviction_policy,
        enable_priority_scheduling=args.enable_priority_scheduling,
        priority_scheduling_preemption_threshold=args.priority_scheduling_preemption_threshold,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        time_scale=args.time_scale,
        cost=cost,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=sc.max_prefill_tokens,
        chunked_prefill_size=sc.chunked_prefill_size,
        context_length=sc.context_length,
        new_token_ratio_decay_steps=sc.new_token_ratio_decay_steps,
        retract_decode_steps=sc.retract_decode_steps,
        clip_max_new_tokens=sc.clip_max_new_tokens,
        # The preset's mixed chunk (decode inside prefill steps): the lab's engines run
        # it, so the HTTP engine must too, or a burst's first turns all answer at once.
        enable_mixed_chunk=sc.enable_mixed_chunk,
        mixed_decode_every=sc.mixed_decode_every,
        output_len_dist=args.output_len_dist,
        streaming_session_timeout_s=args.streaming_session_timeout,
        hicache=(
            hicache_config(
                preset.name,
                args.token_scale,
                ratio=args.hicache_ratio,
                size_gb=args.hicache_size,
                write_policy=args.hicache_write_policy,
            )
            if args.enable_hierarchical_cache
            else None
        ),
        model_name=args.model_name,
        model_path=args.model_path,
        faults=FaultConfig(
            metrics=args.fault_metrics,
            latency_s=args.fault_latency_s,
            drop_stream_after_chunks=args.fault_drop_stream_after_chunks,
            status_503=args.fault_503,
            token_usage=args.fault_token_usage,
        ),
        record_requests=args.record_requests,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys

    from aiohttp import web

    from kvlab.sim.config import validate_sim_config
    from kvlab.sim.server import create_sim_app

    try:
        cfg = config_from_args(args)
        validate_sim_config(cfg)
    except ValueError as e:
        print(f"kvproxy sim-engine: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The router probes workers with HTTP/2 prior knowledge; aiohttp logs those as
    # bad requests. They are harmless.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is optional on some platforms
        pass
    app = create_sim_app(cfg)
    print(
        f"kvproxy sim-engine: http://{cfg.host}:{cfg.port} mode={cfg.mode} "
        f"max_total_tokens={cfg.max_total_tokens} time_scale={cfg.time_scale} "
        f"cost_model={cfg.cost.preset} token_scale={cfg.cost.token_scale}",
        flush=True,
    )
    web.run_app(
        app,
        host=cfg.host,
        port=cfg.port,
        print=None,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=1.0,
    )
    return 0
