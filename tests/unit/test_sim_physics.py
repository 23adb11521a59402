"""Engine physics on the pure scheduler: cost-model inputs, token scale, priority
preemption, the priority ratchet and the realtime token counters."""

from __future__ import annotations

import dataclasses
import heapq
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.presets import cost_model, scheduler_config
from kvlab.sim.scheduler import Batch, Scheduler, SimRequest, State
from tests.helpers import seq

MAX_STEPS = 200_000


def run_until_idle(s: Scheduler, now: float = 0.0) -> tuple[float, list[Batch]]:
    batches: list[Batch] = []
    for _ in range(MAX_STEPS):
        batch = s.schedule(now)
        if batch is None:
            return now, batches
        now += batch.duration
        s.finish_batch(batch, now)
        s.check_invariants()
        batches.append(batch)
    raise AssertionError("scheduler did not go idle")


# ------------------------------------------------------------- cost-model inputs


def test_prefill_passes_new_and_already_in_kv_per_request_across_chunks() -> None:
    cfg = scheduler_config("qwen3-8b-h100", chunked_prefill_size=1000, max_total_tokens=50_000)
    s = Scheduler(cfg)
    s.submit(SimRequest("a", seq(0, 1200), max_new_tokens=1), 0.0)
    _, batches = run_until_idle(s)
    s.submit(SimRequest("b", seq(0, 1200) + seq(5000, 2500), max_new_tokens=1), 0.0)
    _, more = run_until_idle(s)
    prefills = [b for b in batches + more if b.kind == "prefill"]
    assert [b.items for b in prefills] == [
        [(1000, 0)],
        [(200, 1000)],
        # b: 1200 cached (a's prompt), then chunks of 1000 on top of it.
        [(1000, 1200)],
        [(1000, 2200)],
        [(500, 3200)],
    ]
    c = cfg.cost
    for b in prefills:
        assert b.duration == c.prefill_s(b.items)


def test_decode_passes_the_running_context() -> None:
    cfg = scheduler_config("qwen3-8b-h100", max_total_tokens=50_000)
    s = Scheduler(cfg)
    s.submit(SimRequest("a", seq(0, 100), max_new_tokens=5), 0.0)
    s.submit(SimRequest("b", seq(1000, 300), max_new_tokens=3), 0.0)
    _, batches = run_until_idle(s)
    decodes = [(b.size, b.context_tokens, b.duration) for b in batches if b.kind == "decode"]
    # After the prefill each has 1 output token; a decode step's context is prompt + output.
    assert [(n, ctx) for n, ctx, _ in decodes] == [(2, 402), (2, 404), (1, 103), (1, 104)]
    for n, ctx, dur in decodes:
        assert dur == cfg.cost.decode_s(n, ctx)


# ----------------------------------------------------------------- token scale


@dataclass
class Session:
    sid: str
    turns_left: int
    context: list[int]
    prev_len: int = 0
    next_new: list[int] = field(default_factory=list)


@dataclass
class ScenarioResult:
    makespan_s: float
    hit_rate: float
    recomputed: int  # in real tokens
    computed: int  # in real tokens
    turns: int


def run_scenario(k: int) -> ScenarioResult:
    """Eight agent sessions on one engine whose pool holds about half their contexts.

    Every token quantity is divided by ``k``; tool pauses are not. Deterministic.
    """
    system = 1600 // k
    task = 800 // k
    tool = 800 // k
    out = 160 // k
    pool = 24_000 // k
    cfg = scheduler_config("qwen3-8b-h100", k, max_total_tokens=pool)
    s = Scheduler(cfg)
    sessions = [
        Session(f"s{i}", 6, [], next_new=seq(0, system) + seq(10_000 * (i + 1), task))
        for i in range(8)
    ]
    due: list[tuple[float, int, int]] = [(0.5 * i, i, 0) for i in range(len(sessions))]
    heapq.heapify(due)
    now = 0.0
    turns = prompt = cached = recomputed = 0
    inflight: dict[str, tuple[Session, int]] = {}
    for _ in range(MAX_STEPS):
        while due and due[0][0] <= now:
            _, i, turn = heapq.heappop(due)
            sess = sessions[i]
            ids = sess.context + sess.next_new
            r = SimRequest(f"{sess.sid}-t{turn}", ids, max_new_tokens=out, session_id=sess.sid)
            s.submit(r, now, output_len=out)
            inflight[r.rid] = (sess, turn)
        batch = s.schedule(now)
        if batch is None:
            if not due:
                break
            now = due[0][0]
            continue
        now += batch.duration
        for r in s.finish_batch(batch, now).finished:
            sess, turn = inflight.pop(r.rid)
            turns += 1
            prompt += r.prompt_tokens
            cached += r.cached_tokens
            if turn:
                recomputed += max(0, sess.prev_len - r.cached_tokens)
            sess.prev_len = r.prompt_tokens + r.generated - 1
            assert r.out is not None
            sess.context = r.input_ids + r.out.ids(r.generated)
            sess.turns_left -= 1
            if sess.turns_left:
                idx = int(sess.sid[1:])
                sess.next_new = seq(100_000 * (idx + 1) + 1000 * turn, tool)
                heapq.heappush(due, (now + 2.0, idx, turn + 1))
    else:
        raise AssertionError("scenario did not finish")
    st = s.stats
    assert not s.busy and turns == 8 * 6
    return ScenarioResult(
        makespan_s=now,
        hit_rate=cached / prompt,
        recomputed=recomputed * k,
        computed=st.realtime_prefill_compute_tokens * k,
        turns=turns,
    )


