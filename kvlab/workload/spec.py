"""Workload presets: every parameter of an agentic workload, scaled by the token scale.

A :class:`WorkloadSpec` is plain data. :func:`workload_spec` builds one from a preset
name (``swe``, ``rl``, ``subagents``, ``legacy``) or a trace (``trace:PATH``), applies
overrides given in *real* (unscaled) units, then divides every token quantity by the
token scale ``k`` (calibration.md §5): distribution medians and bounds, fixed prefixes
and the context length. Turns, tool latencies, probabilities and counts are unscaled.

Sources of the preset values: ``../shared/reference/calibration.md`` §4 (see
docs/workloads.md for the table with each parameter's marker).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.workload.trace import Trace

DIST_KINDS = ("lognormal", "uniform", "fixed")
STEP_MODES = ("closed", "sync")


class WorkloadError(ValueError):
    """A workload parameter, preset name or trace is invalid."""


@dataclass(frozen=True, slots=True)
class Dist:
    """A distribution: ``lognormal`` (median, log-sd ``sigma``, clipped to [lo, hi]),
    ``uniform`` on [lo, hi] or ``fixed`` (always ``median``)."""

    kind: str = "lognormal"
    median: float = 1.0
    sigma: float = 0.0
    lo: float = 0.0
    hi: float = math.inf

    def validate(self, name: str) -> None:
        if self.kind not in DIST_KINDS:
            raise WorkloadError(f"{name}: kind must be one of {DIST_KINDS} (got {self.kind!r})")
        for attr in ("median", "sigma", "lo", "hi"):
            v = getattr(self, attr)
            if not isinstance(v, int | float) or math.isnan(v) or v < 0:
                raise WorkloadError(f"{name}_{attr} must be a number >= 0 (got {v!r})")
        if self.lo > self.hi:
            raise WorkloadError(f"{name}: need lo <= hi (got {self.lo} > {self.hi})")
        if self.kind != "uniform" and math.isinf(self.median):
            raise WorkloadError(f"{name}_median must be finite")
        if self.kind == "uniform" and math.isinf(self.hi):
            raise WorkloadError(f"{name}: a uniform distribution needs a finite hi")

    def scaled(self, k: float) -> Dist:
        """The distribution of the value divided by ``k``."""
        return Dist(self.kind, self.median / k, self.sigma, self.lo / k, self.hi / k)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if math.isinf(self.hi):
            d["hi"] = None
        return d


def lognormal(median: float, sigma: float, lo: float = 0.0, hi: float = math.inf) -> Dist:
    return Dist("lognormal", float(median), float(sigma), float(lo), float(hi))


def uniform(lo: float, hi: float) -> Dist:
    return Dist("uniform", (lo + hi) / 2, 0.0, float(lo), float(hi))


def fixed(value: float) -> Dist:
    return Dist("fixed", float(value), 0.0, 0.0, math.inf)


# Fields holding token quantities: divided by the token scale.
_TOKENS = {"unit": "tokens"}


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Every parameter of one workload, token quantities already divided by
    ``token_scale`` (tool latencies, turns, probabilities unscaled).

    A session (``main`` role) starts with ``system_prompt_tokens`` shared by every
    session of the run, then its task prompt; every turn resends the whole history plus
    the previous turn's tool output. ``tool_latency`` is a two-part mixture: with
    probability ``tool_latency_slow_share`` the slow part, else the fast one, capped.
    """

    name: str
    token_scale: int = 1
    context_length: int = field(default=40_960, metadata=_TOKENS)
    sessions_per_engine: int = 48
    cost_model: str = "qwen3-8b-h100"
    system_prompt_tokens: int = field(default=1_100, metadata=_TOKENS)
    task_prompt: Dist = field(default=lognormal(500, 0.6, 100, 3000), metadata=_TOKENS)
    turns: Dist = field(default=lognormal(29, 0.49, 5, 99))
    output: Dist = field(default=lognormal(150, 0.85, 10, 1024), metadata=_TOKENS)
    tool_output: Dist = field(default=lognormal(300, 1.4, 5, 4000), metadata=_TOKENS)
    tool_latency_fast: Dist = field(default=lognormal(0.4, 0.6))
    tool_latency_slow: Dist = field(default=lognormal(10.0, 1.6))
    tool_latency_slow_share: float = 0.10
    tool_latency_cap_s: float = 300.0
    # W2: GRPO groups of group_size samples sharing one task prompt; "sync" runs steps
    # of `concurrency` trajectories (whole groups) and waits for the last, "closed"
    # starts a new group when one ends.
    group_size: int = 1
    step_mode: str = "closed"
    # W3: after 1-based lead turn fanout_turn (and with fanout_second_prob after
    # fanout_second_turn) the lead spawns k ~ uniform{fanout_min..fanout_max}
    # subagents and waits for all; 0 disables.
    fanout_turn: int = 0
    fanout_second_turn: int = 0
    fanout_second_prob: float = 0.0
    fanout_min: int = 3
    fanout_max: int = 5
    sub_system_prompt_tokens: int = field(default=3_000, metadata=_TOKENS)
    sub_brief: Dist = field(default=lognormal(800, 0.4), metadata=_TOKENS)
    sub_turns: Dist = field(default=lognormal(8, 0.5, 2, 30))
    sub_output: Dist = field(default=lognormal(200, 0.8), metadata=_TOKENS)
    sub_tool_output: Dist = field(default=lognormal(1200, 0.9, 5, 6000), metadata=_TOKENS)
    sub_tool_latency_fast: Dist = field(default=lognormal(1.5, 0.6))
    sub_tool_latency_slow: Dist = field(default=lognormal(8.0, 1.2))
    sub_tool_latency_slow_share: float = 0.30
    sub_tool_latency_cap_s: float = 300.0
    sub_summary: Dist = field(default=lognormal(800, 0.5), metadata=_TOKENS)
    # The first wave of sessions starts staggered: slot i waits i x start_stagger_s.
    start_stagger_s: float = 0.0
    close_sessions: bool = True
    vocab_size: int = 32_000
    # Token ids below this are never drawn (clear of special tokens).
    min_token_id: int = 1_000
    # trace:PATH workloads: the parsed trace (its sessions replace the drawn ones).
    trace_path: str | None = None
    trace: Trace | None = field(default=None, repr=False, compare=False)

    def validate(self) -> None:
        if not isinstance(self.token_scale, int) or self.token_scale < 1:
            raise WorkloadError(f"token_scale must be an integer >= 1 (got {self.token_scale!r})")
        for name, ok in (
            ("context_length", self.context_length >= 2),
            ("sessions_per_engine", self.sessions_per_engine >= 1),
            ("system_prompt_tokens", self.system_prompt_tokens >= 0),
            ("sub_system_prompt_tokens", self.sub_system_prompt_tokens >= 0),
            ("group_size", self.group_size >= 1),
            ("fanout_turn", self.fanout_turn >= 0),
            ("fanout_second_turn", self.fanout_second_turn >= 0),
            ("fanout_min", 1 <= self.fanout_min <= self.fanout_max),
            ("tool_latency_cap_s", self.tool_latency_cap_s >= 0),
            ("sub_tool_latency_cap_s", self.sub_tool_latency_cap_s >= 0),
            ("start_stagger_s", self.start_stagger_s >= 0),
            ("vocab_size", self.vocab_size > self.min_token_id >= 0),
        ):
            if not ok:
                raise WorkloadError(f"{name} is out of range (got {getattr(self, name)!r})")
        for name in ("tool_latency_slow_share", "sub_tool_latency_slow_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise WorkloadError(f"{name} must be in [0, 1] (got {v!r})")
        if not 0.0 <= self.fanout_second_prob <= 1.0:
            raise WorkloadError(
                f"fanout_second_prob must be in [0, 1] (got {self.fanout_second_prob!r})"
            )
        if self.step_mode not in STEP_MODES:
            raise WorkloadError(f"step_mode must be one of {STEP_MODES} (got {self.step_mode!r})")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Dist):
                value.validate(f.name)
        if self.turns.lo < 1 and self.turns.kind != "fixed":
            raise WorkloadError("turns_lo must be >= 1")
        if self.sub_turns.lo < 1 and self.sub_turns.kind != "fixed":
            raise WorkloadError("sub_turns_lo must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "trace":
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Dist) else value
        return out


