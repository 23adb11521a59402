"""The peer cores against their rules, with an injected clock: ThunderAgent's program
scheduler (arXiv 2602.13692: capacity eq. 6-7, pause smallest acting first, resume
pending -> new -> acting by best-fit decreasing on the most room, forced resume after
1800 s, resume-side decay) and a fixed per-engine cap."""

from __future__ import annotations

import pytest

from kvlab.peers import is_peer, parse_cap
from kvlab.peers.cap import CapGate
from kvlab.peers.thunder import ACTING, REASONING, ThunderConfig, ThunderScheduler

A, B = "http://a", "http://b"


def sched(cap: int = 1000, **kw: object) -> ThunderScheduler:
    cfg = ThunderConfig(capacity_tokens=cap, buffer_tokens=10, **kw)  # type: ignore[arg-type]
    return ThunderScheduler(cfg, (A, B))


def run_turn(s: ThunderScheduler, pid: str, prompt: int, out: int, t: float) -> str | None:
    backend = s.request(pid, prompt, t)
    if backend is not None:
        s.response(pid, prompt + out, t + 1.0)
    return backend


def test_capacity_is_reasoning_plus_weighted_acting_plus_buffer() -> None:
    s = sched(acting_weight=0.5, decay_scope="resume")
    assert s.request("r", 300, 0.0) == A  # reasoning: 300 + 10
    assert s.request("x", 200, 0.0) == B
    s.response("x", 400, 1.0)  # acting: 0.5 x 400 + 10
    assert s.used(A, 1.0) == 310
    assert s.used(B, 1.0) == 210
    # Resume-side decay: half-life 1 s halves the acting part each second.
    assert s.used(B, 3.0, decay=True) == pytest.approx(0.5 * 400 / 4 + 10)
    assert s.used(B, 3.0) == 210  # the code's scope: the pause side never decays
    # The paper's (and the port's) scope: decayed everywhere.
    paper = sched(acting_weight=0.5)
    paper.request("x", 200, 0.0)
    paper.response("x", 400, 1.0)
    assert paper.used(A, 3.0) == pytest.approx(0.5 * 400 / 4 + 10)


def test_new_program_goes_to_least_loaded_backend_with_room_else_waits() -> None:
    s = sched(cap=500)
    assert s.request("p1", 300, 0.0) == A
    assert s.request("p2", 100, 0.0) == B
    assert s.request("p3", 100, 0.0) == B  # B has 100 active tokens, A 300
    assert s.request("p4", 400, 0.0) is None  # fits nowhere: waits
    assert s.programs["p4"].waiting_since == 0.0
    assert s.counters.immediate == 3


def test_active_programs_always_pass_even_over_capacity() -> None:
    s = sched(cap=500)
    assert s.request("p", 400, 0.0) == A
    s.response("p", 450, 1.0)
    assert s.request("p", 900, 2.0) == A  # resident: never held (R2)
    assert s.programs["p"].phase == REASONING


@pytest.mark.parametrize(
    ("capacity", "acting", "expected_paused"),
    [
        # Over by 50: the smallest acting program alone suffices.
        (700, {"s": 150, "m": 250, "l": 350}, {"s"}),
        # Over by 80: smallest first until it fits.
        (650, {"s": 60, "m": 70, "l": 600}, {"s", "m"}),
    ],
)
def test_pause_takes_smallest_acting_first(
    capacity: int, acting: dict[str, int], expected_paused: set[str]
) -> None:
    cfg = ThunderConfig(capacity_tokens=capacity, buffer_tokens=0, decay_scope="resume")
    s = ThunderScheduler(cfg, (A,))
    for pid, tokens in acting.items():
        assert s.request(pid, 10, 0.0) == A
        s.response(pid, tokens, 0.5)
    s.tick(5.0)
    assert {p.pid for p in s.programs.values() if p.paused} == expected_paused
    assert s.used(A, 5.0) <= capacity


