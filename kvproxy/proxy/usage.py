"""What an engine's response tells the ledger: prompt, cached and completion tokens.

Pure: no I/O. Nothing is parsed chunk by chunk:

* a buffered body (:func:`usage_from_body`; one over :data:`PARSE_BYTES` is read by a
  reverse key search over the whole body instead): SGLang ``/generate`` puts them in
  ``meta_info`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``); the OpenAI
  endpoints in ``usage`` (``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``). A JSON list is an ``n > 1`` answer (one
  object per sequence; the router rejects batched ``/generate``, sglang-wire.md §9.3):
  the sequences share one prompt, so prompt and cached tokens are the largest reported
  and completion tokens their sum.
* a stream (:func:`usage_from_stream_tail`): the last complete ``data:`` events of the
  SSE tail kept by a :class:`TailWindow`. SGLang's chunks carry cumulative
  ``meta_info``, so the last chunk of each sequence (``index``) has its totals; an
  OpenAI stream has ``usage`` in its final chunk when the client asked for it
  (``stream_options.include_usage``), ``usage: null`` or none before.
* a JSON body relayed in chunks (chunked, or over the proxy's buffered-response limit;
  :class:`StreamedBodyUsage`): kept and read as a buffered one while small, else each
  chunk searched for the keys as it passes (the last number of each wins), since the
  counts may be anywhere in it (SGLang's come before the logprob lists).

Only the events that can carry the answer are parsed (at most ``max_events`` from the
end, each at most :data:`MAX_EVENT_BYTES`); a final chunk too big or cut by the window
is read with a key search over its last bytes (``"prompt_tokens": N`` in valid JSON is
always a key: a quote inside a string is escaped), taking the last occurrence.
"""

from __future__ import annotations

import re
from itertools import islice
from typing import Any, Final

import orjson

from kvproxy.record import Record

# Events larger than this are not parsed; their last bytes are searched instead.
MAX_EVENT_BYTES = 256 * 1024
# How many bytes of a big event (or body) the key search looks at.
SEARCH_BYTES = 4096
# Per stream: at most twice this plus one chunk is held (2,000 open streams: ~32 MB).
DEFAULT_TAIL_BYTES = 8 * 1024

_DONE = b"[DONE]"
_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")
# The number must be followed by something: one cut off at the data's end is not taken
# (a complete JSON number is always followed by ``,``, ``}`` or whitespace).
_KEY_RES = {key: re.compile(rb'"' + key.encode() + rb'"\s*:\s*(\d+)(?=\D)') for key in _KEYS}
_NEEDLES = {key: b'"' + key.encode() + b'"' for key in _KEYS}
# What the streamed-body search looks for: the keys' common suffix, then which key.
_KEY_SUFFIX = b'_tokens"'
_KEY_NAMES = tuple((key, b'"' + key.removesuffix("_tokens").encode()) for key in _KEYS)
# Bytes of a chunk searched again with the next one: a key, its colon and its number.
_CARRY_BYTES = 128
# A buffered JSON object larger than this is read by a key search from its end, not
# parsed: a response with logprobs is mostly number lists (105 KB for 4,000 output
# tokens of /generate with return_logprob: a parse costs about 0.9 ms here, the search
# 40-70 µs) and its counts may sit far from the end, before those lists.
PARSE_BYTES = 4 * 1024
# Occurrences of a key looked at from the end before giving up on it.
_RSEARCH_TRIES = 8


class Usage(Record):
    __slots__ = ("cached_tokens", "completion_tokens", "prompt_tokens", "sequences", "source")

    def __init__(
        self,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        sequences: int = 1,
        source: str = "meta_info",
    ) -> None:
        self.prompt_tokens: Final = prompt_tokens
        self.completion_tokens: Final = completion_tokens
        self.cached_tokens: Final = cached_tokens
        # Sequences the numbers cover (n > 1 answers report one object per sequence).
        self.sequences: Final = sequences
        self.source: Final = source  # meta_info | usage | search


def _int(value: Any) -> int | None:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _from_object(doc: Any) -> Usage | None:
    """Usage of one response object (or stream chunk), None when it carries none."""
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            cached = usage.get("cached_tokens")  # some servers put it at the top
        found = Usage(
            _int(usage.get("prompt_tokens")),
            _int(usage.get("completion_tokens")),
            _int(cached),
            source="usage",
        )
        if found.prompt_tokens is not None or found.completion_tokens is not None:
            return found
    meta = doc.get("meta_info")
    if isinstance(meta, dict):
        found = Usage(
            _int(meta.get("prompt_tokens")),
            _int(meta.get("completion_tokens")),
            _int(meta.get("cached_tokens")),
        )
        if found.prompt_tokens is not None or found.completion_tokens is not None:
            return found
    return None


