"""A one-token request that makes a prompt's KV resident on its engine. Pure.

The shape shared by Dynamo's speculative prefill (:mod:`kvproxy.dynamo.prefill`: the
conversation plus the answer) and program admission's prefetch
(:mod:`kvproxy.admission.program.prefetch`: the session's last prompt, sent before its tool
returns). The engine matches the prompt in its radix cache, loads back what its host
tier holds (SGLang's HiCache), computes what is missing and decodes one token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Client keys not carried into it (one non-streaming, one-token, single-sample request
# with its own rid).
DROPPED_KEYS = frozenset(
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

# Where each path carries its prompt.
_PROMPT_KEYS = {
    "/generate": ("input_ids", "text"),
    "/v1/completions": ("prompt",),
    "/v1/chat/completions": ("messages",),
}


def warm_body(
    path: str, body: Mapping[str, Any], *, session_id: str, rid: str
) -> dict[str, Any] | None:
    """``body`` (a request to ``path``) as one output token of its prompt, with ``rid``
    and a top-level ``session_id``; None when the path or the body has no prompt."""
    keys = _PROMPT_KEYS.get(path)
    if keys is None or not any(body.get(k) for k in keys):
        return None
    out = {k: body[k] for k in body if k not in DROPPED_KEYS}
    out["rid"] = rid
    out["session_id"] = session_id
    if path == "/generate":
        sp = body.get("sampling_params")
        sp = dict(sp) if isinstance(sp, Mapping) else {}
        sp.pop("n", None)
        sp["max_new_tokens"] = 1
        out["sampling_params"] = sp
    else:
        out["max_tokens"] = 1
    return out


def body_bytes(body: Mapping[str, Any]) -> int:
    """About what keeping ``body`` costs in memory: its raw size when it was scanned
    from bytes (:class:`~kvproxy.proxy.scan.BodyScan`), else an estimate from its token
    ids (7 bytes each, as JSON digits and a comma; counted, not walked) or its text."""
    size = getattr(body, "size_bytes", 0)
    if size:
        return int(size)
    total = 256
    for value in body.values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list) and value and isinstance(value[0], int):
            total += 7 * len(value)
        elif isinstance(value, list):  # messages
            for item in value:
                content = item.get("content") if isinstance(item, Mapping) else None
                total += len(content) if isinstance(content, str) else 64
    return total


__all__ = ["DROPPED_KEYS", "body_bytes", "warm_body"]