def test_reasoning_is_marked_and_paused_at_its_response() -> None:
    s = ThunderScheduler(ThunderConfig(capacity_tokens=100, buffer_tokens=0), (A,))
    assert s.request("r1", 60, 0.0) == A
    assert s.request("r2", 30, 0.0) == A
    s.programs["r1"].tokens = 90  # grew while decoding: 120 > 100, nobody is acting
    s.tick(5.0)
    assert s.programs["r2"].pause_pending and not s.programs["r2"].paused
    assert not s.programs["r1"].pause_pending  # marking the smallest sufficed
    s.response("r2", 35, 6.0)
    assert s.programs["r2"].paused and s.programs["r2"].phase == ACTING
    assert s.counters.pause_marks == 1 and s.counters.pauses == 1
    # Its next request waits for a tick: a paused program is never admitted on arrival.
    assert s.request("r2", 40, 7.0) is None


def test_resume_order_pending_then_new_then_acting() -> None:
    cfg = ThunderConfig(capacity_tokens=300, buffer_tokens=0, acting_half_life_s=0.0)
    s = ThunderScheduler(cfg, (A,))
    for pid in ("pend", "act"):
        s.request(pid, 100, 0.0)
        s.response(pid, 100, 1.0)
    s.request("fill", 100, 1.0)
    s.programs["fill"].tokens = 250  # over: pauses the two acting programs
    s.tick(5.0)
    assert s.programs["pend"].paused and s.programs["act"].paused
    assert s.request("pend", 120, 6.0) is None  # a paused program's request waits
    assert s.request("new", 100, 6.0) is None  # no room for a new one either
    s.response("fill", 80, 7.0)  # "fill" shrinks (a compaction): 80 acting
    # Room 300 - 80 = 220: pending (120) first, then new (100); "act" does not fit.
    admitted = s.tick(10.0)
    assert admitted == [("pend", A), ("new", A)]
    assert s.programs["act"].paused
    assert s.counters.resumes == 1  # "new" is admitted, not resumed


def test_resume_is_best_fit_decreasing_onto_most_room_with_migration() -> None:
    s = sched(cap=1000, acting_half_life_s=0.0)
    s.request("home", 300, 0.0)  # -> A
    s.response("home", 300, 1.0)
    s.programs["home"].paused = True  # paused from A
    s.request("fillA", 600, 2.0)  # -> A (a tie at 0 active tokens: the first backend)
    s.request("fillB", 500, 2.0)  # -> B
    # Rooms: A 1000 - 610 = 390, B 1000 - 510 = 490: the most room is B (a migration).
    s.tick(5.0)
    assert s.programs["home"].backend == B and not s.programs["home"].paused
    s.programs["home"].paused = True
    s.programs["fillA"].tokens = 100  # now A has the most room: back again
    s.tick(10.0)
    assert s.programs["home"].backend == A
    assert s.counters.migrations == 2 and s.counters.resumes == 2


def test_resume_packs_largest_first_within_the_total_room() -> None:
    cfg = ThunderConfig(capacity_tokens=500, buffer_tokens=0, acting_half_life_s=0.0)
    s = ThunderScheduler(cfg, (A, B))
    assert s.request("a", 480, 0.0) == A
    assert s.request("b", 480, 0.0) == B
    for pid, tokens in (("x", 150), ("y", 250), ("z", 100)):
        assert s.request(pid, tokens, 1.0) is None
    s.response("a", 400, 2.0)
    s.response("b", 300, 2.0)
    # Rooms A 100, B 200 (total 300): selected smallest first x, z (250); y does not
    # fit the total. Placed largest first: x (150) -> B (most room), z (100) -> A.
    assert s.tick(5.0) == [("x", B), ("z", A)]
    assert s.programs["y"].waiting_since == 1.0


