"""Headline numbers of a workload run (pure)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kvlab.workload.model import TurnRecord, WorkloadResult


def percentile(values: Iterable[float], q: float) -> float | None:
    """``q``-th percentile (0..100) with linear interpolation between closest ranks;
    None for no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100] (got {q})")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(data[lo])
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def error_counts(records: Iterable[TurnRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "error").split(":", 1)[0]
            counts[key] = counts.get(key, 0) + 1
    return counts


def summarize(result: WorkloadResult) -> dict[str, Any]:
    """One flat JSON-serialisable dict. Rates are per simulated (loop) second.

    ``sessions``: main sessions (leads, trajectories) completed; ``recompute_share``:
    recomputed prefill / all prefill computed (prompt - cached); token counts are in
    the run's (scaled) tokens.
    """
    main = result.main_sessions
    completed = [s for s in main if s.ok]
    subs = [s for s in result.sessions if s.role == "subagent"]
    ok = [r for r in result.turns if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    prefill = sum(r.prefill_tokens for r in ok)
    recomputed = sum(r.recomputed_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    ttft_first = [r.ttft_s for r in ok if r.ttft_s is not None and r.first]
    ttft_cont = [r.ttft_s for r in ok if r.ttft_s is not None and r.continuing]
    latency = [r.latency_s for r in ok if r.latency_s is not None]
    waits = [r.admission_wait_ms for r in result.turns if r.admission_wait_ms is not None]
    durations = [d for s in completed if (d := s.duration_s) is not None]
    span = result.makespan_s
    return {
        "workload": result.spec.name,
        "token_scale": result.spec.token_scale,
        "seed": result.seed,
        "concurrency": result.concurrency,
        "sessions": len(completed),
        "sessions_started": len(main),
        "sessions_completed": len(completed),
        "sessions_failed": len(main) - len(completed),
        "subagent_sessions": len(subs),
        "context_exits": sum(1 for s in result.sessions if s.exit == "context"),
        "turns": len(ok),
        "requests": len(result.turns),
        "requests_ok": len(ok),
        "requests_failed": len(result.turns) - len(ok),
        "makespan_s": _round(span, 3),
        "simulated_s": _round(span, 3),
        "sessions_per_min": _round(_ratio(len(completed), span / 60.0), 3),
        "output_tokens_per_s": _round(_ratio(completion, span), 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "prefill_tokens": prefill,
        "recomputed_prefill_tokens": recomputed,
        "cache_hit_rate": _round(_ratio(cached, prompt)),
        "recompute_share": _round(_ratio(recomputed, prefill)),
        "ttft_p50_s": _round(percentile(ttft, 50)),
        "ttft_p99_s": _round(percentile(ttft, 99)),
        "ttft_p99_first_s": _round(percentile(ttft_first, 99)),
        "ttft_p50_continuing_s": _round(percentile(ttft_cont, 50)),
        "ttft_p99_continuing_s": _round(percentile(ttft_cont, 99)),
        "latency_p50_s": _round(percentile(latency, 50)),
        "latency_p99_s": _round(percentile(latency, 99)),
        "admission_wait_p50_ms": _round(percentile(waits, 50), 2),
        "admission_wait_p99_ms": _round(percentile(waits, 99), 2),
        "session_time_p50_s": _round(percentile(durations, 50), 3),
        "session_time_p99_s": _round(percentile(durations, 99), 3),
        "errors": error_counts(result.turns),
    }
