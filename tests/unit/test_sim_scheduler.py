"""The simulator's continuous-batching scheduler, driven with a fake clock."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest

from kvlab.sim.config import CostModel, SchedulerConfig
from kvlab.sim.scheduler import Scheduler, SimError, SimRequest, State
from kvlab.sim.tokenizer import EOS_TOKEN_ID, OutputStream
from tests.helpers import seq

MAX_STEPS = 100_000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


def step(s: Scheduler, clock: Clock) -> list[SimRequest]:
    batch = s.schedule(clock.now)
    finished = list(s.finished_outside)
    s.finished_outside.clear()
    if batch is None:
        return finished
    clock.now += batch.duration
    finished += s.finish_batch(batch, clock.now).finished
    s.check_invariants()
    return finished


def drain(s: Scheduler, clock: Clock) -> list[SimRequest]:
    done: list[SimRequest] = []
    for _ in range(MAX_STEPS):
        if not s.busy:
            return done
        done += step(s, clock)
    raise AssertionError("scheduler did not drain")


def req(rid: str, ids: list[int], max_new: int = 8, **kw: Any) -> SimRequest:
    return SimRequest(rid=rid, input_ids=list(ids), max_new_tokens=max_new, **kw)


def make(**kw: Any) -> tuple[Scheduler, Clock]:
    return Scheduler(SchedulerConfig(**kw)), Clock()


# ------------------------------------------------------------------ prefix reuse


def test_prefix_reuse_counts_cached_tokens_across_requests_and_turns() -> None:
    s, c = make(max_total_tokens=10_000)
    system = seq(1000, 100)
    a = s.submit(req("a", [*system, *seq(1, 20)], max_new=5), c.now)
    drain(s, c)
    assert a.cached_tokens == 0
    assert a.finish_reason == {"type": "length", "length": 5}
    b = s.submit(req("b", [*system, *seq(50, 30)], max_new=5), c.now)
    drain(s, c)
    assert b.cached_tokens == 100  # shared system prompt
    # Next turn of conversation a: previous prompt + its output + a new message.
    turn2 = [*a.input_ids, *s.output_ids(a), *seq(7000, 10)]
    a2 = s.submit(req("a2", turn2, max_new=5), c.now)
    drain(s, c)
    # The KV of prompt + output[:-1] was cached (the last token never got KV).
    assert a2.cached_tokens == len(a.input_ids) + 5 - 1
    assert s.stats.cached_tokens_total == 100 + a2.cached_tokens


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        (seq(0, 50), 49),  # identical prompt: at least one token is recomputed
        (seq(0, 30), 29),  # a prefix of the cached prompt
        ([*seq(0, 50), 7], 50),
        ([*seq(0, 10), 999, *seq(11, 39)], 10),
        (seq(500, 40), 0),
    ],
)
def test_cached_tokens_table(second: list[int], expected: int) -> None:
    s, c = make(max_total_tokens=10_000)
    s.submit(req("first", seq(0, 50), max_new=1), c.now)
    drain(s, c)
    r = s.submit(req("second", second, max_new=1), c.now)
    drain(s, c)
    assert r.cached_tokens == expected


def test_concurrent_requests_share_a_prompt_once_it_is_prefilled() -> None:
    s, c = make(max_total_tokens=10_000)
    s.submit(req("a", seq(0, 200), max_new=50), c.now)
    step(s, c)  # a's prefill: its prompt is now in the tree, locked
    b = s.submit(req("b", [*seq(0, 200), 1], max_new=5), c.now)
    step(s, c)
    assert b.cached_tokens == 200
    drain(s, c)


# --------------------------------------------------------------- accounting


def test_token_usage_excludes_evictable_cache() -> None:
    s, c = make(max_total_tokens=1_000)
    s.submit(req("a", seq(0, 200), max_new=20), c.now)
    step(s, c)
    step(s, c)
    assert s.kv.evictable == 0
    assert s.token_usage() == pytest.approx(round((200 + 1) / 1000, 2))
    drain(s, c)
    assert s.kv.evictable == 219  # prompt + output[:-1], now ordinary cache
    assert s.kv.available == 1000 - 219
    assert s.token_usage() == 0.0
    pool = s.pool()
    assert pool["used"] == 0


def test_cost_model_durations() -> None:
    cost = CostModel.legacy(
        prefill_base_s=0.01, prefill_per_token_s=0.001, decode_base_s=0.02, decode_per_req_s=0.005
    )
    s, c = make(max_total_tokens=10_000, cost=cost)
    s.submit(req("a", seq(0, 100), max_new=3), c.now)
    s.submit(req("b", seq(1000, 60), max_new=3), c.now)
    prefill = s.schedule(c.now)
    assert prefill is not None and prefill.kind == "prefill"
    assert prefill.tokens == 160
    assert prefill.duration == pytest.approx(0.01 + 0.001 * 160)
    s.finish_batch(prefill, c.now + prefill.duration)
    decode = s.schedule(c.now)
    assert decode is not None and decode.kind == "decode" and decode.size == 2
    assert decode.duration == pytest.approx(0.02 + 0.005 * 2)
    s.finish_batch(decode, c.now + 1)


def test_uncached_tokens_only_are_prefilled() -> None:
    s, c = make(max_total_tokens=10_000)
    s.submit(req("a", seq(0, 300), max_new=1), c.now)
    drain(s, c)
    s.submit(req("b", [*seq(0, 300), *seq(900, 20)], max_new=1), c.now)
    batch = s.schedule(c.now)
    assert batch is not None and batch.tokens == 20 and batch.hit_tokens == 300
    assert s.stats.cache_hit_rate == pytest.approx(300 / 320, abs=1e-4)
    s.finish_batch(batch, c.now + batch.duration)


def test_chunked_prefill_splits_a_long_prompt() -> None:
    s, c = make(max_total_tokens=50_000, chunked_prefill_size=1_000)
    r = s.submit(req("long", seq(0, 2_500), max_new=2), c.now)
    kinds = []
    for _ in range(10):
        batch = s.schedule(c.now)
        if batch is None:
            break
        kinds.append((batch.kind, batch.tokens))
        c.now += batch.duration
        s.finish_batch(batch, c.now)
        s.check_invariants()
    assert kinds == [("prefill", 1000), ("prefill", 1000), ("prefill", 500), ("decode", 1)]
    assert r.finished and r.generated == 2


def test_request_waits_in_queue_when_kv_is_short() -> None:
    s, c = make(max_total_tokens=1_000)
    a = s.submit(req("a", seq(0, 600), max_new=100), c.now)
    b = s.submit(req("b", seq(5000, 600), max_new=100), c.now)
    step(s, c)
    assert a.state is State.DECODE
    assert b.state is State.WAITING and s.num_waiting == 1
    done = drain(s, c)
    assert [r.rid for r in done] == ["a", "b"]
    assert b.cached_tokens == 0 and b.generated == 100


def test_output_is_deterministic_from_rid_and_max_new_tokens() -> None:
    s, c = make(max_total_tokens=10_000)
    r1 = s.submit(req("same-rid", seq(0, 10), max_new=12), c.now)
    drain(s, c)
    s2, c2 = make(max_total_tokens=10_000)
    r2 = s2.submit(req("same-rid", seq(500, 30), max_new=12), c2.now)
    drain(s2, c2)
    assert s.output_ids(r1) == s2.output_ids(r2)
    assert len(s.output_ids(r1)) == 12
    assert OutputStream("same-rid").ids(5) == s.output_ids(r1)[:5]


@pytest.mark.parametrize(
    ("kwargs", "expected_len", "expected_reason"),
    [
        ({}, 10, {"type": "length", "length": 10}),
        ({"output_len": 4}, 4, {"type": "stop", "matched": EOS_TOKEN_ID}),
        ({"output_len": 4, "stop_token_ids": (42,)}, 4, {"type": "stop", "matched": 42}),
        ({"output_len": 50}, 10, {"type": "length", "length": 10}),
    ],
)
def test_output_length_and_finish_reason(
    kwargs: dict[str, Any], expected_len: int, expected_reason: dict[str, Any]
) -> None:
    s, c = make(max_total_tokens=10_000)
    r = s.submit(req("r", seq(0, 10), max_new=10), c.now, **kwargs)
    drain(s, c)
    ids = s.output_ids(r)
    assert len(ids) == expected_len
    assert r.finish_reason == expected_reason
    if expected_reason["type"] == "stop":
        assert ids[-1] == expected_reason["matched"]


def test_uniform_output_length_ends_with_stop() -> None:
    s, c = make(max_total_tokens=100_000, output_len_dist="uniform")
    reqs = [s.submit(req(f"u{i}", seq(i * 100, 20), max_new=64), c.now) for i in range(30)]
    drain(s, c)
    lengths = {r.generated for r in reqs}
    assert len(lengths) > 5 and all(1 <= n <= 64 for n in lengths)
    for r in reqs:
        if r.generated < 64:
            assert r.finish_reason == {"type": "stop", "matched": EOS_TOKEN_ID}


def test_max_new_tokens_zero_prefills_only() -> None:
    s, c = make(max_total_tokens=1_000)
    r = s.submit(req("z", seq(0, 10), max_new=0), c.now)
    drain(s, c)
    assert r.generated == 0 and r.finish_reason == {"type": "length", "length": 0}
    assert s.kv.evictable == 10


# ---------------------------------------------------------------- retraction


def test_retraction_under_decode_pressure_is_counted_and_requests_still_finish() -> None:
    s, c = make(max_total_tokens=3_000, retract_decode_steps=5)
    reqs = [s.submit(req(f"r{i:02d}", seq(i * 1000, 100), max_new=300), c.now) for i in range(12)]
    saw_gauge = 0
    for _ in range(MAX_STEPS):
        if not s.busy:
            break
        step(s, c)
        saw_gauge = max(saw_gauge, s.stats.num_retracted_reqs)
    assert s.stats.num_retracted_requests_total > 0
    assert saw_gauge > 0
    assert any(r.num_retractions > 0 for r in reqs)
    for r in reqs:
        assert r.finished and r.generated == 300
        assert r.finish_reason == {"type": "length", "length": 300}
    retracted = [r for r in reqs if r.num_retractions]
    # A retracted request re-prefills and reuses whatever of its prefix survived.
    assert all(r.cached_tokens >= 0 for r in retracted)
    assert s.new_token_ratio <= 1.0


def test_retraction_picks_fewest_output_tokens_longest_prompt_first() -> None:
    s, c = make(max_total_tokens=1_000, retract_decode_steps=1, init_new_token_ratio=0.0)
    old = s.submit(req("old", seq(0, 100), max_new=400), c.now)
    for _ in range(20):
        step(s, c)
    short = s.submit(req("short", seq(1000, 50), max_new=400), c.now)
    long_ = s.submit(req("long", seq(2000, 150), max_new=400), c.now)
    for _ in range(MAX_STEPS):
        step(s, c)
        if s.stats.num_retracted_requests_total:
            break
    assert long_.num_retractions == 1
    assert short.num_retractions == 0 and old.num_retractions == 0
    drain(s, c)


# ------------------------------------------------------------------- sessions


def test_session_radix_referenced_kv_outlives_unreferenced_under_pressure() -> None:
    s, c = make(max_total_tokens=1_000, mode="session-radix")
    sess = s.submit(req("s-turn1", seq(0, 200), max_new=10, session_id="traj-1"), c.now)
    drain(s, c)
    c.now += 1
    other = s.submit(req("other", seq(5000, 200), max_new=10), c.now)
    drain(s, c)
    assert s.kv.referenced_sessions() == ["traj-1"]
    # Pressure: a request that needs most of the pool. LRU alone would evict the
    # older session KV first; session references make the unreferenced KV go first.
    c.now += 1
    s.submit(req("big", seq(9000, 600), max_new=10), c.now)
    drain(s, c)
    again = s.submit(req("s-turn2", [*sess.input_ids, 1], max_new=1, session_id="traj-1"), c.now)
    drain(s, c)
    assert again.cached_tokens == 200
    probe = s.submit(req("probe", [*other.input_ids, 1], max_new=1), c.now)
    drain(s, c)
    assert probe.cached_tokens == 0


def test_plain_mode_evicts_by_lru_regardless_of_session_id() -> None:
    s, c = make(max_total_tokens=1_000, mode="plain")
    sess = s.submit(req("s-turn1", seq(0, 200), max_new=10, session_id="traj-1"), c.now)
    drain(s, c)
    c.now += 1
    s.submit(req("other", seq(5000, 200), max_new=10), c.now)
    drain(s, c)
    c.now += 1
    s.submit(req("big", seq(9000, 600), max_new=10), c.now)
    drain(s, c)
    again = s.submit(req("s-turn2", [*sess.input_ids, 1], max_new=1), c.now)
    drain(s, c)
    assert again.cached_tokens == 0


def test_close_session_dereferences_but_keeps_kv_in_radix_mode() -> None:
    s, c = make(max_total_tokens=10_000, mode="session-radix")
    a = s.submit(req("a", seq(0, 100), max_new=5, session_id="traj-1"), c.now)
    drain(s, c)
    kv_before = s.kv.evictable
    assert s.kv.session_tokens("traj-1") == 104
    s.close_session("traj-1", c.now)
    s.close_session("traj-1", c.now)  # idempotent
    s.close_session("never-seen", c.now)
    assert s.kv.referenced_sessions() == []
    assert s.kv.evictable == kv_before  # still cached, now ordinary
    again = s.submit(req("b", [*a.input_ids, 3], max_new=1), c.now)
    drain(s, c)
    assert again.cached_tokens == 100


def test_late_finish_after_close_does_not_retag_and_new_request_reopens() -> None:
    s, c = make(max_total_tokens=10_000, mode="session-radix")
    s.submit(req("in-flight", seq(0, 50), max_new=30, session_id="traj-1"), c.now)
    step(s, c)
    s.close_session("traj-1", c.now)
    drain(s, c)
    assert s.kv.referenced_sessions() == []  # tombstone: the late finish did not tag
    s.submit(req("reopen", seq(100, 50), max_new=3, session_id="traj-1"), c.now)
    drain(s, c)
    assert s.kv.referenced_sessions() == ["traj-1"]


def test_aborted_request_does_not_tag_its_session() -> None:
    s, c = make(max_total_tokens=10_000, mode="session-radix")
    s.submit(req("x", seq(0, 50), max_new=30, session_id="traj-1"), c.now)
    step(s, c)
    s.abort("x", c.now)
    assert s.kv.referenced_sessions() == []
    assert s.kv.evictable > 0  # its KV is cached, untagged
    s.check_invariants()


def test_streaming_session_holds_kv_outside_eviction_and_close_frees_it() -> None:
    s, c = make(max_total_tokens=1_000, mode="streaming")
    s.open_session("st-1", c.now, streaming=True)
    t1 = s.submit(req("t1", seq(0, 100), max_new=10), c.now, session_params={"id": "st-1"})
    drain(s, c)
    held = s.streaming_held_tokens()
    assert held == 109
    assert s.kv.evictable == 0
    assert s.token_usage() == pytest.approx(0.11)  # held KV counts as used
    # Pressure cannot evict the held KV.
    s.submit(req("big", seq(5000, 800), max_new=5), c.now)
    drain(s, c)
    assert s.streaming_held_tokens() == held
    # Turn 2 sends only the new tokens and restores the whole context.
    t2 = s.submit(req("t2", seq(300, 20), max_new=5), c.now, session_params={"id": "st-1"})
    assert t2.input_ids[:110] == [*t1.input_ids, *s.output_ids(t1)]
    drain(s, c)
    assert t2.cached_tokens == 109
    assert s.streaming_held_tokens() == 110 + 20 + 4
    available = s.kv.available
    s.close_session("st-1", c.now)
    assert s.kv.available == available + 134
    assert s.streaming_held_tokens() == 0
    with pytest.raises(SimError, match="does not exist"):
        s.submit(req("t3", [1], max_new=1), c.now, session_params={"id": "st-1"})


def test_streaming_close_is_deferred_until_the_active_request_finishes() -> None:
    s, c = make(max_total_tokens=1_000, mode="streaming")
    s.open_session("st", c.now, streaming=True)
    s.submit(req("t1", seq(0, 50), max_new=20), c.now, session_params={"id": "st"})
    step(s, c)
    with pytest.raises(SimError, match="already has an active request"):
        s.submit(req("t1b", [1], max_new=1), c.now, session_params={"id": "st"})
    s.close_session("st", c.now)
    assert "st" in s.streaming_sessions
    drain(s, c)
    assert "st" not in s.streaming_sessions
    assert s.kv.available + s.kv.evictable == 1_000


def test_streaming_session_idle_timeout_reaps() -> None:
    # SGLang's clock runs from the start of the session's last turn (create_req).
    s, c = make(max_total_tokens=1_000, mode="streaming")
    s.open_session("st", c.now, streaming=True, timeout_s=5.0)
    started = c.now
    s.submit(req("t1", seq(0, 50), max_new=3), c.now, session_params={"id": "st"})
    drain(s, c)
    assert s.next_deadline() == pytest.approx(started + 5.0)
    assert s.reap(started + 4.9) == 0
    assert s.reap(started + 5.0) == 1
    assert s.streaming_held_tokens() == 0


def test_streaming_session_timed_out_mid_turn_closes_when_the_turn_finishes() -> None:
    s, c = make(max_total_tokens=1_000, mode="streaming")
    s.open_session("st", c.now, streaming=True, timeout_s=0.001)
    s.submit(req("t1", seq(0, 50), max_new=20), c.now, session_params={"id": "st"})
    step(s, c)
    assert s.reap(c.now + 1.0) == 0  # deferred: a turn is running
    assert "st" in s.streaming_sessions
    drain(s, c)
    assert "st" not in s.streaming_sessions
    assert s.kv.available + s.kv.evictable == 1_000


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"replace": True}, "do not support replace"),
        ({"drop_previous_output": True}, "do not support drop_previous_output"),
        ({"offset": -1}, "do not support offset"),
        ({"offset": 3}, "do not support offset"),
    ],
)
def test_streaming_sessions_refuse_history_rewrites(params: dict, message: str) -> None:
    s, c = make(max_total_tokens=1_000, mode="streaming")
    s.open_session("st", c.now, streaming=True)
    s.submit(req("t1", seq(0, 10), max_new=2), c.now, session_params={"id": "st"})
    drain(s, c)
    with pytest.raises(SimError, match=message):
        s.submit(req("t2", [5], max_new=1), c.now, session_params={"id": "st", **params})
    ok = s.submit(req("t3", [5], max_new=1), c.now, session_params={"id": "st", "offset": 0})
    assert ok.input_ids[-1] == 5


@pytest.mark.parametrize(
    ("mode", "streaming", "error"),
    [
        ("plain", True, "Streaming sessions are disabled"),
        ("session-radix", True, "Streaming sessions are disabled"),
    ],
)
def test_open_session_errors(mode: str, streaming: bool, error: str) -> None:
    s, c = make(mode=mode)
    with pytest.raises(SimError, match=error):
        s.open_session("x", c.now, streaming=streaming)


def test_legacy_session_params_append_to_context_and_unknown_id_is_rejected() -> None:
    s, c = make(max_total_tokens=10_000)
    with pytest.raises(SimError, match="session id nope does not exist"):
        s.submit(req("r", [1, 2], max_new=1), c.now, session_params={"id": "nope"})
    s.open_session("leg", c.now)
    with pytest.raises(SimError, match="same id is still open"):
        s.open_session("leg", c.now)
    r1 = s.submit(req("r1", seq(0, 40), max_new=4), c.now, session_params={"id": "leg"})
    drain(s, c)
    r2 = s.submit(req("r2", seq(100, 5), max_new=2), c.now, session_params={"id": "leg"})
    assert r2.input_ids == [*r1.input_ids, *s.output_ids(r1), *seq(100, 5)]
    drain(s, c)
    assert r2.cached_tokens == 43


# ---------------------------------------------------------------------- abort


def test_abort_by_prefix_waiting_and_running() -> None:
    s, c = make(max_total_tokens=10_000, max_running_requests=1)
    run = s.submit(req("abc", seq(0, 10), max_new=100), c.now)
    step(s, c)
    waiting = s.submit(req("abcdef", seq(100, 10), max_new=5), c.now)
    bystander = s.submit(req("ab", seq(200, 10), max_new=5), c.now)
    done = s.abort("abc", c.now)
    assert {r.rid for r in done} == {"abc", "abcdef"}
    assert run.finish_reason == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert waiting.finish_reason is not None
    assert waiting.finish_reason["message"] == "Abort in waiting queue"
    assert not bystander.finished
    assert s.abort("zzz", c.now) == []
    assert s.stats.num_aborted_requests_total == 2
    s.check_invariants()
    drain(s, c)
    assert bystander.finished and bystander.finish_reason == {"type": "length", "length": 5}


def test_abort_all_and_abort_of_inflight_prefill() -> None:
    s, c = make(max_total_tokens=10_000)
    a = s.submit(req("a", seq(0, 100), max_new=10), c.now)
    batch = s.schedule(c.now)
    assert batch is not None and batch.kind == "prefill"
    b = s.submit(req("b", seq(500, 10), max_new=10), c.now)
    done = s.abort("", c.now, abort_all=True)
    assert [r.rid for r in done] == ["b"]  # "a" is inside the batch being computed
    assert not a.finished
    ev = s.finish_batch(batch, c.now + batch.duration)
    assert [r.rid for r in ev.finished] == ["a"]
    assert a.finish_reason is not None and a.finish_reason["message"] == "Aborted"
    assert b.finish_reason is not None and b.finish_reason["message"] == "Abort in waiting queue"
    s.check_invariants()
    assert not s.busy


def test_abort_during_decode_step_returns_its_reserved_slot() -> None:
    s, c = make(max_total_tokens=1_000)
    s.submit(req("a", seq(0, 10), max_new=50), c.now)
    s.submit(req("b", seq(100, 10), max_new=50), c.now)
    step(s, c)
    batch = s.schedule(c.now)
    assert batch is not None and batch.kind == "decode"
    s.abort("a", c.now)
    s.finish_batch(batch, c.now + batch.duration)
    s.check_invariants()
    drain(s, c)


# ------------------------------------------------------------------- priority


def test_priority_scheduling_orders_the_queue() -> None:
    s, c = make(max_total_tokens=10_000, enable_priority_scheduling=True, max_running_requests=1)
    s.submit(req("first", seq(0, 10), max_new=3), c.now)
    step(s, c)
    s.submit(req("low", seq(100, 10), max_new=3, priority=0), c.now)
    s.submit(req("high", seq(200, 10), max_new=3, priority=10), c.now)
    done = [r.rid for r in drain(s, c)]
    assert done == ["first", "high", "low"]


def test_fcfs_without_priority_scheduling() -> None:
    s, c = make(max_total_tokens=10_000, max_running_requests=1)
    s.submit(req("first", seq(0, 10), max_new=3), c.now)
    step(s, c)
    s.submit(req("low", seq(100, 10), max_new=3, priority=0), c.now)
    s.submit(req("high", seq(200, 10), max_new=3, priority=10), c.now)
    assert [r.rid for r in drain(s, c)] == ["first", "low", "high"]


# --------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("ids", "config", "message"),
    [
        ([], {}, "empty"),
        (seq(0, 100), {"context_length": 100}, "longer than the model's context length"),
        (seq(0, 100), {"max_total_tokens": 100}, "does not fit in the KV cache"),
    ],
)
def test_submit_rejections(ids: list[int], config: dict[str, Any], message: str) -> None:
    s, c = make(**config)
    with pytest.raises(SimError, match=message):
        s.submit(req("r", ids), c.now)


def test_duplicate_live_rid_is_rejected() -> None:
    s, c = make()
    s.submit(req("dup", [1, 2, 3]), c.now)
    with pytest.raises(SimError, match="Duplicate request ID"):
        s.submit(req("dup", [4, 5]), c.now)


def test_flush_cache_only_when_idle() -> None:
    s, c = make(max_total_tokens=1_000)
    s.submit(req("a", seq(0, 50), max_new=20), c.now)
    step(s, c)
    assert not s.flush_cache()
    drain(s, c)
    assert s.flush_cache()
    assert s.kv.available == 1_000


def test_snapshot_is_json_friendly() -> None:
    import orjson

    s, c = make(max_total_tokens=1_000, mode="session-radix")
    s.submit(req("a", seq(0, 50), max_new=20, session_id="x"), c.now)
    step(s, c)
    snap = s.snapshot()
    orjson.dumps(snap)
    assert snap["running"] == ["a"]
    assert snap["pool"]["max_total_num_tokens"] == 1_000
    assert snap["sessions"]["radix_open"] == ["x"]


def test_config_is_frozen() -> None:
    cfg = SchedulerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_total_tokens = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("mode", "policy"),
    [("plain", "lru"), ("session-radix", "priority"), ("streaming", "lru")],
)
def test_random_workload_keeps_pool_invariants(mode: str, policy: str) -> None:
    """Random arrivals, aborts, session opens/closes and pressure; invariants every step."""
    import random

    rng = random.Random(f"{mode}-{policy}")
    s, c = make(
        max_total_tokens=3_000,
        mode=mode,
        eviction_policy=policy,
        chunked_prefill_size=256,
        max_running_requests=16,
        retract_decode_steps=4,
    )
    prefixes = [seq(10_000 * k, 150) for k in range(4)]
    n = 0
    for _ in range(1_500):
        op = rng.random()
        if op < 0.25:
            n += 1
            ids = [
                *rng.choice(prefixes),
                *(rng.randrange(5_000) for _ in range(rng.randint(1, 200))),
            ]
            kw: dict[str, Any] = {}
            params = None
            if mode == "session-radix" and rng.random() < 0.7:
                kw["session_id"] = f"s{rng.randrange(6)}"
            if mode == "streaming" and rng.random() < 0.5:
                sid = f"st{rng.randrange(6)}"
                if sid not in s.streaming_sessions:
                    s.open_session(sid, c.now, streaming=True, timeout_s=rng.choice([None, 2.0]))
                params = {"id": sid}
                ids = ids[-rng.randint(1, 40) :]
            r = req(f"r{n:05d}", ids, max_new=rng.randint(0, 120), priority=rng.randrange(3), **kw)
            with contextlib.suppress(SimError):  # e.g. a second turn on a busy session
                s.submit(r, c.now, session_params=params, output_len=rng.choice([None, None, 5]))
        elif op < 0.32 and s.requests:
            victim = rng.choice(sorted(s.requests))
            s.abort(victim[: rng.randint(2, len(victim))], c.now)
        elif op < 0.36:
            s.close_session(rng.choice([f"s{rng.randrange(6)}", f"st{rng.randrange(6)}"]), c.now)
        elif op < 0.38:
            s.reap(c.now)
        else:
            step(s, c)
        s.check_invariants()
    drain(s, c)
    for sid in list(s.streaming_sessions):
        s.close_session(sid, c.now)
    s.check_invariants()
    assert s.kv.protected == 0
    assert s.kv.available + s.kv.evictable == 3_000