@pytest.mark.parametrize(
    ("placement", "backend"),
    [("most-room", B), ("origin-first", A), ("origin-only", A)],
)
def test_resume_placements(placement: str, backend: str) -> None:
    s = sched(cap=1000, acting_half_life_s=0.0, resume_placement=placement)
    s.request("p", 200, 0.0)  # -> A
    s.response("p", 200, 1.0)
    s.programs["p"].paused = True
    s.request("other", 300, 2.0)  # -> A, leaving B with more room
    s.tick(5.0)
    assert s.programs["p"].backend == backend and not s.programs["p"].paused


def test_origin_only_waits_for_its_own_backend() -> None:
    s = sched(cap=500, acting_half_life_s=0.0, resume_placement="origin-only")
    s.request("p", 200, 0.0)  # -> A
    s.request("q", 250, 0.5)  # -> B (least loaded)
    s.request("r", 200, 0.6)  # -> A (A 200, B 250 active)
    s.response("p", 200, 1.0)
    s.programs["p"].paused = True
    s.programs["r"].tokens = 280  # A: 280 + 10 left 210 free; B: 240 free
    assert s.request("p", 250, 3.0) is None
    assert s.tick(5.0) == []  # B has the room (240 < 260, A 210): p waits for A
    s.release("r")
    assert s.tick(10.0) == [("p", A)]
    assert s.counters.migrations == 0


def test_new_programs_wait_behind_the_queue() -> None:
    s = sched(cap=500, acting_half_life_s=0.0)
    s.request("p", 200, 0.0)  # -> A
    s.response("p", 200, 1.0)
    s.programs["p"].paused = True  # the queue is not empty
    assert s.request("n", 100, 2.0) is None  # it would fit, but waits (fairness)
    assert s.tick(5.0) == [("n", B)]  # largest first: p (200) takes A (a tie), n then B
    assert not s.programs["p"].paused  # paused acting programs resume too, room allowing


def test_force_after_1800_s_on_its_own_backend() -> None:
    s = sched(cap=300, acting_half_life_s=0.0)
    s.request("a", 280, 0.0)  # -> A
    s.request("b", 200, 0.0)  # -> B
    s.response("b", 200, 1.0)
    s.programs["b"].paused = True
    s.request("c", 280, 2.0)  # waits: the queue is not empty
    s.programs["b"].paused = False
    assert s.tick(3.0) == []  # no room for c (A 10, B 90 left)
    assert s.request("b", 250, 4.0) == B  # active: passes
    s.programs["b"].paused = True  # paused with its request in flight: forced later
    s.programs["b"].waiting_since = 10.0
    assert s.tick(1805.0) == [("c", B)]  # c waited 1803 s: forced on the least loaded (b paused)
    assert s.tick(1810.0) == [("b", B)]  # b forced on its own backend
    assert s.counters.forced == 2


def test_decay_lets_resume_use_idle_programs_room() -> None:
    cfg = ThunderConfig(
        capacity_tokens=400, buffer_tokens=0, acting_half_life_s=1.0, decay_scope="resume"
    )
    s = ThunderScheduler(cfg, (A,))
    s.request("done", 300, 0.0)
    s.response("done", 300, 1.0)  # never released: acting forever
    assert s.request("new", 300, 2.0) is None  # undecayed on arrival: no room
    admitted = s.tick(11.0)  # 10 half-lives later "done" counts ~0.3 tokens on resume
    assert admitted == [("new", A)]
    # ... but the pause side counts it whole: over capacity, the smaller acting goes.
    assert s.programs["done"].paused


def test_paper_scope_admits_on_decayed_room_and_pauses_nobody_idle() -> None:
    cfg = ThunderConfig(capacity_tokens=400, buffer_tokens=0, acting_half_life_s=1.0)
    s = ThunderScheduler(cfg, (A,))
    s.request("idle", 300, 0.0)
    s.response("idle", 300, 1.0)
    assert s.request("new", 300, 1.5) is None  # 0.5 s idle: still counts 212 tokens
    assert s.tick(5.0) == [("new", A)]  # 4 s idle: counts 19 tokens
    assert not s.programs["idle"].paused  # decayed: the backend is not over capacity


