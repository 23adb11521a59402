"""--token-scale left out: a trace with explicit ids runs at its own scale (issue 38).

The trace is docs/workloads.md's own example, read from the docs so that the two cannot
drift apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest

from kvlab.workload.spec import resolve_token_scale
from kvlab.workload.trace import parse_trace, run_token_scale
from kvproxy.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "workloads.md"


def _doc_example() -> str:
    """The JSON block under docs/workloads.md's "Trace replay"."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Trace replay") :]
    match = re.search(r"```json\n(.*?)```", section, re.S)
    assert match is not None, "docs/workloads.md: no JSON example under 'Trace replay'"
    return match.group(1)


@pytest.fixture
def doc_trace(tmp_path: Path) -> Path:
    path = tmp_path / "doc.jsonl"
    path.write_text(_doc_example(), encoding="utf-8")
    return path


def _with_scale(text: str, scale: int) -> str:
    lines = text.splitlines()
    header = orjson.loads(lines[0])
    return "\n".join([orjson.dumps({**header, "token_scale": scale}).decode(), *lines[1:]])


def test_the_doc_example_has_explicit_ids_at_token_scale_1() -> None:
    trace = parse_trace(_doc_example(), "doc.jsonl")
    assert trace.token_scale == 1 and trace.has_ids


@pytest.mark.parametrize(
    ("header_scale", "ids", "given", "default", "scale", "noted"),
    [
        (1, True, None, 16, 1, True),  # ids: the trace's own scale, said so
        (4, True, None, 1, 4, True),
        (1, True, None, 1, 1, False),  # the default already fits: nothing to say
        (1, False, None, 16, 16, False),  # counts only: rescaled to the default
        (1, True, 1, 16, 1, False),  # given: used as it is
        (1, True, 16, 16, 16, False),  # given and conflicting: refused later (check_scale)
    ],
)
def test_run_token_scale(
    header_scale: int, ids: bool, given: int | None, default: int, scale: int, noted: bool
) -> None:
    prefix = '{"prefix": "p", "ids": [1, 2, 3]}' if ids else '{"prefix": "p", "tokens": 3}'
    text = "\n".join(
        [
            json.dumps({"kvproxy_trace": 1, "token_scale": header_scale}),
            prefix,
            '{"session": "s", "prefix": "p", "turns": [{"input": 4, "output": 2}]}',
        ]
    )
    got, note = run_token_scale(parse_trace(text, "t.jsonl"), given, default)
    assert got == scale
    assert (note is not None) == noted
    if note is not None:
        assert "\n" not in note and f"token_scale {header_scale}" in note


def test_a_preset_keeps_the_default_without_reading_anything() -> None:
    assert resolve_token_scale("swe", None, 16) == (16, None)
    assert resolve_token_scale("swe", 4, 16) == (4, None)


def test_lab_replays_the_doc_example_with_no_other_flag(
    doc_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lab", "--workload", f"trace:{doc_trace}"]) == 0
    captured = capsys.readouterr()
    assert "cache hit rate" in captured.out
    note = (
        f"kvproxy lab: {doc_trace} has explicit token ids: running at its token_scale 1 "
        "(not the default 16)"
    )
    assert captured.err.splitlines() == [note]  # one line
    out = tmp_path / "lab.json"
    assert main(["lab", "--workload", f"trace:{doc_trace}", "--json", str(out)]) == 0
    assert capsys.readouterr().err.splitlines() == [note]
    doc = json.loads(out.read_text())
    assert doc["token_scale"] == 1
    assert all(r["median"]["sessions"] == 2 for r in doc["policies"].values())


def test_lab_refuses_an_explicit_conflicting_token_scale(
    doc_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["lab", "--workload", f"trace:{doc_trace}", "--policy", "off"]
    assert main([*args, "--token-scale", "16"]) == 2
    err = capsys.readouterr().err
    assert "explicit ids cannot be rescaled from the trace's token_scale 1 to 16" in err
    assert "--token-scale 1" in err and "leave --token-scale out" in err
    assert main([*args, "--token-scale", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_lab_rescales_a_trace_of_counts_to_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "counts.jsonl"
    path.write_text(
        '{"kvproxy_trace": 1, "token_scale": 1}\n'
        '{"session": "s", "turns": [{"input": 640, "output": 64}]}\n'
    )
    out = tmp_path / "lab.json"
    assert main(["lab", "--workload", f"trace:{path}", "--policy", "off", "--json", str(out)]) == 0
    assert capsys.readouterr().err == ""
    assert json.loads(out.read_text())["token_scale"] == 16


def test_workload_driver_defaults_to_the_traces_scale(
    doc_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scaled = tmp_path / "k4.jsonl"
    scaled.write_text(_with_scale(_doc_example(), 4))
    assert main(["workload", "--workload", f"trace:{scaled}", "--list-params"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_scale"] == 4
    assert captured.err.splitlines()[0] == (
        f"kvproxy workload: {scaled} has explicit token ids: running at its token_scale 4 "
        "(not the default 1)"
    )
    args = ["workload", "--workload", f"trace:{scaled}", "--list-params", "--token-scale", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "from the trace's token_scale 4 to 1" in err and "--token-scale 4" in err
