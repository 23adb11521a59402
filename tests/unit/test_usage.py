"""Reading prompt / cached / completion tokens from the end of a response."""

from __future__ import annotations

import random

import orjson
import pytest

from kvproxy.proxy.usage import (
    MAX_EVENT_BYTES,
    PARSE_BYTES,
    StreamedBodyUsage,
    TailWindow,
    Usage,
    _from_object,
    search_body,
    search_usage,
    usage_from_body,
    usage_from_stream_tail,
)


def _meta(prompt: int, completion: int, cached: int, **extra: object) -> dict[str, object]:
    return {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        **extra,
    }


def _sse(*docs: object, done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(d) + b"\n\n" for d in docs)
    return out + (b"data: [DONE]\n\n" if done else b"")


GENERATE = {"text": " 4.", "output_ids": [576, 4226], "meta_info": _meta(4, 6, 3)}
CHAT = {
    "id": "r",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 64},
    },
}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (orjson.dumps(GENERATE), Usage(4, 6, 3)),
        (orjson.dumps(CHAT), Usage(100, 7, 64, source="usage")),
        # usage without details (cached unknown)
        (
            orjson.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 1}}),
            Usage(5, 1, None, source="usage"),
        ),
        # n > 1 on /generate: one object per sequence, shared prompt
        (
            orjson.dumps([{"meta_info": _meta(10, 3, 0)}, {"meta_info": _meta(10, 5, 10)}]),
            Usage(10, 8, 10, sequences=2),
        ),
        # the usage object wins over meta_info when both are there
        (orjson.dumps({**CHAT, "meta_info": _meta(1, 1, 1)}), Usage(100, 7, 64, source="usage")),
        # nothing to read
        (orjson.dumps({"text": "x"}), None),
        (orjson.dumps({"usage": None, "meta_info": {"id": "r"}}), None),
        (orjson.dumps([]), None),
        (b"", None),
        # an error body
        (orjson.dumps({"error": {"message": "bad", "code": 400}}), None),
        # not JSON (cut off): the key search reads what is there, except a number the
        # cut may have shortened (the last one, cached_tokens 3, ends the data)
        (orjson.dumps(GENERATE)[:-2], Usage(4, 6, None, source="search")),
        (orjson.dumps(GENERATE)[:-1], Usage(4, 6, 3, source="search")),
        # negative or non-integral numbers are not token counts
        (
            orjson.dumps({"meta_info": {"prompt_tokens": -1, "completion_tokens": 2.5}}),
            None,
        ),
        (orjson.dumps({"meta_info": {"prompt_tokens": 3.0}}), Usage(3, None, None)),
    ],
)
def test_usage_from_body(data: bytes, expected: Usage | None) -> None:
    assert usage_from_body(data) == expected


def test_usage_from_big_body_reads_the_end_only() -> None:
    doc = {"text": "x" * (MAX_EVENT_BYTES + 10), "meta_info": _meta(9, 8, 7)}
    assert usage_from_body(orjson.dumps(doc)) == Usage(9, 8, 7, source="search")


def _chunk(i: int, *, final: bool = False, index: int | None = None) -> dict[str, object]:
    meta = _meta(40, i + 1, 32)
    meta["finish_reason"] = {"type": "length", "length": i + 1} if final else None
    doc: dict[str, object] = {"text": "t" * (i + 1), "output_ids": list(range(i + 1))}
    doc["meta_info"] = meta
    if index is not None:
        doc["index"] = index
    return doc


@pytest.mark.parametrize(
    ("tail", "complete", "expected"),
    [
        # SGLang /generate: cumulative meta_info, the last chunk has the totals
        (_sse(*(_chunk(i) for i in range(5)), _chunk(5, final=True)), True, Usage(40, 6, 32)),
        # without [DONE] (a stream cut after its last chunk)
        (_sse(_chunk(0), _chunk(1), done=False), True, Usage(40, 2, 32)),
        # n > 1: chunks carry "index"; the last chunk of each sequence counts
        (
            _sse(
                _chunk(0, index=0),
                _chunk(0, index=1),
                _chunk(1, index=0),
                _chunk(3, index=1, final=True),
                _chunk(2, index=0, final=True),
            ),
            True,
            Usage(40, 3 + 4, 32, sequences=2),
        ),
        # OpenAI stream with include_usage: a final chunk with empty choices
        (
            _sse(
                {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None},
                {"choices": [], "usage": CHAT["usage"]},
            ),
            True,
            Usage(100, 7, 64, source="usage"),
        ),
        # OpenAI stream without usage: nothing to report
        (
            _sse({"choices": [{"index": 0, "delta": {"content": "a"}}]}),
            True,
            None,
        ),
        # an error event then [DONE]: no usage
        (_sse({"error": {"message": "x", "code": 400}}), True, None),
        # CRLF framing and "data:" without a space
        (
            b"data:" + orjson.dumps(_chunk(2, final=True)) + b"\r\n\r\ndata: [DONE]\r\n\r\n",
            True,
            Usage(40, 3, 32),
        ),
        (b"", True, None),
        (b"data: [DONE]\n\n", True, None),
    ],
)
def test_usage_from_stream_tail(tail: bytes, complete: bool, expected: Usage | None) -> None:
    assert usage_from_stream_tail(tail, complete_start=complete) == expected


