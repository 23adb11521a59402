"""Trace replay: the JSONL format, its validation errors and the plans it yields."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from kvlab.workload import WorkloadError, session_plans, workload_spec
from kvlab.workload.trace import SAMPLE_TRACE, load_trace, parse_trace

HEADER = {"kvproxy_trace": 1, "token_scale": 1, "context_length": 4096}
SYS = {"prefix": "sys", "tokens": 32}
S1 = {
    "session": "a",
    "prefix": "sys",
    "turns": [
        {"input": 16, "output": 8, "tool_latency_s": 0.5},
        {"input": 40, "output": 4, "tool_latency_s": 1.5},
        {"input": 8, "output": 2},
    ],
}


def _text(*objs: object) -> str:
    return "\n".join(o if isinstance(o, str) else orjson.dumps(o).decode() for o in objs) + "\n"


def _write(tmp_path: Path, *objs: object) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text(_text(*objs))
    return str(path)


def test_sample_trace_is_packaged_and_valid() -> None:
    assert SAMPLE_TRACE.is_file()
    trace = load_trace("sample")
    assert len(trace.sessions) == 8 and set(trace.prefixes) == {"system", "grpo-task"}
    spec = workload_spec("trace:sample", 16)
    assert spec.name == "trace" and spec.context_length == 2560
    assert spec.group_size == 3 and spec.cost_model == "qwen3-8b-h100"
    plans = list(session_plans(spec, 0))
    assert len(plans) == 8
    grouped = [p for p in plans if p.group is not None]
    assert len(grouped) == 3 and len({p.group for p in grouped}) == 1


def test_a_trace_replays_its_turns_exactly_at_its_own_scale(tmp_path: Path) -> None:
    ids = {"session": "b", "turns": [{"input_ids": [5, 6, 7], "output": 3}]}
    spec = workload_spec("trace:" + _write(tmp_path, HEADER, SYS, S1, ids), 1)
    a, b = list(session_plans(spec, 9))
    assert spec.context_length == 4096
    assert [len(t.new_input_ids) for t in a.turns] == [32 + 16, 40, 8]
    assert [t.max_new_tokens for t in a.turns] == [8, 4, 2]
    # The pause after each turn; none after the last.
    assert [t.tool_latency_s for t in a.turns] == [0.5, 1.5, 0.0]
    assert b.turns[0].new_input_ids == [5, 6, 7]
    # Deterministic by seed; the prefix is shared by every session that names it.
    again = list(session_plans(spec, 9))
    assert again == [a, b]
    other = list(session_plans(spec, 10))
    assert other[0].turns[0].new_input_ids != a.turns[0].new_input_ids


def test_a_trace_is_rescaled_to_the_run_scale(tmp_path: Path) -> None:
    header = {**HEADER, "token_scale": 4}
    path = _write(tmp_path, header, SYS, S1)
    # Recorded at 4 (a 4096 x 4 context), run at 16: counts x 1/4, stochastic.
    spec = workload_spec("trace:" + path, 16)
    assert spec.context_length == 4096 * 4 // 16
    sizes = []
    for seed in range(200):
        (p,) = list(session_plans(spec, seed))
        sizes.append(len(p.turns[1].new_input_ids))
        assert len(p.turns[0].new_input_ids) == 8 + 4  # prefix 32/4 rounds; 16/4 exact
        assert p.turns[2].max_new_tokens == 1  # 2/4 = 0.5 -> at least 1
    assert set(sizes) == {10}
    assert sum(sizes) / len(sizes) == 10


def test_a_trace_stops_a_session_at_the_context_length(tmp_path: Path) -> None:
    long = {"session": "c", "turns": [{"input": 100, "output": 10}] * 10}
    spec = workload_spec("trace:" + _write(tmp_path, {**HEADER, "context_length": 350}, long), 1)
    (p,) = list(session_plans(spec, 0))
    assert len(p.turns) == 3 and p.exit_context and p.turns_drawn == 10


def test_group_members_come_together(tmp_path: Path) -> None:
    def s(name: str, group: str | None) -> dict:
        d: dict = {"session": name, "turns": [{"input": 4, "output": 1}]}
        if group:
            d["group"] = group
        return d

    path = _write(tmp_path, s("x1", "g"), s("y", None), s("x2", "g"), s("z", "h"))
    plans = list(session_plans(workload_spec("trace:" + path, 1), 0))
    assert [p.group is not None for p in plans] == [True, True, False, True]
    assert plans[0].group == plans[1].group != plans[3].group
    assert len(list(itertools.islice(session_plans(workload_spec("trace:" + path), 0), 10))) == 4


@pytest.mark.parametrize(
    ("lines", "where"),
    [
        (["{not json"], ":1: json: not valid JSON"),
        (["[1, 2]"], ":1: json: expected a JSON object"),
        ([S1], ":1: prefix: unknown prefix 'sys'"),
        ([SYS, {**S1, "turns": []}], ":2: turns: expected a non-empty list"),
        ([SYS, {**S1, "turns": [{"input": 3}]}], ":2: turns[0].output: missing"),
        ([SYS, {**S1, "turns": [{"output": 3}]}], ":2: turns[0].input: give exactly one"),
        (
            [SYS, {**S1, "turns": [{"input": 3, "input_ids": [1], "output": 1}]}],
            ":2: turns[0].input: give exactly one",
        ),
        ([SYS, {**S1, "turns": [{"input": -3, "output": 1}]}], ":2: turns[0].input: must be >= 0"),
        ([SYS, {**S1, "turns": [{"input": 3, "output": 0}]}], ":2: turns[0].output: must be >= 1"),
        (
            [SYS, {**S1, "turns": [{"input": 3, "output": 2, "tool_latency_s": -1}]}],
            ":2: turns[0].tool_latency_s: expected seconds >= 0",
        ),
        (
            [SYS, {**S1, "turns": [{"input": 3, "output": 2, "latency": 1}]}],
            ":2: latency: unknown field in a turn",
        ),
        ([SYS, {**S1, "turns": [{"input_ids": [1, "x"], "output": 2}]}], "input_ids[1]"),
        ([SYS, S1, S1], ":3: session: duplicate session 'a'"),
        ([SYS, SYS], ":2: prefix: prefix 'sys' is already declared on line 1"),
        ([{"prefix": "p"}], ":1: tokens: give exactly one"),
        ([SYS, HEADER], ":2: kvproxy_trace: the header must be the first line"),
        ([{**HEADER, "kvproxy_trace": 2}], ":1: kvproxy_trace: unsupported version 2"),
        ([{**HEADER, "token_scale": 0}], ":1: token_scale: must be >= 1"),
        ([{"hello": 1}], ":1: session: missing"),
        (
            [{"session": "n", "turns": [{"input": 0, "output": 1}]}],
            "turns[0].input: the first prompt is empty",
        ),
        ([HEADER], "the trace has no sessions"),
    ],
)
def test_parse_errors_name_the_line_and_the_field(lines: list[object], where: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_trace(_text(*lines), "t.jsonl")
    assert where in str(info.value)
    assert str(info.value).startswith("t.jsonl")


def test_explicit_ids_refuse_another_token_scale(tmp_path: Path) -> None:
    ids = {"session": "b", "turns": [{"input_ids": [5, 6, 7], "output": 3}]}
    path = _write(tmp_path, HEADER, ids)
    with pytest.raises(WorkloadError, match=r":2: turns\[0\].input_ids: explicit ids cannot"):
        workload_spec("trace:" + path, 16)
    assert workload_spec("trace:" + path, 1).trace is not None


def test_blank_lines_are_skipped_and_line_numbers_still_count(tmp_path: Path) -> None:
    text = _text(HEADER, "", SYS, "", {**S1, "turns": [{"input": 1}]})
    with pytest.raises(WorkloadError, match=r":5: turns\[0\].output"):
        parse_trace(text, "x")


def test_a_non_utf8_trace_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load_trace(path)
