"""The relay of translated streaming-session turns (Dynamo ``session_control`` open).

The shell around :class:`kvproxy.dynamo.control.Dynamo`: Dynamo
decides and keeps the slots (pure tables in :mod:`kvproxy.dynamo.streaming`); this
module does the HTTP. A turn is sent to the router in streaming-session form (only its
new token ids); an answer that fails before anything reached the client means the
ordinary request is sent instead (:func:`serve_streaming` returns None).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.control import Dynamo, Turn
from kvproxy.headers import forward_response_headers
from kvproxy.sse import StreamState, parse_sse_line

log = logging.getLogger(__name__)

ObserveTail = Callable[[bytes], None]
# How much of the answer's end goes to the usage reader.
_TAIL_BYTES = 4096
# A streamed answer's first event must come within this many lines.
_MAX_HEAD_LINES = 10_000


async def serve_streaming(
    dynamo: Dynamo,
    request: web.Request,
    turn: Turn,
    body: Mapping[str, Any],
    fields: Mapping[str, Any],
    headers: Mapping[str, str],
    observe_tail: ObserveTail | None,
) -> web.StreamResponse | None:
    """Send a turn in streaming-session form; None: send the ordinary request
    instead (the slot, if any, is closed: nothing reached the client)."""
    slot = await dynamo.claim_slot(turn, body)
    if slot is None:
        return None
    out = dynamo.translated_body(turn, body, fields)
    if body.get("stream"):
        relay = _SseRelay(dynamo, request, turn, slot, body)
        return await relay.serve(out, headers, observe_tail)
    return await _serve_json(dynamo, turn, slot, body, out, headers, observe_tail)


async def _serve_json(
    dynamo: Dynamo,
    turn: Turn,
    slot: st.Slot,
    body: Mapping[str, Any],
    out: bytes,
    headers: Mapping[str, str],
    observe_tail: ObserveTail | None,
) -> web.StreamResponse | None:
    sid = turn.session_id
    try:
        async with dynamo.http.post(
            dynamo.router_base + "/generate", data=out, headers=dict(headers)
        ) as resp:
            data = await resp.read()
            status, resp_headers = resp.status, forward_response_headers(resp.headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("streaming session %s: translated turn failed: %s", sid, exc)
        await dynamo.give_up_first(slot, st.R_ENGINE_ERROR)
        return None
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
        await dynamo.give_up_first(slot, st.R_ENGINE_ERROR)
        return None
    if not dynamo.finish_turn(turn, slot, body["input_ids"], ids, prompt_tokens, False):
        return None
    if observe_tail is not None:
        observe_tail(data[-_TAIL_BYTES:])
    turn.response = data
    return web.Response(status=status, headers=resp_headers, body=data)


class _SseRelay:
    """A streamed translated turn: held until its first event (an error there means
    the ordinary request is sent instead), then relayed chunk by chunk while its
    output ids are accumulated for the slot."""

    def __init__(
        self,
        dynamo: Dynamo,
        request: web.Request,
        turn: Turn,
        slot: st.Slot,
        body: Mapping[str, Any],
    ) -> None:
        self.dynamo = dynamo
        self.request = request
        self.turn = turn
        self.slot = slot
        self.body = body
        self.state = StreamState()
        self.tail = b""
        self.broken = False

    async def serve(
        self, out: bytes, headers: Mapping[str, str], observe_tail: ObserveTail | None
    ) -> web.StreamResponse | None:
        dynamo = self.dynamo
        try:
            async with dynamo.http.post(
                dynamo.router_base + "/generate", data=out, headers=dict(headers)
            ) as resp:
                response = await self._relay(resp)
        except asyncio.CancelledError:
            dynamo.give_up(self.slot, st.R_ENGINE_ERROR)
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "streaming session %s: translated turn failed: %s", self.turn.session_id, exc
            )
            await dynamo.give_up_first(self.slot, st.R_ENGINE_ERROR)
            return None
        if response is None or self.broken:
            return response
        if observe_tail is not None:
            observe_tail(self.tail)
        state = self.state
        aborted = state.error is not None or state.finish_reason == "abort"
        # Already relayed: a slot given up just stops the session being a streaming one.
        dynamo.finish_turn(
            self.turn,
            self.slot,
            self.body["input_ids"],
            state.output_ids,
            state.prompt_tokens,
            aborted,
        )
        return response

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

    async def _relay(self, resp: aiohttp.ClientResponse) -> web.StreamResponse | None:
        if resp.status != 200:
            await resp.read()
            await self.dynamo.give_up_first(self.slot, st.R_ENGINE_ERROR)
            return None
        held = await self._first_event(resp)
        if held is None:
            await self.dynamo.give_up_first(self.slot, st.R_ENGINE_ERROR)
            return None
        response = web.StreamResponse(status=200, headers=forward_response_headers(resp.headers))
        await response.prepare(self.request)
        await response.write(b"".join(held))
        try:
            await self._pump(resp, response)
        except (ConnectionResetError, aiohttp.ClientError, TimeoutError):
            self.broken = True
            self.dynamo.give_up(self.slot, st.R_ENGINE_ERROR)
            if self.request.transport is not None:
                self.request.transport.abort()
            return response
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    async def _pump(self, resp: aiohttp.ClientResponse, response: web.StreamResponse) -> None:
        pending = b""
        async for chunk in resp.content.iter_any():
            await response.write(chunk)
            self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                ev = parse_sse_line(raw)
                if ev is not None and ev[0] == "json":
                    self.state.feed_generate(ev[1])


__all__ = ["serve_streaming"]
