"""scripts/completion_timeline.py: completion shares, and the waits on the last sessions' path."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from kvlab.workload.model import SessionRecord, TurnRecord, WorkloadResult
from kvlab.workload.spec import workload_spec
from tests.helpers import script_module


@pytest.fixture(scope="module")
def tl() -> Iterator[ModuleType]:
    with script_module("completion_timeline", "regime_grid") as module:
        yield module


@pytest.mark.parametrize(
    ("ends", "q", "want"),
    [
        ([40.0, 10.0, 30.0, 20.0], 0.25, 10.0),
        ([40.0, 10.0, 30.0, 20.0], 0.5, 20.0),
        ([40.0, 10.0, 30.0, 20.0], 0.75, 30.0),  # 0.75 x 4 is 3, not the 4th
        ([40.0, 10.0, 30.0, 20.0], 1.0, 40.0),
        ([5.0, 6.0, 7.0], 0.5, 6.0),  # ceil(1.5) = 2nd
        ([5.0, 6.0, 7.0], 0.1, 5.0),
    ],
)
def test_time_to_a_share_is_the_ceil_qn_th_end(
    tl: ModuleType, ends: list[float], q: float, want: float
) -> None:
    assert tl.time_to(ends, q) == want


@pytest.mark.parametrize(("ends", "q"), [([], 0.5), ([1.0], 0.0), ([1.0], 1.5)])
def test_time_to_refuses_no_ends_or_a_share_outside_0_1(
    tl: ModuleType, ends: list[float], q: float
) -> None:
    with pytest.raises(ValueError):
        tl.time_to(ends, q)


def test_quantile_ratios_below_one_where_both_is_ahead(tl: ModuleType) -> None:
    off = [10.0, 20.0, 30.0, 40.0]
    both = [5.0, 10.0, 30.0, 60.0]  # ahead early, behind at the end
    got = tl.quantile_ratios(both, off, (0.25, 0.5, 0.75, 1.0))
    assert got == {"0.25": 0.5, "0.5": 0.5, "0.75": 1.0, "1": 1.5}


def _turn(sid: str, turn: int, wait_ms: float | None, role: str = "main") -> TurnRecord:
    return TurnRecord(session_id=sid, turn=turn, role=role, admission_wait_ms=wait_ms, ok=True)


def test_last_sessions_carry_their_own_and_their_subagents_waits(tl: ModuleType) -> None:
    res = WorkloadResult(
        workload_spec("subagents"), seed=0, sessions_requested=2, concurrency=2, time_scale=1.0
    )
    res.sessions = [
        SessionRecord("lead-a", "main", None, None, 3, start_s=0.0, end_s=100.0, ok=True),
        SessionRecord("lead-b", "main", None, None, 3, start_s=5.0, end_s=300.0, ok=True),
        SessionRecord("sub-b1", "subagent", None, "lead-b", 2, start_s=50.0, end_s=90.0),
        SessionRecord("sub-b2", "subagent", None, "lead-b", 2, start_s=50.0, end_s=95.0),
        SessionRecord("lead-c", "main", None, None, 3, start_s=5.0),  # never ended
    ]
    res.turns = [
        _turn("lead-b", 0, 40_000.0),
        _turn("lead-b", 1, 2_000.0),
        _turn("lead-b", 2, None),
        _turn("lead-b", 3, 3_000.0),
        _turn("sub-b1", 0, 10_000.0, "subagent"),
        _turn("sub-b1", 1, 15_000.0, "subagent"),  # 25 s in all: the longest-held
        _turn("sub-b2", 0, 20_000.0, "subagent"),
        _turn("lead-a", 0, None),
    ]
    got = tl.last_sessions(res, 1)
    assert got == [
        {
            "session": "lead-b",
            "start_s": 5.0,
            "end_s": 300.0,
            "turns": 0,
            "first_turn_wait_s": 40.0,
            "later_turns_wait_s": 5.0,
            "longest_subagent_wait_s": 25.0,
        }
    ]
    assert [s["session"] for s in tl.last_sessions(res, 5)] == ["lead-a", "lead-b"]
    assert tl.last_sessions(res, 5)[0]["longest_subagent_wait_s"] == 0.0
