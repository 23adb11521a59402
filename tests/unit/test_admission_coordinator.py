import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, generate_latest

from kvproxy.admission.catalogue import PROGRAM_STATS_KEYS
from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.fleet.gate import FleetGate
from kvproxy.admission.records import AdmissionRequest, Decision, Mode
from kvproxy.admission.waiters import Wakeup
from kvproxy.config import AdmissionConfig

A, B = "http://a:1", "http://b:1"
HOUR = 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeFleet:
    """Engines serving /metrics text, or raising, without a network."""

    def __init__(self, engines: dict[str, tuple[int | None, float | None]]) -> None:
        self.engines = engines
        self.failing: set[str] = set()
        self.garbage: set[str] = set()
        self.fetched = asyncio.Event()

    def healthy(self) -> list[str]:
        return list(self.engines)

    async def fetch(self, url: str) -> str:
        self.fetched.set()
        if url in self.failing:
            raise aiohttp.ClientConnectionError(f"{url} down")
        if url in self.garbage:
            return "<html>not metrics</html>"
        cap, usage = self.engines[url]
        return metrics_text(cap, usage)


def metrics_text(cap: int | None, usage: float | None) -> str:
    lines = ["# HELP sglang:token_usage The token usage."]
    if cap is not None:
        lines.append(f'sglang:max_total_num_tokens{{model_name="m",tp_rank="0"}} {cap}.0')
    if usage is not None:
        lines.append(f'sglang:token_usage{{model_name="m",tp_rank="0"}} {usage}')
    return "\n".join(lines) + "\n"


def _aging(ctl: AdmissionController) -> Wakeup:
    """Fleet mode's aging timer (its gate's), which these tests watch fire."""
    gate = ctl._gates[Mode.FLEET]
    assert isinstance(gate, FleetGate)
    return gate.aging


def req(
    ticket: str, tokens: int = 10, headers: dict[str, str] | None = None, **body: Any
) -> AdmissionRequest:
    full = {"input_ids": [0] * tokens, "sampling_params": {"max_new_tokens": 0}, **body}
    return AdmissionRequest(ticket, "/generate", CIMultiDict(headers or {}), full, None)


@dataclasses.dataclass
class Env:
    ctl: AdmissionController
    fleet: FakeFleet
    clock: FakeClock


Factory = Callable[..., Awaitable[Env]]


@pytest.fixture
async def make_env() -> AsyncIterator[Factory]:
    envs: list[Env] = []

    async def factory(
        engines: dict[str, tuple[int | None, float | None]] | None = None, **cfg: Any
    ) -> Env:
        fleet = FakeFleet({A: (100, 0.1)} if engines is None else engines)
        clock = FakeClock()
        settings: dict[str, Any] = {
            "enabled": True,
            "headroom": 1.0,
            "pressure_threshold": 0.9,
            "poll_interval_s": HOUR,  # polls are driven by the tests
            "staleness_s": 6.0,
            "max_wait_s": HOUR,
        }
        settings.update(cfg)
        ctl = AdmissionController(
            AdmissionConfig(**settings),
            healthy_engines=fleet.healthy,
            http=None,
            clock=clock,
            fetch_metrics=fleet.fetch,
        )
        await ctl.start()
        env = Env(ctl, fleet, clock)
        envs.append(env)
        return env

    yield factory
    for env in envs:
        await env.ctl.stop()


class Holder:
    """A request task that enters admission and holds its lease until told to exit."""

    def __init__(self, ctl: AdmissionController, r: AdmissionRequest) -> None:
        self.decision: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self.exit = asyncio.Event()
        self.task = asyncio.create_task(self._run(ctl, r))

    async def _run(self, ctl: AdmissionController, r: AdmissionRequest) -> None:
        async with ctl.admit(r) as d:
            self.decision.set_result(d)
            await self.exit.wait()

    async def finish(self) -> None:
        self.exit.set()
        await self.task


async def decided(h: Holder) -> Decision:
    """The holder's decision; a hang is a failure, not a stuck suite."""
    return await asyncio.wait_for(asyncio.shield(h.decision), 2.0)


async def settle() -> None:
    """Let ready tasks run until they block (yields to the loop; no timing)."""
    for _ in range(5):
        await asyncio.sleep(0)


def stat(ctl: AdmissionController, key: str) -> float:
    return ctl.stats()[key]


# -- decision order -----------------------------------------------------------------------


async def test_disabled_and_out_of_scope_pass_uncounted(make_env: Factory) -> None:
    env = await make_env(enabled=False)
    async with env.ctl.admit(req("t")) as d:
        assert (d.action, d.reason, d.lease_id) == ("pass", "disabled", None)
    env = await make_env(trust_client_headers=True)
    async with env.ctl.admit(req("t", headers={"X-KVProxy-Mode": "eval"})) as d:
        assert (d.action, d.reason) == ("pass", "out_of_scope")
    s = env.ctl.stats()
    assert s["agentic_kv/admission/admit"] == 0 and s["agentic_kv/admission/bypass"] == 0
    assert "agentic_kv/admission/defer_rate" not in s  # no counted decision
    assert env.ctl.ledger.reserved == 0