# --------------------------------------------------------------------------- presets

# calibration.md §4.1, W1: SWE-agent-like coding sessions with long tool pauses.
_SWE = WorkloadSpec(name="swe")

# calibration.md §4.2, W2: RL rollout (GRPO n=8) with long reasoning decodes.
_RL = WorkloadSpec(
    name="rl",
    context_length=36_864,
    sessions_per_engine=64,
    cost_model="qwen3-32b-h200",
    system_prompt_tokens=3_000,
    task_prompt=lognormal(1000, 0.5, 200, 4000),
    turns=lognormal(14, 0.5, 3, 50),
    output=lognormal(500, 1.0, 30, 8192),
    tool_latency_fast=lognormal(1.0, 0.6),
    tool_latency_slow=lognormal(10.0, 1.2),
    tool_latency_slow_share=0.15,
    tool_latency_cap_s=600.0,
    group_size=8,
    step_mode="sync",
)

# calibration.md §4.3, W3: lead programs fanning out to subagents.
_SUBAGENTS = WorkloadSpec(
    name="subagents",
    sessions_per_engine=24,
    system_prompt_tokens=3_000,
    task_prompt=lognormal(400, 0.5),
    turns=uniform(6, 12),
    output=lognormal(300, 0.8),
    # Ordinary lead turns: tool output as W1, the subagents' tool latency.
    tool_latency_fast=lognormal(1.5, 0.6),
    tool_latency_slow=lognormal(8.0, 1.2),
    tool_latency_slow_share=0.30,
    tool_latency_cap_s=300.0,
    fanout_turn=2,
    fanout_second_turn=5,
    fanout_second_prob=0.5,
)

