"""kvproxy in the lab: the server's own session and admission objects, without HTTP.

The adapter between the lab's clients and engines. It builds the same two objects
the proxy's app factory builds (``kvproxy.app``): a
:class:`~kvproxy.sessions.lifecycle.SessionManager` and an
:class:`~kvproxy.admission.coordinator.AdmissionController`, with the same config
types, wired the same way (a finished close ends the session's admission
residency). Only the HTTP edges are replaced:

- the controller's ``_scrape(url)`` returns the lab engine's ``/metrics`` text
  (rendered by the simulator's metrics code), so kvproxy's real metric parsing,
  ledger and FIFOs run;
- the session manager's ``http`` is :class:`_EngineHttp`, an in-process stand-in
  for ``aiohttp.ClientSession.post`` that delivers ``/close_session`` and
  ``/abort_request`` to every lab engine (the fan-out code, ``post_to_all``, is
  kvproxy's own);
- :meth:`LabProxy.generate` is :meth:`kvproxy.proxy.handlers.ProxyHandlers.intercepted`
  without the socket: the same pure pipeline (:func:`kvproxy.proxy.pipeline.plan_request`:
  identity, injection, admission class and routing key, priority), then request
  tracking, admission wait and usage report, in the same order; the forwarded
  body goes to the router's placement and then to the chosen engine;
- :meth:`LabProxy.close_session` is the proxy's ``POST /close_session`` dispatch.

Everything HTTP-bound lives in this one module (the integrator adapts it when the
admission call pattern changes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any

import orjson
from multidict import CIMultiDict

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import AdmissionRequest, Decision
from kvproxy.config import Config
from kvproxy.lab.engines import EngineError, LabEngine
from kvproxy.lab.faults import FAULTS, ScrapeFailed, SignalFault
from kvproxy.lab.router import Placement
from kvproxy.proxy.pipeline import Plan, Refusal, final_fields, plan_request, with_turn_headers
from kvproxy.sessions.lifecycle import SessionClosed, SessionManager, TrackedRequest
from kvproxy.sim.scheduler import SimRequest


class ProxyError(Exception):
    """What the proxy (or the engine behind it) answered instead of a completion."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


class _Response:
    """The part of ``aiohttp.ClientResponse`` that ``post_to_all`` reads."""

    __slots__ = ("status",)

    def __init__(self, status: int) -> None:
        self.status = status

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
        return b""


