"""The workload's records: what the other modules of :mod:`kvlab.workload` share.

Pure data, no behaviour beyond checks and derived values, and no import of the other
modules: a workload's parameters (:class:`WorkloadSpec`, its distributions
:class:`Dist`), a parsed trace (:class:`Trace`), the plan of a session
(:class:`SessionPlan` of :class:`TurnPlan`), what a request returned
(:class:`TurnOutcome`) and what a run recorded (:class:`TurnRecord`,
:class:`SessionRecord`, :class:`WorkloadResult`). The presets and
:func:`~kvlab.workload.spec.workload_spec` are in :mod:`.spec`, drawing plans in
:mod:`.plan`, reading traces in :mod:`.trace`, running in :mod:`.runner`, the summary
in :mod:`.report`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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


# ------------------------------------------------------------------------- traces


def trace_error(path: str, line: int, field: str, message: str) -> WorkloadError:
    """The error for a trace's ``field`` on ``line``: every trace error names both."""
    return WorkloadError(f"{path}:{line}: {field}: {message}")


@dataclass(frozen=True, slots=True)
class TraceTurn:
    input_tokens: int  # count in trace units (len(input_ids) where ids are given)
    input_ids: tuple[int, ...] | None
    output_tokens: int
    tool_latency_s: float


@dataclass(frozen=True, slots=True)
class TracePrefix:
    name: str
    line: int
    tokens: int
    ids: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class TraceSession:
    line: int
    name: str
    prefix: str | None
    group: str | None
    turns: tuple[TraceTurn, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    path: str
    token_scale: int
    # Real (unscaled) tokens; None: not given.
    context_length: int | None
    name: str | None
    cost_model: str | None
    sessions_per_engine: int | None
    prefixes: Mapping[str, TracePrefix]
    sessions: tuple[TraceSession, ...]

    @property
    def max_group_size(self) -> int:
        sizes: dict[str, int] = {}
        for s in self.sessions:
            if s.group is not None:
                sizes[s.group] = sizes.get(s.group, 0) + 1
        return max(sizes.values(), default=1)

    @property
    def has_ids(self) -> bool:
        """Whether any prefix or turn gives explicit token ids (which fix the scale)."""
        return any(p.ids is not None for p in self.prefixes.values()) or any(
            t.input_ids is not None for s in self.sessions for t in s.turns
        )

    def check_scale(self, token_scale: int) -> None:
        """Explicit ids cannot be rescaled: refuse a run at another token scale."""
        if token_scale == self.token_scale:
            return
        fix = (
            f"run at --token-scale {self.token_scale} (or leave --token-scale out: a trace "
            f"with ids runs at its own scale by default)"
        )
        for p in self.prefixes.values():
            if p.ids is not None:
                raise trace_error(
                    self.path,
                    p.line,
                    "ids",
                    f"explicit ids cannot be rescaled from the trace's token_scale "
                    f"{self.token_scale} to {token_scale}; give a count ('tokens') or {fix}",
                )
        for s in self.sessions:
            for i, t in enumerate(s.turns):
                if t.input_ids is not None:
                    raise trace_error(
                        self.path,
                        s.line,
                        f"turns[{i}].input_ids",
                        f"explicit ids cannot be rescaled from the trace's token_scale "
                        f"{self.token_scale} to {token_scale}; give a count ('input') or {fix}",
                    )


# ---------------------------------------------------------------------- parameters

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
    # Mean new input (tool output) by turn index, "T:MEAN,T:MEAN,..." in real tokens: from
    # turn T on, the tool output appended before the turn is lognormal with this mean and
    # tool_output's sigma and bounds (claude-code: the trace's mean prompt by turn index).
    # Empty: tool_output for every turn.
    tool_output_schedule: str = ""
    # Context compaction (claude-code): when a turn's prompt plus output would pass this
    # many tokens, the conversation restarts from a fresh prompt drawn as the first one
    # (a prefix the engine has never seen), as an agent that compacts its history. 0: off.
    compact_at: int = field(default=0, metadata=_TOKENS)
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
            ("compact_at", self.compact_at >= 0),
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
        parse_schedule(self.tool_output_schedule)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "trace":
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, Dist) else value
        return out


