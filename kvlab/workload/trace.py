"""Trace replay: recorded agent sessions in a JSONL file (format in docs/workloads.md).

One JSON object per line (blank lines are skipped):

* optional header, first line only: ``{"kvproxy_trace": 1, "token_scale": 1,
  "context_length": 40960, "name": ..., "cost_model": ..., "sessions_per_engine": ...}``;
* a shared prefix: ``{"prefix": "sys", "tokens": 1100}`` or ``{"prefix": "sys",
  "ids": [...]}``, declared before the sessions that use it;
* a session: ``{"session": "s1", "prefix": "sys", "group": "g1", "turns": [{"input":
  500, "output": 150, "tool_latency_s": 0.4}, ...]}``, each turn with ``input`` (a
  count) or ``input_ids`` (explicit ids), ``output`` (tokens, >= 1) and
  ``tool_latency_s`` (the pause after the turn's response, seconds, unscaled).

Token counts are in the trace's ``token_scale``; a run at scale K multiplies them by
``token_scale / K`` (stochastic rounding, outputs at least 1). Explicit ids cannot be
rescaled: a trace with ids runs only at its own scale, which is also the CLIs' default
for it (:func:`run_token_scale`). Parsing is pure apart from reading the file; every
error names the line and the field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from kvlab.workload.draw import stochastic_round, token_ids
from kvlab.workload.model import (
    SessionPlan,
    Trace,
    TracePrefix,
    TraceSession,
    TraceTurn,
    TurnPlan,
    WorkloadError,
    WorkloadSpec,
    trace_error,
)

TRACE_VERSION = 1
MAX_TRACE_SESSIONS = 1_000_000
MAX_TURNS_PER_SESSION = 100_000
MAX_PREFIXES = 10_000
SAMPLE_TRACE = Path(__file__).with_name("traces") / "sample.jsonl"

_HEADER_KEYS = {
    "kvproxy_trace",
    "token_scale",
    "context_length",
    "name",
    "cost_model",
    "sessions_per_engine",
}
_PREFIX_KEYS = {"prefix", "tokens", "ids"}
_SESSION_KEYS = {"session", "prefix", "group", "turns"}
_TURN_KEYS = {"input", "input_ids", "output", "tool_latency_s"}


def run_token_scale(trace: Trace, given: int | None, default: int) -> tuple[int, str | None]:
    """The token scale a run of ``trace`` uses, and a one-line note when the trace's
    explicit ids chose it.

    ``given`` is the scale asked for explicitly (``None``: not given), ``default`` the
    caller's default for presets. A trace with explicit ids runs at its own scale unless
    a scale is given (a conflicting one is refused later, by :meth:`Trace.check_scale`);
    a trace of counts only is rescaled to the default like a preset.
    """
    if given is not None:
        return given, None
    if not trace.has_ids or trace.token_scale == default:
        return default, None
    return trace.token_scale, (
        f"{trace.path} has explicit token ids: running at its token_scale "
        f"{trace.token_scale} (not the default {default})"
    )


def _int(path: str, line: int, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise trace_error(path, line, field, f"expected an integer (got {value!r})")
    if value < minimum:
        raise trace_error(path, line, field, f"must be >= {minimum} (got {value})")
    return value


def _ids(path: str, line: int, field: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise trace_error(
            path, line, field, f"expected a list of token ids (got {type(value).__name__})"
        )
    for j, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise trace_error(path, line, f"{field}[{j}]", f"expected a token id >= 0 (got {t!r})")
    return tuple(value)


def _str(path: str, line: int, field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise trace_error(path, line, field, f"expected a non-empty string (got {value!r})")
    return value


def _unknown(path: str, line: int, obj: Mapping[str, Any], allowed: set[str], what: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise trace_error(
            path, line, extra[0], f"unknown field in a {what} (allowed: {sorted(allowed)})"
        )


def _turn(path: str, line: int, i: int, obj: Any) -> TraceTurn:
    where = f"turns[{i}]"
    if not isinstance(obj, dict):
        raise trace_error(path, line, where, "expected an object")
    _unknown(path, line, obj, _TURN_KEYS, "turn")
    has_count, has_ids = "input" in obj, "input_ids" in obj
    if has_count == has_ids:
        raise trace_error(
            path, line, f"{where}.input", "give exactly one of 'input' (a count) or 'input_ids'"
        )
    ids = _ids(path, line, f"{where}.input_ids", obj["input_ids"]) if has_ids else None
    count = len(ids) if ids is not None else _int(path, line, f"{where}.input", obj["input"], 0)
    if "output" not in obj:
        raise trace_error(path, line, f"{where}.output", "missing (the turn's output length)")
    output = _int(path, line, f"{where}.output", obj["output"], 1)
    latency = obj.get("tool_latency_s", 0.0)
    if (
        isinstance(latency, bool)
        or not isinstance(latency, int | float)
        or not math.isfinite(latency)
        or latency < 0
    ):
        raise trace_error(
            path, line, f"{where}.tool_latency_s", f"expected seconds >= 0 (got {latency!r})"
        )
    return TraceTurn(count, ids, output, float(latency))


def _json_line(path: str, line_no: int, raw: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise trace_error(path, line_no, "json", f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise trace_error(path, line_no, "json", "expected a JSON object per line")
    return obj


def _header(path: str, line_no: int, obj: dict[str, Any]) -> dict[str, Any]:
    """The checked header line (the caller checks that it is the first)."""
    _unknown(path, line_no, obj, _HEADER_KEYS, "header")
    if obj["kvproxy_trace"] != TRACE_VERSION:
        raise trace_error(
            path,
            line_no,
            "kvproxy_trace",
            f"unsupported version {obj['kvproxy_trace']!r} (this reader knows {TRACE_VERSION})",
        )
    for key, minimum in (
        ("token_scale", 1),
        ("context_length", 2),
        ("sessions_per_engine", 1),
    ):
        if key in obj:
            _int(path, line_no, key, obj[key], minimum)
    for key in ("name", "cost_model"):
        if key in obj:
            _str(path, line_no, key, obj[key])
    return obj


def _prefix(
    path: str, line_no: int, obj: dict[str, Any], prefixes: Mapping[str, TracePrefix]
) -> TracePrefix:
    """A checked prefix line, new among ``prefixes`` (those declared before it)."""
    _unknown(path, line_no, obj, _PREFIX_KEYS, "prefix")
    name = _str(path, line_no, "prefix", obj["prefix"])
    if name in prefixes:
        raise trace_error(
            path,
            line_no,
            "prefix",
            f"prefix {name!r} is already declared on line {prefixes[name].line}",
        )
    if ("tokens" in obj) == ("ids" in obj):
        raise trace_error(
            path, line_no, "tokens", "give exactly one of 'tokens' (a count) or 'ids'"
        )
    ids = _ids(path, line_no, "ids", obj["ids"]) if "ids" in obj else None
    count = len(ids) if ids is not None else _int(path, line_no, "tokens", obj["tokens"], 1)
    if len(prefixes) >= MAX_PREFIXES:
        raise trace_error(path, line_no, "prefix", f"more than {MAX_PREFIXES} prefixes")
    return TracePrefix(name, line_no, count, ids)


def _optional_str(path: str, line_no: int, obj: Mapping[str, Any], field: str) -> str | None:
    value = obj.get(field)
    return None if value is None else _str(path, line_no, field, value)


def _session(
    path: str,
    line_no: int,
    obj: dict[str, Any],
    prefixes: Mapping[str, TracePrefix],
    names: set[str],
) -> TraceSession:
    """A checked session line; its name is new among ``names`` (sessions before it)."""
    _unknown(path, line_no, obj, _SESSION_KEYS, "session")
    name = _str(path, line_no, "session", obj["session"])
    if name in names:
        raise trace_error(path, line_no, "session", f"duplicate session {name!r}")
    prefix = _optional_str(path, line_no, obj, "prefix")
    if prefix is not None and prefix not in prefixes:
        raise trace_error(
            path,
            line_no,
            "prefix",
            f"unknown prefix {prefix!r} (declare it on an earlier line)",
        )
    group = _optional_str(path, line_no, obj, "group")
    turns_raw = obj.get("turns")
    if not isinstance(turns_raw, list) or not turns_raw:
        raise trace_error(path, line_no, "turns", "expected a non-empty list of turns")
    if len(turns_raw) > MAX_TURNS_PER_SESSION:
        raise trace_error(path, line_no, "turns", f"more than {MAX_TURNS_PER_SESSION} turns")
    turns = tuple(_turn(path, line_no, i, t) for i, t in enumerate(turns_raw))
    if prefix is None and turns[0].input_tokens == 0:
        raise trace_error(
            path, line_no, "turns[0].input", "the first prompt is empty (no prefix, no input)"
        )
    return TraceSession(line_no, name, prefix, group, turns)


def parse_trace(text: str, path: str = "<trace>") -> Trace:
    """Parse and validate a trace; raises :class:`WorkloadError` naming line and field."""
    header: dict[str, Any] = {}
    prefixes: dict[str, TracePrefix] = {}
    sessions: list[TraceSession] = []
    names: set[str] = set()
    seen_object = False
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        obj = _json_line(path, line_no, raw)
        if "kvproxy_trace" in obj:
            if seen_object:
                raise trace_error(
                    path, line_no, "kvproxy_trace", "the header must be the first line"
                )
            header = _header(path, line_no, obj)
        elif "prefix" in obj and "session" not in obj:
            p = _prefix(path, line_no, obj, prefixes)
            prefixes[p.name] = p
        elif "session" not in obj:
            raise trace_error(
                path, line_no, "session", "missing (a line is a header, a prefix or a session)"
            )
        else:
            session = _session(path, line_no, obj, prefixes, names)
            if len(sessions) >= MAX_TRACE_SESSIONS:
                raise trace_error(
                    path, line_no, "session", f"more than {MAX_TRACE_SESSIONS} sessions"
                )
            names.add(session.name)
            sessions.append(session)
        seen_object = True
    if not sessions:
        raise WorkloadError(f"{path}: the trace has no sessions")
    scale = int(header.get("token_scale", 1))
    ctx = header.get("context_length")
    return Trace(
        path=path,
        token_scale=scale,
        context_length=None if ctx is None else int(ctx) * scale,
        name=header.get("name"),
        cost_model=header.get("cost_model"),
        sessions_per_engine=header.get("sessions_per_engine"),
        prefixes=prefixes,
        sessions=tuple(sessions),
    )


def load_trace(path: str | Path) -> Trace:
    """Read and parse the trace at ``path`` (``sample`` names the packaged sample)."""
    p = SAMPLE_TRACE if str(path) == "sample" else Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text ({exc.reason})") from None
    return parse_trace(text, str(path))


# ------------------------------------------------------------------------ plans


def trace_plans(spec: WorkloadSpec, seed: int) -> Iterator[SessionPlan]:
    """The trace's sessions as plans, once each, members of a group together (in the
    order of the group's first session), counts rescaled to ``spec.token_scale``."""
    trace = spec.trace
    if trace is None:
        raise WorkloadError("not a trace workload")
    factor = trace.token_scale / spec.token_scale
    prefix_ids = _prefix_ids(trace, spec, seed, factor)
    for index in _grouped_order(trace.sessions):
        s = trace.sessions[index]
        rng = random.Random(f"{seed}:trace:{index}")
        first_prefix = prefix_ids[s.prefix] if s.prefix is not None else []
        turns, exit_context = _turn_plans(s, spec, rng, factor, first_prefix)
        yield SessionPlan(
            session_id=f"{spec.name}-{seed}-{index:05d}",
            turns=tuple(turns),
            group=None if s.group is None else f"{spec.name}-{seed}-{s.group}",
            exit_context=exit_context,
            turns_drawn=len(s.turns),
        )


