"""kvproxy in the lab: the server's own session, admission and Dynamo objects, without HTTP.

The adapter between the lab's clients and engines. It builds the same objects the
proxy's app factory builds (``kvproxy.app``): a
:class:`~kvproxy.sessions.lifecycle.SessionManager`, an
:class:`~kvproxy.admission.coordinator.AdmissionController` and a
:class:`~kvproxy.dynamo.control.Dynamo`, with the same config types, wired the same
way (a finished close ends the session's admission residency and its Dynamo state).
Only the HTTP edges are replaced:

- the controller's ``_scrape(url)`` returns the lab engine's ``/metrics`` text
  (rendered by the simulator's metrics code), so kvproxy's real metric parsing,
  ledger and FIFOs run;
- the session manager's and the controller's ``http`` is :class:`_EngineHttp`, an
  in-process :class:`~kvproxy.fleet.client.EngineHttp` that delivers
  ``/close_session`` and ``/abort_request`` to every lab engine (the fan-out code,
  ``post_to_all``, is kvproxy's own);
- :meth:`LabProxy.generate` is :meth:`kvproxy.proxy.handlers.ProxyHandlers.intercepted`
  without the socket: the same pure pipeline (:func:`kvproxy.proxy.pipeline.plan_request`:
  identity, injection, admission class and routing key, priority), then the proxy's
  own turn (:class:`kvproxy.proxy.turn.TurnFlow`: request tracking, admission wait,
  send, usage report, release) through its Dynamo layer
  (:class:`kvproxy.proxy.dynamo_layer.DynamoLayer`: ``nvext`` bind timers, streaming
  sessions, speculative prefills, over the server's own
  :class:`~kvproxy.dynamo.control.Dynamo`), with this object as their transport: the
  forwarded body goes to the router's placement and then to the chosen engine, and
  ``/open_session`` to the engine it names;
- :meth:`LabProxy.close_session` is the proxy's ``POST /close_session`` dispatch.

Everything HTTP-bound lives in this one module (the integrator adapts it when the
admission call pattern changes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import MappingProxyType, TracebackType
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from kvlab.lab.engines import EngineError, LabEngine
from kvlab.lab.faults import FAULTS, ScrapeFailed, SignalFault
from kvlab.lab.router import Placement
from kvlab.sim.responses import generate_body
from kvlab.sim.scheduler import SimRequest
from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import Decision
from kvproxy.config import Config, LiveConfig
from kvproxy.dynamo.control import Dynamo, Translated, Turn
from kvproxy.proxy.dynamo_layer import turn_flow
from kvproxy.proxy.pipeline import (
    CLOSE_LIFECYCLE,
    CLOSE_RESIDENCY,
    Plan,
    Refusal,
    close_route,
    plan_request,
)
from kvproxy.proxy.refusals import Refused
from kvproxy.proxy.relaying import Keep, observe_tail_usage
from kvproxy.proxy.turn import ObserveUsage, TurnFlow
from kvproxy.proxy.usage import Usage
from kvproxy.sessions.lifecycle import SessionManager, TrackedRequest
from kvproxy.wiring import Features


class ProxyError(Exception):
    """What the proxy (or the engine behind it) answered instead of a completion."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


