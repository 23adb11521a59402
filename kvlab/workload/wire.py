"""Wire formats the HTTP driver speaks (pure): SGLang ``/generate`` request bodies and
SSE chunks, and the engines' Prometheus counters it diffs around a run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.workload.plan import SUBAGENT_INFIX
from kvproxy.sse import StreamState, parse_sse_line

__all__ = ["StreamState", "parse_sse_line"]  # re-exported: the driver's callers use them here

SESSION_HEADER = "X-Session-ID"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
FINAL_HEADER = "X-Session-Final"
PARENT_HEADER = "X-Parent-Session-ID"


def lead_of(session_id: str) -> str | None:
    """The lead of a W3 subagent's session id (None: not a subagent's)."""
    at = session_id.rfind(SUBAGENT_INFIX)  # subagents are ``<lead>-sub<turn>.<j>``
    return session_id[:at] if at > 0 else None


def wire_identity(session_id: str, convention: str) -> tuple[str, str | None]:
    """The session id a turn is sent under and the parent it names, for the workload's
    ``subagent_identity`` (``own``: its own id; ``parent``: its own and its lead's as
    parent; ``shared``: its lead's). Only subagents differ."""
    if convention == "own":
        return session_id, None
    lead = lead_of(session_id)
    if lead is None:
        return session_id, None
    return (session_id, lead) if convention == "parent" else (lead, None)


def identity_headers(session_id: str, convention: str) -> dict[str, str]:
    """``X-Session-ID`` (and ``X-Parent-Session-ID``) of one turn (:func:`wire_identity`)."""
    sid, parent = wire_identity(session_id, convention)
    out = {SESSION_HEADER: sid}
    if parent is not None:
        out[PARENT_HEADER] = parent
    return out


ADMISSION_WAIT_HEADER = "X-KVProxy-Admission-Wait-Ms"

# Engine counters scraped before and after a run. Counters are summed over label
# sets; gauges take the maximum.
ENGINE_COUNTERS: tuple[str, ...] = (
    "prompt_tokens_total",
    "cached_tokens_total",
    "evicted_tokens_total",
    "generation_tokens_total",
    "num_aborted_requests_total",
    "num_requests_total",
    "num_retracted_requests_total",
    "retracted_requests_total",
    "num_retractions_total",
    "load_back_tokens_total",  # SGLang's HiCache: host -> device (only with it on)
)
ENGINE_GAUGES: tuple[str, ...] = ("num_retracted_reqs",)
# Counters kept per value of one label: ``realtime_tokens_total{mode="decode"}`` is
# reported as ``realtime_tokens_total:decode``.
ENGINE_LABELLED: dict[str, str] = {"realtime_tokens_total": "mode"}
# Cumulative retraction counters a simulator may expose, in order of preference.
_RETRACTION_COUNTERS = (
    "num_retracted_requests_total",
    "retracted_requests_total",
    "num_retractions_total",
)


def parse_prometheus(text: str) -> dict[str, float]:
    """Engine counters and gauges of interest from Prometheus text.

    Accepts ``sglang:`` and ``sglang_`` prefixes and any label order. Counters are
    summed over label sets (they are split by labels such as ``cache_source``); gauges
    take the maximum (replicated rank label sets).
    """
    out: dict[str, float] = {}
    for raw in text.splitlines():
        sample = _sglang_sample(raw.strip())
        if sample is not None:
            _accumulate(out, *sample)
    return out


def _sglang_sample(line: str) -> tuple[str, str, float] | None:
    """``(name without the sglang prefix, labels, value)`` of one sample line, or None
    for a comment, another family, a ``_created`` series or an unreadable line."""
    if not line or line.startswith("#"):
        return None
    name_end = len(line)
    for i, ch in enumerate(line):
        if ch in "{ ":
            name_end = i
            break
    name = line[:name_end]
    if not name.startswith(("sglang:", "sglang_")):
        return None
    name = name[len("sglang:") :]
    if name.endswith("_created"):
        return None
    value_part = line[name_end:]
    labels = ""
    if value_part.startswith("{"):
        close = value_part.rfind("}")
        if close < 0:
            return None
        labels = value_part[1:close]
        value_part = value_part[close + 1 :]
    fields_ = value_part.split()
    if not fields_:
        return None
    try:
        value = float(fields_[0])
    except ValueError:
        return None
    if math.isnan(value):
        return None
    return name, labels, value


def _accumulate(out: dict[str, float], name: str, labels: str, value: float) -> None:
    """Add one sample to ``out``: counters summed (per label where labelled), gauges maxed."""
    # prometheus_client exposes a counter "x_total" under family "x"; accept both.
    if name in ENGINE_LABELLED:
        label = _label(labels, ENGINE_LABELLED[name])
        if label is not None:
            key = f"{name}:{label}"
            out[key] = out.get(key, 0.0) + value
    elif name in ENGINE_COUNTERS:
        out[name] = out.get(name, 0.0) + value
    elif name in ENGINE_GAUGES:
        out[name] = max(out.get(name, value), value)


def _label(labels: str, wanted: str) -> str | None:
    """The value of label ``wanted`` in ``a="x",b="y"`` (no escapes in the values we read)."""
    for part in labels.split(","):
        key, _, value = part.partition("=")
        if key.strip() == wanted:
            return value.strip().strip('"')
    return None


def diff_counters(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, float]:
    """Fleet-wide counter deltas (after - before, summed over engines). Gauges are
    reported as their maximum after the run."""
    total: dict[str, float] = {}
    for engine, values in after.items():
        prev = before.get(engine, {})
        for name, value in values.items():
            if name in ENGINE_GAUGES:
                total[name] = max(total.get(name, 0.0), value)
            else:
                total[name] = total.get(name, 0.0) + max(0.0, value - prev.get(name, 0.0))
    return total


def generate_body(
    input_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, stream: bool = True
) -> dict[str, Any]:
    """An SGLang ``/generate`` request (streamed unless ``stream`` is false). ``ignore_eos``
    makes the output exactly the drawn length on a real model too (as SGLang's own
    benchmarks do)."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "ignore_eos": True,
        },
        "stream": stream,
    }