async def test_protected_bypasses_without_touching_ledger(make_env: Factory) -> None:
    env = await make_env(protected_priority=5, trust_client_headers=True)
    for r in (req("p1", headers={"X-KVProxy-Protected": "true"}), req("p2", priority=7)):
        async with env.ctl.admit(r) as d:
            assert (d.action, d.reason, d.lease_id) == ("bypass", "protected", None)
            assert env.ctl.ledger.reserved == 0
    s = env.ctl.stats()
    assert s["agentic_kv/admission/bypass_protected"] == 2 and s["agentic_kv/admission/bypass"] == 2


async def test_client_bypass_headers_ignored_unless_trusted(make_env: Factory) -> None:
    env = await make_env(protected_priority=5)
    for headers in ({"X-KVProxy-Protected": "true"}, {"X-KVProxy-Mode": "eval"}):
        async with env.ctl.admit(req("h", headers=headers)) as d:
            assert (d.action, d.reason) != ("bypass", "protected")
            assert d.reason != "out_of_scope"
    async with env.ctl.admit(req("p", priority=7)) as d:  # the priority still protects
        assert (d.action, d.reason) == ("bypass", "protected")


async def test_degraded_without_any_engine_signal(make_env: Factory) -> None:
    env = await make_env(engines={})
    async with env.ctl.admit(req("t")) as d:
        assert (d.action, d.reason, d.lease_id) == ("bypass", "degraded", None)
    assert stat(env.ctl, "agentic_kv/admission/bypass_degraded") == 1
    assert stat(env.ctl, "agentic_kv/budget/degraded") == 1.0


async def test_admit_then_release_on_exit_and_on_exception(make_env: Factory) -> None:
    env = await make_env()
    ctl = env.ctl
    async with ctl.admit(req("t1", 30)) as d:
        assert (d.action, d.reason, d.lease_id, d.tokens) == (
            "admit",
            "capacity_available",
            "1:t1",
            30,
        )
        assert ctl.ledger.reserved == 30
    assert ctl.ledger.reserved == 0
    with pytest.raises(RuntimeError):
        async with ctl.admit(req("t2", 30)):
            assert ctl.ledger.reserved == 30
            raise RuntimeError("upstream failed")
    assert ctl.ledger.reserved == 0 and ctl.ledger.lease_count == 0


async def test_retried_ticket_is_not_double_charged(make_env: Factory) -> None:
    env = await make_env()
    async with env.ctl.admit(req("t", 40)) as first, env.ctl.admit(req("t", 40)) as again:
        assert again.lease_id == first.lease_id
        assert env.ctl.ledger.reserved == 40
    assert env.ctl.ledger.reserved == 0
    assert stat(env.ctl, "agentic_kv/admission/admit") == 1


# -- FIFO ----------------------------------------------------------------------------------


async def test_strict_fifo_grant_order_on_release(make_env: Factory) -> None:
    env = await make_env()  # ceiling 100
    ctl = env.ctl
    first = Holder(ctl, req("first", 100))
    await settle()
    assert (await decided(first)).action == "admit"
    second, third = Holder(ctl, req("second", 70)), Holder(ctl, req("third", 40))
    await settle()
    fourth = Holder(ctl, req("fourth", 10))  # would fit after second, but arrives later
    await settle()
    assert ctl.waiting == 3

    await first.finish()
    d2 = await decided(second)
    assert (d2.action, d2.tokens) == ("admit", 70)
    assert d2.wait_s >= 0.0
    # third (40) does not fit next to second (70); fourth (10) would, but waits behind it.
    assert not third.decision.done() and not fourth.decision.done()
    assert ctl.waiting == 2 and ctl.ledger.reserved == 70

    await second.finish()
    assert (await decided(third)).action == "admit"
    assert (await decided(fourth)).action == "admit"
    assert ctl.ledger.reserved == 50
    await third.finish()
    await fourth.finish()
    s = ctl.stats()
    assert s["agentic_kv/admission/admit"] == 4 and s["agentic_kv/admission/wait"] == 3
    assert s["agentic_kv/admission/defer_rate"] == pytest.approx(3 / 7)


async def test_pressure_guard_waits_until_a_poll_clears_it(make_env: Factory) -> None:
    env = await make_env(engines={A: (100, 0.95)})
    h = Holder(env.ctl, req("t", 10))
    await settle()
    assert env.ctl.waiting == 1 and not h.decision.done()
    env.fleet.engines[A] = (100, 0.5)
    env.clock.now += 3.0
    await env.ctl.poll_once()
    d = await decided(h)
    assert d.action == "admit" and d.wait_s == pytest.approx(3.0)
    await h.finish()
    assert stat(env.ctl, "agentic_kv/admission/wait_seconds_mean") == pytest.approx(3.0)


async def test_queue_full_bypasses(make_env: Factory) -> None:
    env = await make_env(max_queue=1)
    first = Holder(env.ctl, req("first", 100))
    second = Holder(env.ctl, req("second", 10))
    await settle()
    async with env.ctl.admit(req("third", 10)) as d:
        assert (d.action, d.reason, d.lease_id) == ("bypass", "queue_full", None)
    assert stat(env.ctl, "agentic_kv/admission/bypass_queue_full") == 1
    await first.finish()
    await second.finish()