# The agent workload of kvproxy's demo and rollout benchmark before the calibrated
# presets (4-8 turns of 48 tokens, 1k shared prefix, 256-512-token tool results).
_LEGACY = WorkloadSpec(
    name="legacy",
    context_length=1 << 30,
    sessions_per_engine=24,
    cost_model="legacy",
    system_prompt_tokens=1024,
    task_prompt=fixed(128),
    turns=uniform(4, 8),
    output=fixed(48),
    tool_output=uniform(256, 512),
    tool_latency_fast=lognormal(0.5, 0.5),
    tool_latency_slow=fixed(0.0),
    tool_latency_slow_share=0.0,
    tool_latency_cap_s=math.inf,
)

PRESETS: dict[str, WorkloadSpec] = {s.name: s for s in (_SWE, _RL, _SUBAGENTS, _LEGACY)}
TRACE_PREFIX = "trace:"

_FIELDS = {f.name: f for f in dataclasses.fields(WorkloadSpec)}
_DIST_ATTRS = ("kind", "median", "sigma", "lo", "hi")


def override_names() -> list[str]:
    """Every name :func:`workload_spec` accepts as an override (``--set NAME=VALUE``)."""
    names: list[str] = []
    for f in dataclasses.fields(WorkloadSpec):
        if f.name in ("name", "token_scale", "trace", "trace_path"):
            continue
        default = getattr(_SWE, f.name)
        if isinstance(default, Dist):
            names.extend(f"{f.name}_{a}" for a in _DIST_ATTRS)
        else:
            names.append(f.name)
    return names


def _coerce(name: str, value: Any, like: Any) -> Any:
    """``value`` (maybe a string from the command line) as the type of ``like``."""
    if isinstance(like, bool):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise WorkloadError(f"{name}: expected a boolean (got {value!r})")
    if isinstance(like, int) and not isinstance(like, bool):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise WorkloadError(f"{name}: expected an integer (got {value!r})") from None
        if not f.is_integer():
            raise WorkloadError(f"{name}: expected an integer (got {value!r})")
        return int(f)
    if isinstance(like, float):
        if isinstance(value, str) and value.strip().lower() in ("inf", "none"):
            return math.inf
        try:
            return float(value)
        except (TypeError, ValueError):
            raise WorkloadError(f"{name}: expected a number (got {value!r})") from None
    return str(value)


def _apply_overrides(spec: WorkloadSpec, overrides: dict[str, Any]) -> WorkloadSpec:
    changes: dict[str, Any] = {}
    dist_changes: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if key in ("name", "token_scale", "trace", "trace_path"):
            raise WorkloadError(f"{key} cannot be overridden")
        if key in _FIELDS:
            current = getattr(spec, key)
            if isinstance(current, Dist):
                if not isinstance(value, Dist):
                    raise WorkloadError(f"{key}: expected a Dist (or set {key}_median etc.)")
                changes[key] = value
            else:
                changes[key] = _coerce(key, value, current)
            continue
        base, _, attr = key.rpartition("_")
        if base in _FIELDS and attr in _DIST_ATTRS and isinstance(getattr(spec, base), Dist):
            if attr == "kind":
                dist_changes.setdefault(base, {})[attr] = str(value)
            else:
                dist_changes.setdefault(base, {})[attr] = _coerce(key, value, 0.0)
            continue
        raise WorkloadError(
            f"unknown workload parameter {key!r} (see docs/workloads.md for the names)"
        )
    for base, attrs in dist_changes.items():
        current = changes.get(base, getattr(spec, base))
        changes[base] = dataclasses.replace(current, **attrs)
    return dataclasses.replace(spec, **changes)


