"""The read-only views of one simulated rank's scheduler: pool usage and ``/sim/state``.

Pure: reads the scheduler's parts, changes nothing. :func:`scheduler_snapshot` is the
JSON-able dump of pool, queues, sessions, the main counters and, with HiCache, the host
tier.
"""

from __future__ import annotations

from typing import Any

from kvlab.sim.accounting import SchedulerStats
from kvlab.sim.batching import RunningSet
from kvlab.sim.hicache import HiKVCache
from kvlab.sim.kvcache import KVCache
from kvlab.sim.records import SimRequest, State
from kvlab.sim.sessions import SessionTable


def pool(kv: KVCache) -> dict[str, int]:
    used = kv.max_total_tokens - kv.available - kv.evictable
    return {
        "max_total_num_tokens": kv.max_total_tokens,
        "available": kv.available,
        "evictable": kv.evictable,
        "protected": kv.protected,
        "used": used,
    }


def token_usage(kv: KVCache) -> float:
    return round((kv.max_total_tokens - kv.available - kv.evictable) / kv.max_total_tokens, 2)


def private_tokens(
    requests: dict[str, SimRequest], runset: RunningSet, sessions: SessionTable
) -> int:
    """KV slots held outside the tree (running requests, sessions, reserved)."""
    total = runset.decode_reserved
    for req in requests.values():
        if req.state is State.DECODE:
            total += runset.decode_private(req)
        else:
            total += req.private
    for s in sessions.streaming.values():
        total += s.held
    return total


def scheduler_snapshot(
    kv: KVCache,
    hi: HiKVCache | None,
    stats: SchedulerStats,
    requests: dict[str, SimRequest],
    runset: RunningSet,
    prefilling: set[SimRequest],
    sessions: SessionTable,
    now: float,
) -> dict[str, Any]:
    """JSON-able dump of the pool, queues and sessions."""
    waiting = sorted(
        (r for r in requests.values() if r.state is State.WAITING), key=lambda r: r.qkey
    )
    return {
        "pool": {
            **pool(kv),
            "tree_tokens": kv.tree_tokens,
            "tree_nodes": kv.num_nodes,
            "private": private_tokens(requests, runset, sessions),
            "session_referenced_evictable": kv.referenced_evictable_tokens(),
            "streaming_held": sessions.held_tokens(),
            "token_usage": token_usage(kv),
            "evicted_total": kv.evicted_total,
        },
        "running": [r.rid for r in runset.requests.values()],
        "prefilling": sorted(r.rid for r in prefilling),
        "waiting": [r.rid for r in waiting],
        "new_token_ratio": round(runset.new_token_ratio, 4),
        "decode_steps": runset.decode_ct,
        "now": now,
        "sessions": {
            "radix_open": sessions.radix_sessions(),
            "radix_referenced": kv.referenced_sessions(),
            "radix_closed": sessions.radix_closed_count(),
            "streaming": {
                sid: {
                    "held": ss.held,
                    "tree_len": ss.tree_len,
                    "context_len": len(ss.context),
                    "active": ss.active.rid if ss.active else None,
                    "close_pending": ss.close_pending,
                }
                for sid, ss in sessions.streaming.items()
            },
            "legacy": sorted(sessions.legacy),
        },
        "stats": {
            "num_requests_total": stats.num_requests_total,
            "num_aborted_requests_total": stats.num_aborted_requests_total,
            "num_retracted_requests_total": stats.num_retracted_requests_total,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "cached_tokens_total": stats.cached_tokens_total,
            "generation_tokens_total": stats.generation_tokens_total,
        },
        **_hicache_snapshot(hi, stats),
    }


def _hicache_snapshot(hi: HiKVCache | None, stats: SchedulerStats) -> dict[str, Any]:
    if hi is None:
        return {}
    return {
        "hicache": {
            "host_total_tokens": hi.host_total,
            "host_used_tokens": hi.host_used,
            "host_only_tokens": hi.host_only,
            "backed_up_total": hi.backed_up_total,
            "loaded_back_total": hi.loaded_back_total,
            "host_evicted_total": hi.host_evicted_total,
            "host_cached_tokens_total": stats.host_cached_tokens_total,
        }
    }
