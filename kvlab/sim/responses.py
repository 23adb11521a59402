"""Response bodies of the simulated engine, as SGLang 0.5.23 writes them.

Pure functions of a finished (or streaming) request: ``/generate``'s ``meta_info``,
the OpenAI objects and chunks, and SGLang's error bodies. The shell
(:mod:`kvlab.sim.httpio`) turns them into HTTP responses.
"""

from __future__ import annotations

from typing import Any

from kvlab.sim import tokenizer
from kvlab.sim.config import HiCacheConfig, SchedulerConfig
from kvlab.sim.scheduler import SimRequest

# The SGLang version the simulator reports (/server_info, /v1/loads).
SGLANG_VERSION = "0.5.23"


def cache_policy_info(cfg: SchedulerConfig) -> dict[str, Any]:
    """The ``/server_info`` fields of the session mode, eviction and scheduling policy
    (what kvproxy reads): the HTTP simulator's and the lab engines' report."""
    return {
        "enable_session_radix_cache": cfg.mode == "session-radix",
        "enable_streaming_session": cfg.mode == "streaming",
        "radix_eviction_policy": cfg.eviction_policy,
        "enable_priority_scheduling": cfg.enable_priority_scheduling,
        "priority_scheduling_preemption_threshold": cfg.priority_scheduling_preemption_threshold,
        "disable_radix_cache": False,
        **hicache_server_args(cfg),
    }


def hicache_server_args(cfg: SchedulerConfig) -> dict[str, Any]:
    """SGLang's HiCache server args as /server_info reports them (its defaults when off)."""
    if cfg.hicache is not None:
        return cfg.hicache.to_server_args()
    return {**HiCacheConfig().to_server_args(), "enable_hierarchical_cache": False}


def error_body(message: str) -> dict[str, Any]:
    """SGLang's ``_create_error_response``: ``{"error": {"message": ...}}``."""
    return {"error": {"message": message}}


def validation_error_body(message: str) -> dict[str, Any]:
    """SGLang's body for request-validation errors (HTTP 400)."""
    return {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


def fake_logprob(token_id: int) -> float:
    """A deterministic stand-in log-probability (the simulator samples nothing)."""
    return -0.01 - (token_id % 997) / 1000.0


def meta_info(
    req: SimRequest, n_out: int, finish: dict[str, Any] | None, ids: list[int] | None = None
) -> dict[str, Any]:
    """``/generate``'s ``meta_info`` after ``n_out`` output tokens; ``ids``: with logprobs."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": req.prompt_tokens,
        "weight_version": "default",
        "num_retractions": req.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": n_out,
        "cached_tokens": req.cached_tokens,
    }
    if ids is not None:
        # return_logprob: [logprob, token_id, text] triples, cumulative like the text.
        meta["output_token_logprobs"] = [[fake_logprob(t), t, None] for t in ids]
        meta["input_token_logprobs"] = []
    if finish is not None and req.finish_time is not None:
        meta["e2e_latency"] = round(req.finish_time - req.arrival, 6)
    return meta


def generate_body(
    req: SimRequest, ids: list[int], n_out: int, finish: dict[str, Any] | None, logprobs: bool
) -> dict[str, Any]:
    """A ``/generate`` response (or SSE chunk) after ``n_out`` output tokens, ``ids``."""
    return {
        "text": tokenizer.decode(ids),
        "output_ids": ids,
        "meta_info": meta_info(req, n_out, finish, ids if logprobs else None),
    }


# ----------------------------------------------------------------------------- OpenAI


def openai_finish(reason: dict[str, Any] | None) -> tuple[str | None, Any]:
    """OpenAI's ``finish_reason`` and ``matched_stop`` for SGLang's finish reason."""
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def usage(req: SimRequest, n_out: int) -> dict[str, Any]:
    """OpenAI's ``usage`` after ``n_out`` output tokens."""
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": req.prompt_tokens + n_out,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        "reasoning_tokens": 0,
    }


def openai_body(
    req: SimRequest, ids: list[int], *, chat: bool, created: int, model: Any
) -> dict[str, Any]:
    """The non-streamed OpenAI response of a finished request with output ``ids``."""
    text = tokenizer.decode(ids)
    finish, matched = openai_finish(req.finish_reason)
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": None,
            "tool_calls": None,
        }
    else:
        choice["text"] = text
    choice.update({"logprobs": None, "finish_reason": finish, "matched_stop": matched})
    return {
        "id": req.rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(req, len(ids)),
        "metadata": {"weight_version": "default"},
    }


def responses_body(req: SimRequest, ids: list[int], *, created: int, model: Any) -> dict[str, Any]:
    """The non-streamed Responses API answer (``/v1/responses``) of a finished request."""
    u = usage(req, len(ids))
    return {
        "id": req.rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": tokenizer.decode(ids)}],
            }
        ],
        "usage": {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
        },
    }


class OpenAIChunks:
    """The SSE chunks of one streamed OpenAI response, step by step: each call of
    :meth:`after` gives the chunks for the text generated since the last call."""

    def __init__(
        self, req: SimRequest, *, chat: bool, created: int, model: Any, include_usage: bool
    ) -> None:
        self.req = req
        self.chat = chat
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.sent_text = ""
        self.role_sent = False

    def _wrap(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.req.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def chunk(self, delta_text: str | None, finish: str | None, matched: Any) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if self.chat:
            c["delta"] = {"content": delta_text} if delta_text is not None else {}
        else:
            c["text"] = delta_text or ""
        c.update({"logprobs": None, "finish_reason": finish, "matched_stop": matched})
        return self._wrap([c], None)

    def after(self, n: int, finished: bool) -> list[dict[str, Any]]:
        """The chunks to send once ``n`` output tokens exist (``finished``: the last)."""
        req = self.req
        out: list[dict[str, Any]] = []
        if self.chat and not self.role_sent:
            # SGLang opens a chat stream with a role-only chunk.
            self.role_sent = True
            first = self.chunk(None, None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            out.append(first)
        text = tokenizer.decode(req.out.ids(n)) if req.out is not None else ""
        delta = text[len(self.sent_text) :]
        self.sent_text = text
        if delta or not finished:
            out.append(self.chunk(delta, None, None))
        if finished:
            finish, matched = openai_finish(req.finish_reason)
            out.append(self.chunk(None if self.chat else "", finish, matched))
            if self.include_usage:
                out.append(self._wrap([], usage(req, n)))
        return out
