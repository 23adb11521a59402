"""The speculative-prefill request for ``agent_hints.speculative_prefill``. Pure.

After a turn's response, kvproxy sends the conversation *including the assistant's
answer as the engine returned it* with one output token, so the next turn's prefix
is already in the radix cache. The answer is text on the OpenAI paths (the chat
template renders the assistant message as it renders it in the next turn) and ids on
``/generate`` with ``input_ids``.

A buffered answer is read as it is; a streamed (SSE) one is accumulated as it is
relayed (:class:`StreamAnswer`: content and tool-call deltas on the OpenAI paths,
``output_ids`` and text on ``/generate``, bounded) into the same shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from kvproxy.sse import StreamState, parse_sse_line
from kvproxy.warm import warm_body

# Bound on what a streamed answer keeps for its prefill: characters of text and
# tool-call fields plus output ids, and the bytes of one unfinished SSE line. Past it
# the prefill is skipped (``answer_too_big``); as a buffered answer past the buffered
# response limit is never kept.
STREAM_ANSWER_LIMIT = 1024 * 1024
# Skip reasons of a streamed answer (counted like the other speculative-prefill skips).
R_TOO_BIG = "answer_too_big"
R_UNREADABLE = "unreadable"
# Bound on the tool calls of one streamed chat answer.
MAX_STREAM_TOOL_CALLS = 128


def _answer_text(doc: Mapping[str, Any], path: str) -> tuple[str | None, Any]:
    choices = doc.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        return None, None
    choice = choices[0]
    if path == "/v1/completions":
        text = choice.get("text")
        return (text, None) if isinstance(text, str) else (None, None)
    msg = choice.get("message")
    if not isinstance(msg, Mapping):
        return None, None
    content = msg.get("content")
    tool_calls = msg.get("tool_calls")
    if not isinstance(content, str) and not tool_calls:
        return None, None
    return (content if isinstance(content, str) else ""), tool_calls


def prefill_body(
    path: str, body: Mapping[str, Any], response: Any, *, session_id: str, rid: str
) -> dict[str, Any] | None:
    """The prefill request for a finished turn, or None when it cannot be built
    (an error, a batch, n > 1, or an answer kvproxy cannot read): the turn's prompt
    extended by its answer, as one output token (:func:`kvproxy.warm.warm_body`)."""
    if not isinstance(response, Mapping):
        return None
    extended: dict[str, Any]
    if path == "/generate":
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            out = response.get("output_ids")
            if not isinstance(out, list):
                return None
            extended = {"input_ids": [*ids, *out]}
        elif isinstance(body.get("text"), str):
            text = response.get("text")
            if not isinstance(text, str):
                return None
            extended = {"text": body["text"] + text}
        else:
            return None
    else:
        text, tool_calls = _answer_text(response, path)
        if text is None:
            return None
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            extended = {"prompt": prompt + text}
        else:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                answer["tool_calls"] = tool_calls
            extended = {"messages": [*messages, answer]}
    return warm_body(path, {**body, **extended}, session_id=session_id, rid=rid)


class StreamAnswer:
    """The answer of a streamed (SSE) response to ``path``, accumulated chunk by chunk
    for the speculative prefill. Pure: :meth:`feed` takes the stream's raw bytes as they
    are relayed, :meth:`document` gives the answer in the shape of the buffered
    response (what :func:`prefill_body` reads), or why there is none.

    Chat: ``choices[0].delta.content`` appended, ``delta.tool_calls`` merged by their
    ``index`` (``id``, ``type`` and ``function.name`` set, ``function.arguments``
    appended). Completions: ``choices[0].text`` appended. ``/generate``: ``output_ids``
    as :class:`~kvproxy.sse.StreamState` reads them (cumulative or incremental) and
    ``text`` (SGLang's default stream repeats the text so far, ``--incremental-streaming-
    output`` sends deltas: the second chunk with text decides, cumulative when it extends
    the first). An error event, another
    choice than index 0 (``n`` > 1) or an event that is not a JSON object makes the
    answer unreadable; past :data:`STREAM_ANSWER_LIMIT` it is too big. Either way
    nothing more is kept.

    ``on_done`` is called once, with the answer, at the stream's ``[DONE]`` event (the
    answer is complete: the upstream connection may stay open a while longer) or at
    :meth:`finish` (the stream's end without one), whichever comes first.
    """

    __slots__ = (
        "_chat",
        "_cumulative",
        "_done",
        "_limit",
        "_line",
        "_on_done",
        "_path",
        "_size",
        "_state",
        "_text",
        "_tools",
        "skip",
    )

    def __init__(
        self,
        path: str,
        limit: int = STREAM_ANSWER_LIMIT,
        on_done: Callable[[StreamAnswer], None] | None = None,
    ) -> None:
        self._path = path
        self._on_done = on_done
        self._done = False
        self._line = b""  # the unfinished last line
        self._text: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}
        self._state = StreamState() if path == "/generate" else None
        self._chat = path not in ("/v1/completions", "/generate")
        self._cumulative: bool | None = None  # /generate's text: decided by its 2nd text
        self._size = 0
        self._limit = limit
        self.skip: str | None = None  # why there is no answer (None: none so far)

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the stream, as relayed."""
        if self._done:
            return
        if self.skip is not None:  # nothing kept: only the end is watched for
            if chunk.rstrip().endswith(b"data: [DONE]"):
                self.finish()
            return
        lines = (self._line + chunk).split(b"\n")
        self._line = lines.pop()
        if len(self._line) > self._limit:
            self._stop(R_TOO_BIG)
            return
        for line in lines:
            parsed = parse_sse_line(line)
            if parsed is None:
                continue
            if parsed[0] == "done":
                self.finish()
                return
            self._feed_event(parsed[0], parsed[1])
            if self.skip is not None:
                if chunk.rstrip().endswith(b"data: [DONE]"):
                    self.finish()
                return

    def _feed_event(self, kind: str, doc: Any) -> None:
        if kind != "json" or not isinstance(doc, Mapping) or "error" in doc:
            self._stop(R_UNREADABLE)
            return
        if self._state is not None:
            self._feed_generate(doc)
        else:
            self._feed_choices(doc)
        if self.skip is None and self._size > self._limit:
            self._stop(R_TOO_BIG)

    def finish(self) -> None:
        """The stream is over: ``on_done`` gets the answer (once)."""
        if self._done:
            return
        if self._line.strip() and self.skip is None:
            self.feed(b"\n")  # a last event without its blank line
        self._done = True
        if self._on_done is not None:
            self._on_done(self)

    def document(self) -> tuple[dict[str, Any] | None, str | None]:
        """``(answer, None)`` in the buffered response's shape, or ``(None, reason)``."""
        if self._line.strip() and not self._done:
            self.feed(b"\n")  # a last event without its blank line
        if self.skip is not None:
            return None, self.skip
        text = "".join(self._text)
        if self._state is not None:
            doc: dict[str, Any] = {"text": text}
            if self._state.output_ids:
                doc["output_ids"] = list(self._state.output_ids)
            return doc, None
        if not self._chat:
            return {"choices": [{"text": text}]}, None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._tools:
            message["tool_calls"] = [self._tools[i] for i in sorted(self._tools)]
        return {"choices": [{"message": message}]}, None

    def body(self) -> tuple[bytes | None, str | None]:
        """:meth:`document` as the bytes of a buffered response."""
        doc, reason = self.document()
        return (None, reason) if doc is None else (orjson.dumps(doc), None)

    def _stop(self, reason: str) -> None:
        self.skip = reason
        self._text.clear()
        self._tools.clear()
        self._line = b""
        if self._state is not None:
            self._state.output_ids.clear()

    def _add_text(self, text: Any) -> None:
        if isinstance(text, str) and text:
            self._text.append(text)
            self._size += len(text)

    def _feed_generate(self, doc: Mapping[str, Any]) -> None:
        assert self._state is not None
        before = len(self._state.output_ids)
        self._state.feed_generate(doc)
        self._size += max(0, len(self._state.output_ids) - before)
        text = doc.get("text")
        if not isinstance(text, str) or not text:
            return
        kept = self._text[0] if self._text else ""
        if self._cumulative is None and kept:
            if text == kept:
                return  # nothing new either way (SGLang's default repeats the text)
            self._cumulative = text.startswith(kept)
        if self._cumulative:
            self._text[:] = [text]
            self._size += len(text) - len(kept)
        else:
            self._add_text(text)

    def _feed_choices(self, doc: Mapping[str, Any]) -> None:
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return  # e.g. the final usage chunk
        for choice in choices:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                self._stop(R_UNREADABLE)
                return
            if not self._chat:
                self._add_text(choice.get("text"))
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                self._add_text(delta.get("content"))
                calls = delta.get("tool_calls")
                if isinstance(calls, list) and not self._merge_tools(calls):
                    self._stop(R_UNREADABLE)
                    return

    def _merge_tools(self, calls: list[Any]) -> bool:
        """Merge tool-call deltas; False: one is not readable."""
        for call in calls:
            if not isinstance(call, Mapping):
                return False
            index = call.get("index", 0)
            if isinstance(index, bool) or not isinstance(index, int):
                return False
            tool = self._tools.get(index)
            if tool is None:
                if len(self._tools) >= MAX_STREAM_TOOL_CALLS:
                    return False
                tool = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                self._tools[index] = tool
            fn = tool["function"]
            for key in ("id", "type"):
                value = call.get(key)
                if isinstance(value, str) and value:
                    self._size += len(value) - len(tool[key])
                    tool[key] = value
            given = call.get("function")
            if isinstance(given, Mapping):
                name, args = given.get("name"), given.get("arguments")
                if isinstance(name, str) and name:
                    self._size += len(name) - len(fn["name"])
                    fn["name"] = name
                if isinstance(args, str):
                    fn["arguments"] += args
                    self._size += len(args)
        return True


__all__ = ["R_TOO_BIG", "R_UNREADABLE", "STREAM_ANSWER_LIMIT", "StreamAnswer", "prefill_body"]
