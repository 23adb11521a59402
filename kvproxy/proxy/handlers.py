"""HTTP handlers: streaming passthrough and the interception pipeline.

Every request goes to ``router.url`` unchanged unless it is one of the intercepted
LLM endpoints, which pass through the two features in order:

1. session lifecycle: resolve the session id, decide what to inject, track the
   request (queued, then forwarded) so a session close can reject, abort or await it;
2. admission: wait in the global FIFO until the ledger grants a lease (or bypass);
3. forward: inject the planned top-level fields into the raw bytes and stream the
   response back chunk by chunk. The lease and the session's tracking are released
   when the upstream attempt ends, on every exit path.

With both features off the body is not even parsed: the bytes forwarded are the
bytes received.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from kvproxy.admission.coordinator import AdmissionRequest, Decision
from kvproxy.proxy.body import inject_fields, parse_object
from kvproxy.proxy.errors import ErrorType, error_response
from kvproxy.proxy.upstream import forward_request_headers, forward_response_headers
from kvproxy.sessions import streaming
from kvproxy.sessions.agent_hints import NO_NVEXT, InvalidNvext, combine_priority, parse_nvext
from kvproxy.sessions.dynamo import Turn
from kvproxy.sessions.identity import (
    ROUTING_KEY_HEADER,
    InvalidSessionId,
    injection_plan,
    new_rid,
    resolve_identity,
    split_session_path,
    validate_session_id,
)
from kvproxy.sessions.lifecycle import SessionClosed

if TYPE_CHECKING:
    from kvproxy.runtime import Runtime

log = logging.getLogger(__name__)

INTERCEPTED_PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})
# Bodies up to this size are read whole before forwarding; larger ones are streamed.
_BUFFER_LIMIT = 256 * 1024
# Non-streaming upstream responses up to this size are returned in one write.
_RESPONSE_BUFFER_LIMIT = 1024 * 1024
# How much of a stream's tail to keep for reading the engine's prompt_tokens.
_TAIL_BYTES = 4096
_PROMPT_TOKENS_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')

ObserveTail = Callable[[bytes], None]
ObserveBody = Callable[[bytes], None]


# The last event of an SGLang or OpenAI-compatible stream. Once it has been relayed the
# engine has finished the request: a client hanging up afterwards aborts nothing.
_SSE_DONE = b"data: [DONE]\n\n"


class _Relayed:
    """What a relay has passed on so far (shared with :meth:`ProxyHandlers.forward`)."""

    __slots__ = ("complete",)

    def __init__(self) -> None:
        self.complete = False


class _ClientGone(Exception):
    """The client closed its connection while its response was being streamed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


class BodyTooLarge(Exception):
    pass


def _last_int(pattern: re.Pattern[bytes], tail: bytes) -> int | None:
    matches = pattern.findall(tail)
    return int(matches[-1]) if matches else None


