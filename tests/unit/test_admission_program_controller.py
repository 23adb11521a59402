"""The asyncio glue of program admission, driven the way the lab drives it: engine URLs,
router policy and server_info injected, metrics through an overridden ``_scrape``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from multidict import CIMultiDict

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import AdmissionRequest
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.ring import HashRing

A, B = "http://a:1", "http://b:1"
RING = HashRing([A, B])


def keys_on(url: str, n: int) -> list[str]:
    out = [k for k in (f"s{i}" for i in range(500)) if RING.owner(k) == url]
    return out[:n]


def metrics(cap: int, evicted: int = 0) -> str:
    return (
        f'sglang:max_total_num_tokens{{model_name="m"}} {cap}\n'
        'sglang:token_usage{model_name="m"} 0.1\n'
        f'sglang:evicted_tokens_total{{model_name="m",cache_type="RadixCache"}} {evicted}\n'
    )


# Each controller's engines' capacities, which its metric fetch reports (by id: the
# controller is a compiled class in a KVPROXY_COMPILE=1 build, closed to subclasses
# and new attributes).
CAPS: dict[int, dict[str, int]] = {}


def set_cap(ctl: AdmissionController, url: str, cap: int) -> None:
    CAPS[id(ctl)][url] = cap


def request(ticket: str, sid: str | None, tokens: int, **body: Any) -> AdmissionRequest:
    full = {"input_ids": [1] * tokens, "sampling_params": {"max_new_tokens": 0}, **body}
    return AdmissionRequest(ticket, "/generate", CIMultiDict(), full, sid)


@pytest.fixture
async def lab() -> AsyncIterator[Any]:
    made: list[AdmissionController] = []

    async def factory(policy: str | None = "consistent_hashing", info: str = "priority", **cfg):
        settings: dict[str, Any] = {
            "enabled": True,
            "headroom": 1.0,
            "poll_interval_s": 3600.0,
            "staleness_s": 3600.0,
            "target_start": 0.9,
            "session_buffer_tokens": 0,
            # The gate's mechanics, engaged from the start (when it engages: the
            # engagement tests).
            "engage_on_thrash": False,
            **cfg,
        }
        caps = {A: 1000, B: 1000}

        async def fetch(url: str) -> str:
            return metrics(caps[url])

        ctl = AdmissionController(
            AdmissionConfig(**settings),
            healthy_engines=lambda: [A, B],
            http=None,
            fetch_metrics=fetch,
            router_policy=policy,
            server_info={u: {"radix_eviction_policy": info} for u in (A, B)},
        )
        CAPS[id(ctl)] = caps
        await ctl.start()
        made.append(ctl)
        return ctl

    yield factory
    for ctl in made:
        await ctl.stop()
        del CAPS[id(ctl)]


async def turn(ctl: AdmissionController, r: AdmissionRequest, prompt: int, completion: int = 0):
    async with ctl.admit(r) as decision:
        # A turn program admission lets run is always learnt from (its context).
        assert ctl.learns_from(r) or not ctl.program.running(r.ticket_id)
        ctl.observe_usage(r, prompt, 0, completion)
    return decision


async def test_a_full_engine_holds_its_new_sessions_while_the_other_engines_pass(lab) -> None:
    ctl = await lab()
    assert ctl.program_active and ctl.fallback_reason is None
    a1, a2 = keys_on(A, 2)
    (b1,) = keys_on(B, 1)
    d = await turn(ctl, request("t1", a1, 700), prompt=800, completion=100)
    assert (d.action, d.reason) == ("admit", "new_admitted")
    # A continuing turn of the active session on the full engine is never held; while it
    # runs (an engine with nothing in flight takes the next held turn), a1 holds 900 of
    # A's 1000: a2's first turn (200) waits; b1's passes at once.
    async with ctl.admit(request("t4", a1, 950)) as d:
        assert d.reason == "continuing_forwarded" and d.wait_s == 0.0
        waiting = asyncio.create_task(turn(ctl, request("t2", a2, 200), prompt=200))
        await asyncio.sleep(0)
        assert ctl.waiting == 1 and ctl.health().to_json()["held"]["reason"] == "new_session_fit"
        d = await turn(ctl, request("t3", b1, 200), prompt=200)
        assert d.reason == "new_admitted"
        assert ctl.waiting == 1
        ctl.end_session(a1)  # frees A: the waiting new session goes
        d = await asyncio.wait_for(waiting, 2.0)
        assert (d.action, d.reason) == ("admit", "new_waited")
    stats = ctl.stats()
    assert stats["agentic_kv/admission/decision_new_waited"] == 1
    assert stats["agentic_kv/admission/decision_continuing_forwarded"] == 1
    assert stats["agentic_kv/admission/sessions_running"] == 0


async def test_priority_is_injected_only_when_engines_evict_by_priority(lab) -> None:
    default = await lab()  # off by default (docs/admission.md#defaults)
    d = await turn(default, request("t0", keys_on(A, 1)[0], 100), prompt=100)
    assert d.priority is None
    ctl = await lab(priority_steering=True)
    (a1,) = keys_on(A, 1)
    d = await turn(
        ctl,
        request(
            "t1",
            a1,
            100,
        ),
        prompt=100,
    )
    assert d.priority == 0
    set_cap(ctl, A, 10**6)
    await ctl.poll_once()
    d = await turn(ctl, request("t2", a1, 20_000), prompt=20_000)
    assert d.priority == 2
    lru = await lab(info="lru", priority_steering=True)
    d = await turn(lru, request("t3", a1, 100), prompt=100)
    assert d.priority is None
    off = await lab(priority_steering=False)
    d = await turn(off, request("t4", a1, 100), prompt=100)
    assert d.priority is None


async def test_unknown_router_policy_falls_back_to_fleet_accounting_and_says_so(lab) -> None:
    ctl = await lab(policy="round_robin")
    assert not ctl.program_active
    program = ctl.health().program
    assert program.fallback is not None and "round_robin" in program.fallback
    assert program.active is False
    d = await turn(ctl, request("t1", "s", 10), prompt=10)
    assert d.reason == "capacity_available"  # the fleet-wide path decided
    ctl.set_router_policy("consistent_hashing")
    assert ctl.program_active
    fleet = await lab(ledger="fleet")
    assert not fleet.program_active and fleet.fallback_reason == "admission.ledger is fleet"
    request_mode = await lab(mode="request")
    assert not request_mode.program_active and request_mode.fallback_reason is None


async def test_a_paused_turn_waits_no_longer_than_its_bound(lab) -> None:
    ctl = await lab(
        idle_lease_s=0.01,
        idle_half_life_s=3600.0,
        paused_soft_wait_s=0.2,
        paused_max_wait_s=0.2,
        feedback=False,
    )
    a1, a2 = keys_on(A, 2)
    await turn(ctl, request("t1", a1, 10), prompt=500)
    await turn(ctl, request("t2", a2, 10), prompt=10)
    # a2 grows past the pause mark while a1 is idle: the tick pauses the smaller, a1.
    set_cap(ctl, A, 1000)
    await asyncio.sleep(0.02)
    task = asyncio.create_task(turn(ctl, request("t3", a2, 470), prompt=480))
    await asyncio.sleep(0)
    await asyncio.wait_for(task, 1.0)
    ctl.tick()
    assert ctl.program.ledger.sessions[a1].state.value == "paused"
    # a2 keeps growing (continuing, forwarded); a1's next turn does not fit and waits.
    async with ctl.admit(request("t4", a2, 900)):
        loop = asyncio.get_running_loop()
        started = loop.time()
        d = await asyncio.wait_for(turn(ctl, request("t5", a1, 500), prompt=500), 2.0)
        waited = loop.time() - started
    assert d.reason == "paused_aged" and d.action == "bypass"
    # t4 runs and nothing was answered on A meanwhile: the hold ages at twice its bound
    # (a proxy whose clock runs ahead of its engine does not age holds early).
    assert 0.35 <= waited < 1.0 and d.wait_s == pytest.approx(0.4, abs=0.1)
    assert ctl.stats()["agentic_kv/admission/paused_wait_count"] == 1


async def test_placement_moves_sessions_when_an_engine_goes_unavailable(lab) -> None:
    ctl = await lab()
    ctl.set_workers([A, B])
    sessions = keys_on(A, 3)
    for i, sid in enumerate(sessions):
        await turn(ctl, request(f"t{i}", sid, 10), prompt=10)
    ctl.set_workers([A, B], available=[B])
    assert all(ctl.program.ledger.sessions[s].engine == B for s in sessions)
    assert ctl.stats()["agentic_kv/admission/event_moved"] == 3
    text = "".join(str(m) for m in ctl.collect())
    assert "agentic_kv_admission_engine_footprint_tokens" in text


def test_diverted_requests_reads_smgs_off_ring_branches() -> None:
    from kvproxy.admission.poller import diverted_requests

    text = (
        "# TYPE smg_consistent_hashing_policy_branch_total counter\n"
        'smg_consistent_hashing_policy_branch_total{branch="routing_key_hit"} 90\n'
        'smg_consistent_hashing_policy_branch_total{branch="random_fallback"} 3\n'
        'smg_consistent_hashing_policy_branch_total{branch="no_healthy_workers"} 2\n'
    )
    assert diverted_requests(text) == 5.0
    assert diverted_requests("smg_router_requests_total 4\n") is None


async def test_waiters_go_when_program_mode_is_switched_off(lab) -> None:
    ctl = await lab()
    a1, a2 = keys_on(A, 2)
    await asyncio.wait_for(turn(ctl, request("t1", a1, 850), prompt=850), 1.0)
    waiting = asyncio.create_task(turn(ctl, request("t2", a2, 200), prompt=200))
    await asyncio.sleep(0)
    assert ctl.waiting == 1
    ctl.set_router_policy("round_robin")
    d = await asyncio.wait_for(waiting, 1.0)
    assert (d.action, d.reason) == ("bypass", "bypass_no_placement")
    assert ctl.waiting == 0


async def test_each_engines_host_write_policy_is_read_from_its_server_info() -> None:
    # An engine whose host tier is write-back keeps pool + host distinct; the others
    # (write-through, SGLang's default, or no host tier) keep the larger tier's worth.
    info = {
        A: {
            "radix_eviction_policy": "priority",
            "enable_hierarchical_cache": True,
            "hicache_write_policy": "write_back",
        },
        B: {"radix_eviction_policy": "priority", "enable_hierarchical_cache": True},
    }
    ctl = AdmissionController(
        AdmissionConfig(enabled=True, headroom=1.0),
        healthy_engines=lambda: [A, B],
        http=None,
        fetch_metrics=lambda url: asyncio.sleep(0, metrics(1000)),
        router_policy="consistent_hashing",
        server_info=info,
    )
    led = ctl.program.ledger
    assert (led.engine(A).host_write_back, led.engine(B).host_write_back) == (True, False)
    for url in (A, B):
        led.observe_engine(url, 0.0, max_total_num_tokens=1000, host_tokens=2000)
    assert (led.kv_room(A), led.kv_room(B)) == (3000, 2000)


async def test_prefetch_keeps_each_sessions_last_prompt_and_a_reload_turning_it_off_drops_them() -> (
    None
):
    async def fetch(url: str) -> str:
        return metrics(1000)

    class NoCalls:
        """An HTTP client this test never reaches (no prefetch comes due in it)."""

        def post(self, url: str, **kw: Any) -> Any:
            raise AssertionError(f"unexpected POST {url}")

        def get(self, url: str, **kw: Any) -> Any:
            raise AssertionError(f"unexpected GET {url}")

    cfg = AdmissionConfig(enabled=True, poll_interval_s=3600.0, staleness_s=3600.0, prefetch=True)
    ctl = AdmissionController(
        cfg,
        healthy_engines=lambda: [A, B],
        http=NoCalls(),
        fetch_metrics=fetch,
        router_policy="consistent_hashing",
        server_info={u: {"radix_eviction_policy": "lru"} for u in (A, B)},
        router_url="http://router:1",
    )
    await ctl.start()
    try:
        assert ctl.prefetching
        sid = keys_on(A, 1)[0]
        first, second = request("t1", sid, 100), request("t2", sid, 120)
        await turn(ctl, first, prompt=100)
        await turn(ctl, second, prompt=120)
        kept = ctl.prefetcher.prompts.get(sid)
        assert kept is not None and kept.body is second.body  # the latest, by reference
        assert ctl.expect_tool_end(sid, 30.0) and sid in ctl.program.prefetch
        assert not ctl.expect_tool_end("unknown", 30.0)
        ctl.end_session(sid)
        assert ctl.prefetcher.prompts.get(sid) is None and sid not in ctl.program.prefetch
        await turn(ctl, request("t3", "other", 100), prompt=100)
        assert len(ctl.prefetcher.prompts) == 1
        await ctl.reconfigure(AdmissionConfig(enabled=True, poll_interval_s=3600.0))
        assert not ctl.prefetching and len(ctl.prefetcher.prompts) == 0
        assert not ctl.expect_tool_end("other", 30.0)
    finally:
        await ctl.stop()


async def test_a_childs_request_naming_its_parent_keeps_the_lead_running(lab) -> None:
    ctl = await lab()
    lead, child = keys_on(A, 2)
    await turn(ctl, request("l1", lead, 100), prompt=100)
    led = ctl.program.ledger
    assert not led.has_running_children(lead)
    r = AdmissionRequest(
        "c1",
        "/generate",
        CIMultiDict(),
        {"input_ids": [1] * 50, "sampling_params": {"max_new_tokens": 0}},
        child,
        None,
        lead,
    )
    await turn(ctl, r, prompt=50)
    assert led.family.parent(child) == lead and led.has_running_children(lead)
    assert led.sessions[lead].busy
    ctl.end_session(child)
    assert not led.has_running_children(lead)
