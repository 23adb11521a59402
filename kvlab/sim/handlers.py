"""The simulated engine's data plane: ``/generate``, ``/v1/chat/completions``,
``/v1/completions`` and (non-streamed) ``/v1/responses``.

A handler parses the body (:mod:`kvlab.sim.parse`), submits the request to the
scheduler of a DP rank, and either waits for it to finish or streams it
(:mod:`kvlab.sim.streaming`); the bodies are :mod:`kvlab.sim.responses`'.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from kvlab.sim.httpio import error_response, json_response, read_json
from kvlab.sim.parse import (
    ParsedRequest,
    parse_generate,
    parse_openai,
    parse_responses,
    scheduler_request,
)
from kvlab.sim.rank import Rank, Waiter
from kvlab.sim.responses import OpenAIChunks, generate_body, openai_body, responses_body
from kvlab.sim.scheduler import SimError
from kvlab.sim.state import SIM_STATE, SimState
from kvlab.sim.streaming import stream, stream_error

_STOPPED = "The engine stopped before the request finished."


def submit(st: SimState, body: Mapping[str, Any], p: ParsedRequest) -> tuple[Rank, Waiter]:
    """Queue ``p`` on its DP rank; raises :class:`SimError` for what the engine refuses."""
    session = p.session_id
    if session is None and p.session_params is not None:
        session = str(p.session_params.get("id")) if p.session_params.get("id") else None
    rank = st.pick_rank(body, session)
    if rank.stopped:
        raise SimError("The engine's scheduler loop has stopped.", 503)
    if p.rid in rank.waiters or st.find(p.rid) is not None:
        raise SimError(f"Duplicate request ID: {p.rid}")
    req, options = scheduler_request(p)
    rank.sched.submit(req, rank.now(), **options)
    return rank, rank.add_waiter(req, p.stream)


async def _refused(request: web.Request, p: ParsedRequest, e: SimError) -> web.StreamResponse:
    if p.stream:
        return await stream_error(request, e.message)
    return error_response(e.message, e.status)


async def handle_generate(request: web.Request) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    body = await read_json(request)
    p = parse_generate(body)
    try:
        rank, w = submit(st, body, p)
    except SimError as e:
        return await _refused(request, p, e)
    sched = rank.sched
    req = w.req
    logprobs = bool(body.get("return_logprob"))

    if not p.stream:
        await rank.wait_done(w)
        if not req.finished:
            return error_response(_STOPPED, 500)
        ids = sched.output_ids(req)
        return json_response(generate_body(req, ids, len(ids), req.finish_reason, logprobs))

    def chunks(n: int, finished: bool) -> list[dict[str, Any]]:
        ids = req.out.ids(n) if req.out is not None else []
        finish = req.finish_reason if finished else None
        return [generate_body(req, ids, n, finish, logprobs)]

    return await stream(request, rank, w, chunks)


async def _handle_openai(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    body = await read_json(request)
    p = parse_openai(body, chat)
    model = body.get("model") if isinstance(body.get("model"), str) else st.cfg.model_name
    try:
        rank, w = submit(st, body, p)
    except SimError as e:
        return await _refused(request, p, e)
    req = w.req
    created = int(time.time())

    if not p.stream:
        await rank.wait_done(w)
        if not req.finished:
            return error_response(_STOPPED, 500)
        ids = rank.sched.output_ids(req)
        return json_response(openai_body(req, ids, chat=chat, created=created, model=model))

    opts = body.get("stream_options") or {}
    chunks = OpenAIChunks(
        req, chat=chat, created=created, model=model, include_usage=bool(opts.get("include_usage"))
    )
    return await stream(request, rank, w, chunks.after)


async def handle_responses(request: web.Request) -> web.StreamResponse:
    """SGLang's Responses API, non-streamed: the request id is ``request_id``."""
    st = request.app[SIM_STATE]
    body = await read_json(request)
    p = parse_responses(body)
    model = body.get("model") if isinstance(body.get("model"), str) else st.cfg.model_name
    try:
        rank, w = submit(st, body, p)
    except SimError as e:
        return await _refused(request, p, e)
    await rank.wait_done(w)
    if not w.req.finished:
        return error_response(_STOPPED, 500)
    ids = rank.sched.output_ids(w.req)
    return json_response(responses_body(w.req, ids, created=int(time.time()), model=model))


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, chat=True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, chat=False)
