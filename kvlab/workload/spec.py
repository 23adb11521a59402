"""Workload presets: every parameter of an agentic workload, scaled by the token scale.

A :class:`~kvlab.workload.model.WorkloadSpec` is plain data. :func:`workload_spec` builds one from a preset
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
from typing import Any

from kvlab.workload.model import Dist, WorkloadError, WorkloadSpec, fixed, lognormal, uniform
from kvlab.workload.trace import load_trace, run_token_scale

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

# Claude Code sessions as the public Weka traces' summary statistics give them
# (zetxqx/thunderagent-original-verification, 07-inference-perf-weka/REPORT.md): every
# parameter's source and derivation is in docs/workloads.md ("claude-code").
CLAUDE_CODE_COST_MODEL = "qwen3-coder-30b-a3b-fp8-h100-tp2"
_CLAUDE_CODE = WorkloadSpec(
    name="claude-code",
    context_length=262_144,
    sessions_per_engine=24,
    cost_model=CLAUDE_CODE_COST_MODEL,
    system_prompt_tokens=0,
    task_prompt=lognormal(20_000, 0.5, 2_000, 120_000),
    turns=lognormal(64, 0.9, 2, 1000),
    output=lognormal(350, 0.964, 1, 32_768),
    tool_output=lognormal(650, 1.0, 1, 200_000),
    tool_output_schedule="1:7649,5:68,10:1071",
    compact_at=156_000,
    tool_latency_fast=lognormal(0.4, 0.6),
    tool_latency_slow=lognormal(10.0, 1.6),
    tool_latency_slow_share=0.10,
    tool_latency_cap_s=10.0,
)

# The replication's step 06 (06-single-node-ab): sessions of 3 turns on a ~60.7k-token
# unique preamble, 80 output tokens, 0.3 s think time, the first wave started over 10 s
# (80 sessions: 0.125 s apart), no cross-session sharing. Other bursts are --set away.
_BURST = WorkloadSpec(
    name="burst",
    context_length=262_144,
    sessions_per_engine=80,
    cost_model=CLAUDE_CODE_COST_MODEL,
    system_prompt_tokens=0,
    task_prompt=fixed(60_700),
    turns=fixed(3),
    output=fixed(80),
    tool_output=fixed(500),
    tool_latency_fast=fixed(0.3),
    tool_latency_slow=fixed(0.0),
    tool_latency_slow_share=0.0,
    tool_latency_cap_s=math.inf,
    start_stagger_s=0.125,
)

PRESETS: dict[str, WorkloadSpec] = {
    s.name: s for s in (_SWE, _RL, _SUBAGENTS, _LEGACY, _CLAUDE_CODE, _BURST)
}
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
