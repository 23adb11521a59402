"""The ``admission:`` section: admission's keys, and program admission's defaults. Pure.

:class:`AdmissionConfig` is the one place admission's keys and defaults are written:
:class:`~kvproxy.admission.program.params.ProgramParams` inherits its fields, and a test
keeps ``configs/kvproxy.yaml`` and ``docs/configuration.md`` stating the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvproxy.config.coerce import as_bool
from kvproxy.config.errors import ConfigError, check, check_each

ADMISSION_MODES = ("program", "request")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = False
    headroom: float = 0.90
    pressure_threshold: float = 0.92
    # Cap on the completion part of a reservation; None means default_completion_tokens.
    expected_decode_cap: int | None = None
    max_wait_s: float = 30.0
    scope: str = "train"  # train | all
    # Completion budget when a request states none (the rollout's max response length).
    default_completion_tokens: int = 4096
    poll_interval_s: float = 2.0
    # A fresh snapshot is one younger than this; None means 3 poll intervals (min 5 s).
    staleness_s: float | None = None
    metrics_timeout_s: float = 5.0
    lease_ttl_s: float = 600.0
    # FIFO bound: past it a request bypasses (reason queue_full).
    max_queue: int = 10_000
    # Requests whose header eval_header equals "eval", or whose path starts with
    # eval_path_prefix, are eval traffic (out of scope when scope=train).
    eval_header: str = "X-KVProxy-Mode"
    eval_path_prefix: str | None = None
    # Requests carrying protected_header with a true value, or a priority at or above
    # protected_priority, bypass admission without touching the ledger.
    protected_header: str = "X-KVProxy-Protected"
    # Whether eval_header and protected_header are honoured: a client sending them
    # skips admission, so they are read only where the operator trusts every client
    # (or a gateway in front sets and strips them). Off: both headers are ignored
    # (eval_path_prefix and protected_priority still apply).
    trust_client_headers: bool = False
    protected_priority: int | None = None
    # Prompt-size estimate for text / chat bodies (no input_ids): characters per token
    # before calibration from the engines' reported prompt_tokens.
    chars_per_token: float = 4.0
    # program: program-aware admission (per-engine session ledgers when the router's
    # placement can be mirrored, see router.policy; else the fleet-wide residency
    # ledger). request: every request admitted on its own (Relax per-request semantics).
    mode: str = "program"
    # Fleet-wide fallback only: count a session's KV between its turns. The YAML key
    # session_residency is accepted as an alias of mode (true -> program,
    # false -> request); see resolve_session_residency.
    session_residency: bool = True
    # --- program mode, per-engine ledger (docs/admission.md#program-mode) ---
    # engine: one ledger per engine from the mirrored ring; fleet: the fleet-wide
    # residency ledger even when placement is known (ablation).
    ledger: str = "engine"
    # Ablation: hold continuing turns of active sessions for capacity like new ones
    # (false, the default: a continuing turn is forwarded at once, never held).
    hold_continuing: bool = False
    # Pause idle sessions under growth pressure; a paused session's next turn waits for
    # room ahead of new sessions; past paused_soft_wait_s (the soft bound) it goes once
    # its resume would not push its engine past the pause mark (pause_high x pool +
    # host: the tick would pause another session for it), and past paused_max_wait_s
    # in any case: the most a paused turn waits, as ever (docs/admission.md, "Holds that
    # last as long as they pay"). 30 s: with the hold past it, a soft bound of 30 s gives
    # the throughput of 60 s with the continuing-turn tail of off's on W1. The soft bound
    # never outlasts paused_max_wait_s: paused_max_wait_s: 30 alone is a fixed 30 s hold,
    # the behaviour of earlier versions (their default 60 s).
    pause: bool = True
    paused_soft_wait_s: float = 30.0
    # 600 s: the knee of the hold's throughput / tail curve (docs/admission.md).
    paused_max_wait_s: float = 600.0
    # A new session's first turn waits in its engine's FIFO for room; past
    # new_session_soft_wait_s (its soft bound) it goes once admitting it would not push
    # its engine past the pause mark (as a paused turn past paused_soft_wait_s), and past
    # new_session_max_wait_s (the first-turn wait bound) in any case. 180 s / 1800 s: the
    # measured trade-off (docs/admission.md#defaults): a plain 300 s bound lifted the
    # grid's KV-bound cells but cost the deep fleet 8% and 5.7x its continuing-turn tail;
    # held only while it pays, the deep fleet keeps its gain. 180 s from the soft bound's
    # curve (60-300 s): W1 2.02x (1.96x at 300 s), first turns served sooner everywhere,
    # the deep fleet's gain kept; shorter bounds cost the tails. The soft bound never
    # outlasts the hard one: new_session_soft_wait_s >= new_session_max_wait_s is the
    # plain bound of earlier versions.
    new_session_soft_wait_s: float = 180.0
    new_session_max_wait_s: float = 1800.0
    # Inject a size-based top-level priority when every engine evicts by priority. Off by
    # default: with --enable-priority-scheduling (required for priority eviction) the
    # priority also orders the engine's waiting queue, which starves small sessions
    # (W2 continuing-turn TTFT p99 9x in the lab) for no throughput gain.
    priority_steering: bool = False
    # Tokens per priority step: priority = floor(log2(context / priority_unit_tokens)),
    # clamped to [0, priority_max] and monotone per session.
    priority_unit_tokens: int = 4096
    priority_max: int = 9
    # Adapt each engine's admission target from its eviction and retraction counters
    # and the cached fraction of continuing turns.
    feedback: bool = True
    tick_s: float = 1.0
    # An idle session counts fully for idle_lease_s after its last turn, then decays
    # with idle_half_life_s (0: it stops counting at once); after idle_ttl_s it leaves.
    # 0 s and 1 s (ThunderAgent's acting decay): the engine's LRU evicts an idle
    # session's KV first, so the gate counts what the turns in flight hold
    # (docs/admission.md, "Defaults").
    idle_lease_s: float = 0.0
    idle_half_life_s: float = 1.0
    idle_ttl_s: float = 600.0
    # Pause idle sessions while the footprint, an idle session's decayed, passes
    # pause_high x capacity, down to pause_low; the undecayed footprint over pause_high
    # is the mark a held turn past its soft bound waits under.
    pause_high: float = 0.95
    pause_low: float = 0.85
    # Admission target theta (fraction of capacity): start and bounds.
    target_start: float = 0.92
    target_min: float = 0.60
    target_max: float = 0.95
    # The gate stays off while the undecayed footprint is under this fraction.
    gate_off_below: float = 0.75
    # Thrash: continuing turns' cached fraction under this over a feedback window.
    thrash_cached_fraction: float = 0.85
    feedback_window_s: float = 5.0
    # Per-session constant added to its footprint (tokens).
    session_buffer_tokens: int = 100
    # Hold work on an engine only while holding is measured to pay
    # (docs/admission.md#when-admission-holds): permissive (nothing held, nothing
    # paused) until engage_windows feedback windows in a row spent at least engage_cost
    # of the engine's work recomputing evicted context (a decoded token weighing
    # decode_token_weight prefill tokens) while a turn was in flight at least
    # engage_busy of the time; permissive again after release_windows windows busy less
    # than release_busy. false: the gate is always engaged (earlier versions).
    engage_on_thrash: bool = True
    engage_cost: float = 0.4
    engage_busy: float = 0.75
    decode_token_weight: float = 16.0
    release_busy: float = 0.5
    engage_windows: int = 2
    release_windows: int = 6
    # Cold start: a permissive engine also engages, before any thrash is measured, after
    # engage_windows busy windows in a row in which it ran at least cold_start_sessions
    # sessions expected to grow to more than 1.5 x its capacity, whose contexts would
    # cost at least 0.5 of its work to recompute were they all evicted. 0: off.
    cold_start_sessions: int = 24
    # The hold model (docs/admission.md, "The hold model"): a permissive engine also
    # engages at once, on a new session's first turn or at a window's end, when the
    # contexts it already knows exceed its room (pool + host) and recomputing them would
    # cost at least half its work (predicted from prompts against the decodes asked
    # for, measured once turns come back); released with a back-off when the windows
    # that follow refute it. false: off.
    engage_on_forecast: bool = True
    # Growth-aware admission of new sessions: a new session starts only if what the
    # engine's admitted sessions and it are expected to grow to (each: max(footprint,
    # expected peak context)) fits growth_target x capacity (x the host pool where an
    # engine has a host tier larger than its pool). The expected peak is the
    # growth_quantile of the last growth_window closed sessions' final contexts once
    # growth_min_closed have closed; before, context + the fleet's per-turn growth x
    # growth_horizon_turns (the engine's context length before any growth is seen),
    # capped by the engine's context length. Continuing turns are never held by it.
    growth_reservation: bool = True
    growth_target: float = 0.92
    growth_quantile: float = 0.25
    growth_window: int = 256
    growth_min_closed: int = 16
    growth_horizon_turns: float = 16.0
    # Prefetch before the tool returns (docs/admission.md#prefetch-before-the-tool-returns):
    # on an engine with a host KV tier (SGLang's HiCache), an idle session's last prompt
    # sent again as one output token through the router with its routing key,
    # prefetch_lead_s before its tool is expected to return (the shortest of its last
    # tool calls, or when a client says so: POST /kvproxy/sessions/{id}/prefetch), so
    # that its next turn finds its prefix loaded back. Only to an engine that queues
    # nothing, is under pressure_threshold, runs fewer than three of kvproxy's turns and
    # prefetch_max_in_flight prefetches, and whose sessions fit pool + host; the prompts
    # it resends are kept up to prefetch_max_bytes in all (least recently kept out
    # first). Measured to gain nothing in the simulator (docs/benchmarks.md): off.
    prefetch: bool = False
    prefetch_lead_s: float = 2.0
    prefetch_max_in_flight: int = 2
    prefetch_max_bytes: int = 256 * 1024 * 1024
    # Bound of the per-engine session table (least recently active idle session first).
    max_sessions: int = 100_000
    # A session with no request for this long stops being counted resident (its KV is
    # evictable anyway); this releases residency when sessions never close explicitly.
    session_idle_s: float = 600.0

    @property
    def effective_staleness_s(self) -> float:
        if self.staleness_s is not None:
            return self.staleness_s
        return max(3 * self.poll_interval_s, 5.0)

    @property
    def completion_cap(self) -> int:
        return self.expected_decode_cap or self.default_completion_tokens


# The old key: true is mode program, false is mode request.
SESSION_RESIDENCY = "session_residency"


def resolve_session_residency(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The ``admission:`` mapping without the old key ``session_residency``, and the
    changes it implies (``mode`` and the key itself); a contradiction with ``mode`` is
    an error naming the replacement."""
    if SESSION_RESIDENCY not in raw:
        return raw, {}
    rest = dict(raw)
    old = as_bool("admission.session_residency", rest.pop(SESSION_RESIDENCY))
    implied = "program" if old else "request"
    if "mode" in rest and rest["mode"] != implied:
        raise ConfigError(
            f"admission.session_residency: {str(old).lower()} contradicts admission.mode: "
            f"{rest['mode']!r}; session_residency is replaced by mode (true -> program, "
            "false -> request): set only mode"
        )
    return rest, {"mode": implied, SESSION_RESIDENCY: old}