class _Response:
    """An :class:`~kvproxy.fleet.client.EngineResponse`: a status and a short text."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: str = "") -> None:
        self.status = status
        self.body = body

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def read(self) -> bytes:
        return self.body.encode()

    async def text(self, encoding: str | None = None, errors: str = "strict") -> str:
        return self.body

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise aiohttp.ClientError(f"HTTP {self.status}")


@asynccontextmanager
async def _routed(engine: LabEngine, body: dict[str, Any]) -> AsyncIterator[_Response]:
    """A request posted to the lab's router: sent to the engine its routing key's
    placement picks, answered 200 once the engine finished it (502 on an engine error)."""
    try:
        await engine.generate(body)
    except EngineError:
        yield _Response(502)
        return
    yield _Response(200)


# The router's URL in the lab: what admission's prefetches are posted to.
LAB_ROUTER_URL = "http://lab-router"


class _EngineHttp:
    """``http.post(url, data=...)`` delivered to the lab engine that owns ``url``, or
    through the placement for the lab's router (an :class:`~kvproxy.fleet.client.EngineHttp`)."""

    def __init__(self, engines: Mapping[str, LabEngine], placement: Placement) -> None:
        self._engines = engines
        self._placement = placement
        self.posts = 0

    def post(
        self,
        url: str,
        *,
        data: Any = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> AbstractAsyncContextManager[_Response]:
        self.posts += 1
        doc = json if json is not None else orjson.loads(data) if data is not None else {}
        if url.startswith(LAB_ROUTER_URL + "/"):
            engine = self._engines[self._placement.pick(headers or {})]
            return _routed(engine, doc)
        for base, engine in self._engines.items():
            if url.startswith(base + "/"):
                path = url[len(base) :]
                if path == "/open_session":
                    timeout_s = doc.get("timeout")
                    error = engine.open_session(
                        str(doc["session_id"]),
                        streaming=bool(doc.get("streaming")),
                        timeout_s=float(timeout_s) if timeout_s is not None else None,
                    )
                    return _Response(200) if error is None else _Response(400, error)
                if path == "/close_session":
                    engine.close_session(str(doc["session_id"]))
                    return _Response(200)
                if path == "/abort_request":
                    engine.abort(str(doc.get("rid") or ""), abort_all=bool(doc.get("abort_all")))
                    return _Response(200)
                return _Response(404)
        return _Response(502)

    def get(self, url: str, *, timeout: aiohttp.ClientTimeout | None = None) -> _Response:
        """Nothing is read over HTTP in the lab (metrics and server info are read in
        process): a caller sees an unreachable engine."""
        raise aiohttp.ClientConnectionError(f"{url}: no HTTP reads in the lab")


class _LabFleet:
    """The lab's engines as the fleet sees them: all healthy, all on the router's ring."""

    __slots__ = ("_ring", "_urls")

    def __init__(self, urls: tuple[str, ...]) -> None:
        self._urls = urls
        self._ring = (urls, urls)

    def all_engines(self) -> tuple[str, ...]:
        return self._urls

    def healthy_engines(self) -> tuple[str, ...]:
        return self._urls

    def ring_workers(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self._ring


class _LabRequest:
    """One intercepted request in the lab, as its turn carries it: the path, the
    headers (the planned ones added when it is sent), the body, and what admission
    decided."""

    __slots__ = ("body", "headers", "observe", "path", "wait_s")

    def __init__(self, path: str, headers: CIMultiDict[str], body: dict[str, Any]) -> None:
        self.path = path
        self.headers = headers
        self.body = body
        self.wait_s: float | None = None  # the admission wait (None: admission did not act)
        self.observe: ObserveUsage | None = None


# No fields, no headers (never written).
_NONE: Mapping[str, Any] = MappingProxyType({})


class LabProxy:
    """The proxy's interception pipeline over lab engines (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        engines: Sequence[LabEngine],
        placement: Placement,
        fault: SignalFault = FAULTS["none"],
        seed: int = 0,
    ) -> None:
        # The proxy's config as deployed in front of the lab's router: its placement
        # policy and URL, and no engine session-mode probe (that reads /server_info over
        # HTTP: the lab's engines are known).
        router = dataclasses.replace(config.router, policy=placement.policy, url=LAB_ROUTER_URL)
        lifecycle = dataclasses.replace(config.session_lifecycle, check_engines=False)
        self.config = dataclasses.replace(config, router=router, session_lifecycle=lifecycle)
        self.fault = fault
        self._fault_rng = random.Random(seed)
        self.engines = {e.url: e for e in engines}
        self.placement = placement
        self.http = _EngineHttp(self.engines, placement)
        self.features: Features | None = None
        self.sessions: SessionManager | None = None
        self.admission: AdmissionController | None = None
        self.dynamo: Dynamo | None = None
        self._turns: TurnFlow[_LabRequest, Turn, SimRequest, TrackedRequest] | None = None
        self.decisions: dict[str, int] = {}
        # Injected priorities (value -> requests), for the run's summary.
        self.priorities: dict[int, int] = {}

    def _build(self) -> Features:
        """The features built as :mod:`kvproxy.app` builds them (:class:`kvproxy.wiring.Features`),
        over the lab's edges: the engines as the fleet (all available: the lab's engines
        never fail), the virtual clock, each engine's exposition and ``/server_info`` read
        in process."""
        clock = asyncio.get_running_loop().time
        features = self.features = Features(
            LiveConfig(self.config),
            http=self.http,
            fleet=_LabFleet(tuple(self.engines)),
            clock=clock,
            timers=clock,
            fetch_metrics=self._scrape,
            server_info={url: e.server_info() for url, e in self.engines.items()},
        )
        self.sessions, self.admission, self.dynamo = (
            features.sessions,
            features.admission,
            features.dynamo,
        )
        self._turns = turn_flow(
            features.sessions, features.admission, features.dynamo, features.live, self
        )
        return features

    @asynccontextmanager
    async def running(self) -> AsyncIterator[LabProxy]:
        """The engines' drivers and the proxy started; on exit the proxy stopped, then
        the engines (also when the proxy failed to start)."""
        for e in self.engines.values():
            e.start()
        try:
            async with self._build().running():
                yield self
        finally:
            for e in self.engines.values():
                await e.stop()

    async def _scrape(self, url: str) -> str:
        loop = asyncio.get_running_loop()
        if self.fault.failing(loop.time()):
            raise ScrapeFailed(f"{url}/metrics: injected fault {self.fault.name!r}")
        text = self.engines[url].metrics_text()
        delay = self.fault.delay_s(self._fault_rng)
        if delay > 0:  # the reading arrives late, as it was when the scrape began
            await asyncio.sleep(delay)
        return text

    # -- the data plane ----------------------------------------------------------------

    async def generate(
        self, headers: Mapping[str, str], body: dict[str, Any], path: str = "/generate"
    ) -> tuple[SimRequest, float | None]:
        """One intercepted request, as ``ProxyHandlers.intercepted`` handles it: the
        finished engine request and the admission wait (None: admission did not act).

        The decisions are the proxy's own pure pipeline (:mod:`kvproxy.proxy.pipeline`),
        its turn (:mod:`kvproxy.proxy.turn`) and its Dynamo layer
        (:mod:`kvproxy.proxy.dynamo_layer`), this object their transport."""
        assert self._turns is not None
        req = _LabRequest(path, CIMultiDict(headers), body)
        plan = plan_request(self.config, path, None, req.headers, body)
        if isinstance(plan, Refusal):
            raise ProxyError(plan.status, plan.kind.value, plan.message)
        try:
            if plan.passthrough:  # as the handler forwards it: the body as received
                done = await self.forward(req, plan, _NONE, None, None)
            else:
                done = await self._turns.run(req, plan, path, req.headers)
        except Refused as exc:
            refusal = exc.refusal
            raise ProxyError(refusal.status, refusal.kind.value, refusal.message) from None
        return done, req.wait_s

    # -- the turn's transport (kvproxy.proxy.dynamo_layer.Transport) -------------------

    def received(self, req: _LabRequest) -> tuple[str, Mapping[str, str]]:
        return req.path, req.headers

    def entered(self, req: _LabRequest, plan: Plan, tracked: TrackedRequest | None) -> None:
        return None  # a lab client never disconnects

    def decided(self, req: _LabRequest, decision: Decision, observe: ObserveUsage | None) -> None:
        if decision.action != "pass":
            req.wait_s = decision.wait_s
        key = decision.action + ":" + decision.reason
        self.decisions[key] = self.decisions.get(key, 0) + 1
        req.observe = observe

    async def forward(
        self,
        req: _LabRequest,
        plan: Plan,
        fields: Mapping[str, Any],
        source: str | None,
        keep: Keep | None,
    ) -> SimRequest:
        """The forwarded body to the engine the router's placement picks."""
        if source == "steering":  # eviction steered by priority, as the handler splices it
            prio = fields["priority"]
            self.priorities[prio] = self.priorities.get(prio, 0) + 1
        req.headers.update(plan.headers)
        out = {**req.body, **fields} if fields else req.body
        engine = self.engines[self.placement.pick(req.headers)]
        try:
            done = await engine.generate(out)
        except EngineError as exc:
            raise ProxyError(exc.status, "engine_error", str(exc)) from None
        if req.observe is not None:
            # The engine's own usage report (meta_info of the final chunk).
            req.observe(
                Usage(
                    prompt_tokens=done.prompt_tokens,
                    completion_tokens=done.generated,
                    cached_tokens=done.cached_tokens,
                )
            )
        if keep is not None:
            keep.body(_answer(done))
        return done

    def answered(self, response: SimRequest) -> bool:
        return True  # an engine's refusal is raised (ProxyError), never answered

    def sent_headers(self, req: _LabRequest, plan: Plan) -> Mapping[str, str]:
        headers = CIMultiDict(req.headers)
        headers.update(plan.headers)
        return headers

    async def relay(
        self,
        req: _LabRequest,
        out: bytes,
        headers: Mapping[str, str],
        streamed: bool,
        sid: str,
    ) -> Translated[SimRequest]:
        """A turn in streaming-session form, to the engine the router's placement picks,
        answered whole (the lab's engines do not stream): the ordinary request follows
        when the engine refuses or aborts it."""
        engine = self.engines[self.placement.pick(headers)]
        try:
            done = await engine.generate(orjson.loads(out))
        except EngineError:
            return Translated(None)
        if (done.finish_reason or {}).get("type") == "abort":
            return Translated(None)
        data = _answer(done)
        assert done.out is not None
        ids = done.out.ids(done.generated)
        return Translated(done, True, ids, done.prompt_tokens, False, data, data)

    def observe_tail(self, req: _LabRequest, tail: bytes) -> None:
        observe_tail_usage(req.observe, tail)

    async def close_session(self, session_id: str) -> None:
        """``POST /close_session {"session_id"}`` sent to the proxy."""
        sessions, admission = self.sessions, self.admission
        assert sessions is not None and admission is not None
        route = close_route(self.config)
        if route == CLOSE_LIFECYCLE:
            await sessions.close(session_id, reason="close_session")
        elif route == CLOSE_RESIDENCY:
            # close_session_passthrough: residency ends; the router answers 404.
            admission.end_session(session_id)
        # CLOSE_ROUTER: the proxy forwards the call to the router, which answers 404.


def _answer(done: SimRequest) -> bytes:
    """A finished request's ``/generate`` answer, as the simulator's HTTP engine writes it."""
    assert done.out is not None
    ids = done.out.ids(done.generated)
    return orjson.dumps(generate_body(done, ids, done.generated, done.finish_reason, False))