def _prefix_ids(trace: Trace, spec: WorkloadSpec, seed: int, factor: float) -> dict[str, list[int]]:
    """Each declared prefix's token ids (given, or drawn at the rescaled count)."""
    prefix_ids: dict[str, list[int]] = {}
    for name, p in trace.prefixes.items():
        if p.ids is not None:
            prefix_ids[name] = list(p.ids)
        else:
            n = max(1, math.floor(p.tokens * factor + 0.5))
            prefix_ids[name] = token_ids(random.Random(f"{seed}:trace-prefix:{name}"), n, spec)
    return prefix_ids


def _grouped_order(sessions: Sequence[TraceSession]) -> list[int]:
    """Session indices in trace order, except that a group's members follow its first."""
    order: list[int] = []
    by_group: dict[str, list[int]] = {}
    for i, s in enumerate(sessions):
        if s.group is None:
            order.append(i)
        elif s.group in by_group:
            by_group[s.group].append(i)
        else:
            by_group[s.group] = [i]
            order.append(i)
    out: list[int] = []
    for first in order:
        g = sessions[first].group
        out.extend(by_group[g] if g is not None else [first])
    return out


def _turn_plans(
    s: TraceSession,
    spec: WorkloadSpec,
    rng: random.Random,
    factor: float,
    prefix: list[int],
) -> tuple[list[TurnPlan], bool]:
    """The session's turns until one would pass the context length (then True)."""
    turns: list[TurnPlan] = []
    context = 0
    last = len(s.turns) - 1
    for i, t in enumerate(s.turns):
        if t.input_ids is not None:
            new = list(t.input_ids)
        else:
            new = token_ids(rng, stochastic_round(t.input_tokens * factor, rng), spec)
        if i == 0 and prefix:
            new = [*prefix, *new]
        if i == 0 and not new:
            new = token_ids(rng, 1, spec)
        out = max(1, stochastic_round(t.output_tokens * factor, rng))
        if i and context + len(new) + out > spec.context_length:
            return turns, True
        turns.append(TurnPlan(new, out, 0.0 if i == last else t.tool_latency_s))
        context += len(new) + out
    return turns, False
