"""Server-sent events of the simulated engine: a streamed request, chunk by chunk.

:func:`stream` drives one SSE response from a request's :class:`~kvlab.sim.rank.Waiter`
(woken by the scheduler loop on each step), applying the ``drop_stream_after_chunks``
and ``hold_after_done_s`` faults; :func:`stream_error` is SGLang's in-stream error for a request it refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from kvlab.sim.rank import Rank, Waiter
from kvlab.sim.state import SIM_STATE

# ``make_chunks(n_out, finished)``: the chunks to send once ``n_out`` output tokens exist.
ChunkMaker = Callable[[int, bool], list[dict[str, Any]]]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def stream(
    request: web.Request, rank: Rank, w: Waiter, make_chunks: ChunkMaker
) -> web.StreamResponse:
    """Drive an SSE response: ``make_chunks(n_out, finished)`` returns the chunks to send."""
    st = request.app[SIM_STATE]
    resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
    sent_chunks = 0
    try:
        await resp.prepare(request)
        assert w.progress is not None
        last = -1
        while True:
            await w.progress.wait()
            w.progress.clear()
            if rank.stopped and not w.req.finished:
                return resp  # no [DONE]: the client sees a truncated stream, as on a crash
            finished = w.req.finished
            n = rank.sched.output_len(w.req)
            if n == last and not finished:
                continue
            last = n
            for chunk in make_chunks(n, finished):
                drop_after = st.faults.drop_stream_after_chunks
                if drop_after is not None and sent_chunks >= drop_after:
                    rank.cancel(w)
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await resp.write(_sse(chunk))
                sent_chunks += 1
            if finished:
                break
        await resp.write(b"data: [DONE]\n\n")
        if st.faults.hold_after_done_s > 0:  # the stream is over, its end held back
            await asyncio.sleep(st.faults.hold_after_done_s)
        await resp.write_eof()
    except ConnectionResetError:
        rank.cancel(w)  # the client went away mid-stream
    except asyncio.CancelledError:
        rank.cancel(w)
        raise
    finally:
        rank.forget(w)
    return resp


async def stream_error(request: web.Request, message: str) -> web.StreamResponse:
    """SGLang's answer to a streamed request it refused: one error event, then [DONE]."""
    resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
    await resp.prepare(request)
    err = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    await resp.write(_sse(err))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