async def test_oversized_bypasses_at_once_and_never_blocks_the_head(make_env: Factory) -> None:
    env = await make_env()  # ceiling 100
    ctl = env.ctl
    async with ctl.admit(req("huge", 150)) as d:  # empty queue
        assert (d.action, d.reason, d.lease_id, d.tokens) == ("bypass", "oversized", None, 150)
    first = Holder(ctl, req("first", 100))
    second = Holder(ctl, req("second", 10))
    await settle()
    assert ctl.waiting == 1
    async with ctl.admit(req("huge2", 101)) as d:  # queue non-empty
        assert d.reason == "oversized"
    assert ctl.waiting == 1
    await first.finish()
    assert (await decided(second)).action == "admit"
    await second.finish()
    assert stat(ctl, "agentic_kv/admission/bypass_oversized") == 2


async def test_waiter_becomes_oversized_when_capacity_shrinks(make_env: Factory) -> None:
    env = await make_env(engines={A: (100, 0.1), B: (100, 0.1)})  # ceiling 200
    first = Holder(env.ctl, req("first", 150))
    second = Holder(env.ctl, req("second", 120))
    await settle()
    assert env.ctl.waiting == 1
    del env.fleet.engines[B]
    await env.ctl.poll_once()  # ceiling 100: the head can never fit any more
    d = await decided(second)
    assert (d.action, d.reason) == ("bypass", "oversized")
    await first.finish()
    await second.finish()


# -- cancellation --------------------------------------------------------------------------


async def test_cancel_waiter_removes_it_and_promotes_next(make_env: Factory) -> None:
    env = await make_env()
    ctl = env.ctl
    first = Holder(ctl, req("first", 60))
    head = Holder(ctl, req("head", 60))
    behind = Holder(ctl, req("behind", 30))
    await settle()
    assert ctl.waiting == 2
    head.task.cancel()  # the client of the FIFO head disconnects
    with pytest.raises(asyncio.CancelledError):
        await head.task
    # The next waiter fits next to first (60 + 30) and is granted at once.
    assert (await decided(behind)).action == "admit"
    assert ctl.waiting == 0 and ctl.ledger.reserved == 90
    s = ctl.stats()
    assert s["agentic_kv/admission/cancelled"] == 1 and s["agentic_kv/admission/admit"] == 2
    await first.finish()
    await behind.finish()
    assert ctl.ledger.reserved == 0


async def test_cancel_mid_queue_waiter(make_env: Factory) -> None:
    env = await make_env()
    ctl = env.ctl
    first = Holder(ctl, req("first", 100))
    waiters = [Holder(ctl, req(f"w{i}", 10)) for i in range(3)]
    await settle()
    waiters[1].task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiters[1].task
    assert ctl.waiting == 2
    await first.finish()
    assert (await decided(waiters[0])).action == "admit"
    assert (await decided(waiters[2])).action == "admit"
    assert ctl.ledger.reserved == 20
    for w in (waiters[0], waiters[2]):
        await w.finish()


async def test_cancel_after_grant_race_releases_the_lease(make_env: Factory) -> None:
    env = await make_env()  # ceiling 100
    ctl = env.ctl
    bystander = Holder(ctl, req("bystander", 30))  # holds its lease throughout
    await settle()
    assert (await decided(bystander)).action == "admit"
    first_cm = ctl.admit(req("first", 70))
    assert (await first_cm.__aenter__()).action == "admit"
    waiter = Holder(ctl, req("waiter", 50))
    tail = Holder(ctl, req("tail", 60))  # fits next to the bystander, not next to the waiter
    await settle()
    assert ctl.waiting == 2 and ctl.ledger.reserved == 100
    # Release grants the waiter a lease; its task is cancelled before it resumes.
    await first_cm.__aexit__(None, None, None)
    assert ctl.ledger.lease_for_ticket("waiter") is not None
    assert ctl.ledger.reserved == 30 + 50 and not tail.decision.done()
    waiter.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter.task
    assert not waiter.decision.done()
    # Exactly the waiter's own lease went back, and the head behind it was drained.
    assert ctl.ledger.lease_for_ticket("waiter") is None
    assert ctl.ledger.lease_for_ticket("bystander") is not None
    d_tail = await decided(tail)
    assert (d_tail.action, d_tail.tokens) == ("admit", 60)
    assert ctl.ledger.reserved == 30 + 60 and ctl.ledger.lease_count == 2
    assert stat(ctl, "agentic_kv/admission/cancelled") == 0  # it was granted, not dropped
    await tail.finish()
    await bystander.finish()
    assert ctl.ledger.reserved == 0 and ctl.ledger.lease_count == 0


async def test_cancel_before_acquire(make_env: Factory) -> None:
    env = await make_env()
    ctl = env.ctl
    # A task cancelled before it ever ran leaves no trace.
    h = Holder(ctl, req("never", 10))
    h.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await h.task
    assert ctl.ledger.lease_count == 0 and ctl.waiting == 0


# -- aging ---------------------------------------------------------------------------------


async def test_aging_bypasses_without_a_lease(make_env: Factory) -> None:
    env = await make_env(max_wait_s=0.0)
    ctl = env.ctl
    async with ctl.admit(req("first", 100)) as d1:
        assert d1.action == "admit"
        async with ctl.admit(req("second", 50)) as d2:
            assert (d2.action, d2.reason, d2.lease_id) == ("bypass", "aged", None)
            assert ctl.ledger.reserved == 100 and ctl.ledger.lease_count == 1
    s = ctl.stats()
    assert s["agentic_kv/admission/wait"] == 1 and s["agentic_kv/admission/bypass_aged"] == 1


