"""One DP rank of the simulated engine: its scheduler, its loop task and its clock.

The loop (:meth:`Rank.run`, one task per rank, started by the app's ``cleanup_ctx``)
wakes request handlers through per-request asyncio events (:class:`Waiter`). No task
is created per request or per token.

Time: each loop step asks the core for the next batch, sleeps until the step's end
on the simulated clock, then applies the batch. While the engine is busy, simulated
time advances only by step durations: a step that follows another starts exactly at
its simulated end, so late wake-ups and the loop's own work never stretch a step.
The wall-clock deadline of a step is absolute (``anchor + sim * time_scale``), so a
late wake-up is made up by the following steps; the lag that remains is reported as
overrun (``/server_info``, ``/sim/state``), never folded into simulated time. When
the engine is idle the simulated clock follows the wall clock (divided by
``time_scale``) and is re-anchored there. With ``time_scale == 0`` steps do not
sleep and the clock is the sum of step durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from kvlab.sim.scheduler import Scheduler, SimRequest, State, StepEvents

log = logging.getLogger("kvproxy.sim")


@dataclass(eq=False, slots=True)
class Waiter:
    """How a handler waits for its request: ``done`` when finished, ``progress`` per step."""

    req: SimRequest
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event | None = None


class Rank:
    """One DP rank: a scheduler, its loop task and its waiters."""

    def __init__(self, index: int, sched: Scheduler, time_scale: float) -> None:
        self.index = index
        self.sched = sched
        self.time_scale = time_scale
        self.wake = asyncio.Event()
        self.waiters: dict[str, Waiter] = {}
        self.streams: dict[str, Waiter] = {}
        # Simulated time ``sim`` maps to wall time ``_anchor_wall + (sim - _anchor_sim) * ts``.
        self._anchor_wall = time.monotonic()
        self._anchor_sim = 0.0
        self._virtual = 0.0
        self._last_end = 0.0  # simulated end of the last step: the clock never goes back
        # (start, end) of the step being computed, in simulated seconds; None when idle.
        self._step: tuple[float, float] | None = None
        # Overrun: how far (wall seconds) the loop ran behind the cost model's deadlines.
        self.lag_s = 0.0  # after the last step (0 when on time)
        self.max_lag_s = 0.0
        self.overrun_s = 0.0  # total lateness introduced (sum of the lag's increases)
        self.late_steps = 0  # steps that ended after their wall-clock deadline
        self.steps = 0
        self.stopped = False  # the loop crashed or the app is shutting down

    def _wall_sim(self) -> float:
        return self._anchor_sim + (time.monotonic() - self._anchor_wall) / self.time_scale

    def now(self) -> float:
        """Simulated time for an event now (an arrival, a close, a step start)."""
        if self.time_scale <= 0:
            return self._virtual
        t = self._wall_sim()
        step = self._step
        if step is not None:
            # During a step the clock stays inside it, even when the loop is late.
            return min(max(t, step[0]), step[1])
        return max(t, self._last_end)

    def to_wall(self, sim_seconds: float) -> float:
        return sim_seconds * self.time_scale

    def clock_stats(self) -> dict[str, float | int]:
        return {
            "steps": self.steps,
            "overrun_s": round(self.overrun_s, 6),
            "lag_s": round(self.lag_s, 6),
            "max_lag_s": round(self.max_lag_s, 6),
            "late_steps": self.late_steps,
        }

    def notify(self, reqs: list[SimRequest]) -> None:
        for req in reqs:
            w = self.waiters.get(req.rid)
            if w is not None and w.req is req:
                w.done.set()
                if w.progress is not None:
                    w.progress.set()

    def notify_streams(self) -> None:
        for w in self.streams.values():
            if w.req.state is State.DECODE and w.progress is not None:
                w.progress.set()

    def release_all(self) -> None:
        """Wake every handler; unfinished requests then fail instead of hanging."""
        self.stopped = True
        for w in list(self.waiters.values()):
            w.done.set()
            if w.progress is not None:
                w.progress.set()

    # -- a handler's waiter --------------------------------------------------------------

    def add_waiter(self, req: SimRequest, stream: bool) -> Waiter:
        """Register a submitted request's waiter and wake the loop."""
        w = Waiter(req, progress=asyncio.Event() if stream else None)
        self.waiters[req.rid] = w
        if stream:
            self.streams[req.rid] = w
        self.wake.set()
        return w

    def cancel(self, w: Waiter) -> None:
        """Abort a request whose client went away (SGLang aborts on disconnect)."""
        if not w.req.finished:
            done = self.sched.abort(w.req.rid, self.now(), exact=True)
            self.notify(done)
            self.wake.set()

    def forget(self, w: Waiter) -> None:
        if self.waiters.get(w.req.rid) is w:
            del self.waiters[w.req.rid]
        if self.streams.get(w.req.rid) is w:
            del self.streams[w.req.rid]

    async def wait_done(self, w: Waiter) -> None:
        """Wait for a non-streamed request (aborted if the handler is cancelled)."""
        try:
            await w.done.wait()
        except asyncio.CancelledError:
            self.cancel(w)
            raise
        finally:
            self.forget(w)

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("scheduler loop of dp rank %d crashed", self.index)
            self.release_all()
            raise

    async def _run(self) -> None:
        sched = self.sched
        ts = self.time_scale
        chained = False  # the previous iteration ran a step: start at its simulated end
        while True:
            now = self._last_end if chained and ts > 0 else self.now()
            sched.maybe_reap(now)
            batch = sched.schedule(now)
            if sched.finished_outside:
                self.notify(sched.finished_outside)
                sched.finished_outside.clear()
            if batch is None:
                await self._idle(now, chained)
                chained = False
                continue
            end_sim = await self._sleep_step(now, batch.duration)
            ev = sched.finish_batch(batch, end_sim)
            self.steps += 1
            chained = True
            self._deliver(ev)

    async def _idle(self, now: float, chained: bool) -> None:
        """Wait (bounded by the scheduler's next deadline) for new work."""
        sched = self.sched
        ts = self.time_scale
        if chained and ts > 0:
            # Going idle: re-anchor the clock at the last step's end, so that a
            # lag of the burst is dropped (reported, never folded into simulated
            # time) and idle time follows the wall clock from here.
            self._anchor_sim = self._last_end
            self._anchor_wall = time.monotonic()
            self.lag_s = 0.0
        self.wake.clear()
        deadline = sched.next_deadline()
        timeout = None
        if deadline is not None:
            timeout = max(self.to_wall(deadline - now), 0.001) if ts > 0 else 0.05
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)
        if ts == 0 and timeout is not None and not self.wake.is_set():
            # Virtual time: an idle engine lets session timeouts elapse.
            self._virtual = max(self._virtual, deadline or 0.0)

    async def _sleep_step(self, now: float, duration: float) -> float:
        """Let a step of ``duration`` simulated seconds pass; return its simulated end."""
        if self.time_scale <= 0:
            self._virtual += duration
            await asyncio.sleep(0)
            return self._virtual
        # Sleep until the step's end on the simulated clock. The deadline is
        # absolute, so a timer that fires early or late is made up by the
        # following steps; simulated time advances by the step's duration only.
        end_sim = now + duration
        self._step = (now, end_sim)
        deadline = self._anchor_wall + (end_sim - self._anchor_sim) * self.time_scale
        delay = deadline - time.monotonic()
        await asyncio.sleep(delay if delay > 0 else 0)
        lag = max(time.monotonic() - deadline, 0.0)
        if lag > self.lag_s:
            self.overrun_s += lag - self.lag_s
        if lag > 0:
            self.late_steps += 1
        self.lag_s = lag
        self.max_lag_s = max(self.max_lag_s, lag)
        self._step = None
        self._last_end = end_sim
        return end_sim

    def _deliver(self, ev: StepEvents) -> None:
        """Wake the handlers of requests that finished or got their first token."""
        if ev.finished:
            self.notify(ev.finished)
        if self.streams:
            for req in ev.first_tokens:
                w = self.streams.get(req.rid)
                if w is not None and w.progress is not None:
                    w.progress.set()
            self.notify_streams()
