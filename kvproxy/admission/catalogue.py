"""The catalogue of program admission's metrics: names, help, and one snapshot rendered
as stats gauges, Prometheus families and the health document. Pure.

Counter names are ``agentic_kv/admission/*`` keys (``/kvproxy/stats``; on ``/metrics``
with ``/`` as ``_`` and a ``_total`` suffix). Per-engine gauges are labelled by engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from kvproxy.admission.decisions import Event, Outcome
from kvproxy.admission.program import ProgramCore
from kvproxy.fleet.placement import Placement

_A = "agentic_kv/admission/"
PROGRAM_HELP: dict[str, str] = {}
_C_DECISION = {o: _A + "decision_" + o.value for o in Outcome}
_C_EVENT = {e: _A + "event_" + e.value for e in Event}
C_PAUSED_WAIT_SUM = _A + "paused_wait_seconds_sum"
C_PAUSED_WAIT_COUNT = _A + "paused_wait_count"
C_DIVERTED = _A + "router_diverted"
_PROGRAM_COUNTERS = (
    *_C_DECISION.values(),
    *_C_EVENT.values(),
    C_PAUSED_WAIT_SUM,
    C_PAUSED_WAIT_COUNT,
    C_DIVERTED,
)
for _o, _name in _C_DECISION.items():
    PROGRAM_HELP[_name] = f"Program admission decisions with outcome {_o.value}."
for _e, _name in _C_EVENT.items():
    PROGRAM_HELP[_name] = f"Program admission events: {_e.value}."
PROGRAM_HELP[C_PAUSED_WAIT_SUM] = "Seconds paused sessions' turns waited before going (sum)."
PROGRAM_HELP[C_PAUSED_WAIT_COUNT] = "Paused sessions' turns that waited."
PROGRAM_HELP[C_DIVERTED] = (
    "Requests smg routed outside the consistent-hashing ring (its random_fallback and "
    "no_healthy_workers branches); only counted when router.metrics_url is reachable."
)
# Keys stats() adds for program admission (on top of the fleet path's).
PROGRAM_STATS_KEYS = frozenset(
    {
        *_PROGRAM_COUNTERS,
        _A + "waiting_paused",
        _A + "program_active",
        _A + "sessions_active",
        _A + "sessions_paused",
        _A + "sessions_new",
        _A + "sessions_running",
    }
)
PROGRAM_HELP[_A + "program_active"] = "1 when program admission keeps per-engine ledgers."
PROGRAM_HELP[_A + "waiting_paused"] = "Turns of paused sessions waiting now (program mode)."
PROGRAM_HELP[_A + "sessions_active"] = "Sessions counted on their engine (program mode)."
PROGRAM_HELP[_A + "sessions_paused"] = "Paused sessions (program mode)."
PROGRAM_HELP[_A + "sessions_new"] = "Sessions whose first turn has not been admitted yet."
PROGRAM_HELP[_A + "sessions_running"] = "Sessions with a turn in flight (program mode)."

ENGINE_FAMILIES = (
    (
        "streaming_held",
        "agentic_kv_admission_engine_streaming_held_tokens",
        "KV the engine's streaming sessions hold (sglang:streaming_session_held_tokens): "
        "pinned, counted as committed.",
    ),
    (
        "streaming_sessions",
        "agentic_kv_admission_engine_streaming_sessions",
        "The engine's streaming sessions (sglang:num_streaming_sessions).",
    ),
    (
        "footprint",
        "agentic_kv_admission_engine_footprint_tokens",
        "Undecayed footprint U of the engine's active sessions (drives pausing).",
    ),
    (
        "committed",
        "agentic_kv_admission_engine_committed_tokens",
        "Decayed footprint W of the engine's active sessions (drives admission).",
    ),
    (
        "reserved",
        "agentic_kv_admission_engine_reserved_tokens",
        "Decayed reservations R of the engine's active sessions: max(footprint, expected "
        "peak) each (drives the growth gate on new sessions).",
    ),
    ("capacity", "agentic_kv_admission_engine_capacity_tokens", "max_total_num_tokens x headroom."),
    (
        "target",
        "agentic_kv_admission_engine_target",
        "The engine's admission target theta (fraction of capacity), set by feedback.",
    ),
    (
        "engaged",
        "agentic_kv_admission_engine_engaged",
        "1 while the engine's gate holds work (busy and recomputing evicted context), 0 "
        "while it is permissive (docs/admission.md#when-admission-holds).",
    ),
    (
        "busy",
        "agentic_kv_admission_engine_busy",
        "Share of the current feedback window with a turn in flight on the engine.",
    ),
    (
        "inflight",
        "agentic_kv_admission_engine_inflight",
        "Turns kvproxy has in flight on the engine.",
    ),
    (
        "waiting_new",
        "agentic_kv_admission_engine_waiting_new",
        "New sessions waiting in the engine's FIFO.",
    ),
    (
        "waiting_paused",
        "agentic_kv_admission_engine_waiting_paused",
        "Paused sessions' turns waiting on the engine.",
    ),
    (
        "paused_sessions",
        "agentic_kv_admission_engine_paused_sessions",
        "Paused sessions attributed to the engine.",
    ),
    (
        "active_sessions",
        "agentic_kv_admission_engine_active_sessions",
        "Active sessions counted on the engine.",
    ),
)


@dataclass(frozen=True, slots=True)
class ProgramSnapshot:
    """Program admission at one moment: everything stats, /metrics and health show."""

    active: bool
    mode: str
    policy: str
    fallback: str | None
    priority_steering: bool
    workers: tuple[str, ...]
    available: tuple[str, ...]
    generation: int
    counts: Mapping[str, int]
    held: Mapping[str, Any] | None
    engines: Sequence[Mapping[str, Any]]
    waiting_new: int
    waiting_paused: int


def take(
    core: ProgramCore,
    placement: Placement,
    now: float,
    *,
    active: bool,
    mode: str,
    fallback: str | None,
    priority_steering: bool,
) -> ProgramSnapshot:
    oldest = core.queues.oldest()
    held = (
        None
        if oldest is None
        else {
            "reason": oldest.held.value,
            "engine": oldest.engine,
            "wait_s": round(now - oldest.enqueued_at, 3),
        }
    )
    queues = core.queues.by_engine.values()
    return ProgramSnapshot(
        active=active,
        mode=mode,
        policy=placement.policy,
        fallback=fallback,
        priority_steering=priority_steering,
        workers=placement.workers,
        available=tuple(sorted(placement.available)),
        generation=placement.generation,
        counts=core.ledger.counts(),
        held=held,
        engines=core.engine_rows(now),
        waiting_new=sum(q.live_new for q in queues),
        waiting_paused=sum(q.live_paused for q in queues),
    )


def gauges(snap: ProgramSnapshot) -> dict[str, float]:
    c = snap.counts
    return {
        _A + "program_active": 1.0 if snap.active else 0.0,
        _A + "sessions_active": float(c["active"]),
        _A + "sessions_paused": float(c["paused"]),
        _A + "sessions_new": float(c["new"]),
        _A + "sessions_running": float(c["running"]),
    }


def health(snap: ProgramSnapshot) -> dict[str, Any]:
    return {
        "mode": snap.mode,
        "program_active": snap.active,
        "router_policy": snap.policy,
        "fallback": snap.fallback,
        "priority_steering": snap.priority_steering,
        "placement": {
            "workers": list(snap.workers),
            "available": list(snap.available),
            "generation": snap.generation,
        },
        "sessions": dict(snap.counts),
        "held": None if snap.held is None else dict(snap.held),
        "program_engines": [dict(r) for r in snap.engines],
    }


def engine_families(snap: ProgramSnapshot) -> Iterator[Metric]:
    """Per-engine program-admission gauges labelled by engine base URL."""
    for key, name, help_text in ENGINE_FAMILIES:
        fam = GaugeMetricFamily(name, help_text, labels=["engine"])
        for row in snap.engines:
            value = row.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                fam.add_metric([str(row["url"])], float(value))
        yield fam
