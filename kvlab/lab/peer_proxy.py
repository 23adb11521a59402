"""A peer scheduler in the lab, in kvproxy's place: the thin asyncio shell of
:mod:`kvlab.peers` (``thunder``, ``thunder-origin``, ``cap:N``).

The same surface as :class:`kvlab.lab.proxy.LabProxy` (``generate``, ``close_session``,
``running``), so the workload's :class:`~kvlab.lab.transport.LabTransport` drives it
unchanged. No kvproxy feature runs: the engines are those of ``off``.

- ``thunder``: ThunderAgent chooses the backend (it is the router): a request goes to the
  engine its program is placed on, which the scheduler may change on a resume
  (migration). A tick every ``tick_s`` resumes, then pauses. Clients never release
  programs (as the replication's did not); a close is not a release.
- ``thunder-origin``: the same, a program resumed only on its own engine.
- ``thunder-router``: ThunderAgent in kvproxy's place, under its invariant: a new program
  goes to the engine the router picks, and is resumed only there.
- ``cap:N``: the router's placement picks the engine; a new session waits in that
  engine's FIFO while it has N live sessions; a close frees a place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from kvlab.lab.engines import EngineError, LabEngine
from kvlab.lab.proxy import ProxyError
from kvlab.lab.router import Placement
from kvlab.peers import CAP_PREFIX, parse_cap
from kvlab.peers.cap import CapGate
from kvlab.peers.thunder import ThunderConfig, ThunderScheduler
from kvlab.sim.scheduler import SimRequest
from kvlab.workload.wire import SESSION_HEADER


class PeerProxy:
    """Runs one peer policy over the lab engines."""

    admission: Any = None  # no kvproxy admission (tool hints are refused)

    def __init__(
        self,
        policy: str,
        engines: Sequence[LabEngine],
        placement: Placement,
        *,
        thunder: ThunderConfig | None = None,
    ) -> None:
        self.policy = policy
        self.engines = {e.url: e for e in engines}
        self.placement = placement
        self.decisions: dict[str, int] = {}
        self.priorities: dict[int, int] = {}
        self.thunder: ThunderScheduler | None = None
        self.cap: CapGate | None = None
        if policy.startswith(CAP_PREFIX):
            self.cap = CapGate(parse_cap(policy))
        else:
            assert thunder is not None
            self.thunder = ThunderScheduler(thunder, tuple(self.engines))
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self._ticker: asyncio.Task[None] | None = None

    def _count(self, key: str) -> None:
        self.decisions[key] = self.decisions.get(key, 0) + 1

    @asynccontextmanager
    async def running(self) -> AsyncIterator[PeerProxy]:
        for e in self.engines.values():
            e.start()
        try:
            if self.thunder is not None:
                self._ticker = asyncio.ensure_future(self._tick_loop())
            yield self
        finally:
            if self._ticker is not None:
                self._ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._ticker
            for e in self.engines.values():
                await e.stop()

    async def _tick_loop(self) -> None:
        assert self.thunder is not None
        loop = asyncio.get_running_loop()
        while True:  # cancelled when the run ends
            await asyncio.sleep(self.thunder.cfg.tick_s)
            for pid, backend in self.thunder.tick(loop.time()):
                fut = self._waiters.pop(pid, None)
                if fut is not None and not fut.done():
                    fut.set_result(backend)

    async def _wait(self, session: str) -> str:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        self._waiters[session] = fut
        return await fut

    async def _engine_for(self, session: str, headers: Mapping[str, str], prompt: int) -> str:
        loop = asyncio.get_running_loop()
        if self.thunder is not None:
            routed = None
            if self.thunder.cfg.new_placement == "router":
                routed = self.placement.pick(headers)
            backend = self.thunder.request(session, prompt, loop.time(), routed)
            if backend is not None:
                self._count("pass")
                return backend
            self._count("wait")
            return await self._wait(session)
        assert self.cap is not None
        url = self.placement.pick(headers)
        if self.cap.request(session, url):
            self._count("pass")
            return url
        self._count("wait")
        return await self._wait(session)

    async def generate(
        self, headers: Mapping[str, str], body: dict[str, Any], path: str = "/generate"
    ) -> tuple[SimRequest, float | None]:
        loop = asyncio.get_running_loop()
        session = headers.get(SESSION_HEADER) or ""
        prompt = len(body.get("input_ids") or ())
        start = loop.time()
        url = await self._engine_for(session, headers, prompt)
        wait = loop.time() - start
        try:
            done = await self.engines[url].generate(body)
        except EngineError as exc:
            raise ProxyError(exc.status, "engine_error", str(exc)) from None
        if self.thunder is not None:
            total = done.prompt_tokens + done.generated
            self.thunder.response(session, total, loop.time())
        return done, wait

    async def close_session(self, session_id: str) -> None:
        """The client's close: a cap frees its place; ThunderAgent's clients never
        release (the program is forgotten after its idle TTL)."""
        if self.cap is None:
            return
        for nxt in self.cap.close(session_id):
            fut = self._waiters.pop(nxt, None)
            if fut is not None and not fut.done():
                fut.set_result(self.cap.live[nxt])

    def counters(self) -> dict[str, float]:
        if self.thunder is not None:
            c = self.thunder.counters
            return {
                "pauses": c.pauses,
                "pause_marks": c.pause_marks,
                "resumes": c.resumes,
                "migrations": c.migrations,
                "forced": c.forced,
                "immediate": c.immediate,
                "forgotten": c.forgotten,
            }
        assert self.cap is not None
        return {"admitted_from_fifo": self.cap.admitted_waiting}