def _max(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _combine(parts: list[Usage]) -> Usage:
    """Sequences of one request: shared prompt (largest), summed completions."""
    if len(parts) == 1:
        return parts[0]
    completions = [p.completion_tokens for p in parts if p.completion_tokens is not None]
    return Usage(
        _max([p.prompt_tokens for p in parts]),
        sum(completions) if completions else None,
        _max([p.cached_tokens for p in parts]),
        sequences=len(parts),
        source=parts[0].source,
    )


def _last_number(data: bytes, key: str) -> int | None:
    needle, regex, end = _NEEDLES[key], _KEY_RES[key], len(data)
    for _ in range(_RSEARCH_TRIES):
        pos = data.rfind(needle, 0, end)
        if pos < 0:
            return None
        found = regex.match(data, pos)
        if found is not None:
            return int(found.group(1))
        end = pos  # "prompt_tokens": null, say: an earlier one
    return None


def search_body(data: bytes) -> Usage | None:
    """The last ``"prompt_tokens"`` / ``"completion_tokens"`` / ``"cached_tokens"``
    numbers anywhere in ``data``, each found by a reverse ``bytes.rfind`` (no parse)."""
    prompt = _last_number(data, "prompt_tokens")
    completion = _last_number(data, "completion_tokens")
    if prompt is None and completion is None:
        return None
    return Usage(prompt, completion, _last_number(data, "cached_tokens"), source="search")


def search_usage(data: bytes) -> Usage | None:
    """:func:`search_body` over the last :data:`SEARCH_BYTES` of ``data`` (a stream's
    tail, or an event cut by its window)."""
    return search_body(data[-SEARCH_BYTES:])


def usage_from_body(data: bytes) -> Usage | None:
    """Usage reported in a buffered (non-streaming) JSON response body.

    Parsed up to :data:`PARSE_BYTES` (and a list, ``n > 1``, up to
    :data:`MAX_EVENT_BYTES`); a bigger body is read by :func:`search_body`, the last
    occurrence of each key anywhere in it (for a list: the last sequence's)."""
    if not data:
        return None
    if len(data) > PARSE_BYTES and (
        len(data) > MAX_EVENT_BYTES or data[:64].lstrip(b" \t\r\n")[:1] == b"{"
    ):
        return search_body(data)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return search_usage(data)
    if isinstance(doc, list):
        parts = [u for u in (_from_object(item) for item in doc) if u is not None]
        return _combine(parts) if parts else None
    return _from_object(doc)


def _events_from_end(tail: bytes, complete_start: bool) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of ``tail``'s complete events, last first, and the first
    event's bytes when the window may have cut it (unless ``complete_start``).

    Events are separated by a blank line (``\\n\\n``; ``\\r\\n\\r\\n`` is normalised).
    """
    if b"\r" in tail:
        tail = tail.replace(b"\r\n", b"\n")
    events = tail.split(b"\n\n")
    cut = b""
    if not complete_start and events:
        cut = events[0]
        events = events[1:]
    out: list[bytes] = []
    for event in reversed(events):
        payload: list[bytes] = []
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payload.append(line[5:].lstrip(b" "))
        if payload:
            out.append(b"\n".join(payload))
    return out, cut


def _parse_event(payload: bytes) -> tuple[Any, bool]:
    """``(doc, True)``: the event's JSON; ``(None, False)``: too big to parse, or not JSON
    (cut by the window, say), so only a key search can read it."""
    if len(payload) > MAX_EVENT_BYTES:
        return None, False
    try:
        return orjson.loads(payload), True
    except orjson.JSONDecodeError:
        return None, False


def _note_sequence(per_index: dict[int, Usage], doc: dict[str, Any], found: Usage) -> bool:
    """Keep ``found`` as its sequence's totals unless a later chunk of that sequence was
    read already (cumulative counts: the later one is newer). False: stop reading (an
    ``n == 1`` stream, whose last chunk is enough)."""
    index = doc.get("index")
    key = index if type(index) is int else 0
    if key not in per_index:
        per_index[key] = found
    return index is not None


def usage_from_stream_tail(
    tail: bytes, *, complete_start: bool = False, max_events: int = 16
) -> Usage | None:
    """Usage from the tail of an SSE stream (SGLang ``/generate`` or OpenAI chunks).

    ``complete_start``: ``tail`` begins at an event boundary (the whole stream fit in
    the window). Parses at most ``max_events`` events from the end.
    """
    per_index: dict[int, Usage] = {}
    events, cut = _events_from_end(tail, complete_start)
    for payload in islice((p for p in events if p != _DONE), max_events):
        doc, parsed = _parse_event(payload)
        if not parsed:
            if not per_index and (searched := search_usage(payload)) is not None:
                return searched
            continue
        found = _from_object(doc)
        if found is None:
            continue
        if found.source == "usage":
            return found  # OpenAI usage covers every choice of the request
        if not _note_sequence(per_index, doc, found):
            break
    if not per_index:
        # The one event that carries it may be the one the window cut.
        return search_usage(cut) if cut else None
    return _combine([per_index[k] for k in sorted(per_index)])


class StreamedBodyUsage:
    """Usage of a JSON body relayed in chunks (chunked, or over the buffered-response
    limit), read as it passes, never kept whole.

    While the body is at most :data:`DEFAULT_TAIL_BYTES` it is kept and read as a
    buffered one (:func:`usage_from_body`). Past that, each chunk is searched for the
    count keys (one ``bytes.find`` of their common ``_tokens"`` suffix, about 1 ms per
    MB here) and the last number of each key is kept: the same answer as
    :func:`search_body` over the whole body, wherever in it the counts are (SGLang puts
    them at the start of ``meta_info``, before any logprob lists). The last
    :data:`_CARRY_BYTES` of each chunk are searched again with the next, so a key split
    between two chunks is found; a number cut by the chunk's end is not taken until
    the next chunk completes it.
    """

    __slots__ = ("_carry", "_found", "_head", "_size")

    def __init__(self) -> None:
        self._head: list[bytes] | None = []  # the body while it is small, then None
        self._size = 0
        self._carry = b""
        self._found: dict[str, int] = {}

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._size += len(chunk)
        if self._head is not None:
            self._head.append(chunk)
            if self._size <= DEFAULT_TAIL_BYTES:
                return
            chunk, self._head = b"".join(self._head), None
        data = self._carry + chunk if self._carry else chunk
        found = self._found
        pos = data.find(_KEY_SUFFIX)
        while pos >= 0:
            for key, name in _KEY_NAMES:
                start = pos - len(name)
                if start >= 0 and data.startswith(name, start):
                    number = _KEY_RES[key].match(data, start)
                    if number is not None:
                        found[key] = int(number.group(1))
                    break
            pos = data.find(_KEY_SUFFIX, pos + 1)
        self._carry = data[-_CARRY_BYTES:]

    def usage(self) -> Usage | None:
        if self._head is not None:
            return usage_from_body(b"".join(self._head))
        found = self._found
        prompt, completion = found.get("prompt_tokens"), found.get("completion_tokens")
        if prompt is None and completion is None:
            return None
        return Usage(prompt, completion, found.get("cached_tokens"), source="search")


class TailWindow:
    """The last ``limit`` bytes of a stream, kept without copying on every chunk.

    ``feed`` is O(1) amortised: chunks are kept in a list and trimmed once they hold
    more than twice the limit.
    """

    __slots__ = ("_chunks", "_size", "limit", "total")

    def __init__(self, limit: int = DEFAULT_TAIL_BYTES) -> None:
        if limit <= 0:
            raise ValueError("limit must be > 0")
        self.limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self.total = 0  # bytes fed in all

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._chunks.append(chunk)
        self._size += len(chunk)
        self.total += len(chunk)
        if self._size > 2 * self.limit and len(self._chunks) > 1:
            joined = b"".join(self._chunks)[-self.limit :]
            self._chunks = [joined]
            self._size = len(joined)

    @property
    def complete(self) -> bool:
        """Whether the window still holds the stream from its first byte."""
        return self.total <= self.limit

    def value(self) -> bytes:
        data = b"".join(self._chunks)
        return data[-self.limit :]

    def usage(self) -> Usage | None:
        return usage_from_stream_tail(self.value(), complete_start=self.complete)


__all__ = [
    "StreamedBodyUsage",
    "TailWindow",
    "Usage",
    "search_body",
    "search_usage",
    "usage_from_body",
    "usage_from_stream_tail",
]