def parse_schedule(text: str) -> tuple[tuple[int, float], ...]:
    """``"1:7649,5:68"`` -> ((1, 7649.0), (5, 68.0)): turn indices (>= 1, increasing) and
    mean tokens (>= 0); raises :class:`WorkloadError` naming what is wrong."""
    if not text.strip():
        return ()
    out: list[tuple[int, float]] = []
    for part in text.split(","):
        turn, sep, mean = part.strip().partition(":")
        try:
            t, m = int(turn), float(mean)
        except ValueError:
            t, m = -1, -1.0
        if not sep or t < 1 or not m >= 0 or math.isinf(m) or (out and t <= out[-1][0]):
            raise WorkloadError(
                f"tool_output_schedule: want TURN:MEAN,... with turns >= 1 increasing and "
                f"means >= 0 (got {text!r})"
            )
        out.append((t, m))
    return tuple(out)


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """One request of a session.

    ``new_input_ids``: tokens appended after the previous turn's output (its tool
    output; the first turn's are the whole first prompt). ``tool_latency_s``: the pause
    after this turn's response. ``subagents``: spawned after this turn; the session
    waits for all of them and their summaries are the next turn's new input.
    """

    new_input_ids: list[int]
    max_new_tokens: int
    tool_latency_s: float
    subagents: tuple[SessionPlan, ...] = ()
    # True: the conversation restarts here (compaction): the request is
    # ``new_input_ids`` alone, not the history plus them.
    reset: bool = False


@dataclass(frozen=True, slots=True)
class SessionPlan:
    session_id: str
    turns: tuple[TurnPlan, ...]
    group: str | None = None
    role: str = "main"  # main | subagent
    parent: str | None = None
    # True: the plan stopped early because the next turn would pass the context length.
    exit_context: bool = False
    # Turns drawn before the context limit cut them.
    turns_drawn: int = 0

    @property
    def planned_context(self) -> int:
        """KV tokens at the end of the session if every turn returns its full output."""
        return sum(len(t.new_input_ids) + t.max_new_tokens for t in self.turns)


# ------------------------------------------------------------------------- records


@dataclass(slots=True)
class TurnOutcome:
    """What one request returned. ``output_ids`` continue the conversation."""

    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    latency_s: float
    ok: bool = True
    error: str | None = None
    finish_reason: str | None = None
    # kvproxy's X-KVProxy-Admission-Wait-Ms response header, where present.
    admission_wait_ms: float | None = None


def context_after_turn(prompt_tokens: int, completion_tokens: int) -> int:
    """Tokens whose KV exists after a turn: the prompt plus every generated token but
    the last (the last sampled token is never fed back, so it has no KV)."""
    return prompt_tokens + max(0, completion_tokens - 1)


def recomputed_tokens(previous_context_len: int, cached_tokens: int) -> int:
    """Prompt tokens an earlier turn of the session already prefilled but that the
    engine did not serve from cache this turn."""
    return max(0, previous_context_len - cached_tokens)


@dataclass(slots=True)
class TurnRecord:
    session_id: str
    turn: int
    role: str = "main"
    group: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # KV context the session's previous turn left (see context_after_turn); 0 on turn 0.
    previous_context_len: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    ok: bool = False
    error: str | None = None
    finish_reason: str | None = None
    admission_wait_ms: float | None = None

    @property
    def first(self) -> bool:
        """The session's first request (nothing of it can be cached but shared prefixes)."""
        return self.turn == 0

    @property
    def continuing(self) -> bool:
        return self.turn > 0

    @property
    def recomputed_tokens(self) -> int:
        return recomputed_tokens(self.previous_context_len, self.cached_tokens) if self.ok else 0

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens) if self.ok else 0


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    role: str
    group: str | None
    parent: str | None
    turns_planned: int
    start_s: float = 0.0
    end_s: float | None = None
    turns_done: int = 0
    ok: bool = False
    # done | context (ended on the context length) | error | cancelled
    exit: str = "running"
    error: str | None = None

    @property
    def duration_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s


@dataclass(slots=True)
class WorkloadResult:
    """Every request and session of one run; times are loop time relative to the start."""

    spec: WorkloadSpec
    seed: int
    sessions_requested: int
    concurrency: int
    time_scale: float
    turns: list[TurnRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    makespan_s: float = 0.0
    # True: the run hit its deadline and the sessions still running were cancelled.
    timed_out: bool = False

    @property
    def main_sessions(self) -> list[SessionRecord]:
        return [s for s in self.sessions if s.role != "subagent"]