class ProxyHandlers:
    """Request handlers bound to one application's runtime state."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    # ------------------------------------------------------------------ dispatch
    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        """Catch-all route: strip ``/sessions/{id}``, then intercept or pass through."""
        started = time.perf_counter()
        rt = self.rt
        if rt.shutting_down:
            return self._count(
                request.path, error_response(ErrorType.SHUTTING_DOWN, "kvproxy is shutting down")
            )
        lifecycle_on = rt.config.session_lifecycle.enabled
        try:
            path_sid, path = split_session_path(request.path)
        except InvalidSessionId as exc:
            if lifecycle_on:
                return self._count(
                    request.path, error_response(ErrorType.INVALID_SESSION_ID, str(exc))
                )
            # The feature is off: nothing reads the id, so the path goes as it came.
            path_sid, path = None, request.path
        if request.method == "POST":
            if path in INTERCEPTED_PATHS:
                return await self.intercepted(request, path, path_sid, started)
            if path == "/close_session":
                if lifecycle_on:
                    return self._count(path, await self.close_session_api(request, path_sid))
                if rt.config.admission.enabled:
                    return await self.close_session_passthrough(request, path_sid, started)
        return await self.passthrough(request, path, started)

    def _count(self, path: str, response: web.StreamResponse) -> web.StreamResponse:
        self.rt.metrics.count(path, response.status)
        return response

    # --------------------------------------------------------------- passthrough
    async def passthrough(
        self, request: web.Request, path: str, started: float
    ) -> web.StreamResponse:
        length = request.content_length
        max_body = self.rt.config.server.max_body_bytes
        if length is not None and length > max_body:
            return self._count(path, _too_large(max_body))
        body: bytes | aiohttp.StreamReader | None
        if not request.body_exists:
            body = None
        elif length is not None and length > _BUFFER_LIMIT:
            body = request.content  # stream it; Content-Length is kept below
        else:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return self._count(path, _too_large(max_body))
        extra = {"Content-Length": str(length)} if isinstance(body, aiohttp.StreamReader) else None
        return await self.forward(request, path, body, started=started, extra_headers=extra)

    # --------------------------------------------------------------- intercepted
    async def intercepted(
        self, request: web.Request, path: str, path_sid: str | None, started: float
    ) -> web.StreamResponse:
        rt = self.rt
        cfg = rt.config
        max_body = cfg.server.max_body_bytes
        if request.content_length is not None and request.content_length > max_body:
            return self._count(path, _too_large(max_body))
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._count(path, _too_large(max_body))

        lifecycle_on = cfg.session_lifecycle.enabled
        admission_on = cfg.admission.enabled
        body = parse_object(raw) if (lifecycle_on or admission_on) else None
        if body is None:
            # Features off, or not a JSON object: forward the bytes as received.
            return await self.forward(request, path, raw, started=started)

        fields: dict[str, Any] = {}
        overwrite = False
        extra_headers: dict[str, str] = {}
        session_id: str | None = None
        close_after = False
        abort_rids: tuple[str, ...] = ()
        rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        nvext = NO_NVEXT
        if lifecycle_on:
            try:
                nvext = parse_nvext(body)  # Dynamo's nvext (docs/dynamo.md)
            except InvalidNvext as exc:
                return self._count(path, error_response(ErrorType.INVALID_REQUEST, str(exc)))
            try:
                identity = resolve_identity(
                    cfg.session_lifecycle,
                    path_session_id=path_sid,
                    headers=request.headers,
                    body=body,
                )
            except InvalidSessionId as exc:
                return self._count(path, error_response(ErrorType.INVALID_SESSION_ID, str(exc)))
            plan = injection_plan(cfg.session_lifecycle, identity, body, headers=request.headers)
            rt.sessions.note_injection(plan)
            fields.update(plan.fields)
            overwrite = bool(plan.overwrites)
            extra_headers.update(plan.headers)
            rid = plan.rid or rid
            abort_rids = plan.abort_rids
            session_id = identity.session_id
            close_after = identity.close_after
        elif admission_on:
            # Admission alone still needs to know the session (its KV stays resident
            # between turns), read from the same sources; nothing is injected or refused.
            try:
                session_id = resolve_identity(
                    rt.identity_only, path_session_id=path_sid, headers=request.headers, body=body
                ).session_id
            except InvalidSessionId:
                session_id = None
        ticket = rid or new_rid()
        turn: Turn | None = None
        if lifecycle_on and session_id is not None:
            turn, turn_headers = rt.agents.begin(session_id, path, nvext, close_after)
            for key, value in turn_headers.items():  # bind / open route stickily
                if request.headers.get(key) is None:
                    extra_headers.setdefault(key, value)
        routing_key: str | None = None
        if admission_on and session_id is not None and cfg.admission.mode == "program":
            # Program admission attributes each session to the ring owner of its routing
            # key: every request of a session carries it (sticky routing).
            routing_key = request.headers.get(ROUTING_KEY_HEADER) or extra_headers.get(
                ROUTING_KEY_HEADER
            )
            if routing_key is None:
                routing_key = extra_headers[ROUTING_KEY_HEADER] = session_id

        async with AsyncExitStack() as stack:
            if turn is not None:
                stack.callback(rt.agents.end, turn)
            tracked = None
            on_disconnect: Callable[[], None] | None = None
            if lifecycle_on and session_id is not None:
                try:
                    tracked = await stack.enter_async_context(
                        rt.sessions.track(
                            session_id,
                            ticket,
                            close_after=close_after,
                            abort_rids=abort_rids or None,
                        )
                    )
                except SessionClosed as exc:
                    return self._count(path, error_response(ErrorType.SESSION_CLOSED, str(exc)))
                on_disconnect = tracked.disconnected
            elif abort_rids:
                sessions = rt.sessions

                def on_disconnect() -> None:
                    sessions.abort_in_background(abort_rids)

            waited = 0.0
            steering: int | None = None
            response_headers: dict[str, str] | None = None
            admission_req: AdmissionRequest | None = None
            try:
                if admission_on:
                    admission_req = AdmissionRequest(
                        ticket_id=ticket,
                        path=path,
                        headers=request.headers,
                        body=body,
                        session_id=session_id,
                        routing_key=routing_key,
                    )
                    enter = stack.enter_async_context(rt.admission.admit(admission_req))
                    decision: Decision = await (
                        tracked.until_forwarded(enter) if tracked else enter
                    )
                    waited = decision.wait_s
                    if decision.reason == "cancelled":
                        # The ticket was cancelled from outside (e.g. a duplicate rid whose
                        # twin was withdrawn): it must not reach the engines.
                        return self._count(
                            path,
                            error_response(
                                ErrorType.REQUEST_CANCELLED,
                                f"request {ticket} was cancelled before it was forwarded",
                            ),
                        )
                    steering = decision.priority
                    if decision.action != "pass":
                        response_headers = {
                            "X-KVProxy-Admission": decision.action
                            if decision.action == "admit"
                            else f"bypass; reason={decision.reason}",
                            "X-KVProxy-Admission-Wait-Ms": f"{decision.wait_s * 1000:.1f}",
                            "X-KVProxy-Admission-Decision": decision.reason,
                        }
                if tracked is not None:
                    tracked.forwarded()
            except SessionClosed as exc:
                return self._count(path, error_response(ErrorType.SESSION_CLOSED, str(exc)))
            # The client's agent_hints.priority, else kvproxy's eviction steering (the
            # combination rule: sessions/agent_hints.py): spliced in, never re-serialised.
            hint = nvext.hints.priority if cfg.session_lifecycle.agent_hints else None
            prio, source = combine_priority(
                top_level=body.get("priority"), hint=hint, steering=steering
            )
            if prio is not None and "priority" not in fields:
                fields["priority"] = prio
                if lifecycle_on:
                    rt.agents.note_priority(source)

            observe: ObserveTail | None = None
            if admission_req is not None:
                areq = admission_req

                def observe(tail: bytes) -> None:
                    # The engine's own usage report, in the final chunk (or the body).
                    rt.admission.observe_usage(
                        areq,
                        _last_int(_PROMPT_TOKENS_RE, tail),
                        _last_int(_CACHED_TOKENS_RE, tail),
                        _last_int(_COMPLETION_TOKENS_RE, tail),
                    )

            if turn is not None:
                key = request.headers.get(ROUTING_KEY_HEADER) or extra_headers.get(
                    ROUTING_KEY_HEADER, turn.session_id
                )
                plan = rt.agents.plan(turn, body, key)
                if plan.kind in (streaming.OPEN, streaming.EXTEND):
                    served = await rt.agents.serve_streaming(
                        request,
                        turn,
                        body,
                        fields,
                        forward_request_headers(request, extra_headers),
                        observe,
                    )
                    if served is not None:
                        rt.agents.after_response(
                            turn, body, forward_request_headers(request, extra_headers)
                        )
                        return self._count(path, served)
                await rt.agents.settle(turn, body, key)
            if lifecycle_on and path in cfg.session_lifecycle.strip_nvext_paths and "nvext" in body:
                out = orjson.dumps({**{k: v for k, v in body.items() if k != "nvext"}, **fields})
            elif not fields:
                out = raw
            elif overwrite:  # rare: a configured source outranks the body's own session_id
                out = orjson.dumps({**body, **fields})
            else:
                out = inject_fields(raw, fields)
            response = await self.forward(
                request,
                path,
                out,
                started=started,
                waited=waited,
                extra_headers=extra_headers or None,
                response_headers=response_headers,
                on_disconnect=on_disconnect,
                observe_tail=observe,
                observe_body=turn.keep_body if turn is not None and turn.wants_body else None,
            )
            if turn is not None and response.status == 200:
                rt.agents.after_response(
                    turn, body, forward_request_headers(request, extra_headers)
                )
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------- forward
    async def forward(
        self,
        request: web.Request,
        path: str,
        body: bytes | aiohttp.StreamReader | None,
        *,
        started: float,
        waited: float = 0.0,
        extra_headers: Mapping[str, str] | None = None,
        response_headers: Mapping[str, str] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        observe_tail: ObserveTail | None = None,
        observe_body: ObserveBody | None = None,
    ) -> web.StreamResponse:
        """Send one upstream attempt and stream its response back."""
        rt = self.rt
        url = rt.router_base + path
        if request.query_string:
            url += "?" + request.query_string
        headers = forward_request_headers(request, extra_headers)
        sent_at = time.perf_counter()
        try:
            upstream_cm = rt.http.request(
                request.method, url, data=body, headers=headers, allow_redirects=False
            )
            upstream = await upstream_cm.__aenter__()
        except asyncio.CancelledError:
            if on_disconnect is not None:
                on_disconnect()
            raise
        except (TimeoutError, aiohttp.ServerTimeoutError):
            rt.metrics.upstream_error("timeout")
            return self._count(
                path,
                error_response(
                    ErrorType.ROUTER_TIMEOUT, f"router did not answer in time ({rt.router_base})"
                ),
            )
        except aiohttp.ClientError as exc:
            rt.metrics.upstream_error("unreachable")
            return self._count(
                path,
                error_response(
                    ErrorType.ROUTER_UNREACHABLE,
                    f"cannot reach the router at {rt.router_base}: {exc}",
                ),
            )
        headers_at = time.perf_counter()
        relayed = _Relayed()
        try:
            return await self._relay(
                request,
                path,
                upstream,
                started,
                sent_at,
                headers_at,
                waited,
                response_headers,
                observe_tail,
                relayed,
                observe_body,
            )
        except asyncio.CancelledError:
            # Client went away (handler cancellation): drop the upstream connection so the
            # router stops too, and tell the engines if the session feature tracks the rid.
            upstream.close()
            if on_disconnect is not None and not relayed.complete:
                on_disconnect()
            raise
        except _ClientGone as gone:
            # The client closed its connection mid-response: a normal event, not an
            # error. aiohttp finishes a response whose peer is gone quietly.
            upstream.close()
            if on_disconnect is not None and not relayed.complete:
                on_disconnect()
            return self._count(path, gone.response)
        finally:
            await upstream_cm.__aexit__(None, None, None)

    async def _relay(
        self,
        request: web.Request,
        path: str,
        upstream: aiohttp.ClientResponse,
        started: float,
        sent_at: float,
        headers_at: float,
        waited: float,
        response_headers: Mapping[str, str] | None,
        observe_tail: ObserveTail | None,
        relayed: _Relayed,
        observe_body: ObserveBody | None = None,
    ) -> web.StreamResponse:
        rt = self.rt
        headers = forward_response_headers(upstream.headers)
        if response_headers:
            headers.update(response_headers)
        length = upstream.content_length
        content_type = upstream.headers.get("Content-Type", "")
        overhead = sent_at - started - waited
        if (
            length is not None
            and length <= _RESPONSE_BUFFER_LIMIT
            and "text/event-stream" not in content_type
        ):
            try:
                data = await upstream.read()
            except (
                TimeoutError,
                aiohttp.ClientPayloadError,
                aiohttp.ServerDisconnectedError,
            ) as exc:
                rt.metrics.upstream_error("midstream")
                return self._count(
                    path,
                    error_response(
                        ErrorType.ROUTER_UNREACHABLE,
                        f"the router's response broke off: {type(exc).__name__}",
                    ),
                )
            read_at = time.perf_counter()
            response = web.Response(status=upstream.status, headers=headers, body=data)
            rt.metrics.added_latency.observe(overhead + (time.perf_counter() - read_at))
            if upstream.status == 200:
                if observe_tail is not None:
                    observe_tail(data[-_TAIL_BYTES:])
                if observe_body is not None:
                    observe_body(data)
            return self._count(path, response)

        response = web.StreamResponse(status=upstream.status, headers=headers)
        if length is not None:
            response.content_length = length
        await response.prepare(request)
        rt.metrics.added_latency.observe(overhead + (time.perf_counter() - headers_at))
        tail = b""
        end = b""  # the stream's last bytes, to recognise its final [DONE] event
        done_len = len(_SSE_DONE)
        # A chunked JSON body (not SSE) kept whole, bounded, for observe_body.
        whole: list[bytes] | None = (
            [] if observe_body is not None and "text/event-stream" not in content_type else None
        )
        kept = 0
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if whole is not None:
                    kept += len(chunk)
                    if kept > _RESPONSE_BUFFER_LIMIT:
                        whole = None
                    else:
                        whole.append(chunk)
                if observe_tail is not None:
                    tail = (tail + chunk)[-_TAIL_BYTES:]
                end = chunk[-done_len:] if len(chunk) >= done_len else (end + chunk)[-done_len:]
                relayed.complete = end == _SSE_DONE
        except ConnectionResetError:  # the client went away (aiohttp's reset error included)
            raise _ClientGone(response) from None
        except (TimeoutError, aiohttp.ClientError):
            # The upstream broke mid-stream. End the client's stream the same way the
            # router does (no terminating chunk, no [DONE]) without an error traceback.
            rt.metrics.upstream_error("midstream")
            upstream.close()
            if request.transport is not None:
                request.transport.abort()
            return self._count(path, response)
        relayed.complete = True
        # The client may hang up before the chunked terminator, as streaming clients
        # often do once they have read [DONE]: everything was relayed, nothing to abort.
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        if observe_tail is not None and upstream.status == 200:
            observe_tail(tail)
        if whole is not None and observe_body is not None and upstream.status == 200:
            observe_body(b"".join(whole))
        return self._count(path, response)

    # ------------------------------------------------------------- session close
    async def close_session_api(self, request: web.Request, path_sid: str | None) -> web.Response:
        """``POST /close_session {"session_id": ...}``: SGLang's API, served by the proxy.

        Under ``/sessions/{id}/`` the path names the session and the body may be empty;
        a body naming another session is refused.
        """
        raw = await request.read()
        sid: object = None
        if raw.strip():
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError:
                doc = None
            if not isinstance(doc, dict):
                return error_response(
                    ErrorType.INVALID_REQUEST, "body must be a JSON object with a session_id"
                )
            sid = doc.get("session_id")
        if path_sid is not None:
            if sid is not None and sid != path_sid:
                return error_response(
                    ErrorType.INVALID_REQUEST,
                    f"body session_id {sid!r} does not match the path's session {path_sid!r}",
                )
            sid = path_sid
        if not isinstance(sid, str):
            return error_response(
                ErrorType.INVALID_REQUEST, "body must be a JSON object with a string session_id"
            )
        return await self._close(sid, reason="close_session")

    async def close_session_passthrough(
        self, request: web.Request, path_sid: str | None, started: float
    ) -> web.StreamResponse:
        """Lifecycle off, admission on: the session's KV stops counting as resident,
        and the request goes to the router as it came (the router gives its own answer)."""
        raw = await request.read()
        doc = parse_object(raw)
        sid = doc.get("session_id") if doc is not None else None
        sid = sid if isinstance(sid, str) else path_sid
        if sid is not None:
            self.rt.admission.end_session(sid)
        return await self.forward(request, "/close_session", raw, started=started)

    async def close_session_admin(self, request: web.Request) -> web.Response:
        """``POST /kvproxy/sessions/{session_id}/close``."""
        if not self.rt.config.session_lifecycle.enabled:
            return error_response(
                ErrorType.INVALID_REQUEST,
                "session lifecycle is disabled (session_lifecycle.enabled: false)",
            )
        return await self._close(request.match_info["session_id"], reason="admin")

    async def _close(self, session_id: str, *, reason: str) -> web.Response:
        try:
            validate_session_id(
                session_id,
                source="close",
                max_length=self.rt.config.session_lifecycle.id_max_length,
            )
        except InvalidSessionId as exc:
            return error_response(ErrorType.INVALID_SESSION_ID, str(exc))
        result = await self.rt.sessions.close(session_id, reason=reason)
        return web.Response(body=orjson.dumps(result.to_json()), content_type="application/json")


def _too_large(limit: int) -> web.Response:
    return error_response(
        ErrorType.BODY_TOO_LARGE, f"request body exceeds server.max_body_bytes ({limit} bytes)"
    )


__all__ = ["INTERCEPTED_PATHS", "ProxyHandlers"]