def test_stream_tail_skips_the_event_the_window_cut() -> None:
    full = _sse(_chunk(0), _chunk(1, final=True))
    cut = full[10:]  # starts inside the first event
    assert usage_from_stream_tail(cut) == Usage(40, 2, 32)
    # Only a cut first event: searched, not parsed (unless the window holds it whole).
    only = _sse(_chunk(4, final=True))
    assert usage_from_stream_tail(only[3:]) == Usage(40, 5, 32, source="search")
    assert usage_from_stream_tail(only, complete_start=True) == Usage(40, 5, 32)


def test_stream_tail_parses_only_the_last_events() -> None:
    # Junk (not JSON) early in the window is never parsed: only the last events are.
    tail = b"data: {not json\n\n" + _sse(_chunk(9, final=True))
    assert usage_from_stream_tail(tail, complete_start=True) == Usage(40, 10, 32)
    # max_events bounds the walk back over events without usage.
    events = _sse(_chunk(1), *({"choices": []} for _ in range(20)))
    assert usage_from_stream_tail(events, complete_start=True, max_events=5) is None
    assert usage_from_stream_tail(events, complete_start=True, max_events=30) == Usage(40, 2, 32)


def test_a_final_event_cut_by_the_window_falls_back_to_the_key_search() -> None:
    big = {"text": "y" * 5000, "meta_info": _meta(11, 12, 13)}
    tail = _sse(big)[-3000:]  # the window holds only the end of the one big event
    assert usage_from_stream_tail(tail) == Usage(11, 12, 13, source="search")


def test_search_usage_takes_the_last_number_and_real_keys_only() -> None:
    text = orjson.dumps(
        {
            "text": 'the model wrote "prompt_tokens": 999',
            "meta_info": _meta(5, 6, 7, cached_tokens_details={"device": 7, "host": 0}),
        }
    )
    assert search_usage(text) == Usage(5, 6, 7, source="search")
    assert search_usage(b'{"x": 1}') is None


def test_tail_window_keeps_the_last_bytes() -> None:
    w = TailWindow(limit=10)
    assert w.value() == b"" and w.complete
    w.feed(b"abc")
    w.feed(b"")
    assert w.value() == b"abc" and w.complete
    for i in range(100):
        w.feed(bytes([65 + i % 26]) * 3)
    assert len(w.value()) == 10
    assert w.value() == b"".join(bytes([65 + i % 26]) * 3 for i in range(96, 100))[-10:]
    assert not w.complete and w.total == 303
    assert w._size <= 2 * 10 + 3  # bounded however long the stream
    with pytest.raises(ValueError, match="limit"):
        TailWindow(0)


def test_tail_window_usage_of_a_relayed_stream() -> None:
    stream = _sse(*(_chunk(i) for i in range(50)), _chunk(50, final=True))
    w = TailWindow(limit=4096)
    for i in range(0, len(stream), 97):  # arbitrary chunk boundaries
        w.feed(stream[i : i + 97])
    assert not w.complete
    assert w.usage() == Usage(40, 51, 32)
    small = TailWindow(limit=1 << 20)
    small.feed(_sse(_chunk(0, final=True)))
    assert small.complete and small.usage() == Usage(40, 1, 32)


def _with_logprobs(tokens: int) -> bytes:
    """A /generate answer with return_logprob: the counts come before the long lists."""
    logprobs = [[-0.25, 1000 + i, None] for i in range(tokens)]
    meta = _meta(9000, tokens, 8000, output_token_logprobs=logprobs)
    return orjson.dumps(
        {"text": "tok " * tokens, "output_ids": list(range(tokens)), "meta_info": meta}
    )