def validate_admission(a: AdmissionConfig) -> None:
    """Raise ConfigError naming the first ``admission.`` key out of range.

    Called only when admission is enabled."""
    _validate_request_keys(a)
    _validate_program_ranges(a)
    _validate_program_relations(a)


def _validate_request_keys(a: AdmissionConfig) -> None:
    """The keys every mode reads."""
    check(0 < a.headroom <= 1, f"admission.headroom: must be in (0, 1] (got {a.headroom})")
    check(
        0 < a.pressure_threshold <= 1,
        f"admission.pressure_threshold: must be in (0, 1] (got {a.pressure_threshold})",
    )
    check(
        a.expected_decode_cap is None or a.expected_decode_cap > 0,
        f"admission.expected_decode_cap: must be > 0 (got {a.expected_decode_cap})",
    )
    check(a.max_wait_s >= 0, f"admission.max_wait_s: must be >= 0 (got {a.max_wait_s})")
    check(a.scope in ("train", "all"), f"admission.scope: must be train or all (got {a.scope!r})")
    check_each(
        "admission", a, ("default_completion_tokens", "poll_interval_s"), _positive, "must be > 0"
    )
    check(
        a.staleness_s is None or a.staleness_s >= a.poll_interval_s,
        f"admission.staleness_s: must be >= admission.poll_interval_s ({a.poll_interval_s}) "
        f"(got {a.staleness_s})",
    )
    check_each("admission", a, ("metrics_timeout_s", "lease_ttl_s"), _positive, "must be > 0")
    check(a.max_queue >= 1, f"admission.max_queue: must be >= 1 (got {a.max_queue})")
    check_each("admission", a, ("chars_per_token", "session_idle_s"), _positive, "must be > 0")


