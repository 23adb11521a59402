"""The workload runner against an in-memory Transport under a plain asyncio loop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvlab.workload import TurnOutcome, WorkloadError, run_workload, summarize, workload_spec
from kvlab.workload.plan import session_plans


class FakeTransport:
    """Returns max_new_tokens output ids; serves the previous prompt + output as cached."""

    def __init__(self, delay_s: float = 0.001) -> None:
        self.delay_s = delay_s
        self.calls: list[tuple[str, int, int, bool]] = []
        self.closed: list[str] = []
        self.kv: dict[str, int] = {}
        self.live = 0
        self.max_live = 0
        self.live_sessions: set[str] = set()

    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
    ) -> TurnOutcome:
        self.calls.append((session_id, len(input_ids), max_new_tokens, final))
        self.live_sessions.add(session_id)
        self.max_live = max(self.max_live, len(self.live_sessions))
        await asyncio.sleep(self.delay_s)
        cached = min(self.kv.get(session_id, 0), len(input_ids))
        out = [7] * max_new_tokens
        self.kv[session_id] = len(input_ids) + max_new_tokens - 1
        return TurnOutcome(out, len(input_ids), cached, max_new_tokens, self.delay_s, self.delay_s)

    async def close(self, session_id: str) -> None:
        self.closed.append(session_id)
        self.live_sessions.discard(session_id)


async def test_swe_closed_loop_counts_and_closes_every_session() -> None:
    spec = workload_spec("swe", 16)
    fake = FakeTransport()
    res = await run_workload(spec, fake, sessions=12, concurrency=4, seed=3, time_scale=0.0)
    s = summarize(res)
    assert s["sessions"] == 12
    assert sorted(fake.closed) == sorted(r.session_id for r in res.sessions)
    assert len(set(fake.closed)) == 12
    assert fake.max_live <= 4
    # Every session's last request is marked final, exactly once.
    finals = [c for c in fake.calls if c[3]]
    assert len({c[0] for c in finals}) == len(finals)
    # The fake caches each previous turn exactly: nothing is recomputed.
    assert s["recomputed_prefill_tokens"] == 0
    assert s["cache_hit_rate"] > 0.8
    assert all(c[1] + c[2] <= spec.context_length for c in fake.calls)


async def test_bad_arguments_raise_workload_error() -> None:
    spec = workload_spec("swe", 16)
    with pytest.raises(WorkloadError):
        await run_workload(spec, FakeTransport(), sessions=1, concurrency=0, seed=0)


def test_plans_are_deterministic_by_seed() -> None:
    spec = workload_spec("swe", 16)
    a = [p for _, p in zip(range(5), session_plans(spec, 1), strict=False)]
    b = [p for _, p in zip(range(5), session_plans(spec, 1), strict=False)]
    c = [p for _, p in zip(range(5), session_plans(spec, 2), strict=False)]
    assert a == b
    assert a != c
    assert dataclasses.replace(spec) == spec


class TimedTransport(FakeTransport):
    """Records each request's (session, start, end, prompt length) and each close time."""

    def __init__(self, delay_s: float = 0.001, output_factor: int = 1) -> None:
        super().__init__(delay_s)
        self.output_factor = output_factor
        self.spans: list[tuple[str, float, float, int]] = []
        self.close_at: dict[str, float] = {}

    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
    ) -> TurnOutcome:
        loop = asyncio.get_running_loop()
        start = loop.time()
        out = await super().generate(
            session_id, input_ids, max_new_tokens * self.output_factor, final=final
        )
        self.spans.append((session_id, start, loop.time(), len(input_ids)))
        return out

    async def close(self, session_id: str) -> None:
        self.close_at[session_id] = asyncio.get_running_loop().time()
        await super().close(session_id)