class _EngineHttp:
    """``http.post(url, data=...)`` delivered to the lab engine that owns ``url``."""

    def __init__(self, engines: Mapping[str, LabEngine]) -> None:
        self._engines = engines
        self.posts = 0

    def post(self, url: str, *, data: bytes, **_: Any) -> _Response:
        self.posts += 1
        for base, engine in self._engines.items():
            if url.startswith(base + "/"):
                path = url[len(base) :]
                doc = orjson.loads(data)
                if path == "/close_session":
                    engine.close_session(str(doc["session_id"]))
                    return _Response(200)
                if path == "/abort_request":
                    engine.abort(str(doc.get("rid") or ""), abort_all=bool(doc.get("abort_all")))
                    return _Response(200)
                return _Response(404)
        return _Response(502)


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
        self.config = config
        self.fault = fault
        self._fault_rng = random.Random(seed)
        self.engines = {e.url: e for e in engines}
        self.placement = placement
        self.http = _EngineHttp(self.engines)
        self.identity_only = dataclasses.replace(config.session_lifecycle, enabled=True)
        self.sessions: SessionManager | None = None
        self.admission: AdmissionController | None = None
        self.decisions: dict[str, int] = {}
        # Injected priorities (value -> requests), for the run's summary.
        self.priorities: dict[int, int] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        urls = list(self.engines)
        cfg = self.config
        # The engine session-mode probe reads /server_info over HTTP: the lab's
        # engines are known, so it is off.
        lifecycle_cfg = dataclasses.replace(cfg.session_lifecycle, check_engines=False)
        self.sessions = SessionManager(
            lifecycle_cfg,
            all_engines=lambda: urls,
            http=self.http,  # type: ignore[arg-type]
            clock=loop.time,
            on_closed=self._session_closed,
        )
        # As kvproxy.app wires it: the router's policy as deployed, the worker URLs as
        # the router registered them (all available: the lab's engines never fail), and
        # each engine's /server_info (read over HTTP in the proxy; known here).
        ring = (tuple(urls), tuple(urls))
        self.admission = AdmissionController(
            cfg.admission,
            healthy_engines=lambda: urls,
            http=self.http,  # type: ignore[arg-type]
            fetch_metrics=self._scrape,  # each engine's exposition, read in process
            clock=loop.time,
            router_policy=self.placement.policy,
            workers=lambda: ring,
            server_info={url: e.server_info() for url, e in self.engines.items()},
            token_scale=cfg.server.token_scale,
        )
        await self.sessions.start()
        await self.admission.start()

    async def stop(self) -> None:
        if self.sessions is not None:
            await self.sessions.stop()
        if self.admission is not None:
            await self.admission.stop()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[LabProxy]:
        """The engines' drivers and the proxy started; on exit the proxy stopped, then
        the engines (also when the proxy failed to start)."""
        for e in self.engines.values():
            e.start()
        try:
            await self.start()
            yield self
        finally:
            await self.stop()
            for e in self.engines.values():
                await e.stop()

    def _session_closed(self, session_id: str) -> None:
        assert self.admission is not None
        self.admission.end_session(session_id)

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

        The decisions are the proxy's own pure pipeline (:mod:`kvproxy.proxy.pipeline`);
        only the Dynamo turn (session control over HTTP) is not run in the lab."""
        sessions, admission = self.sessions, self.admission
        assert sessions is not None and admission is not None
        hdrs = CIMultiDict(headers)
        planned = plan_request(self.config, path, None, hdrs, body)
        if isinstance(planned, Refusal):
            raise ProxyError(planned.status, planned.kind.value, planned.message)
        plan = planned
        if plan.injection is not None:
            sessions.note_injection(plan.injection)
        if plan.turn:
            plan = with_turn_headers(plan, self.config, hdrs, {})
        async with AsyncExitStack() as stack:
            tracked = None
            if plan.track and plan.session_id is not None:
                try:
                    tracked = await stack.enter_async_context(
                        sessions.track(
                            plan.session_id,
                            plan.ticket,
                            close_after=plan.close_after,
                            abort_rids=plan.abort_rids or None,
                        )
                    )
                except SessionClosed as exc:
                    raise ProxyError(409, "session_closed", str(exc)) from None
            areq, wait_s, steering = await self._admit(stack, path, hdrs, body, plan, tracked)
            fields, source = final_fields(plan, steering) if not plan.passthrough else ({}, None)
            if source == "steering":  # eviction steered by priority, as the handler splices it
                prio = fields["priority"]
                self.priorities[prio] = self.priorities.get(prio, 0) + 1
            hdrs.update(plan.headers)
            out = {**body, **fields} if fields else body
            engine = self.engines[self.placement.pick(hdrs)]
            try:
                req = await engine.generate(out)
            except EngineError as exc:
                raise ProxyError(exc.status, "engine_error", str(exc)) from None
            if areq is not None:
                # The engine's own usage report (meta_info of the final chunk).
                admission.observe_usage(areq, req.prompt_tokens, req.cached_tokens, req.generated)
            return req, wait_s
        raise AssertionError("unreachable")  # pragma: no cover

    async def _admit(
        self,
        stack: AsyncExitStack,
        path: str,
        hdrs: Mapping[str, str],
        body: dict[str, Any],
        plan: Plan,
        tracked: TrackedRequest | None,
    ) -> tuple[AdmissionRequest | None, float | None, int | None]:
        """The admission wait (the lease lives on ``stack``): (request, wait, steering)."""
        assert self.admission is not None
        areq: AdmissionRequest | None = None
        wait_s: float | None = None
        steering: int | None = None
        try:
            if plan.admit:
                areq = AdmissionRequest(
                    ticket_id=plan.ticket,
                    path=path,
                    headers=hdrs,
                    body=body,
                    session_id=plan.session_id,
                    routing_key=plan.routing_key,
                )
                enter = stack.enter_async_context(self.admission.admit(areq))
                decision: Decision = await (tracked.until_forwarded(enter) if tracked else enter)
                if decision.action != "pass":
                    wait_s = decision.wait_s
                key = decision.action + ":" + decision.reason
                self.decisions[key] = self.decisions.get(key, 0) + 1
                if decision.reason == "cancelled":
                    raise ProxyError(
                        409, "request_cancelled", f"request {plan.ticket} was cancelled"
                    )
                steering = decision.priority
            if tracked is not None:
                tracked.forwarded()
        except SessionClosed as exc:
            raise ProxyError(409, "session_closed", str(exc)) from None
        return areq, wait_s, steering

    async def close_session(self, session_id: str) -> None:
        """``POST /close_session {"session_id"}`` sent to the proxy."""
        sessions, admission = self.sessions, self.admission
        assert sessions is not None and admission is not None
        if self.config.session_lifecycle.enabled:
            await sessions.close(session_id, reason="close_session")
        elif self.config.admission.enabled:
            # close_session_passthrough: residency ends; the router answers 404.
            admission.end_session(session_id)
        # Both off: the proxy forwards the call to the router, which answers 404.
