"""What the simulated engine reports: ``/server_info``, ``/model_info``, ``/v1/models``,
``/v1/loads``, ``/metrics`` and the simulator's own ``/sim/state``."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from kvlab.sim.faults import faults_json
from kvlab.sim.httpio import json_response
from kvlab.sim.metrics import GARBAGE_METRICS, render_metrics
from kvlab.sim.responses import SGLANG_VERSION, cache_policy_info
from kvlab.sim.scheduler import State
from kvlab.sim.state import SIM_STATE, SimState


def server_info(st: SimState, request: web.Request | None = None) -> dict[str, Any]:
    cfg = st.cfg
    c = cfg.cost
    return {
        "model_path": st.model_path,
        "tokenizer_path": st.model_path,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": cfg.port,
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "pp_size": 1,
        "ep_size": 1,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_running_requests": cfg.max_running_requests,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "context_length": cfg.context_length,
        "page_size": 1,
        "schedule_policy": "fcfs",
        **cache_policy_info(cfg.scheduler),
        "enable_metrics": True,
        "enable_cache_report": True,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "is_embedding": False,
        "skip_tokenizer_init": False,
        "version": SGLANG_VERSION,
        "internal_states": [
            {
                "last_gen_throughput": r.sched.stats.gen_throughput,
                "memory_usage": {"token_capacity": cfg.max_total_tokens},
                "dp_rank": r.index,
            }
            for r in st.ranks
        ],
        "kvproxy_sim": {
            "mode": cfg.mode,
            "time_scale": cfg.time_scale,
            # The cost model: preset, kind, token_scale and every constant (unit in the key).
            "cost_model": c.preset,
            **c.to_dict(),
            # The legacy model's constant names (equal to t0/tau_lin/decode_a/decode_b).
            "prefill_base_s": c.prefill_base_s,
            "prefill_per_token_s": c.prefill_per_token_s,
            "decode_base_s": c.decode_base_s,
            "decode_per_req_s": c.decode_per_req_s,
            "output_len_dist": cfg.output_len_dist,
            "radix_eviction_policy": cfg.eviction_policy,
            "enable_priority_scheduling": cfg.enable_priority_scheduling,
            "priority_scheduling_preemption_threshold": (
                cfg.priority_scheduling_preemption_threshold
            ),
            "retract_decode_steps": cfg.retract_decode_steps,
            "new_token_ratio_decay_steps": cfg.new_token_ratio_decay_steps,
            "clip_max_new_tokens": cfg.clip_max_new_tokens,
            **_hicache_info(st),
            # Wall-clock lateness per DP rank (never folded into simulated time).
            "clock": [{"dp_rank": r.index, **r.clock_stats()} for r in st.ranks],
        },
    }


def _hicache_info(st: SimState) -> dict[str, Any]:
    """The HiCache model's constants and host pool per DP rank (nothing when off)."""
    h = st.cfg.hicache
    if h is None:
        return {}
    return {
        "hicache": {
            "kv_bytes_per_token": h.kv_bytes_per_token,
            "host_link_gb_s": h.host_link_gb_s,
            "num_layers": h.num_layers,
            "load_back_threshold": h.load_back_threshold,
            "host_total_tokens": [r.sched.hi.host_total for r in st.ranks if r.sched.hi],
        }
    }


async def handle_server_info(request: web.Request) -> web.Response:
    return json_response(server_info(request.app[SIM_STATE], request))


async def handle_model_info(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    return json_response(
        {
            "model_path": st.model_path,
            "tokenizer_path": st.model_path,
            "served_model_name": st.cfg.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
        }
    )


async def handle_models(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    name = st.cfg.model_name
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": st.created,
                    "owned_by": "sglang",
                    "root": name,
                    "max_model_len": st.cfg.context_length,
                }
            ],
        }
    )


async def handle_loads(request: web.Request) -> web.Response:
    """``GET /v1/loads`` (SGLang >= 0.5.10), the per-DP-rank load report a router polls."""
    st = request.app[SIM_STATE]
    loads = []
    for r in st.ranks:
        s = r.sched
        kv = s.kv
        used = kv.max_total_tokens - kv.available - kv.evictable
        loads.append(
            {
                "dp_rank": r.index,
                "num_running_reqs": len(s.running),
                "num_waiting_reqs": s.num_waiting,
                "num_total_reqs": len(s.requests),
                "num_used_tokens": used,
                "max_total_num_tokens": kv.max_total_tokens,
                "token_usage": s.token_usage(),
                "gen_throughput": s.stats.gen_throughput,
                "cache_hit_rate": s.stats.cache_hit_rate,
                "utilization": round(used / kv.max_total_tokens, 4),
                "max_running_requests": st.cfg.max_running_requests,
                # Upper bound: prompt tokens of queued requests, before prefix matching.
                "num_waiting_uncached_tokens": sum(
                    q.prompt_tokens + q.generated
                    for q in s.requests.values()
                    if q.state is State.WAITING
                ),
                # Nominal sizes of the modelled GPU: an 8B bf16 model, 128 KiB of KV per token.
                "memory": {
                    "weight_gb": 16.0,
                    "kv_cache_gb": round(kv.max_total_tokens * 131072 / 1e9, 3),
                    "graph_gb": 0.5,
                    "token_capacity": kv.max_total_tokens,
                },
            }
        )
    return json_response(
        {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": SGLANG_VERSION,
            "dp_rank_count": len(st.ranks),
            "loads": loads,
        }
    )


async def handle_metrics(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    mode = st.faults.metrics
    if mode == "error":
        return web.Response(status=500, text="Internal Server Error (simulated fault)\n")
    if mode == "garbage":
        return web.Response(text=GARBAGE_METRICS, content_type="text/plain")
    text = render_metrics(
        st.metrics_ctx, [r.sched for r in st.ranks], st.cfg.context_length, st.faults.token_usage
    )
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


# ----------------------------------------------------------------------------- admin


async def handle_state(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    ranks = []
    for r in st.ranks:
        snap = r.sched.snapshot()
        snap["dp_rank"] = r.index
        snap["loop_steps"] = r.steps
        snap.update(r.clock_stats())
        ranks.append(snap)
    return json_response({"mode": st.cfg.mode, "faults": faults_json(st.faults), "ranks": ranks})


# ----------------------------------------------------------------------------- app