async def test_aging_timer_releases_waiter_at_its_deadline_with_no_other_event() -> None:
    # The injected clock decides when a waiter has aged; the real loop timer decides when
    # the coordinator looks. The test checks that the timer is armed for exactly the time
    # left, never releases early, and releases at the deadline, without relying on how
    # promptly a loaded machine runs timers.
    loop = asyncio.get_running_loop()
    clock = FakeClock()
    fleet = FakeFleet({A: (100, 0.1)})
    max_wait = 0.1
    cfg = AdmissionConfig(
        enabled=True, headroom=1.0, max_wait_s=max_wait, poll_interval_s=HOUR, staleness_s=HOUR
    )
    ctl = AdmissionController(
        cfg, healthy_engines=fleet.healthy, http=None, clock=clock, fetch_metrics=fleet.fetch
    )
    await ctl.start()

    async def rearmed(previous: asyncio.TimerHandle) -> asyncio.TimerHandle:
        # Bounded poll until the timer fired and armed a new one (or resolved the waiter).
        for _ in range(400):
            if _aging(ctl).handle is not previous:
                return _aging(ctl).handle  # type: ignore[return-value]
            await asyncio.sleep(0.005)
        raise AssertionError("the aging timer never fired")

    try:
        first = Holder(ctl, req("first", 100))
        await settle()
        # An arrival time at which (t0 + max_wait) - t0 < max_wait in floating point: the
        # waiter must still age when the clock reads exactly its deadline.
        t0 = clock.now = 2000.0
        before = loop.time()
        waiter = Holder(ctl, req("waiter", 10))
        await settle()
        after = loop.time()
        assert ctl.waiting == 1
        timer = _aging(ctl).handle
        assert timer is not None
        assert before + max_wait <= timer.when() <= after + max_wait  # armed for max_wait

        # The timer fires when only half the wait has passed on the clock: not yet.
        clock.now = t0 + max_wait / 2
        timer2 = await rearmed(timer)
        seen = loop.time()
        assert not waiter.decision.done() and ctl.waiting == 1
        assert timer2 is not None
        assert timer.when() + max_wait / 2 <= timer2.when() <= seen + max_wait / 2  # time left

        # At the deadline the next firing releases it: aged, no lease, no other event.
        clock.now = t0 + max_wait
        d = await decided(waiter)
        assert (d.action, d.reason, d.lease_id) == ("bypass", "aged", None)
        assert d.wait_s == pytest.approx(max_wait)
        assert ctl.waiting == 0 and _aging(ctl).handle is None
        assert ctl.ledger.reserved == 100  # only the first's lease
        assert stat(ctl, "agentic_kv/admission/bypass_aged") == 1
        await waiter.finish()
        await first.finish()
    finally:
        await ctl.stop()


# -- polling -------------------------------------------------------------------------------


async def test_failing_engine_is_excluded_while_the_rest_keep_admitting(make_env: Factory) -> None:
    env = await make_env(engines={A: (100, 0.1), B: (100, 0.1)})
    ctl = env.ctl
    assert ctl.ledger.ceiling == 200 and ctl.ledger.epoch == 1
    env.fleet.failing.add(B)
    env.clock.now += 3.0
    await ctl.poll_once()
    assert ctl.ledger.ceiling == 200  # B's last reading is still fresh
    env.clock.now += 4.0  # B's reading is now 7 s old (staleness 6 s)
    await ctl.poll_once()
    assert ctl.ledger.ceiling == 100 and ctl.ledger.epoch == 2
    async with ctl.admit(req("t", 60)) as d:
        assert d.action == "admit"
    s = ctl.stats()
    assert s["agentic_kv/budget/degraded"] == 0.0
    assert s["agentic_kv/budget/engines_fresh"] == 1 and s["agentic_kv/budget/engines_stale"] == 1
    assert s["agentic_kv/budget/scrape_failure"] == 2
    health = ctl.health()
    assert not health.degraded
    assert {e.url: e.fresh for e in health.engines} == {A: True, B: False}
    # Garbage from A too: no engine is fresh any more -> degraded, fail open.
    env.fleet.garbage.add(A)
    env.clock.now += 7.0
    await ctl.poll_once()
    async with ctl.admit(req("u", 10)) as d:
        assert (d.action, d.reason) == ("bypass", "degraded")


async def test_max_total_emitted_once_is_cached(make_env: Factory) -> None:
    env = await make_env(engines={A: (500, 0.1)})
    env.fleet.engines[A] = (None, 0.2)  # later scrapes carry only token_usage
    env.clock.now += 5.0
    await env.ctl.poll_once()
    env.clock.now += 5.0
    await env.ctl.poll_once()
    assert env.ctl.ledger.ceiling == 500 and env.ctl.ledger.pressure == 0.2
    assert not env.ctl.ledger.is_degraded(env.clock.now)


async def test_engine_leaving_the_fleet_leaves_the_ledger(make_env: Factory) -> None:
    env = await make_env(engines={A: (100, 0.1), B: (100, 0.1)})
    del env.fleet.engines[B]
    await env.ctl.poll_once()
    assert env.ctl.ledger.ceiling == 100 and env.ctl.ledger.epoch == 2
    assert [e.url for e in env.ctl.health().engines] == [A]


async def test_poll_once_survives_exceptions(make_env: Factory) -> None:
    env = await make_env()
    calls = 0

    def broken() -> list[str]:
        nonlocal calls
        calls += 1
        raise RuntimeError("fleet exploded")

    env.ctl._healthy_engines = broken
    await env.ctl.poll_once()  # does not raise
    assert calls == 1 and stat(env.ctl, "agentic_kv/budget/poll_error") == 1


