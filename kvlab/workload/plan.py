"""The pure session model: what every session of a workload sends, drawn from a seed.

:func:`session_plans` turns a :class:`~kvlab.workload.spec.WorkloadSpec` and a seed
into an endless, deterministic stream of :class:`SessionPlan` (or the trace's sessions,
once each). A plan fixes every turn's new input ids, output length and the tool latency
after it, and ends the session where its next request's input plus drawn output would
pass the context length (calibration.md §4, ``exit_context``), assuming each turn
returns its full ``max_new_tokens`` (the simulator does; the runner checks again against
what the engine really returned).

Randomness: one ``random.Random`` per session (seeded by a string, so stable across
processes and Python versions); drawn token counts use stochastic rounding (the mean
survives the token scale) and are at least 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvlab.workload.draw import draw_count, draw_latency, draw_tokens, token_ids
from kvlab.workload.model import Dist, SessionPlan, TurnPlan, WorkloadSpec, parse_schedule
from kvlab.workload.trace import trace_plans


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


# ------------------------------------------------------------------------ sessions


@dataclass(frozen=True, slots=True)
class _Role:
    """The distributions one kind of session draws from."""

    turns: Dist
    output: Dist
    tool_output: Dist
    lat_fast: Dist
    lat_slow: Dist
    lat_share: float
    lat_cap_s: float


def _main_role(spec: WorkloadSpec) -> _Role:
    return _Role(
        spec.turns,
        spec.output,
        spec.tool_output,
        spec.tool_latency_fast,
        spec.tool_latency_slow,
        spec.tool_latency_slow_share,
        spec.tool_latency_cap_s,
    )


def _sub_role(spec: WorkloadSpec) -> _Role:
    return _Role(
        spec.sub_turns,
        spec.sub_output,
        spec.sub_tool_output,
        spec.sub_tool_latency_fast,
        spec.sub_tool_latency_slow,
        spec.sub_tool_latency_slow_share,
        spec.sub_tool_latency_cap_s,
    )


def _fanout_turns(spec: WorkloadSpec, rng: random.Random) -> set[int]:
    """0-based indices of the turns after which a lead fans out."""
    out: set[int] = set()
    if spec.fanout_turn > 0:
        out.add(spec.fanout_turn - 1)
    if spec.fanout_second_turn > 0 and rng.random() < spec.fanout_second_prob:
        out.add(spec.fanout_second_turn - 1)
    return out


def _tool_output(spec: WorkloadSpec, role: _Role, turn: int) -> Dist:
    """The tool output appended before 0-based ``turn``: ``role.tool_output``, or for a
    main session with ``tool_output_schedule`` the lognormal of that turn's scheduled mean
    (scaled) with the same sigma and bounds (median = mean x exp(-sigma^2 / 2))."""
    if not spec.tool_output_schedule or role.tool_output is not spec.tool_output:
        return role.tool_output
    mean: float | None = None
    for start, m in parse_schedule(spec.tool_output_schedule):
        if turn >= start:
            mean = m
    if mean is None:
        return role.tool_output
    base = role.tool_output
    median = mean / spec.token_scale * math.exp(-(base.sigma**2) / 2)
    return dataclasses.replace(base, median=median)


def _compacted(
    spec: WorkloadSpec, seed: int, rng: random.Random, context: int, new: int, out: int
) -> list[int] | None:
    """A fresh first prompt when the next request (context + new input + output) would
    pass ``compact_at``: the session compacts its history. None: no compaction."""
    if spec.compact_at <= 0 or context + new + out <= spec.compact_at:
        return None
    return [
        *_system_ids(spec, seed, "system"),
        *token_ids(rng, draw_tokens(spec.task_prompt, rng), spec),
    ]


def build_session(
    spec: WorkloadSpec,
    seed: int,
    session_id: str,
    first_prompt: Sequence[int],
    role: _Role,
    *,
    group: str | None = None,
    role_name: str = "main",
    parent: str | None = None,
    fanout: bool = False,
) -> SessionPlan:
    rng = _rng(seed, session_id)
    n_turns = draw_count(role.turns, rng)
    fan_at = _fanout_turns(spec, rng) if fanout else set()
    turns: list[TurnPlan] = []
    context = 0
    new_input: list[int] = list(first_prompt)
    exit_context = False
    for t in range(n_turns):
        out = draw_tokens(role.output, rng)
        reset = False
        if t and role_name == "main":
            fresh = _compacted(spec, seed, rng, context, len(new_input), out)
            if fresh is not None:
                new_input, context, reset = fresh, 0, True
        if t == 0:
            # The first turn always runs; its output is cut to fit if it must be.
            out = max(1, min(out, spec.context_length - len(new_input)))
        elif context + len(new_input) + out > spec.context_length:
            exit_context = True
            break
        last = t == n_turns - 1
        latency = draw_latency(role.lat_fast, role.lat_slow, role.lat_share, role.lat_cap_s, rng)
        subs: tuple[SessionPlan, ...] = ()
        if t in fan_at and not last:
            k = rng.randint(spec.fanout_min, spec.fanout_max)
            subs = tuple(
                _subagent(spec, seed, f"{session_id}{SUBAGENT_INFIX}{len(turns)}.{j}", session_id)
                for j in range(k)
            )
            summary: list[int] = []
            for _ in subs:
                summary.extend(token_ids(rng, draw_tokens(spec.sub_summary, rng), spec))
            next_input = summary
            latency = 0.0
        else:
            tool = _tool_output(spec, role, t + 1)
            next_input = [] if last else token_ids(rng, draw_tokens(tool, rng), spec)
        turns.append(TurnPlan(new_input, out, 0.0 if last else latency, subs, reset))
        context += len(new_input) + out
        new_input = next_input
    return SessionPlan(
        session_id=session_id,
        turns=tuple(turns),
        group=group,
        role=role_name,
        parent=parent,
        exit_context=exit_context,
        turns_drawn=n_turns,
    )


# Subagent session ids are ``<parent>-sub<turn>.<j>``.
SUBAGENT_INFIX = "-sub"


def is_subagent_id(session_id: str) -> bool:
    """Whether ``session_id`` names a subagent session of a W3 plan."""
    return SUBAGENT_INFIX in session_id


def _subagent(spec: WorkloadSpec, seed: int, session_id: str, parent: str) -> SessionPlan:
    rng = _rng(seed, session_id, "brief")
    prompt = [
        *_system_ids(spec, seed, "sub-system"),
        *token_ids(rng, draw_tokens(spec.sub_brief, rng), spec),
    ]
    return build_session(
        spec, seed, session_id, prompt, _sub_role(spec), role_name="subagent", parent=parent
    )


_SYSTEM_CACHE: dict[tuple[int, str, int, int, int], list[int]] = {}


def _system_ids(spec: WorkloadSpec, seed: int, which: str) -> list[int]:
    n = spec.system_prompt_tokens if which == "system" else spec.sub_system_prompt_tokens
    key = (seed, which, n, spec.min_token_id, spec.vocab_size)
    ids = _SYSTEM_CACHE.get(key)
    if ids is None:
        if len(_SYSTEM_CACHE) > 64:
            _SYSTEM_CACHE.clear()
        ids = token_ids(_rng(seed, which), n, spec)
        _SYSTEM_CACHE[key] = ids
    return ids


def session_id(spec: WorkloadSpec, seed: int, index: int, member: int | None = None) -> str:
    base = f"{spec.name}-{seed}-{index:05d}"
    return base if member is None else f"{base}.{member}"


def session_plans(spec: WorkloadSpec, seed: int) -> Iterator[SessionPlan]:
    """Deterministic plans: endless for a preset, the trace's sessions once for a trace.
    Members of a GRPO group (``group_size`` > 1) come consecutively with one ``group``."""
    if spec.trace is not None:
        yield from trace_plans(spec, seed)
        return
    system = _system_ids(spec, seed, "system")
    role = _main_role(spec)
    fanout = spec.fanout_turn > 0 or spec.fanout_second_turn > 0
    for index in itertools.count():
        rng = _rng(seed, spec.name, index, "task")
        task = token_ids(rng, draw_tokens(spec.task_prompt, rng), spec)
        prompt = [*system, *task]
        if spec.group_size == 1:
            yield build_session(
                spec, seed, session_id(spec, seed, index), prompt, role, fanout=fanout
            )
            continue
        group = session_id(spec, seed, index)
        for member in range(spec.group_size):
            yield build_session(
                spec,
                seed,
                session_id(spec, seed, index, member),
                prompt,
                role,
                group=group,
                fanout=fanout,
            )
