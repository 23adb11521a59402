"""The HTTP relay of translated streaming-session turns (Dynamo ``session_control`` open).

The server's half of :meth:`kvproxy.proxy.dynamo_layer.Transport.relay`: a turn in
streaming-session form (only its new token ids) is posted to the router's
``/generate`` and its answer relayed to the client. What it produced comes back as a
:class:`~kvproxy.dynamo.control.Translated`; the Dynamo layer records it (this
module keeps no state). An answer that fails before anything reached the client comes
back without a response: the ordinary request is sent instead. A streamed answer's
client that hangs up once it has read ``[DONE]`` (the upstream still holding the stream
open) cancels the relay of a complete answer: that answer comes back inside the
cancellation (:class:`~kvproxy.dynamo.control.AnsweredThenCancelled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.control import AnsweredThenCancelled, Translated
from kvproxy.headers import forward_response_headers
from kvproxy.sse import StreamState, parse_sse_line

log = logging.getLogger(__name__)

# How much of the answer's end goes to the usage reader.
_TAIL_BYTES = 4096
# A streamed answer's first event must come within this many lines.
_MAX_HEAD_LINES = 10_000
_NOT_SERVED: Translated[web.StreamResponse] = Translated(None)


async def relay_translated(
    http: aiohttp.ClientSession,
    url: str,
    request: web.Request,
    out: bytes,
    headers: Mapping[str, str],
    streamed: bool,
    sid: str,
) -> Translated[web.StreamResponse]:
    """Post ``out``, a turn of session ``sid``, to ``url`` and relay the answer to
    ``request``'s client."""
    if streamed:
        return await _SseRelay(request, sid).serve(http, url, out, headers)
    return await _serve_json(http, url, out, headers, sid)


async def _serve_json(
    http: aiohttp.ClientSession, url: str, out: bytes, headers: Mapping[str, str], sid: str
) -> Translated[web.StreamResponse]:
    try:
        async with http.post(url, data=out, headers=dict(headers)) as resp:
            data = await resp.read()
            status, resp_headers = resp.status, forward_response_headers(resp.headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("streaming session %s: translated turn failed: %s", sid, exc)
        return _NOT_SERVED
    doc: Any = None
    if status == 200:
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(data)
    ids, prompt_tokens, aborted = st.read_generate_result(doc)
    if status != 200 or aborted:
        log.warning(
            "streaming session %s: translated turn answered %s: %s; sent as an "
            "ordinary request instead",
            sid,
            status,
            data[:300].decode("utf-8", "replace"),
        )
        return _NOT_SERVED
    response = web.Response(status=status, headers=resp_headers, body=data)
    return Translated(response, True, ids, prompt_tokens, False, data, data[-_TAIL_BYTES:])


class _SseRelay:
    """A streamed translated turn: held until its first event (an error there means
    the ordinary request is sent instead), then relayed chunk by chunk while its
    output ids are accumulated."""

    def __init__(self, request: web.Request, sid: str) -> None:
        self.request = request
        self.sid = sid
        self.state = StreamState()
        self.tail = b""
        self.done = False  # the answer's [DONE] was relayed

    async def serve(
        self, http: aiohttp.ClientSession, url: str, out: bytes, headers: Mapping[str, str]
    ) -> Translated[web.StreamResponse]:
        try:
            async with http.post(url, data=out, headers=dict(headers)) as resp:
                return await self._relay(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("streaming session %s: translated turn failed: %s", self.sid, exc)
            return _NOT_SERVED

    async def _first_event(self, resp: aiohttp.ClientResponse) -> list[bytes] | None:
        """The lines up to the first event, or None when it is missing or an error."""
        held: list[bytes] = []
        first: tuple[str, Any] | None = None
        for _ in range(_MAX_HEAD_LINES):
            line = await resp.content.readline()
            if not line:
                break
            held.append(line)
            first = parse_sse_line(line)
            if first is not None:
                break
        if first is None or first[0] != "json" or "error" in first[1]:
            return None
        self.state.feed_generate(first[1])
        return held

    async def _relay(self, resp: aiohttp.ClientResponse) -> Translated[web.StreamResponse]:
        if resp.status != 200:
            await resp.read()
            return _NOT_SERVED
        held = await self._first_event(resp)
        if held is None:
            return _NOT_SERVED
        response = web.StreamResponse(status=200, headers=forward_response_headers(resp.headers))
        await response.prepare(self.request)
        await response.write(b"".join(held))
        try:
            await self._pump(resp, response)
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientError, TimeoutError):
            if self.request.transport is not None:
                self.request.transport.abort()
            return Translated(response)  # broke off: not complete
        except asyncio.CancelledError:
            if not self.done:
                raise
            # The client hung up once it had read [DONE] (the upstream may hold the
            # stream open a while after it): the answer is complete.
            raise AnsweredThenCancelled(self._answer(response)) from None
        return self._answer(response)

    def _answer(self, response: web.StreamResponse) -> Translated[web.StreamResponse]:
        """The answer relayed through its ``[DONE]`` (or its end): complete."""
        state = self.state
        aborted = state.error is not None or state.finish_reason == "abort"
        return Translated(
            response, True, state.output_ids, state.prompt_tokens, aborted, None, self.tail
        )

    async def _pump(self, resp: aiohttp.ClientResponse, response: web.StreamResponse) -> None:
        pending = b""
        async for chunk in resp.content.iter_any():
            await response.write(chunk)
            self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                ev = parse_sse_line(raw)
                if ev is not None:
                    if ev[0] == "json":
                        self.state.feed_generate(ev[1])
                    elif ev[0] == "done":
                        self.done = True  # relayed: the answer is complete


__all__ = ["relay_translated"]
