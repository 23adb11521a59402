"""Parse one SGLang engine's Prometheus ``/metrics`` text into an :class:`EngineMetrics`.

Pure: no I/O, no clock. This runs on the event loop for every engine at every
admission poll, so it is written for speed: one compiled pattern scans the whole
text for the handful of gauge names of interest (the pattern starts with the
literal ``"\\nsglang"``, so the regex engine skips to candidate lines at C speed);
every other family, comment and malformed line is never looked at in Python. On a
~170-family 0.5.23 text this is about 4-6x faster than splitting into lines and
filtering with ``str.startswith`` (see docs/benchmarks.md, "Admission").

Names are matched with either prefix, ``sglang:`` (engine ``/metrics``) or
``sglang_`` (the router's ``/engine_metrics`` rewrite). Labels may come in any order.

Aggregation across label sets, per gauge:

* label sets that differ only in replicated rank labels (``tp_rank``, ``pp_rank``,
  ``moe_ep_rank``, ``priority``, custom labels) carry the same per-engine value, so
  they are combined with MAX. Summing them would multiply capacity by the TP degree
  and divide usage by it (a summing parser reads 0.92 usage as 0.23 on TP4). MAX is
  also right for the ``priority`` breakdown: the aggregate ``priority=""`` series is
  at least as large as any per-priority part.
* series that differ in ``dp_rank`` come from separate schedulers, each with its own
  KV pool and queue: token counts and request counts (``max_total_num_tokens``,
  ``num_used_tokens``, ``kv_evictable_tokens``, ``num_running_reqs``,
  ``num_queue_reqs``, ``hicache_host_total_tokens``) are SUMMED across DP ranks, while
  the usage fractions (``token_usage``, ``full_token_usage``) take the MAX across DP
  ranks, because the fullest pool is the one that thrashes first.

Usage: ``token_usage`` when present, else ``full_token_usage``, else
``num_used_tokens / max_total_num_tokens`` (per DP rank, then MAX). As in the Relax
V2 design, a reported usage of exactly 0.0 with a non-zero used-token count is
replaced by the derived fraction (SGLang rounds ``token_usage`` to two decimals).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# The gauges the parser extracts (name without prefix).
_NAMES = (
    "max_total_num_tokens",
    "token_usage",
    "full_token_usage",
    "num_used_tokens",
    "kv_evictable_tokens",
    "num_running_reqs",
    "num_queue_reqs",
    # Counters read by program admission's feedback (deltas between polls). With several
    # cache_type label sets the largest is taken (one radix cache per engine in practice).
    "evicted_tokens_total",
    "num_retracted_requests_total",
    # Streaming sessions (--enable-streaming-session): pinned KV outside eviction.
    "num_streaming_sessions",
    "streaming_session_held_tokens",
    # The host KV tier (--enable-hierarchical-cache): its capacity in tokens.
    "hicache_host_total_tokens",
)
# One sample line of interest: "\n" prefix name, optional {labels}, whitespace, value.
# The labels group runs to the last "}" on the line, so a "}" inside a label value
# does not end it early. A trailing timestamp is ignored.
_SAMPLE_RE = re.compile(r"\nsglang[:_](" + "|".join(_NAMES) + r")(\{[^\n]*\})?[ \t]+([^ \t\r\n]+)")


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One engine's KV-pressure reading, aggregated over its label sets.

    A field is ``None`` when the scrape did not contain that gauge.
    ``usage_source`` names where ``token_usage`` came from: ``"token_usage"``,
    ``"full_token_usage"``, ``"derived"`` (used / max_total) or ``None``.
    """

    max_total_num_tokens: int | None = None
    token_usage: float | None = None
    num_used_tokens: int | None = None
    kv_evictable_tokens: int | None = None
    num_running_reqs: int | None = None
    num_queue_reqs: int | None = None
    evicted_tokens_total: int | None = None
    num_retracted_requests_total: int | None = None
    num_streaming_sessions: int | None = None
    streaming_session_held_tokens: int | None = None
    hicache_host_total_tokens: int | None = None
    usage_source: str | None = None


def _dp_rank(labels: str | None) -> str:
    """The ``dp_rank`` label value of a ``{...}`` label block ("" when absent)."""
    if not labels:
        return ""
    i = labels.find('dp_rank="')
    while i >= 0:
        # Reject a longer label name that ends in dp_rank (e.g. attn_dp_rank).
        if labels[i - 1] in "{, \t":
            start = i + 9
            end = labels.find('"', start)
            return labels[start:end] if end >= 0 else ""
        i = labels.find('dp_rank="', i + 9)
    return ""


def _max_over_dp(per_dp: dict[str, float] | None) -> float | None:
    return max(per_dp.values()) if per_dp else None


def _sum_over_dp(per_dp: dict[str, float] | None) -> int | None:
    return int(sum(per_dp.values())) if per_dp else None


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse Prometheus exposition text; never raises on malformed input."""
    # name -> dp_rank -> MAX over the replicated label sets of that DP rank.
    found: dict[str, dict[str, float]] = {}
    for name, labels, raw in _SAMPLE_RE.findall("\n" + text):
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isnan(value) or math.isinf(value) or value < 0:
            continue
        per_dp = found.get(name)
        if per_dp is None:
            per_dp = found[name] = {}
        dp = _dp_rank(labels)
        prev = per_dp.get(dp)
        if prev is None or value > prev:
            per_dp[dp] = value

    max_total = _sum_over_dp(found.get("max_total_num_tokens"))
    used = _sum_over_dp(found.get("num_used_tokens"))

    usage: float | None = None
    source: str | None = None
    for name in ("token_usage", "full_token_usage"):
        usage = _max_over_dp(found.get(name))
        if usage is not None:
            source = name
            break
    if usage is None or (usage == 0.0 and used):
        derived = _derived_usage(found.get("num_used_tokens"), found.get("max_total_num_tokens"))
        if derived is not None:
            usage, source = derived, "derived"

    return EngineMetrics(
        max_total_num_tokens=max_total,
        token_usage=None if usage is None else min(1.0, usage),
        num_used_tokens=used,
        kv_evictable_tokens=_sum_over_dp(found.get("kv_evictable_tokens")),
        num_running_reqs=_sum_over_dp(found.get("num_running_reqs")),
        num_queue_reqs=_sum_over_dp(found.get("num_queue_reqs")),
        evicted_tokens_total=_sum_over_dp(found.get("evicted_tokens_total")),
        num_retracted_requests_total=_sum_over_dp(found.get("num_retracted_requests_total")),
        num_streaming_sessions=_sum_over_dp(found.get("num_streaming_sessions")),
        streaming_session_held_tokens=_sum_over_dp(found.get("streaming_session_held_tokens")),
        hicache_host_total_tokens=_sum_over_dp(found.get("hicache_host_total_tokens")),
        usage_source=source,
    )


def _derived_usage(
    used: dict[str, float] | None, max_total: dict[str, float] | None
) -> float | None:
    """MAX over DP ranks of used / max_total, for ranks that report both."""
    if not used or not max_total:
        return None
    fractions = [u / max_total[dp] for dp, u in used.items() if max_total.get(dp)]
    return max(fractions) if fractions else None
