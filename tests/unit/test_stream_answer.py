"""A streamed answer accumulated for the speculative prefill (kvproxy.dynamo.prefill)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.dynamo.prefill import R_TOO_BIG, R_UNREADABLE, StreamAnswer, prefill_body

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


def _sse(*events: object, done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _chat(delta: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta}]}


def _tool(index: int, **fields: Any) -> dict[str, Any]:
    return _chat({"tool_calls": [{"index": index, **fields}]})


def _gen(text: str, ids: list[int], n: int | None = None) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "meta_info": {"completion_tokens": n or len(ids)}}


USAGE = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 3}}

CASES: list[tuple[str, str, bytes, Any]] = [
    (
        "chat text",
        CHAT,
        _sse(
            _chat({"role": "assistant", "content": ""}),
            _chat({"content": "Hel"}),
            _chat({"content": "lo"}),
            USAGE,
        ),
        {"choices": [{"message": {"role": "assistant", "content": "Hello"}}]},
    ),
    (
        "chat tool calls merged by index",
        CHAT,
        _sse(
            _chat({"content": "Let me look."}),
            _tool(0, id="call_a", type="function", function={"name": "read", "arguments": ""}),
            _tool(0, function={"arguments": '{"path": '}),
            _tool(0, function={"name": None, "arguments": '"a.py"}'}),
            _tool(1, id="call_b", function={"name": "ls", "arguments": "{}"}),
        ),
        {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": "Let me look.",
                        "tool_calls": [
                            {
                                "id": "call_a",
                                "type": "function",
                                "function": {"name": "read", "arguments": '{"path": "a.py"}'},
                            },
                            {
                                "id": "call_b",
                                "type": "function",
                                "function": {"name": "ls", "arguments": "{}"},
                            },
                        ],
                    }
                }
            ]
        },
    ),
    (
        "completions text",
        COMPLETIONS,
        _sse({"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]}),
        {"choices": [{"text": "ab"}]},
    ),
    (
        "generate cumulative (SGLang's default)",
        GENERATE,
        _sse(_gen("a", [7]), _gen("ab", [7, 8]), _gen("abc", [7, 8, 9])),
        {"text": "abc", "output_ids": [7, 8, 9]},
    ),
    (
        "generate incremental",
        GENERATE,
        _sse(_gen("a", [7], 1), _gen("b", [8], 2), _gen("c", [9], 3)),
        {"text": "abc", "output_ids": [7, 8, 9]},
    ),
    (
        "generate incremental, a repeated delta",
        GENERATE,
        _sse(_gen("\n", [5], 1), _gen("x\n", [6], 2), _gen("\n", [5], 3)),
        {"text": "\nx\n\n", "output_ids": [5, 6, 5]},
    ),
    (
        "no [DONE]: the stream's end",
        CHAT,
        _sse(_chat({"content": "ok"}), done=False),
        {"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
    ),
    (
        "an error event",
        CHAT,
        _sse(_chat({"content": "a"}), {"error": {"message": "boom"}}),
        R_UNREADABLE,
    ),
    ("n > 1", CHAT, _sse(_chat({"content": "a"}), _chat({"content": "b"}, index=1)), R_UNREADABLE),
    ("not JSON", CHAT, b"data: {nope\n\n", R_UNREADABLE),
    ("a JSON array", GENERATE, b"data: [1, 2]\n\n", R_UNREADABLE),
    ("a bad tool-call index", CHAT, _sse(_tool("x", function={"name": "f"})), R_UNREADABLE),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(
    ("path", "stream", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("split", [None, 1, 7])
def test_stream_answer(path: str, stream: bytes, want: Any, split: int | None) -> None:
    answer = StreamAnswer(path)
    step = split or len(stream)
    for i in range(0, len(stream), step):  # the same answer however the bytes arrive
        answer.feed(stream[i : i + step])
    doc, reason = answer.document()
    if isinstance(want, str):
        assert (doc, reason) == (None, want)
    else:
        assert (doc, reason) == (want, None)


@pytest.mark.parametrize(
    ("path", "stream"),
    [
        (CHAT, _sse(*[_chat({"content": "x" * 10}) for _ in range(11)])),
        (GENERATE, _sse(*[_gen("", list(range(i))) for i in range(1, 120)])),
        (CHAT, _sse(_tool(0, function={"name": "f", "arguments": "y" * 101}))),
        (CHAT, b"data: " + b"z" * 200),  # one unfinished line past the bound
    ],
)
def test_an_answer_past_the_bound_is_too_big(path: str, stream: bytes) -> None:
    answer = StreamAnswer(path, limit=100)
    answer.feed(stream)
    answer.feed(_sse(_chat({"content": "more"})))  # nothing more is kept
    assert answer.document() == (None, R_TOO_BIG)
    assert answer.body() == (None, R_TOO_BIG)


def test_too_many_tool_calls_are_unreadable() -> None:
    answer = StreamAnswer(CHAT)
    answer.feed(_sse(*[_tool(i, function={"name": "f"}) for i in range(200)]))
    assert answer.document() == (None, R_UNREADABLE)


def test_a_last_event_without_its_blank_line_counts() -> None:
    answer = StreamAnswer(COMPLETIONS)
    answer.feed(b'data: {"choices": [{"index": 0, "text": "end"}]}')
    assert answer.document() == ({"choices": [{"text": "end"}]}, None)


@pytest.mark.parametrize(
    ("path", "body", "stream", "field", "value"),
    [
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "stream": True},
            _sse(_chat({"content": "yo"})),
            "messages",
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        ),
        (
            GENERATE,
            {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 9}},
            _sse(_gen("ab", [7, 8])),
            "input_ids",
            [1, 2, 7, 8],
        ),
        (GENERATE, {"text": "Q: ", "stream": True}, _sse(_gen("A", [3])), "text", "Q: A"),
    ],
)
def test_a_streamed_answer_makes_the_buffered_answers_prefill(
    path: str, body: dict[str, Any], stream: bytes, field: str, value: Any
) -> None:
    answer = StreamAnswer(path)
    answer.feed(stream)
    data, reason = answer.body()
    assert reason is None and data is not None
    pbody = prefill_body(path, body, orjson.loads(data), session_id="s", rid="r")
    assert pbody is not None and pbody[field] == value and "stream" not in pbody


def test_on_done_is_called_once_at_done_before_the_streams_end() -> None:
    seen: list[Any] = []
    answer = StreamAnswer(CHAT, on_done=lambda a: seen.append(a.document()))
    answer.feed(_sse(_chat({"content": "hi"}), done=False))
    assert seen == []
    answer.feed(b"data: [DONE]\n\n")
    assert seen == [({"choices": [{"message": {"role": "assistant", "content": "hi"}}]}, None)]
    answer.feed(_sse(_chat({"content": "late"})))  # nothing after [DONE] counts
    answer.finish()  # the upstream's end, later: not called again
    assert len(seen) == 1


def test_on_done_at_the_streams_end_without_done() -> None:
    seen: list[Any] = []
    answer = StreamAnswer(GENERATE, on_done=lambda a: seen.append(a.document()))
    answer.feed(b'data: {"text": "x", "output_ids": [4], "meta_info": {"completion_tokens": 1}}')
    answer.finish()
    answer.finish()
    assert seen == [({"text": "x", "output_ids": [4]}, None)]


def test_on_done_reports_a_skip_too() -> None:
    seen: list[Any] = []
    answer = StreamAnswer(CHAT, limit=4, on_done=lambda a: seen.append(a.document()))
    answer.feed(_sse(_chat({"content": "too long"})))
    assert seen == [(None, R_TOO_BIG)]
    answer.feed(b"data: [DONE]\n\n")
    answer.finish()
    assert len(seen) == 1


def test_after_a_skip_the_done_still_ends_the_answer() -> None:
    seen: list[Any] = []
    answer = StreamAnswer(CHAT, on_done=lambda a: seen.append(a.document()))
    answer.feed(_sse({"error": "x"}, done=False))
    assert seen == []
    answer.feed(b"data: [DONE]\n\n")
    assert seen == [(None, R_UNREADABLE)]