# Program mode's keys by the range they must lie in.
_NON_NEGATIVE = (
    "paused_soft_wait_s",
    "paused_max_wait_s",
    "new_session_soft_wait_s",
    "new_session_max_wait_s",
    "idle_lease_s",
    "idle_half_life_s",
)
_POSITIVE = ("tick_s", "idle_ttl_s", "feedback_window_s", "prefetch_lead_s")
_FRACTIONS = (
    "pause_high",
    "pause_low",
    "target_start",
    "target_min",
    "target_max",
    "gate_off_below",
    "thrash_cached_fraction",
    "growth_target",
    "growth_quantile",
    "engage_cost",
    "engage_busy",
)


def _positive(value: Any) -> bool:
    return bool(value > 0)


def _validate_program_ranges(a: AdmissionConfig) -> None:
    check(
        a.mode in ADMISSION_MODES,
        f"admission.mode: must be program or request (got {a.mode!r})",
    )
    check(
        a.ledger in ("engine", "fleet"),
        f"admission.ledger: must be engine or fleet (got {a.ledger!r})",
    )
    check_each("admission", a, _NON_NEGATIVE, lambda v: v >= 0, "must be >= 0")
    check_each("admission", a, _POSITIVE, _positive, "must be > 0")
    check_each("admission", a, _FRACTIONS, lambda v: 0 < v <= 1, "must be in (0, 1]")
    check(
        0 <= a.release_busy < 1,
        f"admission.release_busy: must be in [0, 1) (got {a.release_busy})",
    )
    check(
        a.decode_token_weight > 0,
        f"admission.decode_token_weight: must be > 0 (got {a.decode_token_weight})",
    )
    check_each(
        "admission", a, ("engage_windows", "release_windows"), lambda v: v >= 1, "must be >= 1"
    )
    check(
        a.cold_start_sessions >= 0,
        f"admission.cold_start_sessions: must be >= 0 (got {a.cold_start_sessions})",
    )


