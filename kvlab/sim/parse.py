"""Wire body to scheduler request: what the simulated engine accepts, and how.

Pure (no I/O; reading a request is :func:`kvlab.sim.httpio.read_json`'s).
:func:`parse_json_object` decodes a body, :func:`parse_generate` (SGLang's
``/generate``) and :func:`parse_openai` (``/v1/chat/completions``, ``/v1/completions``)
turn a JSON body into a :class:`ParsedRequest`, raising :class:`BadRequest` with
SGLang's message for what it rejects; :func:`scheduler_request` turns that into the
scheduler's :class:`~kvlab.sim.scheduler.SimRequest` and the keywords of
``Scheduler.submit``. The HTTP simulator and the lab's in-process engines both build
their requests here.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import orjson

from kvlab.sim import tokenizer
from kvlab.sim.scheduler import SimRequest


class BadRequest(Exception):
    """A body the engine rejects: HTTP 400, as SGLang's validation error when
    ``validation`` (else as its ``{"error": {"message": ...}}``)."""

    def __init__(self, message: str, validation: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.validation = validation


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body's JSON object (``{}`` for an empty body)."""
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def parse_int(v: Any, name: str, default: int | None = None) -> int | None:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise BadRequest(f"{name} must be an integer")
    return v


def parse_str(v: Any, name: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string")
    return v


@dataclass(slots=True)
class ParsedRequest:
    """What the engine takes from a request body, checked."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    priority: int | None
    session_id: str | None
    session_params: dict[str, Any] | None
    stream: bool
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    output_len: int | None


def _common_fields(
    body: Mapping[str, Any], sampling: Mapping[str, Any], input_ids: list[int], max_new: int | None
) -> ParsedRequest:
    rid = parse_str(body.get("rid"), "rid") or uuid.uuid4().hex
    session_id = parse_str(body.get("session_id"), "session_id")
    session_params = body.get("session_params")
    if session_params is not None and not isinstance(session_params, dict):
        raise BadRequest("session_params must be an object")
    if session_id is not None and session_params is not None:
        raise BadRequest("session_id and session_params cannot both be set.", validation=False)
    n = parse_int(sampling.get("n"), "n", 1)
    if n != 1:
        raise BadRequest("The simulator supports n=1 only.", validation=False)
    stop_ids = sampling.get("stop_token_ids") or ()
    if not isinstance(stop_ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise BadRequest("stop_token_ids must be a list of integers")
    custom = sampling.get("custom_params")
    output_len = None
    if isinstance(custom, dict) and custom.get("sim_output_len") is not None:
        output_len = parse_int(custom.get("sim_output_len"), "custom_params.sim_output_len")
    # None when absent: the scheduler applies SGLang's default (see Scheduler.submit).
    priority = parse_int(body.get("priority"), "priority")
    return ParsedRequest(
        rid=rid,
        input_ids=input_ids,
        max_new_tokens=128 if max_new is None else max_new,
        priority=priority,
        session_id=session_id,
        session_params=session_params,
        stream=bool(body.get("stream", False)),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        output_len=output_len,
    )


def parse_generate(body: Mapping[str, Any]) -> ParsedRequest:
    text = body.get("text")
    ids = body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise BadRequest("input_embeds is not supported by the simulator.", validation=False)
    if (text is None) == (ids is None):
        raise BadRequest("Either text or input_ids should be provided.", validation=False)
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise BadRequest("Batch requests are not supported by the simulator.", validation=False)
    sampling = body.get("sampling_params") or {}
    if isinstance(sampling, list):
        raise BadRequest("Batch requests are not supported by the simulator.", validation=False)
    if not isinstance(sampling, dict):
        raise BadRequest("sampling_params must be an object")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest("text must be a string")
        input_ids = tokenizer.encode(text)
    else:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise BadRequest("input_ids must be a list of integers")
        input_ids = list(ids)
    max_new = parse_int(sampling.get("max_new_tokens"), "max_new_tokens")
    return _common_fields(body, sampling, input_ids, max_new)


def parse_openai(body: Mapping[str, Any], chat: bool) -> ParsedRequest:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise BadRequest("input_ids must be a list of integers")
            input_ids = list(ids)
        else:
            if not all(isinstance(m, dict) for m in messages):
                raise BadRequest("each message must be an object")
            input_ids = tokenizer.encode(tokenizer.render_chat(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            input_ids = tokenizer.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            input_ids = list(prompt)
        elif isinstance(prompt, list):
            raise BadRequest("Batch prompts are not supported by the simulator.", validation=False)
        else:
            raise BadRequest("prompt must be a string or a list of token ids")
    max_new = parse_int(body.get("max_completion_tokens"), "max_completion_tokens")
    if max_new is None:
        max_new = parse_int(body.get("max_tokens"), "max_tokens")
    sampling: dict[str, Any] = {
        "n": body.get("n"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos", False),
        "custom_params": body.get("custom_params"),
    }
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise BadRequest("stream_options must be an object")
    return _common_fields(body, sampling, input_ids, max_new)


def _responses_text(value: Any) -> str:
    """The text of a Responses ``input``: a string, or items whose content is a string or
    parts with ``text``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty list of items")
    parts: list[str] = []
    for item in value:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(c.get("text", "")) for c in content if isinstance(c, dict))
        else:
            raise BadRequest("each input item must carry content")
    return "\n".join(parts)


def parse_responses(body: Mapping[str, Any]) -> ParsedRequest:
    """SGLang's ``/v1/responses`` (``ResponsesRequest``): ``input``, ``instructions``,
    ``max_output_tokens``, ``session_id``, and the request id as ``request_id`` (its rid)."""
    if body.get("stream"):
        raise BadRequest("Streamed responses are not supported by the simulator.", validation=False)
    text = _responses_text(body.get("input"))
    if isinstance(body.get("instructions"), str):
        text = body["instructions"] + "\n" + text
    rid = parse_str(body.get("request_id"), "request_id")
    fields = {k: v for k, v in body.items() if k in ("session_id", "priority")}
    if rid is not None:
        fields["rid"] = rid
    max_new = parse_int(body.get("max_output_tokens"), "max_output_tokens")
    sampling: dict[str, Any] = {"n": None, "stop_token_ids": None, "ignore_eos": False}
    return _common_fields(fields, sampling, tokenizer.encode(text), max_new)


class SubmitOptions(TypedDict):
    """The keywords of ``Scheduler.submit`` that a body sets."""

    session_params: dict[str, Any] | None
    output_len: int | None
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


def scheduler_request(
    p: ParsedRequest, *, stream: bool | None = None
) -> tuple[SimRequest, SubmitOptions]:
    """The scheduler's request for ``p`` and the keywords to submit it with:
    ``sched.submit(req, now, **options)``.

    ``stream``: whether the engine counts the request as streamed (SGLang's
    ``is_streaming`` label); None takes the body's ``stream``.
    """
    req = SimRequest(
        rid=p.rid,
        input_ids=p.input_ids,
        max_new_tokens=p.max_new_tokens,
        priority=p.priority,
        session_id=p.session_id,
        stream=p.stream if stream is None else stream,
    )
    options = SubmitOptions(
        session_params=p.session_params,
        output_len=p.output_len,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    return req, options
