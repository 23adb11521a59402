"""The speculative-prefill request for ``agent_hints.speculative_prefill``. Pure.

After a turn's response, kvproxy sends the conversation *including the assistant's
answer as the engine returned it* with one output token, so the next turn's prefix
is already in the radix cache. The answer is text on the OpenAI paths (the chat
template renders the assistant message as it renders it in the next turn) and ids on
``/generate`` with ``input_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Client keys not carried into the prefill (it is one non-streaming, one-token,
# single-sample request with its own rid).
_DROP = frozenset(
    {
        "nvext",
        "stream",
        "stream_options",
        "n",
        "rid",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "return_logprob",
        "session_params",
    }
)


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
    (an error, a batch, n > 1, or an answer kvproxy cannot read)."""
    if not isinstance(response, Mapping):
        return None
    base = {k: v for k, v in body.items() if k not in _DROP}
    base["rid"] = rid
    base["session_id"] = session_id
    if path == "/generate":
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            out = response.get("output_ids")
            if not isinstance(out, list):
                return None
            base["input_ids"] = [*ids, *out]
        elif isinstance(body.get("text"), str):
            text = response.get("text")
            if not isinstance(text, str):
                return None
            base["text"] = body["text"] + text
        else:
            return None
        sp = body.get("sampling_params")
        sp = dict(sp) if isinstance(sp, Mapping) else {}
        sp.pop("n", None)
        sp["max_new_tokens"] = 1
        base["sampling_params"] = sp
        return base
    text, tool_calls = _answer_text(response, path)
    if text is None:
        return None
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        base["prompt"] = prompt + text
    else:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            answer["tool_calls"] = tool_calls
        base["messages"] = [*messages, answer]
    base["max_tokens"] = 1
    return base


__all__ = ["prefill_body"]