async def test_w3_leads_wait_for_their_subagents_and_get_their_summaries() -> None:
    spec = workload_spec("subagents", 16)
    fake = TimedTransport()
    res = await run_workload(spec, fake, sessions=3, concurrency=3, seed=2, time_scale=0.0)
    plans = [p for _, p in zip(range(3), session_plans(spec, 2), strict=False)]
    assert summarize(res)["sessions"] == 3
    subs = [s for p in plans for t in p.turns for s in t.subagents]
    assert summarize(res)["subagent_sessions"] == len(subs) >= 9
    by_sid: dict[str, list[tuple[str, float, float, int]]] = {}
    for span in fake.spans:
        by_sid.setdefault(span[0], []).append(span)
    for p in plans:
        lead = by_sid[p.session_id]
        for i, turn in enumerate(p.turns):
            if not turn.subagents:
                continue
            sub_ids = [s.session_id for s in turn.subagents]
            # Every subagent ran all its turns and was closed before the lead went on.
            for s in turn.subagents:
                assert len(by_sid[s.session_id]) == len(s.turns)
                assert fake.close_at[s.session_id] <= lead[i + 1][1]
            assert min(by_sid[sid][0][1] for sid in sub_ids) >= lead[i][2]
            # The next lead prompt is the whole history plus the summaries.
            summaries = len(p.turns[i + 1].new_input_ids)
            assert lead[i + 1][3] == lead[i][3] + turn.max_new_tokens + summaries
    assert set(fake.closed) == {p.session_id for p in plans} | {s.session_id for s in subs}


async def test_rl_sync_steps_start_together_and_wait_for_the_last_trajectory() -> None:
    spec = workload_spec("rl", 16)
    assert spec.step_mode == "sync" and spec.group_size == 8
    fake = TimedTransport()
    res = await run_workload(spec, fake, sessions=32, concurrency=16, seed=1, time_scale=0.0)
    assert summarize(res)["sessions"] == 32
    main = sorted(res.sessions, key=lambda s: s.start_s)
    step1, step2 = main[:16], main[16:]
    assert len({s.group for s in step1}) == 2 and len({s.group for s in step2}) == 2
    assert max(s.start_s for s in step1) < min(s.end_s for s in step1)
    assert min(s.start_s for s in step2) >= max(s.end_s for s in step1)  # type: ignore[type-var]
    assert res.makespan_s >= max(s.end_s for s in step2)  # type: ignore[type-var]


async def test_rl_closed_loop_runs_whole_groups() -> None:
    spec = workload_spec("rl", 16, step_mode="closed")
    fake = TimedTransport()
    res = await run_workload(spec, fake, sessions=20, concurrency=16, seed=1, time_scale=0.0)
    # 20 trajectories round up to 3 whole groups of 8; at most 2 groups at once.
    assert len(res.main_sessions) == 24
    assert fake.max_live <= 16