def scale_spec(spec: WorkloadSpec, token_scale: int) -> WorkloadSpec:
    """``spec`` (in real tokens) with every token quantity divided by ``token_scale``:
    distributions exactly (drawn values are rounded stochastically when drawn), fixed
    quantities rounded half up (calibration.md §5)."""
    if not isinstance(token_scale, int) or isinstance(token_scale, bool) or token_scale < 1:
        raise WorkloadError(f"token_scale must be an integer >= 1 (got {token_scale!r})")
    changes: dict[str, Any] = {"token_scale": token_scale}
    for f in dataclasses.fields(spec):
        if f.metadata.get("unit") != "tokens":
            continue
        value = getattr(spec, f.name)
        if isinstance(value, Dist):
            changes[f.name] = value.scaled(token_scale)
        else:
            changes[f.name] = round_half_up(value / token_scale)
    return dataclasses.replace(spec, **changes)


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def resolve_token_scale(
    name_or_trace: str, given: int | None, default: int
) -> tuple[int, str | None]:
    """The token scale for a run of ``name_or_trace`` (a preset name or ``trace:PATH``),
    and a one-line note for the user when it is not ``default``.

    ``given`` is an explicitly given scale (``None``: the flag was left out): it is used
    as it is. Otherwise a preset runs at ``default`` and so does a trace of counts; a
    trace with explicit token ids runs at its own ``token_scale`` (ids cannot be
    rescaled). Reads the trace; raises :class:`WorkloadError` for an unreadable one.
    """
    path = name_or_trace[len(TRACE_PREFIX) :]
    if given is not None or not name_or_trace.startswith(TRACE_PREFIX) or not path:
        return (default if given is None else given), None
    from kvlab.workload.trace import load_trace, run_token_scale

    return run_token_scale(load_trace(path), given, default)


def workload_spec(name_or_trace: str, token_scale: int = 1, **overrides: Any) -> WorkloadSpec:
    """The preset ``name_or_trace`` (``swe``, ``rl``, ``subagents``, ``legacy`` or
    ``trace:PATH``) with ``overrides`` applied, scaled by ``token_scale``.

    Overrides are given in real (unscaled) units, by field name (``context_length=
    32768``, ``group_size=4``) or, for a distribution, by ``<field>_<attr>`` with attr
    one of kind, median, sigma, lo, hi (``turns_median=20``, ``output_hi=2048``).
    Values may be strings (as from ``--set``). Raises :class:`WorkloadError`.
    """
    if not isinstance(name_or_trace, str):
        raise WorkloadError(f"workload must be a name or trace:PATH (got {name_or_trace!r})")
    if name_or_trace.startswith(TRACE_PREFIX):
        from kvlab.workload.trace import load_trace

        path = name_or_trace[len(TRACE_PREFIX) :]
        if not path:
            raise WorkloadError("trace: needs a path (trace:PATH)")
        trace = load_trace(path)
        base = dataclasses.replace(
            _SWE,
            name="trace",
            trace_path=path,
            trace=trace,
            context_length=trace.context_length or _SWE.context_length,
            group_size=trace.max_group_size,
            step_mode="closed",
        )
        if trace.sessions_per_engine is not None:
            base = dataclasses.replace(base, sessions_per_engine=trace.sessions_per_engine)
        if trace.cost_model is not None:
            base = dataclasses.replace(base, cost_model=trace.cost_model)
    else:
        try:
            base = PRESETS[name_or_trace]
        except KeyError:
            names = ", ".join([*PRESETS, "trace:PATH"])
            raise WorkloadError(
                f"unknown workload {name_or_trace!r} (choose one of {names})"
            ) from None
    spec = scale_spec(_apply_overrides(base, overrides), token_scale)
    if spec.trace is not None:
        spec.trace.check_scale(token_scale)
    spec.validate()
    return spec
