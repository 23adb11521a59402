"""The simulated engine's control plane: sessions, aborts, the cache flush, health."""

from __future__ import annotations

import uuid

from aiohttp import web

from kvlab.sim.httpio import error_response, json_response, read_json
from kvlab.sim.parse import BadRequest, parse_int, parse_str
from kvlab.sim.scheduler import SimError
from kvlab.sim.state import SIM_STATE


async def handle_open_session(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await read_json(request)
    cap = body.get("capacity_of_str_len")
    if cap is None or parse_int(cap, "capacity_of_str_len") is None:
        raise BadRequest("Field required: capacity_of_str_len")
    sid = parse_str(body.get("session_id"), "session_id") or uuid.uuid4().hex
    streaming = bool(body.get("streaming") or False)
    timeout = body.get("timeout")
    if timeout is not None and not isinstance(timeout, int | float):
        raise BadRequest("timeout must be a number")
    rank = st.pick_rank(body, sid)
    for r in st.ranks:
        s = r.sched
        if sid in s.streaming_sessions or sid in s.legacy_sessions:
            return error_response(
                "Failed to open the session. Check if a session with the same id is still open."
            )
    try:
        rank.sched.open_session(sid, rank.now(), streaming=streaming, timeout_s=timeout)
    except SimError as e:
        return error_response(e.message, e.status)
    rank.wake.set()  # the loop recomputes the idle-timeout deadline
    return json_response(sid)


async def handle_close_session(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await read_json(request)
    sid = parse_str(body.get("session_id"), "session_id")
    if sid is None:
        raise BadRequest("Field required: session_id")
    for rank in st.ranks:
        rank.sched.close_session(sid, rank.now())
        rank.wake.set()
    return web.Response(status=200)


async def handle_abort(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await read_json(request)
    rid = parse_str(body.get("rid"), "rid") or ""
    abort_all = bool(body.get("abort_all", False))
    for rank in st.ranks:
        done = rank.sched.abort(rid, rank.now(), abort_all=abort_all)
        rank.notify(done)
        rank.wake.set()
    return web.Response(status=200)


async def handle_flush_cache(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    for rank in st.ranks:
        rank.sched.flush_cache()
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. (When there are "
        "running or waiting requests, the operation will not be performed.)\n"
    )


async def handle_health(request: web.Request) -> web.Response:
    if any(r.stopped for r in request.app[SIM_STATE].ranks):
        return web.Response(status=503, text="scheduler loop stopped\n")
    return web.Response(status=200)
