"""The shared state's shell (kvproxy.state.shared) over the pure memory store, with a
store that can be switched off: batching, claims, the fallback and its one warning,
the rejoin, the leased sweep; and ``--workers``' rules, the doctor's store lines."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from kvproxy.config import Config, StateConfig
from kvproxy.doctor.checks import Status
from kvproxy.doctor.store_checks import StoreFacts, store_lines
from kvproxy.serve import workers_check
from kvproxy.state.core import Begin, End, Heartbeat, MemoryStore, Op, Peek
from kvproxy.state.redis_store import StoreUnavailable, redacted_url
from kvproxy.state.shared import SharedState
from tests.helpers import wait_until


class FakeStore:
    """The memory store behind the Store protocol; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.mem = MemoryStore()
        self.down = False
        self.batches: list[list[Op]] = []
        self.published: list[str] = []
        self.inbox: asyncio.Queue[str] = asyncio.Queue()

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("ConnectionError: refused")

    async def execute(self, ops: Sequence[Op]) -> list[Any]:
        self._check()
        self.batches.append(list(ops))
        return [self.mem.apply(op) for op in ops]

    async def publish(self, message: str) -> None:
        self._check()
        self.published.append(message)

    async def messages(self) -> AsyncIterator[str]:
        for _ in range(1000):
            self._check()
            try:
                yield await asyncio.wait_for(self.inbox.get(), 0.05)
            except TimeoutError:
                continue

    async def ping(self) -> None:
        self._check()

    async def close(self) -> None:
        return None


class Harness:
    def __init__(
        self, idle: float | None = None, orphan_abort_after_s: float | None = 30.0
    ) -> None:
        self.store = FakeStore()
        self.now = 1000.0
        self.due: list[str] = []
        self.remote: list[str] = []
        self.open: list[tuple[str, float, int]] = []
        self.orphans: list[str] = []
        cfg = StateConfig(
            backend="redis",
            sweep_interval_s=0.02,
            retry_interval_s=0.02,
            replica_ttl_s=5.0,
            orphan_abort_after_s=orphan_abort_after_s,
        )
        self.shared = SharedState(
            cfg,
            self.store,
            replica="A",
            closed_ttl_s=lambda: 60.0,
            idle_timeout_s=lambda: idle,
            closing=lambda: [],
            snapshot=lambda _now: list(self.open),
            on_due=self.due.append,
            on_remote_close=self.remote.append,
            on_orphans=self.orphans.extend,
            clock=lambda: self.now,
        )


async def test_writes_go_out_in_order_and_claims_close_once() -> None:
    h = Harness()
    await h.shared.start()
    try:
        h.shared.submit(Begin("s", "A", h.now, 60.0))
        h.shared.submit(End("s", "A", h.now, 60.0))
        assert await h.shared.claim_close("s") is True
        assert h.store.published == ["close\tA\ts"]
        assert await h.shared.claim_close("s") is False
        assert h.store.mem.peek(Peek("s", h.now))["close"] == "A"
        h.shared.finish_close("s")

        async def tombstone() -> bool:
            return h.store.mem.peek(Peek("s", h.now)) == {"close": "closed"}

        await wait_until(tombstone, timeout_s=5, what="the tombstone written")
        assert h.shared.totals()["agentic_kv/state/close_claims_lost"] == 1
    finally:
        await h.shared.stop()


async def test_store_down_falls_back_with_one_warning_then_rejoins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()
    h.open = [("kept", 990.0, 1)]
    await h.shared.start()
    try:
        h.store.down = True
        with caplog.at_level(logging.WARNING, logger="kvproxy.state.shared"):
            for _ in range(5):
                assert await h.shared.claim_close("x") in (None, False)
                h.shared.submit(Begin("y", "A", h.now, 60.0))
        assert not h.shared.up
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1
        assert h.shared.totals()["agentic_kv/state/ops_dropped"] >= 5
        assert h.shared.totals()["agentic_kv/state/close_claims_unchecked"] >= 4
        h.store.down = False

        async def rejoined() -> bool:
            return h.shared.up

        await wait_until(rejoined, timeout_s=5, what="the rejoin")
        # The open session was written back with its in-flight count.
        assert h.store.mem.peek(Peek("kept", h.now))["in_flight"] == {"A": 1}
        assert h.shared.totals()["agentic_kv/state/rejoins"] == 1
    finally:
        await h.shared.stop()


async def test_the_leased_sweep_closes_idle_sessions_and_remote_closes_arrive() -> None:
    h = Harness(idle=5.0)
    await h.shared.start()
    try:
        h.store.mem.apply(Begin("old", "B", h.now - 10, 60.0))
        h.store.mem.apply(End("old", "B", h.now - 10, 60.0))
        h.store.mem.apply(Begin("busy", "A", h.now - 10, 60.0))

        async def swept() -> bool:
            return h.due[:1] == ["old"]

        await wait_until(swept, timeout_s=5, what="the sweep")
        assert "busy" not in h.due
        await h.store.inbox.put("close\tB\tgone")
        await h.store.inbox.put("close\tA\tmine")  # this replica's own: ignored

        async def remote() -> bool:
            return h.remote == ["gone"]

        await wait_until(remote, timeout_s=5, what="the remote close")
    finally:
        await h.shared.stop()