def test_token_scale_16_agrees_with_the_real_scale() -> None:
    real = run_scenario(1)
    macro = run_scenario(16)
    # The scenario must exercise eviction, or the comparison says little.
    assert 0.05 < real.recomputed / real.computed < 0.9, real
    assert macro.makespan_s == pytest.approx(real.makespan_s, rel=0.05)
    assert macro.hit_rate == pytest.approx(real.hit_rate, rel=0.05)
    assert macro.recomputed / macro.computed == pytest.approx(
        real.recomputed / real.computed, rel=0.05
    )
    assert macro.computed == pytest.approx(real.computed, rel=0.05)


# ---------------------------------------------------------- priority preemption


def _prio_sched(**kw: Any) -> Scheduler:
    base: dict[str, Any] = dict(
        max_total_tokens=10_000, enable_priority_scheduling=True, max_running_requests=2
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def _step(s: Scheduler, now: float) -> float:
    batch = s.schedule(now)
    assert batch is not None
    now += batch.duration
    s.finish_batch(batch, now)
    s.check_invariants()
    return now


def _fill_running(s: Scheduler, prios: tuple[int, int]) -> float:
    now = 0.0
    s.submit(SimRequest("r0", seq(0, 50), max_new_tokens=100, priority=prios[0]), now)
    s.submit(SimRequest("r1", seq(500, 50), max_new_tokens=100, priority=prios[1]), now)
    now = _step(s, now)  # both prefilled in one batch
    now = _step(s, now)  # one decode step
    assert set(s.running) == {"r0", "r1"}
    return now


@pytest.mark.parametrize(
    ("new_priority", "threshold", "preempted"),
    [
        (11, 10, ["r0"]),  # gap 11 > 10 over the lowest (0): preempt it
        (10, 10, []),  # gap 10 is not > 10
        (16, 10, ["r0"]),  # r1 (priority 5) is within the threshold of 16: only r0
        (20, 10, ["r0"]),  # both qualify; one is enough to cover the deficit
        (3, 2, ["r0"]),  # a custom threshold
    ],
)
def test_priority_preemption_rule(new_priority: int, threshold: int, preempted: list[str]) -> None:
    s = _prio_sched(priority_scheduling_preemption_threshold=threshold)
    now = _fill_running(s, (0, 5))
    s.submit(SimRequest("hi", seq(900, 40), max_new_tokens=4, priority=new_priority), now)
    batch = s.schedule(now)
    assert batch is not None
    if preempted:
        assert batch.kind == "prefill" and [r.rid for r in batch.reqs] == ["hi"]
        assert s.stats.num_preempted_requests_total == len(preempted)
        for rid in preempted:
            r = s.requests[rid]
            assert r.state is State.WAITING and r.num_retractions == 0
        assert "hi" not in s.running and s.requests["hi"].state is State.PREFILL
    else:
        assert batch.kind == "decode" and s.stats.num_preempted_requests_total == 0
    s.finish_batch(batch, now + batch.duration)
    s.check_invariants()
    end, _ = run_until_idle(s, now + batch.duration)
    assert not s.requests  # everyone finishes, preempted ones after re-prefilling
    assert end > now


def test_preempted_request_resumes_where_it_was() -> None:
    s = _prio_sched()
    now = _fill_running(s, (0, 0))
    out_before = s.output_len(s.requests["r1"])
    s.submit(SimRequest("hi", seq(900, 40), max_new_tokens=4, priority=50), now)
    now = _step(s, now)
    # Equal priorities: the later-queued of the two goes first (r1, by arrival then seq).
    victim = s.requests["r1"]
    assert victim.state is State.WAITING and victim.generated == out_before
    run_until_idle(s, now)
    assert victim.finished and victim.generated == 100
    assert victim.finish_reason == {"type": "length", "length": 100}


def test_no_preemption_without_priority_scheduling() -> None:
    s = Scheduler(SchedulerConfig(max_total_tokens=10_000, max_running_requests=2))
    now = _fill_running(s, (0, 0))
    s.submit(SimRequest("hi", seq(900, 40), max_new_tokens=4, priority=100), now)
    batch = s.schedule(now)
    assert batch is not None and batch.kind == "decode"
    assert s.stats.num_preempted_requests_total == 0


def test_missing_priority_defaults_follow_sglang() -> None:
    on = _prio_sched()
    r = on.submit(SimRequest("a", seq(0, 10), priority=None), 0.0)
    assert r.priority == -sys.maxsize - 1
    off = Scheduler(SchedulerConfig())
    r = off.submit(SimRequest("a", seq(0, 10), priority=None), 0.0)
    assert r.priority == 0


# ---------------------------------------------------------- priority ratchet


@pytest.mark.parametrize("priority_scheduling", [False, True])
def test_request_priority_reaches_radix_eviction(priority_scheduling: bool) -> None:
    """Priorities ratchet the tree whether or not priority scheduling is on (SGLang's
    cache_finished_req inserts with ``req.priority or 0`` in both cases)."""
    s = Scheduler(
        SchedulerConfig(
            max_total_tokens=1_000,
            eviction_policy="priority",
            enable_priority_scheduling=priority_scheduling,
        )
    )
    shared = seq(0, 100)
    now = 0.0
    for rid, tail, prio in (("lo", 1000, 0), ("hi", 2000, 9), ("lo2", 3000, 1)):
        s.submit(SimRequest(rid, shared + seq(tail, 200), max_new_tokens=1, priority=prio), now)
        now, _ = run_until_idle(s, now)
        now += 1.0
    # The shared prefix carries the max of the three; the leaves their own.
    node = s.kv.match_prefix(shared, now).node
    assert node.priority == 9
    # Pressure: a big request evicts the lowest-priority leaves first ("lo", then "lo2").
    s.submit(SimRequest("big", seq(50_000, 500), max_new_tokens=1, priority=0), now)
    run_until_idle(s, now)
    assert s.kv.match_prefix(shared + seq(2000, 200), now).length == 300  # hi kept
    assert s.kv.match_prefix(shared + seq(1000, 200), now).length == 100  # lo evicted
    assert s.stats.evicted_tokens_total == s.kv.evicted_total > 0


# ------------------------------------------------------------- realtime counters


def test_realtime_token_counters_split_compute_cache_and_decode() -> None:
    s = Scheduler(dataclasses.replace(SchedulerConfig(), max_total_tokens=20_000))
    now = 0.0
    s.submit(SimRequest("t1", seq(0, 1000), max_new_tokens=10), now, output_len=10)
    now, _ = run_until_idle(s, now)
    st = s.stats
    assert (st.realtime_prefill_compute_tokens, st.realtime_prefill_cache_tokens) == (1000, 0)
    assert st.realtime_decode_tokens == 9  # the prefill yields the first token
    t1 = s.kv.match_prefix(seq(0, 1000), now).length
    assert t1 == 1000
    # The next turn: the history (prompt + output[:-1] is in the tree) plus 200 new.
    s.submit(SimRequest("t2", seq(0, 1000) + seq(7000, 200), max_new_tokens=5), now)
    run_until_idle(s, now)
    assert st.realtime_prefill_cache_tokens == 1000
    assert st.realtime_prefill_compute_tokens == 1000 + 200
    assert st.realtime_decode_tokens == 9 + 4
    assert st.prompt_tokens_total == st.realtime_prefill_compute_tokens + st.cached_tokens_total
    assert st.generation_tokens_total == st.realtime_decode_tokens + 2


def test_cost_model_of_a_legacy_scheduler_is_unchanged() -> None:
    s = Scheduler(SchedulerConfig(max_total_tokens=20_000))
    s.submit(SimRequest("a", seq(0, 300), max_new_tokens=3), 0.0)
    _, batches = run_until_idle(s)
    assert [b.duration for b in batches] == [
        0.010 + 0.00005 * 300,
        0.012 + 0.0002,
        0.012 + 0.0002,
    ]
    assert s.cfg.cost == cost_model("legacy")