async def test_poll_loop_keeps_running_after_exceptions() -> None:
    fleet = FakeFleet({A: (100, 0.1)})
    calls = 0
    recovered = asyncio.Event()

    def flaky() -> list[str]:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise RuntimeError(f"boom {calls}")
        recovered.set()
        return fleet.healthy()

    cfg = AdmissionConfig(enabled=True, poll_interval_s=0.01, staleness_s=HOUR)
    ctl = AdmissionController(cfg, healthy_engines=flaky, http=None, fetch_metrics=fleet.fetch)
    await ctl.start()  # the first poll fails
    try:
        assert ctl.ledger.is_degraded(time.monotonic())
        await asyncio.wait_for(recovered.wait(), 2.0)
        await settle()
        assert not ctl.ledger.is_degraded(time.monotonic())
        assert ctl.stats()["agentic_kv/budget/poll_error"] == 3
    finally:
        await ctl.stop()


async def test_ttl_reclaims_leases_of_vanished_holders(make_env: Factory) -> None:
    env = await make_env(lease_ttl_s=60.0)
    cm = env.ctl.admit(req("lost", 40))
    await cm.__aenter__()  # the holder never exits
    env.clock.now += 61.0
    env.fleet.engines[A] = (100, 0.1)
    await env.ctl.poll_once()
    assert env.ctl.ledger.reserved == 0
    assert env.ctl.stats()["agentic_kv/budget/lease_expired"] == 1


