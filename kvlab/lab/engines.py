"""Simulated engines of the lab: the pure scheduler driven on the virtual clock.

One :class:`LabEngine` per engine URL. Its driver coroutine runs the same two-call
step as the HTTP simulator's scheduler loop (``kvlab.sim.rank.Rank``)::

    batch = sched.schedule(now)
    await asyncio.sleep(batch.duration)      # virtual seconds: nothing sleeps
    events = sched.finish_batch(batch, loop.time())

and resolves the futures of the requests that finished. A request body is parsed, and
the scheduler's request built, by the simulator's own ``parse_generate`` and
``scheduler_request`` (:mod:`kvlab.sim.parse`), and ``/metrics`` is rendered by the
simulator's own ``render_metrics``, so the lab sees exactly what an HTTP client of the
simulator would see (minus the text and the JSON encoding).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.metrics import MetricsContext, render_metrics
from kvlab.sim.parse import BadRequest, parse_generate, scheduler_request
from kvlab.sim.responses import SGLANG_VERSION, cache_policy_info
from kvlab.sim.scheduler import Scheduler, SimError, SimRequest

MODEL_NAME = "kvproxy/sim-model"


class EngineError(Exception):
    """The engine refused a request (what the HTTP simulator answers with ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class LabEngine:
    """One simulated engine (one DP rank) at ``url``, on the running loop's clock."""

    def __init__(self, url: str, cfg: SchedulerConfig) -> None:
        self.url = url
        self.cfg = cfg
        self.sched = Scheduler(cfg, now=0.0)
        self.metrics_ctx = MetricsContext(
            model_name=MODEL_NAME,
            enable_priority_scheduling=cfg.enable_priority_scheduling,
            streaming_sessions=cfg.mode == "streaming",
            hicache=cfg.hicache is not None,
        )
        self._waiters: dict[str, asyncio.Future[SimRequest]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.scrapes = 0

    # -- the driver --------------------------------------------------------------------

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"lab-engine-{self.url}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineError("the engine stopped", 503))
        self._waiters.clear()

    def _notify(self, reqs: list[SimRequest]) -> None:
        waiters = self._waiters
        for req in reqs:
            fut = waiters.pop(req.rid, None)
            if fut is not None and not fut.done():
                fut.set_result(req)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.sched
        wake = self._wake
        assert wake is not None
        sleep = asyncio.sleep
        while True:
            batch = sched.schedule(loop.time())
            if sched.finished_outside:
                self._notify(sched.finished_outside)
                sched.finished_outside.clear()
            if batch is None:
                wake.clear()
                await wake.wait()
                continue
            await sleep(batch.duration)
            events = sched.finish_batch(batch, loop.time())
            self.steps += 1
            if events.finished:
                self._notify(events.finished)

    # -- the engine's HTTP surface, in process ----------------------------------------

    async def generate(self, body: Mapping[str, Any]) -> SimRequest:
        """``POST /generate`` (non-streaming): the finished request, or EngineError."""
        try:
            p = parse_generate(body)
        except BadRequest as exc:
            raise EngineError(str(exc), 400) from None
        if p.rid in self._waiters or p.rid in self.sched.requests:
            raise EngineError(f"Duplicate request ID: {p.rid}")
        # Answered whole (no SSE): counted as SGLang counts a request that is not streamed.
        req, options = scheduler_request(p, stream=False)
        loop = asyncio.get_running_loop()
        try:
            self.sched.submit(req, loop.time(), **options)
        except SimError as exc:
            raise EngineError(exc.message, exc.status) from None
        fut: asyncio.Future[SimRequest] = loop.create_future()
        self._waiters[p.rid] = fut
        assert self._wake is not None
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            # The client went away: SGLang aborts the request (the simulator does too).
            self._waiters.pop(p.rid, None)
            if not req.finished:
                self._notify(self.sched.abort(req.rid, loop.time(), exact=True))
                self._wake.set()
            raise

    def abort(self, rid: str, *, abort_all: bool = False) -> None:
        """``POST /abort_request`` (SGLang's rid-prefix match, as the simulator)."""
        now = asyncio.get_running_loop().time()
        self._notify(self.sched.abort(rid, now, abort_all=abort_all))
        if self._wake is not None:
            self._wake.set()

    def open_session(
        self, session_id: str, *, streaming: bool, timeout_s: float | None
    ) -> str | None:
        """``POST /open_session``: None when opened, else the engine's error message."""
        try:
            self.sched.open_session(
                session_id,
                asyncio.get_running_loop().time(),
                streaming=streaming,
                timeout_s=timeout_s,
            )
        except SimError as exc:
            return exc.message
        if self._wake is not None:
            self._wake.set()  # the loop recomputes the idle-timeout deadline
        return None

    def close_session(self, session_id: str) -> None:
        """``POST /close_session``."""
        self.sched.close_session(session_id, asyncio.get_running_loop().time())
        if self._wake is not None:
            self._wake.set()

    def server_info(self) -> dict[str, Any]:
        """``GET /server_info``: the fields kvproxy reads (session mode, eviction and
        scheduling policy), as the HTTP simulator reports them."""
        cfg = self.cfg
        return {
            "served_model_name": MODEL_NAME,
            "max_total_num_tokens": cfg.max_total_tokens,
            "context_length": cfg.context_length,
            **cache_policy_info(cfg),
            "version": SGLANG_VERSION,
        }

    def metrics_text(self) -> str:
        """``GET /metrics``: the simulator's own Prometheus text."""
        self.scrapes += 1
        return render_metrics(self.metrics_ctx, [self.sched], self.cfg.context_length)