async def test_the_runner_ends_a_session_at_the_context_length() -> None:
    # The engine returns 4x the requested output: contexts grow faster than planned and
    # the runner's own check ends sessions before a request would pass the limit.
    spec = workload_spec("swe", 16)
    fake = TimedTransport(output_factor=4)
    res = await run_workload(spec, fake, sessions=6, concurrency=6, seed=4, time_scale=0.0)
    assert all(c[1] + c[2] // 4 <= spec.context_length for c in fake.calls)
    exits = [s for s in res.sessions if s.exit == "context"]
    assert exits and all(s.ok and s.turns_done < s.turns_planned for s in exits)
    assert len(fake.closed) == 6


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A loop whose clock jumps to the next timer when nothing is ready (test only)."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual = 0.0

    def time(self) -> float:
        return self._virtual

    def _run_once(self) -> None:
        ready = self._ready  # type: ignore[attr-defined]
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if not ready and scheduled:
            self._virtual = max(self._virtual, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]


def test_runner_runs_unchanged_under_a_virtual_time_loop() -> None:
    spec = workload_spec("swe", 16, turns_median=6, turns_lo=4, turns_hi=8)
    fake = FakeTransport(delay_s=0.5)  # each request "takes" 0.5 virtual seconds
    loop = VirtualTimeLoop()
    try:
        res = loop.run_until_complete(
            run_workload(spec, fake, sessions=8, concurrency=4, seed=0, time_scale=1.0)
        )
    finally:
        loop.close()
    plans = [p for _, p in zip(range(8), session_plans(spec, 0), strict=False)]
    # Each session takes exactly its turns x 0.5 s plus its tool latencies in loop time.
    for p in plans:
        rec = next(s for s in res.sessions if s.session_id == p.session_id)
        want = 0.5 * len(p.turns) + sum(t.tool_latency_s for t in p.turns[:-1])
        assert rec.duration_s == pytest.approx(want, rel=1e-6)
    assert res.makespan_s > 10.0  # tens of simulated seconds, no wall-clock wait
    assert summarize(res)["sessions"] == 8


def test_only_the_first_wave_is_staggered() -> None:
    spec = workload_spec("legacy", 1, start_stagger_s=0.25, turns_lo=1, turns_hi=1)
    loop = VirtualTimeLoop()
    try:
        res = loop.run_until_complete(
            run_workload(
                spec, FakeTransport(delay_s=1.0), sessions=6, concurrency=3, seed=0, time_scale=2.0
            )
        )
    finally:
        loop.close()
    starts = sorted(s.start_s for s in res.sessions)
    # Slot i waits i x 0.25 x time_scale once; later sessions follow back to back.
    assert starts == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.5, 2.0])


async def test_a_transport_error_stops_the_run_and_leaves_no_task_behind() -> None:
    spec = workload_spec("swe", 16)
    never = asyncio.Event()
    cancelled: list[str] = []
    first: list[str] = []

    class Failing(FakeTransport):
        async def generate(
            self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
        ) -> TurnOutcome:
            first.append(session_id)
            if len(first) == 3:
                raise RuntimeError("transport bug")
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append(session_id)
                raise
            raise AssertionError("unreachable")

    fake = Failing()
    before = asyncio.all_tasks()
    with pytest.raises(RuntimeError, match="transport bug"):
        await run_workload(spec, fake, sessions=6, concurrency=3, seed=0, time_scale=0.0)
    assert sorted(cancelled) == sorted(first[:2])
    assert asyncio.all_tasks() == before
    # Every started session was still closed.
    assert sorted(fake.closed) == sorted(first)


class HintedTransport(FakeTransport):
    """Records each tool hint (session, seconds) with the calls made before it."""

    def __init__(self) -> None:
        super().__init__()
        self.hints: list[tuple[str, float, int]] = []

    async def tool_call(self, session_id: str, seconds: float) -> None:
        self.hints.append((session_id, seconds, len(self.calls)))


async def test_tool_hints_tell_each_tool_calls_length_before_it_runs() -> None:
    spec = workload_spec("swe", 16)
    fake = HintedTransport()
    res = await run_workload(
        spec, fake, sessions=2, concurrency=2, seed=5, time_scale=0.0, tool_hints=fake
    )
    plans = [p for _, p in zip(range(2), session_plans(spec, 5), strict=False)]
    for p in plans:
        hinted = [(s, sec) for s, sec, _ in fake.hints if s == p.session_id]
        # One hint per tool call (between turns), with the plan's latency.
        assert hinted == [(p.session_id, t.tool_latency_s) for t in p.turns[:-1]]
    # Each hint comes after the turn that precedes its tool call (its session's calls).
    for sid, _, before in fake.hints:
        assert any(c[0] == sid for c in fake.calls[:before])
    assert summarize(res)["sessions"] == 2
    quiet = HintedTransport()  # without tool_hints, never told
    await run_workload(spec, quiet, sessions=1, concurrency=1, seed=5, time_scale=0.0)
    assert quiet.hints == [] and quiet.calls
