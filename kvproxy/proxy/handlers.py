"""HTTP handlers: thin glue between aiohttp and the pure request pipeline.

A request's path is checked once (:func:`kvproxy.paths.path_problem`: one canonical
form), then it goes to ``router.url`` unchanged if ``router.forward_paths`` has its path
(:class:`kvproxy.proxy.gate.ForwardGate`; else kvproxy's 404), unless it is one of the
intercepted LLM endpoints. Those are decided by
:func:`kvproxy.proxy.pipeline.plan_request` (pure) and the plan is carried out by
:class:`kvproxy.proxy.turn.TurnFlow` (the order: count the injection, open the Dynamo
turn, track the request, wait for admission, send, release) through the Dynamo layer
(:class:`kvproxy.proxy.dynamo_layer.DynamoLayer`, the Dynamo turn's decisions), with
this module as their transport: :class:`ProxyHandlers` says what a client disconnect
aborts, puts the admission decision's headers on the response, sends one
:class:`Exchange` upstream, the planned fields spliced into the raw bytes, the response
streamed back chunk by chunk (its usage, read from the tail, goes to admission), and
relays a Dynamo turn in streaming-session form (:mod:`kvproxy.dynamo.relay`).

With both features off the body is not even parsed: the bytes forwarded are the
bytes received. Refusals are raised as :class:`~kvproxy.proxy.refusals.Refused`;
:meth:`ProxyHandlers.dispatch` maps them and counts every response once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import Decision
from kvproxy.config import LiveConfig
from kvproxy.credentials import bearer_matches
from kvproxy.dynamo.control import Dynamo, Translated, Turn
from kvproxy.dynamo.relay import relay_translated
from kvproxy.headers import forward_request_headers, forward_response_headers
from kvproxy.paths import encoded_path, encoded_query, path_problem
from kvproxy.plane import origin_allowed
from kvproxy.proxy.body import BodyParts, parse_object
from kvproxy.proxy.dynamo_layer import turn_flow
from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.gate import ForwardGate
from kvproxy.proxy.metrics import ProxyMetrics
from kvproxy.proxy.pipeline import (
    CLOSE_LIFECYCLE,
    CLOSE_RESIDENCY,
    Plan,
    Refusal,
    close_route,
    close_target,
    plan_request,
    read_body,
    render_body,
)
from kvproxy.proxy.refusals import Refused, json_body, refusal_response
from kvproxy.proxy.relaying import (
    RESPONSE_BUFFER_LIMIT,
    Keep,
    observe_streamed,
    observe_tail_usage,
    payload,
    usage_readers,
)
from kvproxy.proxy.responses import error_response
from kvproxy.proxy.turn import ObserveUsage, TurnFlow
from kvproxy.proxy.usage import usage_from_body
from kvproxy.sessions.identity import (
    InvalidSessionId,
    split_session_path,
    validate_session_id,
)
from kvproxy.sessions.lifecycle import SessionManager, TrackedRequest

log = logging.getLogger(__name__)

INTERCEPTED_PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})
# Bodies up to this size are read whole before forwarding; larger ones are streamed.
_BUFFER_LIMIT = 256 * 1024

# The last event of an SGLang or OpenAI-compatible stream. Once it has been relayed the
# engine has finished the request: a client hanging up afterwards aborts nothing.
_SSE_DONE = b"data: [DONE]\n\n"
_DONE_LEN = len(_SSE_DONE)
_SSE = "text/event-stream"


class Exchange:
    """One request on its way upstream: what was received, what the turn's notifications
    said (what a client disconnect aborts, admission's decision and usage observer),
    and whether its whole response was relayed."""

    __slots__ = (
        "complete",
        "observe_usage",
        "on_disconnect",
        "path",
        "raw",
        "request",
        "response_headers",
        "started",
        "waited",
    )

    def __init__(
        self, request: web.Request, path: str, started: float, raw: bytes | None = None
    ) -> None:
        self.request = request
        self.path = path
        self.started = started
        self.raw = raw  # an intercepted request's body as received
        self.waited = 0.0  # seconds spent in the admission queue (not proxy overhead)
        self.response_headers: Mapping[str, str] | None = None
        self.on_disconnect: Callable[[], None] | None = None
        self.observe_usage: ObserveUsage | None = None
        self.complete = False  # the whole response (through [DONE]) was relayed

    def disconnected(self) -> None:
        if self.on_disconnect is not None and not self.complete:
            self.on_disconnect()


class _ClientGone(Exception):
    """The client closed its connection while its response was being streamed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def _too_large(limit: int) -> Refused:
    return Refused(
        ErrorType.BODY_TOO_LARGE, f"request body exceeds server.max_body_bytes ({limit} bytes)"
    )


def _admission_headers(action: str, reason: str, wait_s: float) -> Mapping[str, str]:
    """The admission decision's response headers (read, never written: a decision made
    at once, most of them, shares one mapping per action and reason)."""
    if wait_s == 0.0:
        cached = _UNWAITED_HEADERS.get((action, reason))
        if cached is not None:
            return cached
    headers = MappingProxyType(
        {
            "X-KVProxy-Admission": action if action == "admit" else f"bypass; reason={reason}",
            "X-KVProxy-Admission-Wait-Ms": f"{wait_s * 1000:.1f}",
            "X-KVProxy-Admission-Decision": reason,
        }
    )
    if wait_s == 0.0 and len(_UNWAITED_HEADERS) < _UNWAITED_HEADERS_MAX:
        _UNWAITED_HEADERS[action, reason] = headers
    return headers


# The headers of decisions made without a wait, by (action, reason): a few dozen pairs.
_UNWAITED_HEADERS: dict[tuple[str, str], Mapping[str, str]] = {}
_UNWAITED_HEADERS_MAX = 64


@dataclass
class Shutdown:
    """Set once the server starts shutting down: new requests get 503 ``shutting_down``."""

    started: bool = False


class ProxyHandlers:
    """The proxy's request handlers, given the resources they use (:mod:`kvproxy.keys`)."""

    def __init__(
        self,
        *,
        live: LiveConfig,
        http: aiohttp.ClientSession,
        sessions: SessionManager,
        admission: AdmissionController,
        dynamo: Dynamo,
        metrics: ProxyMetrics,
        shutdown: Shutdown,
    ) -> None:
        self.live = live
        self.http = http
        self.sessions = sessions
        self.admission = admission
        self.dynamo = dynamo
        self.metrics = metrics
        self.shutdown = shutdown
        # The intercepted request's turn, through the Dynamo layer down to this
        # object's methods (its transport).
        self.turns: TurnFlow[Exchange, Turn, web.StreamResponse, TrackedRequest] = turn_flow(
            sessions, admission, dynamo, live, self
        )
        # Request body bytes held in memory now (server.max_buffered_bytes).
        self.buffered = 0
        # Which paths go to the router (router.forward_paths, the control-plane opt-in).
        self.gate = ForwardGate(live)

    # ------------------------------------------------------------------ dispatch
    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        """Catch-all route: strip ``/sessions/{id}``, then intercept or pass through.

        Every response, a refusal included, is counted once in ``kvproxy_requests_total``
        by the path after ``/sessions/{id}`` (the path as received when it is refused
        before that prefix is read)."""
        started = time.perf_counter()
        counted = request.path
        try:
            if self.shutdown.started:
                raise Refused(ErrorType.SHUTTING_DOWN, "kvproxy is shutting down")
            problem = path_problem(request.raw_path)
            if problem is not None:
                raise Refused(ErrorType.INVALID_PATH, f"{problem}: refused")
            path_sid, path = self._session_path(request)
            counted = path
            response = await self._route(request, path, path_sid, started)
        except Refused as exc:
            response = refusal_response(exc)
        self.metrics.count(counted, response.status)
        return response

    def _session_path(self, request: web.Request) -> tuple[str | None, str]:
        try:
            return split_session_path(request.path)
        except InvalidSessionId as exc:
            if self.live.config.session_lifecycle.enabled:
                raise Refused(ErrorType.INVALID_SESSION_ID, str(exc)) from None
            # The feature is off: nothing reads the id, so the path goes as it came.
            return None, request.path

    def _route(
        self, request: web.Request, path: str, path_sid: str | None, started: float
    ) -> Awaitable[web.StreamResponse]:
        """The handler's coroutine for ``path`` (returned, not awaited: one coroutine
        fewer on every request)."""
        rules = self.gate.rules()
        if request.method == "POST":
            if path in INTERCEPTED_PATHS and rules.allows(path):
                return self.intercepted(request, path, path_sid, started)
            if path == "/close_session":
                route = close_route(self.live.config)
                if route == CLOSE_LIFECYCLE:
                    return self.close_session_api(request, path_sid)
                if route == CLOSE_RESIDENCY:
                    return self.close_session_passthrough(request, path_sid, started)
        if rules.allows(path) or self.gate.control_plane(request, path):
            return self.passthrough(request, path, started)
        raise Refused(
            ErrorType.NOT_FOUND,
            f"{request.method} {path}: not forwarded (not in router.forward_paths)",
        )

    # --------------------------------------------------------------- passthrough
    async def passthrough(
        self, request: web.Request, path: str, started: float
    ) -> web.StreamResponse:
        length = request.content_length
        max_body = self.live.config.server.max_body_bytes
        if length is not None and length > max_body:
            raise _too_large(max_body)
        if not request.body_exists:
            return await self.send_upstream(Exchange(request, path, started), None)
        if length is not None and length > _BUFFER_LIMIT:
            # Stream it; Content-Length is kept.
            extra = {"Content-Length": str(length)}
            return await self.send_upstream(
                Exchange(request, path, started), request.content, extra
            )
        held = self._hold(length or 0)
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise _too_large(max_body) from None
            if length is None:
                held = self._hold(len(body))
            return await self.send_upstream(Exchange(request, path, started), body)
        finally:
            self.buffered -= held

    def _hold(self, size: int) -> int:
        """Count ``size`` body bytes against ``server.max_buffered_bytes`` (the bodies
        held in memory, all requests together); past it 503 overloaded. Returns ``size``:
        the caller gives it back (``self.buffered -= size``) when the request is done."""
        limit = self.live.config.server.max_buffered_bytes
        if limit and self.buffered + size > limit:
            raise Refused(
                ErrorType.OVERLOADED,
                f"request bodies held in memory are at server.max_buffered_bytes ({limit})",
            )
        self.buffered += size
        return size

    # --------------------------------------------------------------- intercepted
    async def intercepted(
        self, request: web.Request, path: str, path_sid: str | None, started: float
    ) -> web.StreamResponse:
        length = request.content_length
        max_body = self.live.config.server.max_body_bytes
        if length is not None and length > max_body:
            raise _too_large(max_body)
        held = self._hold(length or 0)
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise _too_large(max_body) from None
            if length is None:
                held = self._hold(len(raw))
            return await self._intercept(request, path, path_sid, started, raw)
        finally:
            self.buffered -= held

    def _intercept(
        self, request: web.Request, path: str, path_sid: str | None, started: float, raw: bytes
    ) -> Awaitable[web.StreamResponse]:
        cfg = self.live.config
        if not (cfg.session_lifecycle.enabled or cfg.admission.enabled):
            return self.send_upstream(Exchange(request, path, started), raw)
        # Read only what a decision needs: token-id arrays are not built.
        body = read_body(cfg, path, raw)
        plan = plan_request(cfg, path, path_sid, request.headers, body)
        if isinstance(plan, Refusal):
            raise Refused.of(plan)
        if plan.passthrough:  # not a JSON object: the bytes as received
            return self.send_upstream(Exchange(request, path, started), raw)
        return self.turns.run(Exchange(request, path, started, raw), plan, path, request.headers)

    # ----------------------------- the turn's transport (kvproxy.proxy.dynamo_layer)
    def received(self, ex: Exchange) -> tuple[str, Mapping[str, str]]:
        return ex.path, ex.request.headers

    def entered(self, ex: Exchange, plan: Plan, tracked: TrackedRequest | None) -> None:
        """What a client disconnect aborts: the tracked request, or the plan's rids."""
        if tracked is not None:
            ex.on_disconnect = tracked.disconnected
        else:
            ex.on_disconnect = functools.partial(self.sessions.abort_in_background, plan.abort_rids)

    def decided(self, ex: Exchange, decision: Decision, observe: ObserveUsage | None) -> None:
        """The admission decision's headers go on the response; ``observe`` reads its usage."""
        ex.waited = decision.wait_s
        if decision.action != "pass":
            ex.response_headers = _admission_headers(
                decision.action, decision.reason, decision.wait_s
            )
        ex.observe_usage = observe

    def forward(
        self,
        ex: Exchange,
        plan: Plan,
        fields: Mapping[str, Any],
        source: str | None,
        keep: Keep | None,
    ) -> Awaitable[web.StreamResponse]:
        """The planned request, its fields spliced into the bytes received."""
        assert ex.raw is not None
        body = render_body(ex.raw, plan, fields)
        return self.send_upstream(ex, body, plan.headers or None, keep)

    def answered(self, response: web.StreamResponse) -> bool:
        return response.status == 200

    def sent_headers(self, ex: Exchange, plan: Plan) -> Mapping[str, str]:
        return forward_request_headers(
            ex.request, plan.headers or None, self.live.config.server.admin_token
        )

    def relay(
        self, ex: Exchange, out: bytes, headers: Mapping[str, str], streamed: bool, sid: str
    ) -> Awaitable[Translated[web.StreamResponse]]:
        url = self.live.router_base + "/generate"
        return relay_translated(self.http, url, ex.request, out, headers, streamed, sid)

    def observe_tail(self, ex: Exchange, tail: bytes) -> None:
        observe_tail_usage(ex.observe_usage, tail)

    # ------------------------------------------------------------------- forward
    async def send_upstream(
        self,
        ex: Exchange,
        body: bytes | BodyParts | aiohttp.StreamReader | None,
        extra_headers: Mapping[str, str] | None = None,
        keep: Keep | None = None,
    ) -> web.StreamResponse:
        """Send one request upstream, stream its response back (a 200's kept in ``keep``)."""
        request = ex.request
        url = _upstream_url(self.live.router_base, ex.path, request.rel_url.raw_query_string)
        headers = forward_request_headers(
            request, extra_headers, self.live.config.server.admin_token
        )
        sent, sent_at = payload(body), time.perf_counter()
        try:
            upstream_cm = self.http.request(
                request.method, url, data=sent, headers=headers, allow_redirects=False
            )
            upstream = await upstream_cm.__aenter__()
        except asyncio.CancelledError:
            if ex.on_disconnect is not None:
                ex.on_disconnect()
            raise
        except (TimeoutError, aiohttp.ServerTimeoutError):
            self.metrics.upstream_error("timeout")
            raise Refused(
                ErrorType.ROUTER_TIMEOUT, f"router did not answer in time ({self.live.router_base})"
            ) from None
        except aiohttp.ClientError as exc:
            self.metrics.upstream_error("unreachable")
            raise Refused(
                ErrorType.ROUTER_UNREACHABLE,
                f"cannot reach the router at {self.live.router_base}: {exc}",
            ) from None
        try:
            return await self._relay(ex, upstream, sent_at, keep)
        except asyncio.CancelledError:
            # Client went away (handler cancellation): drop the upstream connection so the
            # router stops too, and tell the engines if the session feature tracks the rid.
            upstream.close()
            ex.disconnected()
            raise
        except _ClientGone as gone:
            # The client closed its connection mid-response: a normal event, not an
            # error. aiohttp finishes a response whose peer is gone quietly.
            upstream.close()
            ex.disconnected()
            return gone.response
        finally:
            await upstream_cm.__aexit__(None, None, None)

    def _relay(
        self,
        ex: Exchange,
        upstream: aiohttp.ClientResponse,
        sent_at: float,
        keep: Keep | None,
    ) -> Awaitable[web.StreamResponse]:
        """The response's relay: buffered (a known length up to the limit, not an event
        stream) or streamed chunk by chunk. Returns the relay's coroutine."""
        headers = forward_response_headers(upstream.headers)
        if ex.response_headers:
            headers.update(ex.response_headers)
        length = upstream.content_length
        event_stream = _SSE in upstream.headers.get("Content-Type", "")
        overhead = sent_at - ex.started - ex.waited
        if length is not None and length <= RESPONSE_BUFFER_LIMIT and not event_stream:
            return self._relay_buffered(ex, upstream, headers, overhead, keep)
        return self._relay_streamed(ex, upstream, headers, overhead, event_stream, keep)

    async def _relay_streamed(
        self,
        ex: Exchange,
        upstream: aiohttp.ClientResponse,
        headers: CIMultiDict[str],
        overhead: float,
        event_stream: bool,
        keep: Keep | None,
    ) -> web.StreamResponse:
        """Relay chunk by chunk, the usage read as the chunks pass and a 200's reported
        once: at its ``[DONE]`` (a client that hangs up once it has read it, the upstream
        still open, cancels this), else at the upstream's end, before the client's."""
        length = upstream.content_length
        headers_at = time.perf_counter()
        response = web.StreamResponse(status=upstream.status, headers=headers)
        if length is not None:
            response.content_length = length
        await response.prepare(ex.request)
        self.metrics.added_latency.observe(overhead + (time.perf_counter() - headers_at))
        ok = upstream.status == 200
        window, whole = usage_readers(ex.path, ex.observe_usage, keep, event_stream, ok)
        reported = not ok  # only a 200 is reported, once
        end = b""  # the stream's last bytes, to recognise its final [DONE] event
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if whole is not None:
                    whole.feed(chunk)
                if window is not None:
                    window.feed(chunk)
                end = chunk[-_DONE_LEN:] if len(chunk) >= _DONE_LEN else (end + chunk)[-_DONE_LEN:]
                ex.complete = end == _SSE_DONE
                if ex.complete and not reported:
                    reported = True
                    observe_streamed(ex.observe_usage, keep, window, whole)
        except ConnectionResetError:  # the client went away (aiohttp's reset error included)
            raise _ClientGone(response) from None
        except (TimeoutError, aiohttp.ClientError):
            self._broke_midstream(ex, upstream)
            return response
        ex.complete = True
        if not reported:  # no [DONE] in it
            observe_streamed(ex.observe_usage, keep, window, whole)
        # The client may hang up before the chunked terminator, as streaming clients
        # often do once they have read [DONE]: everything was relayed, nothing to abort.
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _broke_midstream(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> None:
        """The upstream broke mid-stream. The client's stream ends the same way the
        router ends it (no terminating chunk, no [DONE]), without an error traceback."""
        self.metrics.upstream_error("midstream")
        upstream.close()
        if ex.request.transport is not None:
            ex.request.transport.abort()

    async def _relay_buffered(
        self,
        ex: Exchange,
        upstream: aiohttp.ClientResponse,
        headers: Mapping[str, str],
        overhead: float,
        keep: Keep | None,
    ) -> web.StreamResponse:
        try:
            data = await upstream.read()
        except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            self.metrics.upstream_error("midstream")
            raise Refused(
                ErrorType.ROUTER_UNREACHABLE,
                f"the router's response broke off: {type(exc).__name__}",
            ) from None
        read_at = time.perf_counter()
        response = web.Response(status=upstream.status, headers=headers, body=data)
        self.metrics.added_latency.observe(overhead + (time.perf_counter() - read_at))
        if upstream.status == 200:
            if ex.observe_usage is not None:
                ex.observe_usage(usage_from_body(data))
            if keep is not None:
                keep.body(data)
        return response

    # ------------------------------------------------------------- session close
    async def close_session_api(self, request: web.Request, path_sid: str | None) -> web.Response:
        """``POST /close_session {"session_id": ...}``: SGLang's API, served by the proxy.

        Under ``/sessions/{id}/`` the path names the session and the body may be empty;
        a body naming another session is refused. A body must be JSON (415), and a
        session bound to a credential is closed only with it or the admin token (403).
        """
        sid = close_target(await json_body(request), path_sid)
        if isinstance(sid, Refusal):
            raise Refused.of(sid)
        self._check_may_close(request, sid)
        return await self._close(sid, reason="close_session")

    def _check_may_close(self, request: web.Request, session_id: str) -> None:
        """Refuse (403) a close by another credential than the session's own (the admin
        bearer token may close any session)."""
        server = self.live.config.server
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(
            request.method, origin, f"{request.scheme}://{request.host}", server.admin_origins
        ):
            raise Refused(ErrorType.FORBIDDEN, f"cross-origin close from {origin!r} refused")
        token = server.admin_token
        if token is not None and bearer_matches(token, request.headers.get("Authorization")):
            return
        if not self.sessions.may_close(session_id, request.headers):
            raise Refused(
                ErrorType.FORBIDDEN,
                f"session {session_id!r} was opened with another credential: send that "
                "credential, or the admin token",
            )

    async def close_session_passthrough(
        self, request: web.Request, path_sid: str | None, started: float
    ) -> web.StreamResponse:
        """Lifecycle off, admission on: the session's KV stops counting as resident,
        and the request goes to the router as it came (the router gives its own answer)."""
        raw = await json_body(request)
        doc = parse_object(raw)
        sid = doc.get("session_id") if doc is not None else None
        sid = sid if isinstance(sid, str) else path_sid
        if sid is not None:
            self.admission.end_session(sid)
        return await self.send_upstream(Exchange(request, "/close_session", started), raw)

    async def close_session_admin(self, request: web.Request) -> web.Response:
        """``POST /kvproxy/sessions/{session_id}/close``."""
        if not self.live.config.session_lifecycle.enabled:
            return error_response(
                ErrorType.INVALID_REQUEST,
                "session lifecycle is disabled (session_lifecycle.enabled: false)",
            )
        try:
            await json_body(request)
            session_id = request.match_info["session_id"]
            self._check_may_close(request, session_id)
            return await self._close(session_id, reason="admin")
        except Refused as exc:
            return refusal_response(exc)

    async def _close(self, session_id: str, *, reason: str) -> web.Response:
        try:
            validate_session_id(
                session_id,
                source="close",
                max_length=self.live.config.session_lifecycle.id_max_length,
            )
        except InvalidSessionId as exc:
            raise Refused(ErrorType.INVALID_SESSION_ID, str(exc)) from None
        result = await self.sessions.close(session_id, reason=reason)
        return web.Response(body=orjson.dumps(result.to_json()), content_type="application/json")


def _upstream_url(router_base: str, path: str, query: str) -> URL:
    """The path routed on, encoded, and the query as received: never re-parsed."""
    if query:
        return URL(f"{router_base}{encoded_path(path)}?{encoded_query(query)}", encoded=True)
    return _url_of_path(router_base, path)


@functools.lru_cache(maxsize=1024)
def _url_of_path(router_base: str, path: str) -> URL:
    """The upstream URL of a routed path without a query (built once per path)."""
    return URL(router_base + encoded_path(path), encoded=True)


__all__ = ["INTERCEPTED_PATHS", "Exchange", "ProxyHandlers", "Shutdown"]