def _validate_program_relations(a: AdmissionConfig) -> None:
    check(
        a.pause_low < a.pause_high,
        f"admission.pause_low: must be < pause_high ({a.pause_high}) (got {a.pause_low})",
    )
    check(
        a.target_min <= a.target_start <= a.target_max,
        "admission.target_start: must be in [target_min, target_max] "
        f"([{a.target_min}, {a.target_max}]) (got {a.target_start})",
    )
    check(
        0 <= a.priority_max <= 9,
        "admission.priority_max: must be in [0, 9] (SGLang preempts a running request at a "
        f"priority gap of 10) (got {a.priority_max})",
    )
    check(
        a.priority_unit_tokens >= 1,
        f"admission.priority_unit_tokens: must be >= 1 (got {a.priority_unit_tokens})",
    )
    check(
        a.session_buffer_tokens >= 0,
        f"admission.session_buffer_tokens: must be >= 0 (got {a.session_buffer_tokens})",
    )
    check(a.max_sessions >= 1, f"admission.max_sessions: must be >= 1 (got {a.max_sessions})")
    check(
        a.prefetch_max_in_flight >= 1,
        f"admission.prefetch_max_in_flight: must be >= 1 (got {a.prefetch_max_in_flight})",
    )
    check(
        a.prefetch_max_bytes >= 0,
        f"admission.prefetch_max_bytes: must be >= 0 (got {a.prefetch_max_bytes})",
    )
    check(a.growth_window >= 1, f"admission.growth_window: must be >= 1 (got {a.growth_window})")
    check(
        a.growth_min_closed >= 0,
        f"admission.growth_min_closed: must be >= 0 (got {a.growth_min_closed})",
    )
    check(
        a.growth_horizon_turns >= 0,
        f"admission.growth_horizon_turns: must be >= 0 (got {a.growth_horizon_turns})",
    )