@pytest.mark.parametrize("tokens", [2000, 4000, 16000])
def test_big_bodies_are_searched_from_the_end_and_read_the_counts(tokens: int) -> None:
    """Past PARSE_BYTES the body is not parsed; counts far from its end (before 16,000
    logprob triples: about 450 KB, past MAX_EVENT_BYTES) are still found."""
    data = _with_logprobs(tokens)
    assert len(data) > PARSE_BYTES
    assert usage_from_body(data) == Usage(9000, tokens, 8000, source="search")


def test_search_body_reads_what_the_parse_reads() -> None:
    """Between PARSE_BYTES and MAX_EVENT_BYTES the search gives the parse's numbers."""
    long_chat = {
        **CHAT,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * 40_000}}],
    }
    for doc in (long_chat, orjson.loads(_with_logprobs(3000)), {**GENERATE, "text": "z" * 50_000}):
        data = orjson.dumps(doc)
        assert PARSE_BYTES < len(data) <= MAX_EVENT_BYTES
        parsed = _from_object(doc)
        searched = search_body(data)
        assert parsed is not None and searched is not None
        assert (searched.prompt_tokens, searched.completion_tokens, searched.cached_tokens) == (
            parsed.prompt_tokens,
            parsed.completion_tokens,
            parsed.cached_tokens,
        )


def test_search_body_skips_keys_without_a_number_and_keys_inside_strings() -> None:
    text = 'he said "prompt_tokens": 99 ' * 1000  # escaped inside the JSON string
    doc = {"text": text, "meta_info": {**_meta(4, 6, 3), "extra": {"prompt_tokens": None}}}
    data = orjson.dumps(doc)
    assert len(data) > PARSE_BYTES
    assert usage_from_body(data) == Usage(4, 6, 3, source="search")
    assert search_body(b'{"x": "' + b"a" * 20_000 + b'"}') is None


def _streamed(data: bytes, sizes: list[int]) -> Usage | None:
    """``data`` fed to a StreamedBodyUsage in chunks of ``sizes`` (cycled)."""
    body = StreamedBodyUsage()
    pos, i = 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        body.feed(data[pos : pos + size])
        pos, i = pos + size, i + 1
    return body.usage()


@pytest.mark.parametrize("sizes", [[1], [7, 13], [4096], [65536], [1 << 22]])
def test_a_streamed_body_is_read_like_the_whole_body(sizes: list[int]) -> None:
    """Chunked the way a relay sees it (one byte at a time included: every key and number
    split across chunks), a streamed JSON body reports what the whole body reports: the
    counts before 16,000 logprob triples (about 450 KB), a small body parsed."""
    big = _with_logprobs(16000)
    if sizes != [1]:  # a byte at a time over 450 KB: the small bodies cover that split
        assert (
            _streamed(big, sizes) == search_body(big) == Usage(9000, 16000, 8000, source="search")
        )
    small = orjson.dumps([GENERATE, {**GENERATE, "meta_info": _meta(4, 9, 3)}])
    assert _streamed(small, sizes) == usage_from_body(small) == Usage(4, 15, 3, sequences=2)
    mid = orjson.dumps({**GENERATE, "text": "z" * 20_000})
    assert _streamed(mid, sizes) == search_body(mid) == Usage(4, 6, 3, source="search")


def test_a_streamed_body_takes_the_last_counts_and_real_keys_only() -> None:
    """As search_body: the last number of each key, none inside a string (its quotes are
    escaped), none without a number; a body without counts reports none."""
    rng = random.Random(3)
    text = 'he said "prompt_tokens": 99 ' * 1000
    doc = {
        "text": text,
        "meta_info": {**_meta(4, 6, 3), "extra": {"prompt_tokens": None}},
        "later": {"completion_tokens": 12},
    }
    data = orjson.dumps(doc)
    for _ in range(20):
        sizes = [rng.randrange(1, 300) for _ in range(5)]
        assert _streamed(data, sizes) == Usage(4, 12, 3, source="search") == search_body(data)
    assert _streamed(b'{"x": "' + b"a" * 20_000 + b'"}', [999]) is None
    assert StreamedBodyUsage().usage() is None


def test_a_number_cut_at_the_end_of_the_data_is_not_taken() -> None:
    """A count whose digits continue in the next chunk is read whole, not as its prefix."""
    head = b'{"text": "' + b"x" * 10_000 + b'", "meta_info": {"prompt_tokens": 12'
    body = StreamedBodyUsage()
    body.feed(head)
    assert body.usage() is None
    body.feed(b'345, "completion_tokens": 6}}')
    assert body.usage() == Usage(12345, 6, None, source="search")