async def test_the_leased_sweep_aborts_what_a_dead_replica_had_in_flight_once() -> None:
    h = Harness()
    # B beat 10 s ago (its 5 s heartbeat expired) with two requests in flight, one ended.
    h.store.mem.apply(Heartbeat("B", h.now - 10, 5.0))
    h.store.mem.apply(Begin("s", "B", h.now - 10, 60.0, rids=("b1",)))
    h.store.mem.apply(Begin("t", "B", h.now - 10, 60.0, rids=("b2",)))
    h.store.mem.apply(End("t", "B", h.now - 9, 60.0, rids=("b2",)))
    await h.shared.start()
    try:
        h.shared.begin("u", False, ("a1",))  # this replica's own: never taken
        await h.shared.beat()  # (or the beat task's) B marked gone
        assert h.orphans == []
        h.now += 5.0  # replica_ttl_s later: still inside orphan_abort_after_s (30 s)
        await h.shared.beat()
        assert h.orphans == []
        h.now += 25.0  # orphan_abort_after_s after B was found gone: still silent

        async def taken() -> bool:
            return h.orphans == ["b1"]

        await wait_until(taken, timeout_s=5, what="B's request taken")
        h.now += 10.0
        await h.shared.beat()
        await h.shared.beat()
        assert h.orphans == ["b1"]  # once
        assert h.shared.totals()["agentic_kv/state/orphan_aborts"] == 1
        assert h.store.mem.in_flight_rids("A", h.now) == {"a1": "u"}
    finally:
        await h.shared.stop()


@pytest.mark.parametrize(
    ("workers", "sections", "error", "warning"),
    [
        (1, {}, False, False),
        (2, {}, False, False),
        (2, {"session_lifecycle": {"enabled": True}}, True, False),
        (2, {"session_lifecycle": {"enabled": True}, "state": {"backend": "redis"}}, False, False),
        (2, {"admission": {"enabled": True}}, False, True),
        # The default policy cannot be mirrored: each worker accounts fleet-wide alone.
        (2, {"admission": {"enabled": True}, "state": {"backend": "redis"}}, False, True),
        (
            2,
            {
                "admission": {"enabled": True},
                "state": {"backend": "redis"},
                "router": {"policy": "consistent_hashing"},
            },
            False,
            False,
        ),
        (
            2,
            {"admission": {"enabled": True, "ledger": "fleet"}, "state": {"backend": "redis"}},
            False,
            True,
        ),
        (0, {}, True, False),
    ],
)
def test_workers_need_shared_state(
    workers: int, sections: dict[str, dict[str, Any]], error: bool, warning: bool
) -> None:
    cfg = Config()
    for name, values in sections.items():
        cfg = cfg.replace(name, **values)
    problem, warn = workers_check(cfg, workers)
    assert (problem is not None, warn is not None) == (error, warning)


def test_store_lines() -> None:
    assert store_lines(StoreFacts(backend="memory"))[0].status is Status.OK
    down = store_lines(
        StoreFacts(backend="redis", url="redis://h:1/0", error="AuthenticationError")
    )
    assert down[0].status is Status.FAIL and "password" in (down[0].fix or "")
    ok = store_lines(
        StoreFacts(backend="redis", url="redis://h:1/0", password_set=True, latency_ms=0.2)
    )
    assert [line.status for line in ok] == [Status.OK, Status.OK]
    slow = store_lines(StoreFacts(backend="redis", url="u", password_set=False, latency_ms=9))
    assert [line.status for line in slow] == [Status.OK, Status.WARN, Status.WARN]


def test_urls_are_redacted() -> None:
    assert redacted_url("redis://user:secret@host:6379/0") == "redis://***@host:6379/0"
    assert redacted_url("redis://host:6379/0") == "redis://host:6379/0"


def test_the_state_section_is_checked() -> None:
    from kvproxy.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match=r"state\.backend"):
        from_mapping({"state": {"backend": "etcd"}})
    with pytest.raises(ConfigError, match="credentials"):
        from_mapping({"state": {"backend": "redis", "redis_url": "redis://:pw@h:1/0"}})
    assert from_mapping({"state": {"backend": "redis"}}).state.backend == "redis"


async def test_no_request_is_aborted_when_orphan_aborts_are_off() -> None:
    h = Harness(orphan_abort_after_s=None)
    h.store.mem.apply(Heartbeat("B", h.now - 10, 5.0))
    h.store.mem.apply(Begin("s", "B", h.now - 10, 60.0, rids=("b1",)))
    await h.shared.start()
    try:
        for _ in range(3):
            await h.shared.beat()
            h.now += 60.0
        assert h.orphans == []  # B's request left alone, its record to expire
    finally:
        await h.shared.stop()