def test_chars_per_token_undercounts_until_the_first_response() -> None:
    s = sched(cap=1000, chars_per_token=4.0)
    assert s.request("p", 500, 0.0) == A
    assert s.programs["p"].tokens == 400  # 500 x 4.0 / 5.0: ThunderAgent's default ratio
    s.response("p", 520, 1.0)
    assert s.request("q", 500, 2.0) == B
    assert s.programs["q"].tokens == 500  # calibrated by a response: exact


def test_router_placement_puts_a_new_program_where_the_router_picks_and_only_there() -> None:
    """thunder-router: kvproxy's invariant. A new program waits for room on the engine
    the router picked, though the other has room, and a tick admits it only there."""
    s = sched(
        cap=500, acting_half_life_s=0.0, resume_placement="origin-only", new_placement="router"
    )
    assert s.request("big", 400, 0.0, routed=A) == A
    assert s.request("p", 200, 0.5, routed=A) is None  # B is empty, but the router chose A
    assert s.programs["p"].backend == A and not s.programs["p"].started
    assert s.tick(5.0) == []  # still no room on A; B's room is not p's
    s.programs["big"].tokens = 100  # the big program's context shrank (a compaction)
    assert s.tick(10.0) == [("p", A)]
    # A waiting new program is never counted on its engine, nor marked to pause.
    assert s.request("q", 450, 11.0, routed=B) == B
    assert s.request("r", 100, 11.0, routed=B) is None
    assert s.request("q", 520, 12.0, routed=B) == B  # resident: passes, B now over
    s.tick(15.0)
    assert s.programs["q"].pause_pending and not s.programs["r"].pause_pending
    assert s.used(B, 15.0) == 530  # r, waiting, counts nowhere
    # The least-loaded placement ignores the router and takes the emptier engine.
    free = sched(cap=500, acting_half_life_s=0.0)
    free.request("big", 400, 0.0)
    assert free.request("p", 200, 0.5, routed=A) == B


def test_router_placement_needs_the_routers_pick() -> None:
    s = sched(new_placement="router")
    with pytest.raises(ValueError, match="router"):
        s.request("p", 100, 0.0)


def test_idle_programs_are_forgotten_after_the_ttl() -> None:
    s = sched(idle_ttl_s=3600.0)
    s.request("p", 100, 0.0)
    s.response("p", 100, 1.0)
    s.tick(3600.0)
    assert "p" in s.programs
    s.tick(3601.0)
    assert "p" not in s.programs and s.counters.forgotten == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"capacity_tokens": 0},
        {"capacity_tokens": 10, "tick_s": 0},
        {"capacity_tokens": 10, "acting_weight": -1},
        {"capacity_tokens": 10, "resume_placement": "anywhere"},
        {"capacity_tokens": 10, "new_placement": "anywhere"},
    ],
)
def test_bad_thunder_config(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="thunder"):
        ThunderConfig(**bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- cap


def test_cap_admits_fifo_per_engine() -> None:
    g = CapGate(2)
    assert g.request("s1", A) and g.request("s2", A)
    assert not g.request("s3", A)
    assert not g.request("s4", A)
    assert g.request("s5", B)  # another engine has room
    assert g.request("s1", A)  # live sessions always pass
    assert g.close("s2") == ["s3"]
    assert g.live["s3"] == A
    assert not g.request("s6", A)
    assert g.close("s6") == []  # a queued session that goes away leaves the queue
    assert g.close("s1") == ["s4"]
    assert g.admitted_waiting == 2


@pytest.mark.parametrize(
    ("name", "ok"),
    [("cap:4", True), ("cap:0", False), ("cap:x", False), ("cap:", False), ("thunder", True)],
)
def test_policy_names(name: str, ok: bool) -> None:
    assert is_peer(name)
    if name.startswith("cap:"):
        if ok:
            assert parse_cap(name) == 4
        else:
            with pytest.raises(ValueError, match="cap:N"):
                parse_cap(name)
    with pytest.raises(ValueError, match="cap"):
        CapGate(0)