async def test_real_http_scrape(aiohttp_server: Any) -> None:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics_text(1000, 0.3))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app, host="127.0.0.1")
    url = str(server.make_url("/")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        cfg = AdmissionConfig(enabled=True, headroom=0.9, poll_interval_s=HOUR)
        ctl = AdmissionController(
            cfg, healthy_engines=lambda: [url, "http://127.0.0.1:9"], http=http
        )
        await ctl.start()
        try:
            assert ctl.ledger.ceiling == 900 and ctl.ledger.pressure == 0.3
            assert ctl.stats()["agentic_kv/budget/scrape_failure"] == 1  # the closed port
        finally:
            await ctl.stop()


# -- lifecycle -----------------------------------------------------------------------------


async def test_stop_releases_waiters_as_degraded(make_env: Factory) -> None:
    env = await make_env()
    first = Holder(env.ctl, req("first", 100))
    waiter = Holder(env.ctl, req("waiter", 10))
    await settle()
    await env.ctl.stop()
    d = await decided(waiter)
    assert (d.action, d.reason) == ("bypass", "degraded")
    await waiter.finish()
    await first.finish()


async def test_reconfigure_disable_releases_waiters_and_enable_restarts(make_env: Factory) -> None:
    env = await make_env()
    ctl = env.ctl
    first = Holder(ctl, req("first", 100))
    waiter = Holder(ctl, req("waiter", 10))
    await settle()
    await ctl.reconfigure(dataclasses.replace(ctl.config, enabled=False))
    d = await decided(waiter)
    assert (d.action, d.reason) == ("bypass", "disabled")
    async with ctl.admit(req("off", 10)) as d:
        assert (d.action, d.reason) == ("pass", "disabled")
    await waiter.finish()
    await first.finish()
    assert ctl.stats() == {**ctl.stats(), "agentic_kv/admission/enabled": 0.0}

    await ctl.reconfigure(dataclasses.replace(ctl.config, enabled=True))
    assert ctl.ledger.ceiling == 100  # polled again on enable
    async with ctl.admit(req("on", 10)) as d:
        assert d.action == "admit"
    # Thresholds apply to the next decision.
    await ctl.reconfigure(dataclasses.replace(ctl.config, pressure_threshold=0.05, max_wait_s=0.0))
    async with ctl.admit(req("pressured", 10)) as d:
        assert (d.action, d.reason) == ("bypass", "aged")


# -- metrics -------------------------------------------------------------------------------


ADMISSION_KEYS = {
    "agentic_kv/admission/" + k
    for k in [
        "enabled",
        "admit",
        "bypass",
        "bypass_protected",
        "bypass_degraded",
        "bypass_aged",
        "bypass_oversized",
        "bypass_queue_full",
        "bypass_disabled",
        "wait",
        "waiting",
        "cancelled",
        "wait_new_session",
        "wait_continuing",
        "waiting_continuing",
        "waiting_new",
        "defer_rate",
        "degraded_rate",
        "wait_seconds_mean",
    ]
}
BUDGET_KEYS = {
    "agentic_kv/budget/" + k
    for k in [
        "ceiling",
        "reserved",
        "available_tokens",
        "reserved_utilization",
        "lease_count",
        "kv_token_usage_mean",
        "kv_token_usage_max",
        "epoch",
        "degraded",
        "engines_fresh",
        "engines_stale",
        "scrape_failure",
        "poll_error",
        "resident",
        "resident_sessions",
        "committed",
        "residency_expired",
        "residency_evicted",
        "session_ended",
    ]
}


async def test_stats_keys_values_and_reset(make_env: Factory) -> None:
    env = await make_env(engines={A: (1000, 0.4)}, trust_client_headers=True)
    ctl = env.ctl
    first = Holder(ctl, req("first", 1000))
    waiter = Holder(ctl, req("waiter", 100))
    await settle()
    env.clock.now += 2.0
    await first.finish()
    await decided(waiter)
    await waiter.finish()
    async with ctl.admit(req("degraded-check", 1, headers={"X-KVProxy-Protected": "1"})):
        pass
    s = ctl.stats(reset=True)
    assert set(s) == ADMISSION_KEYS | BUDGET_KEYS | PROGRAM_STATS_KEYS
    assert s["agentic_kv/admission/admit"] == 2
    assert s["agentic_kv/admission/wait"] == 1
    assert s["agentic_kv/admission/bypass"] == 1
    assert s["agentic_kv/admission/defer_rate"] == pytest.approx(1 / 4)
    assert s["agentic_kv/admission/degraded_rate"] == 0.0
    assert s["agentic_kv/admission/wait_seconds_mean"] == pytest.approx(2.0)
    assert s["agentic_kv/budget/ceiling"] == 1000 and s["agentic_kv/budget/epoch"] == 1
    assert s["agentic_kv/budget/kv_token_usage_max"] == pytest.approx(0.4)
    after = ctl.stats()
    assert after["agentic_kv/admission/admit"] == 0 and after["agentic_kv/admission/wait"] == 0
    assert "agentic_kv/admission/defer_rate" not in after
    assert "agentic_kv/admission/wait_seconds_mean" not in after
    assert "agentic_kv/budget/lease_expired" not in after


async def test_prometheus_collect(make_env: Factory) -> None:
    env = await make_env()
    ctl = env.ctl
    first = Holder(ctl, req("first", 100))
    waiter = Holder(ctl, req("waiter", 10))
    await settle()
    env.clock.now += 0.3
    await first.finish()
    await decided(waiter)
    await waiter.finish()
    ctl.stats(reset=True)  # the window reset does not touch cumulative series
    registry = CollectorRegistry()
    registry.register(ctl)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert "agentic_kv_admission_admit_total 2.0" in text
    assert "agentic_kv_admission_wait_total 1.0" in text
    assert "agentic_kv_admission_bypass_aged_total 0.0" in text
    assert "agentic_kv_budget_ceiling 100.0" in text
    assert "agentic_kv_admission_waiting 0.0" in text
    assert 'agentic_kv_admission_wait_seconds_bucket{le="0.25"} 0.0' in text
    assert 'agentic_kv_admission_wait_seconds_bucket{le="0.5"} 1.0' in text
    assert 'agentic_kv_admission_wait_seconds_bucket{le="+Inf"} 1.0' in text
    assert "agentic_kv_admission_wait_seconds_count 1.0" in text
    assert "wait_granted" not in text


async def test_observed_prompt_tokens_calibrate_text_requests(make_env: Factory) -> None:
    env = await make_env(engines={A: (10_000, 0.1)}, default_completion_tokens=1)
    body = {"text": "x" * 400, "sampling_params": {"max_new_tokens": 0}}
    r = AdmissionRequest("t1", "/generate", CIMultiDict(), body, "sess")
    async with env.ctl.admit(r) as d:
        assert d.tokens == 100  # 4 chars / token before calibration
    env.ctl.observe_usage(r, 200, None)
    async with env.ctl.admit(AdmissionRequest("t2", r.path, r.headers, r.body, r.session_id)) as d:
        assert d.tokens == 200


# -- session residency (program-aware mode) -------------------------------------------


def sreq(ticket: str, session: str | None, tokens: int) -> AdmissionRequest:
    body = {"input_ids": [0] * tokens, "sampling_params": {"max_new_tokens": 0}}
    return AdmissionRequest(ticket, "/generate", CIMultiDict(), body, session)


async def turn(ctl: AdmissionController, ticket: str, session: str, tokens: int) -> None:
    """One completed turn: the session becomes resident with ``tokens``."""
    async with ctl.admit(sreq(ticket, session, tokens)) as d:
        assert d.action == "admit", d


class Recorder(Holder):
    """A holder that appends its ticket to ``order`` when its decision arrives."""

    def __init__(self, ctl: AdmissionController, r: AdmissionRequest, order: list[str]) -> None:
        self.order = order
        self.ticket = r.ticket_id
        super().__init__(ctl, r)

    async def _run(self, ctl: AdmissionController, r: AdmissionRequest) -> None:
        async with ctl.admit(r) as d:
            self.order.append(self.ticket)
            self.decision.set_result(d)
            await self.exit.wait()


async def set_usage(env: Env, usage: float) -> None:
    cap, _ = env.fleet.engines[A]
    env.fleet.engines[A] = (cap, usage)
    await env.ctl.poll_once()


async def test_new_session_head_does_not_block_a_continuing_request(make_env: Factory) -> None:
    env = await make_env(engines={A: (1000, 0.1)})
    ctl = env.ctl
    await turn(ctl, "s1:1", "s1", 600)
    running = Holder(ctl, sreq("s2:1", "s2", 300))
    assert (await decided(running)).action == "admit"
    new = Holder(ctl, sreq("s3:1", "s3", 200))  # 900 + 200 > 1000: waits
    await settle()
    assert ctl.waiting_new == 1 and not new.decision.done()
    # s1's next turn (growth 100, over the ceiling) is admitted at once, not behind s3.
    cont = Holder(ctl, sreq("s1:2", "s1", 700))
    d = await decided(cont)
    assert (d.action, d.reason, d.tokens, d.wait_s) == ("admit", "capacity_available", 700, 0.0)
    assert ctl.ledger.committed == 1000 and not new.decision.done()
    s = ctl.stats()
    assert s["agentic_kv/admission/wait_new_session"] == 1
    assert s["agentic_kv/admission/wait_continuing"] == 0
    assert s["agentic_kv/budget/resident"] == 600 and s["agentic_kv/budget/committed"] == 1000
    # Under pressure a continuing request waits, and it is granted when pressure
    # clears even though the new head is still refused for capacity.
    await set_usage(env, 0.95)
    held = Holder(ctl, sreq("s1:3", "s1", 700))
    await settle()
    assert ctl.waiting_continuing == 1 and not held.decision.done()
    await set_usage(env, 0.1)
    assert (await decided(held)).action == "admit"
    assert not new.decision.done() and ctl.waiting == 1
    for h in (cont, held, running):
        await h.finish()
    # The turns ended, but s1 (700) and s2 (300) stay resident: s3 still waits ...
    await settle()
    assert ctl.ledger.committed == 1000 and not new.decision.done()
    ctl.end_session("s2")  # ... until a session closes
    assert (await decided(new)).action == "admit"
    await new.finish()


async def test_continuing_requests_wait_under_pressure_and_go_in_fifo_order(
    make_env: Factory,
) -> None:
    env = await make_env(engines={A: (1000, 0.1)})
    ctl = env.ctl
    await turn(ctl, "s1:1", "s1", 100)
    await turn(ctl, "s2:1", "s2", 100)
    await set_usage(env, 0.95)
    order: list[str] = []
    holders = [Recorder(ctl, sreq(t, t.split(":")[0], 150), order) for t in ("s2:2", "s1:2")]
    holders.append(Recorder(ctl, sreq("s1:3", "s1", 150), order))
    await settle()
    assert ctl.waiting_continuing == 3 and not order
    assert stat(ctl, "agentic_kv/admission/wait_continuing") == 3
    await set_usage(env, 0.1)
    for h in holders:
        assert (await decided(h)).action == "admit"
    assert order == ["s2:2", "s1:2", "s1:3"]
    for h in holders:
        await h.finish()
    assert ctl.ledger.reserved == 0 and ctl.ledger.resident_total == 300


async def test_new_sessions_go_in_fifo_order_as_end_session_frees_room(
    make_env: Factory,
) -> None:
    env = await make_env(engines={A: (1000, 0.1)})
    ctl = env.ctl
    await turn(ctl, "s1:1", "s1", 900)
    order: list[str] = []
    holders = [Recorder(ctl, sreq(f"n{i}:1", f"n{i}", n), order) for i, n in enumerate((200, 50))]
    await settle()
    # n1 (50) would fit, but it does not overtake the refused head n0.
    assert ctl.waiting_new == 2 and not order
    ctl.end_session("s1")
    ctl.end_session("s1")  # idempotent
    for h in holders:
        assert (await decided(h)).action == "admit"
    assert order == ["n0:1", "n1:1"]
    s = ctl.stats()
    assert s["agentic_kv/budget/session_ended"] == 1
    assert s["agentic_kv/budget/resident_sessions"] == 0
    for h in holders:
        await h.finish()
    assert ctl.ledger.resident_sessions == 2


async def test_aging_covers_both_fifos(make_env: Factory) -> None:
    env = await make_env(engines={A: (1000, 0.1)}, max_wait_s=5.0)
    ctl, clock = env.ctl, env.clock
    await turn(ctl, "s1:1", "s1", 950)
    new = Holder(ctl, sreq("n:1", "n", 100))
    await settle()
    t_new = clock.now
    assert _aging(ctl).at == t_new + 5.0
    clock.now += 1.0
    await set_usage(env, 0.95)
    cont = Holder(ctl, sreq("s1:2", "s1", 950))
    await settle()
    assert (ctl.waiting_new, ctl.waiting_continuing) == (1, 1)
    assert _aging(ctl).at == t_new + 5.0  # the earlier head
    clock.now = t_new + 5.0
    _aging(ctl).fire()
    d = await decided(new)
    assert (d.action, d.reason) == ("bypass", "aged")
    assert _aging(ctl).at == t_new + 6.0 and not cont.decision.done()
    clock.now = t_new + 6.0
    _aging(ctl).fire()
    d = await decided(cont)
    assert (d.action, d.reason) == ("bypass", "aged")
    assert stat(ctl, "agentic_kv/admission/bypass_aged") == 2
    await new.finish()
    await cont.finish()


async def test_idle_sessions_stop_being_resident_at_the_poll(make_env: Factory) -> None:
    env = await make_env(engines={A: (1000, 0.1)}, session_idle_s=60.0, staleness_s=HOUR)
    ctl, clock = env.ctl, env.clock
    await turn(ctl, "s1:1", "s1", 900)
    new = Holder(ctl, sreq("n:1", "n", 200))
    await settle()
    assert not new.decision.done()
    clock.now += 61.0
    await ctl.poll_once()
    assert (await decided(new)).action == "admit"
    s = ctl.stats()
    assert s["agentic_kv/budget/residency_expired"] == 1
    assert s["agentic_kv/admission/wait_seconds_mean"] == pytest.approx(61.0)
    await new.finish()


async def test_session_residency_off_is_per_request(make_env: Factory) -> None:
    env = await make_env(engines={A: (1000, 0.1)}, session_residency=False)
    ctl = env.ctl
    await turn(ctl, "s1:1", "s1", 900)
    assert ctl.ledger.committed == 0 and ctl.ledger.resident_sessions == 0
    running = Holder(ctl, sreq("s2:1", "s2", 900))
    await decided(running)
    # Without residency s1's next turn is new work: it waits for capacity.
    cont = Holder(ctl, sreq("s1:2", "s1", 200))
    await settle()
    assert not cont.decision.done() and ctl.waiting_new == 1
    assert stat(ctl, "agentic_kv/admission/wait_new_session") == 0
    await running.finish()
    assert (await decided(cont)).action == "admit"
    await cont.finish()
    # Turning residency on later starts counting; turning it off forgets it.
    await ctl.reconfigure(dataclasses.replace(ctl.config, session_residency=True))
    await turn(ctl, "s1:3", "s1", 400)
    assert ctl.ledger.resident_total == 400
    await ctl.reconfigure(dataclasses.replace(ctl.config, session_residency=False))
    assert ctl.ledger.resident_total == 0


async def test_an_aged_turn_of_a_session_makes_it_resident(make_env: Factory) -> None:
    # Otherwise every later turn of a session that aged would be new work and wait again.
    env = await make_env(engines={A: (1000, 0.1)}, max_wait_s=0.0)
    ctl = env.ctl
    await turn(ctl, "s1:1", "s1", 900)
    async with ctl.admit(sreq("s2:1", "s2", 300)) as d:
        assert (d.action, d.reason, d.lease_id) == ("bypass", "aged", None)
        assert not ctl.ledger.is_resident("s2")
    assert ctl.ledger.resident_tokens("s2") == 300 and ctl.ledger.committed == 1200
    async with ctl.admit(sreq("s2:2", "s2", 350)) as d:
        assert (d.action, d.reason, d.tokens) == ("admit", "capacity_available", 350)
    assert ctl.ledger.resident_tokens("s2") == 350 and ctl.ledger.reserved == 0


async def test_only_a_sessions_first_request_teaches_the_shared_prefix(make_env: Factory) -> None:
    env = await make_env(engines={A: (100_000, 0.1)})
    ctl = env.ctl

    def session_req(ticket: str, sid: str, tokens: int) -> AdmissionRequest:
        body = {"input_ids": [0] * tokens, "sampling_params": {"max_new_tokens": 0}}
        return AdmissionRequest(ticket, "/generate", CIMultiDict(), body, sid)

    first = session_req("t1", "s1", 2000)
    async with ctl.admit(first) as d:
        assert d.tokens == 2000
    ctl.observe_usage(first, 2000, 1500)  # the first turn found 1,500 tokens cached
    learned = ctl._p.sizer.shared_prefix
    assert learned > 0
    second = session_req("t2", "s1", 2600)
    async with ctl.admit(second):
        pass
    ctl.observe_usage(second, 2600, 2000)  # a later turn: its cache hit is its own history
    assert ctl._p.sizer.shared_prefix == learned
    async with ctl.admit(session_req("t3", "s2", 2000)) as d:
        assert d.tokens == 2000 - int(learned)


async def test_a_usage_report_is_read_only_where_it_teaches_something(
    make_env: Factory,
) -> None:
    """learns_from: a session's first turn (the shared prefix) and a text prompt (the
    calibration) are learnt from; a later token-id turn, or one without a session, is
    not (in ledger mode), so the proxy does not read its response for usage."""
    env = await make_env(engines={A: (100_000, 0.1)})
    ctl = env.ctl
    first = sreq("t1", "s1", 2000)
    async with ctl.admit(first):
        assert ctl.learns_from(first)
    ctl.observe_usage(first, 2000, 1500)
    later = sreq("t2", "s1", 2600)
    async with ctl.admit(later):
        assert not ctl.learns_from(later)
    anonymous = sreq("t3", None, 100)
    async with ctl.admit(anonymous):
        assert not ctl.learns_from(anonymous)
    text = AdmissionRequest("t4", "/generate", CIMultiDict(), {"text": "x" * 40}, "s1")
    async with ctl.admit(text):
        assert ctl.learns_from(text)


async def test_decide_now_grants_at_once_and_wait_gives_a_queued_decision(
    make_env: Factory,
) -> None:
    """The request path's split entry: a lease that is free is granted synchronously
    (no task, no future); a request that must queue gets None, then wait()'s decision."""
    env = await make_env()  # ceiling 100
    ctl = env.ctl
    first = ctl.admit(req("first", 70))
    d1 = first.decide_now()
    assert d1 is not None and (d1.action, d1.tokens) == ("admit", 70)
    assert ctl.waiting == 0 and ctl.ledger.reserved == 70
    second = ctl.admit(req("second", 50))
    assert second.decide_now() is None  # 70 + 50 > 100: it waits in the FIFO
    assert ctl.waiting == 1
    waiting = asyncio.ensure_future(second.wait())
    await settle()
    assert not waiting.done()
    await first.__aexit__(None, None, None)  # the release grants the waiter
    d2 = await asyncio.wait_for(waiting, 5)
    assert (d2.action, d2.tokens) == ("admit", 50)
    assert ctl.ledger.reserved == 50
    await second.__aexit__(None, None, None)
    assert ctl.ledger.reserved == 0 and ctl.ledger.lease_count == 0 and ctl.waiting == 0
