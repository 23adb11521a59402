"""The catalogue of admission's metrics: every name and its help, and program
admission's snapshot rendered as stats gauges, Prometheus families and the health
document. Pure.

Counter names are ``agentic_kv/admission/*`` and ``agentic_kv/budget/*`` keys
(``/kvproxy/stats``; on ``/metrics`` with ``/`` as ``_`` and a ``_total`` suffix).
Both modes count :class:`~kvproxy.admission.records.Action` values (``admit``,
``bypass``); fleet mode counts its bypasses by :class:`~kvproxy.admission.records.Outcome`
(``bypass_<outcome>``), program mode every outcome (``decision_<outcome>``) and its
:class:`~kvproxy.admission.program.events.Event` values (``event_<event>``).
Per-engine gauges are labelled by engine. The rendering of the whole of admission
(stats, health, /metrics) is :mod:`kvproxy.admission.report`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.events import Event
from kvproxy.admission.records import FLEET_BYPASSES, PROGRAM_OUTCOMES, Action, Outcome
from kvproxy.fleet.placement import Placement

_A = "agentic_kv/admission/"
_B = "agentic_kv/budget/"

# -- ledger (request) mode and both modes' shared counters -------------------------------

C_ADMIT = _A + Action.ADMIT.value
C_BYPASS = _A + Action.BYPASS.value
# One counter per reason a request bypasses for (protected, degraded, aged, ...).
C_BYPASS_REASON: Mapping[Outcome, str] = {r: _A + "bypass_" + r.value for r in FLEET_BYPASSES}
C_BYPASS_PROTECTED = C_BYPASS_REASON[Outcome.PROTECTED]
C_BYPASS_DEGRADED = C_BYPASS_REASON[Outcome.DEGRADED]
C_BYPASS_AGED = C_BYPASS_REASON[Outcome.AGED]
C_BYPASS_OVERSIZED = C_BYPASS_REASON[Outcome.OVERSIZED]
C_BYPASS_QUEUE_FULL = C_BYPASS_REASON[Outcome.QUEUE_FULL]
C_BYPASS_DISABLED = C_BYPASS_REASON[Outcome.DISABLED]
C_WAIT = _A + "wait"
C_CANCELLED = _A + Outcome.CANCELLED.value
C_WAIT_NEW_SESSION = _A + "wait_new_session"
C_WAIT_CONTINUING = _A + "wait_continuing"
C_WAIT_GRANTED = _A + "wait_granted"  # internal: grants after a wait
C_WAIT_SECONDS_SUM = _A + "wait_seconds_sum"  # internal: their summed wait
C_LEASE_EXPIRED = _B + "lease_expired"
C_SCRAPE_FAILURE = _B + "scrape_failure"
C_POLL_ERROR = _B + "poll_error"
C_RESIDENCY_EXPIRED = _B + "residency_expired"
C_RESIDENCY_EVICTED = _B + "residency_evicted"
C_SESSION_ENDED = _B + "session_ended"

COUNTERS = (
    C_ADMIT,
    C_BYPASS,
    C_BYPASS_PROTECTED,
    C_BYPASS_DEGRADED,
    C_BYPASS_AGED,
    C_BYPASS_OVERSIZED,
    C_BYPASS_QUEUE_FULL,
    C_BYPASS_DISABLED,
    C_WAIT,
    C_CANCELLED,
    C_WAIT_NEW_SESSION,
    C_WAIT_CONTINUING,
    C_WAIT_GRANTED,
    C_WAIT_SECONDS_SUM,
    C_LEASE_EXPIRED,
    C_SCRAPE_FAILURE,
    C_POLL_ERROR,
    C_RESIDENCY_EXPIRED,
    C_RESIDENCY_EVICTED,
    C_SESSION_ENDED,
)
# Counters reported by stats() (the internal ones are folded into wait_seconds_mean).
STATS_COUNTERS = tuple(c for c in COUNTERS if c not in (C_WAIT_GRANTED, C_WAIT_SECONDS_SUM))

# Gauges (both modes).
G_ENABLED = _A + "enabled"
G_WAITING = _A + "waiting"
G_WAITING_CONTINUING = _A + "waiting_continuing"
G_WAITING_NEW = _A + "waiting_new"
G_WAITING_PAUSED = _A + "waiting_paused"
G_DEFER_RATE = _A + "defer_rate"
G_DEGRADED_RATE = _A + "degraded_rate"
G_WAIT_SECONDS_MEAN = _A + "wait_seconds_mean"

HELP: dict[str, str] = {
    C_ADMIT: "Requests admitted with a lease (at once or after waiting).",
    C_BYPASS: "Requests forwarded without a lease by the coordinator, all reasons.",
    C_BYPASS_PROTECTED: "Bypasses of protected work.",
    C_BYPASS_DEGRADED: "Bypasses because no engine had a fresh capacity reading.",
    C_BYPASS_AGED: "Bypasses of waiters that waited max_wait_s.",
    C_BYPASS_OVERSIZED: "Bypasses of reservations larger than the whole ceiling.",
    C_BYPASS_QUEUE_FULL: "Bypasses because the FIFO was full.",
    C_BYPASS_DISABLED: "Waiters released when admission was disabled by a reload.",
    C_WAIT: "Requests that entered the FIFO.",
    C_CANCELLED: "Waiting requests cancelled (client gone) before a decision.",
    C_WAIT_NEW_SESSION: "Requests of new (not resident) sessions that entered the new FIFO.",
    C_WAIT_CONTINUING: "Requests of resident sessions that waited (pressure guard).",
    C_RESIDENCY_EXPIRED: "Sessions whose residency ended after session_idle_s without a request.",
    C_RESIDENCY_EVICTED: "Idle resident sessions dropped by the residency table bound.",
    C_SESSION_ENDED: "Resident sessions ended by end_session (session close).",
    C_LEASE_EXPIRED: "Leases reclaimed by the lease TTL.",
    C_SCRAPE_FAILURE: "Engine /metrics scrapes that failed or carried no usage.",
    C_POLL_ERROR: "Poll iterations that raised (polling continued).",
    G_WAITING: "Requests waiting in the FIFOs now.",
    G_WAITING_CONTINUING: "Requests of resident sessions waiting now.",
    G_WAITING_NEW: "Requests of new sessions (or without one) waiting now.",
    G_DEFER_RATE: "wait / (admit + wait + bypass), over the process lifetime.",
    G_DEGRADED_RATE: "bypass_degraded / (admit + wait + bypass), over the process lifetime.",
    G_WAIT_SECONDS_MEAN: "Mean wait of requests admitted after waiting, process lifetime.",
    G_ENABLED: "1 when admission is enabled.",
    _B + "ceiling": "int(sum of fresh engines' max_total_num_tokens x headroom).",
    _B + "reserved": "Tokens held by live leases.",
    _B + "resident": "Tokens of resident sessions between their turns.",
    _B + "resident_sessions": "Resident sessions.",
    _B + "committed": "reserved + resident.",
    _B + "available_tokens": "max(0, ceiling - committed).",
    _B + "reserved_utilization": "committed / ceiling.",
    _B + "lease_count": "Live leases.",
    _B + "kv_token_usage_mean": "Mean token_usage over fresh engines, now.",
    _B + "kv_token_usage_max": "Max token_usage over fresh engines, now (the pressure signal).",
    _B + "epoch": "Generation of the fresh engine set.",
    _B + "degraded": "1 when no engine has a fresh reading (every request bypasses).",
    _B + "engines_fresh": "Engines with a fresh reading.",
    _B + "engines_stale": "Engines known to the fleet without a fresh reading.",
}

# The wait histogram (seconds in either mode's queues, any outcome) and the fleet
# ledger's per-engine gauges.
WAIT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
WAIT_HISTOGRAM = "agentic_kv_admission_wait_seconds"
ENGINE_TOKEN_USAGE = "agentic_kv_budget_engine_token_usage"
ENGINE_MAX_TOKENS = "agentic_kv_budget_engine_max_total_num_tokens"
ENGINE_FRESH = "agentic_kv_budget_engine_fresh"

# -- program mode ------------------------------------------------------------------------

PROGRAM_HELP: dict[str, str] = {}
_C_DECISION = {o: _A + "decision_" + o.value for o in PROGRAM_OUTCOMES}
_C_EVENT = {e: _A + "event_" + e.value for e in Event}
C_PAUSED_WAIT_SUM = _A + "paused_wait_seconds_sum"
C_PAUSED_WAIT_COUNT = _A + "paused_wait_count"
C_DIVERTED = _A + "router_diverted"
C_PREFETCH_FAILED = _A + "prefetch_failed"
C_PREFETCH_NO_PROMPT = _A + "prefetch_skipped_no_prompt"
_PROGRAM_COUNTERS = (
    *_C_DECISION.values(),
    *_C_EVENT.values(),
    C_PAUSED_WAIT_SUM,
    C_PAUSED_WAIT_COUNT,
    C_DIVERTED,
    C_PREFETCH_FAILED,
    C_PREFETCH_NO_PROMPT,
)
for _o, _name in _C_DECISION.items():
    PROGRAM_HELP[_name] = f"Program admission decisions with outcome {_o.value}."
for _e, _name in _C_EVENT.items():
    PROGRAM_HELP[_name] = f"Program admission events: {_e.value}."
PROGRAM_HELP[C_PAUSED_WAIT_SUM] = "Seconds paused sessions' turns waited before going (sum)."
PROGRAM_HELP[C_PAUSED_WAIT_COUNT] = "Paused sessions' turns that waited."
PROGRAM_HELP[C_PREFETCH_FAILED] = "Prefetches the router or engine did not answer with 200."
PROGRAM_HELP[C_PREFETCH_NO_PROMPT] = (
    "Prefetches due for a session whose last prompt was not kept (prefetch_max_bytes)."
)
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
HELP.update(PROGRAM_HELP)

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
        "armed",
        "agentic_kv_admission_engine_armed",
        "1 while a permissive engine is armed: released for quiet after it engaged, it "
        "engages again on the next new session that does not fit it.",
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
