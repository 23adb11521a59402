"""SGLang ``/generate`` streams (pure): one SSE line parsed, one reply accumulated.

Shared by the proxy (Dynamo streaming-session turns keep the output ids of a relayed
stream) and the tools (the workload driver, the lab).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson


def _finish_reason_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        t = value.get("type")
        return str(t) if t is not None else None
    return str(value)


@dataclass(slots=True)
class StreamState:
    """Accumulates one streamed SGLang ``/generate`` reply."""

    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    chunks: int = 0

    def feed_generate(self, chunk: Mapping[str, Any]) -> None:
        self.chunks += 1
        if "error" in chunk:
            self.error = f"stream_error: {chunk['error']}"
            return
        meta = chunk.get("meta_info") or {}
        ids = chunk.get("output_ids")
        completion = meta.get("completion_tokens")
        if isinstance(ids, list):
            # Cumulative by default; with incremental output each chunk is a delta.
            if isinstance(completion, int):
                cumulative = len(ids) == completion
            else:
                cumulative = ids[: len(self.output_ids)] == self.output_ids
            if cumulative:
                self.output_ids = [int(t) for t in ids]
            else:
                self.output_ids.extend(int(t) for t in ids)
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        if isinstance(meta.get("cached_tokens"), int):
            self.cached_tokens = meta["cached_tokens"]
        if isinstance(completion, int):
            self.completion_tokens = completion
        reason = _finish_reason_name(meta.get("finish_reason"))
        if reason is not None:
            self.finish_reason = reason


def parse_sse_line(line: bytes) -> tuple[str, Any] | None:
    """``data: {...}`` -> ("json", obj); ``data: [DONE]`` -> ("done", None); else None."""
    s = line.strip()
    if not s.startswith(b"data:"):
        return None
    payload = s[5:].strip()
    if payload == b"[DONE]":
        return ("done", None)
    if not payload:
        return None
    try:
        return ("json", orjson.loads(payload))
    except orjson.JSONDecodeError:
        return ("bad", payload[:200].decode("utf-8", "replace"))
