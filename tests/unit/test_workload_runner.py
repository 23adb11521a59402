"""The workload runner against an in-memory Transport under a plain asyncio loop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvproxy.workload import TurnOutcome, WorkloadError, run_workload, summarize, workload_spec
from kvproxy.workload.plan import session_plans


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
