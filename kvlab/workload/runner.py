"""Run a workload's sessions against a :class:`Transport`, closed loop, in loop time.

No I/O and no wall clock of its own: the clock is ``asyncio.get_running_loop().time()``
and every pause is ``asyncio.sleep``, so the same code drives real HTTP (the
:class:`~kvlab.workload.driver.HttpTransport`) and a virtual-time loop (the lab).

Closed loop: ``concurrency`` sessions run at once and a new one starts when one ends.
Grouped workloads (W2, ``group_size`` > 1) run whole groups: ``concurrency //
group_size`` groups at once, or, with ``step_mode="sync"``, steps of that many groups
started together, the next step when the last trajectory of the step has ended.
Subagents (W3) run in addition to the ``concurrency`` leads.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, Protocol

from kvlab.workload.model import (
    SessionPlan,
    SessionRecord,
    TurnOutcome,
    TurnRecord,
    WorkloadError,
    WorkloadResult,
    WorkloadSpec,
    context_after_turn,
)
from kvlab.workload.plan import session_plans


class Transport(Protocol):
    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
    ) -> TurnOutcome: ...

    async def close(self, session_id: str) -> None: ...


class ToolHints(Protocol):
    """A transport that can tell kvproxy how long a session's tool call will take
    (``POST /kvproxy/sessions/{id}/prefetch``): what a harness that knows its tools does."""

    async def tool_call(self, session_id: str, seconds: float) -> None: ...


ProgressFn = Callable[[int, int, int], None]  # (completed, failed, total) main sessions


async def _all(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` concurrently; if one raises (or this is cancelled), cancel the rest
    and wait for them before re-raising, so no task outlives the run."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class _Run:
    def __init__(
        self,
        spec: WorkloadSpec,
        transport: Transport,
        result: WorkloadResult,
        time_scale: float,
        progress: ProgressFn | None,
        tool_hints: ToolHints | None = None,
    ) -> None:
        self.spec = spec
        self.transport = transport
        self.tool_hints = tool_hints
        self.result = result
        self.time_scale = time_scale
        self.progress = progress
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.completed = 0
        self.failed = 0

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def pause(self, seconds: float) -> None:
        if seconds > 0 and self.time_scale > 0:
            await asyncio.sleep(seconds * self.time_scale)

    async def tool_call(self, session_id: str, seconds: float) -> None:
        """The session's tool call; with ``tool_hints`` its length is told as it starts,
        while it runs (a harness does not wait for kvproxy's answer to run its tool)."""
        if self.tool_hints is None:
            await self.pause(seconds)
            return
        hint = asyncio.ensure_future(self.tool_hints.tool_call(session_id, seconds))
        try:
            await self.pause(seconds)
        finally:
            await hint  # (bounded: the transport's own timeout)

    async def session(self, plan: SessionPlan) -> None:
        rec = SessionRecord(
            session_id=plan.session_id,
            role=plan.role,
            group=plan.group,
            parent=plan.parent,
            turns_planned=len(plan.turns),
            start_s=self.now(),
        )
        self.result.sessions.append(rec)
        try:
            await self._turns(plan, rec)
            rec.end_s = self.now()
        except asyncio.CancelledError:
            rec.exit, rec.error = "cancelled", rec.error or "cancelled"
            rec.end_s = self.now()
            raise
        finally:
            if self.spec.close_sessions:
                await self.transport.close(plan.session_id)
        if plan.role != "subagent":
            if rec.ok:
                self.completed += 1
            else:
                self.failed += 1
            if self.progress is not None:
                self.progress(self.completed, self.failed, self.result.sessions_requested)

    async def _turns(self, plan: SessionPlan, rec: SessionRecord) -> None:
        prompt: list[int] = []
        output: list[int] = []
        previous_context = 0
        last = len(plan.turns) - 1
        rec.exit = "context" if plan.exit_context else "done"
        for i, turn in enumerate(plan.turns):
            if i and not turn.reset:
                prompt = [*prompt, *output, *turn.new_input_ids]
            else:
                prompt = list(turn.new_input_ids)
                previous_context = 0  # a compacted (fresh) prompt reuses nothing
            if i and len(prompt) + turn.max_new_tokens > self.spec.context_length:
                rec.exit = "context"
                break
            t = TurnRecord(
                session_id=plan.session_id,
                turn=i,
                role=plan.role,
                group=plan.group,
                previous_context_len=previous_context,
                start_s=self.now(),
            )
            self.result.turns.append(t)
            out = await self.transport.generate(
                plan.session_id, prompt, turn.max_new_tokens, final=i == last
            )
            t.end_s = self.now()
            t.prompt_tokens = out.prompt_tokens
            t.cached_tokens = out.cached_tokens
            t.completion_tokens = out.completion_tokens
            t.ttft_s = out.ttft_s
            t.latency_s = out.latency_s
            t.finish_reason = out.finish_reason
            t.admission_wait_ms = out.admission_wait_ms
            t.ok = out.ok
            t.error = out.error
            if not out.ok:
                rec.exit, rec.error = "error", f"turn {i}: {out.error or 'failed'}"
                return
            rec.turns_done += 1
            output = list(out.output_ids)
            previous_context = context_after_turn(out.prompt_tokens, out.completion_tokens)
            if turn.subagents:
                await _all(self.session(s) for s in turn.subagents)
            if i < last:
                await self.tool_call(plan.session_id, turn.tool_latency_s)
        rec.ok = True


def _programs(spec: WorkloadSpec, seed: int, sessions: int) -> Iterator[list[SessionPlan]]:
    """Units started together: one session, or one whole GRPO group; ``sessions`` main
    sessions in all (rounded up to whole groups)."""
    plans = session_plans(spec, seed)
    taken = 0
    for _, members in itertools.groupby(plans, key=lambda p: p.group or p.session_id):
        if taken >= sessions:
            return
        program = list(members)
        taken += len(program)
        yield program


def _check_run(
    spec: WorkloadSpec,
    sessions: int,
    concurrency: int,
    time_scale: float,
    deadline_s: float | None,
) -> None:
    """Raise :class:`WorkloadError` for arguments :func:`run_workload` cannot run."""
    if sessions < 0:
        raise WorkloadError(f"sessions must be >= 0 (got {sessions})")
    if concurrency < 1:
        raise WorkloadError(f"concurrency must be >= 1 (got {concurrency})")
    if time_scale < 0:
        raise WorkloadError(f"time_scale must be >= 0 (got {time_scale})")
    spec.validate()
    if deadline_s is not None and deadline_s <= 0:
        raise WorkloadError(f"deadline_s must be > 0 (got {deadline_s})")


async def run_workload(
    spec: WorkloadSpec,
    transport: Transport,
    *,
    sessions: int,
    concurrency: int,
    seed: int,
    time_scale: float = 1.0,
    progress: ProgressFn | None = None,
    deadline_s: float | None = None,
    tool_hints: ToolHints | None = None,
) -> WorkloadResult:
    """Run ``sessions`` main sessions (leads, trajectories) of ``spec``, ``concurrency``
    at once, and return every record. Tool latencies sleep ``latency x time_scale``;
    with ``tool_hints`` each tool call's length is told before it starts.

    ``deadline_s`` (loop seconds): cancel what still runs then (those sessions count as
    failed, ``result.timed_out``); None waits for every session."""
    _check_run(spec, sessions, concurrency, time_scale, deadline_s)
    result = WorkloadResult(
        spec=spec,
        seed=seed,
        sessions_requested=sessions,
        concurrency=concurrency,
        time_scale=time_scale,
    )
    run = _Run(spec, transport, result, time_scale, progress, tool_hints)
    programs = _programs(spec, seed, sessions)
    slots = max(1, concurrency // spec.group_size)

    async def program(members: list[SessionPlan]) -> None:
        await _all(run.session(p) for p in members)

    async def sync_steps() -> None:
        # Bounded by the program stream (finite: `sessions` main sessions).
        while step := list(itertools.islice(programs, slots)):
            await _all(program(p) for p in step)

    async def worker(slot: int) -> None:
        await run.pause(slot * spec.start_stagger_s)
        # Bounded: the shared stream yields at most `sessions` main sessions.
        for members in programs:
            await program(members)

    async def closed_loop() -> None:
        await _all(worker(i) for i in range(slots))

    body = sync_steps() if spec.step_mode == "sync" else closed_loop()
    if deadline_s is None:
        await body
    else:
        try:
            await asyncio.wait_for(body, deadline_s)
        except TimeoutError:
            result.timed_out = True
    result.makespan_s = run.now()
    result.sessions.sort(key=lambda s: s.start_s)
    return result
