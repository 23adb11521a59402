"""Program admission's ledger shared by two replicas through a real ``redis-server``
(password, 127.0.0.1, stopped by PID): the same turns give the same ledgers whether the
records travel through Redis or are handed over in memory (the two transports'
conformance), and a Redis that stops and comes back is a fallback with one WARNING,
then a rejoin that exchanges the replicas' whole views."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvlab import stack
from kvproxy.admission.decisions import Outcome
from kvproxy.admission.params import ProgramParams
from kvproxy.admission.program import ProgramCore
from kvproxy.config import StateConfig
from kvproxy.state import admission_sync
from kvproxy.state.admission_sync import AdmissionSync
from kvproxy.state.redis_store import RedisStore
from tests.helpers import wait_until
from tests.integration.conftest import RedisServer

E1 = "http://e1:1"
P = ProgramParams(engage_on_thrash=False, headroom=1.0, staleness_s=1e9, growth_reservation=False)
PW_ENV = "KVPROXY_ADMISSION_SYNC_TEST_PW"


class MemoryChannel:
    """The records handed over in memory: every subscriber gets every message."""

    def __init__(self) -> None:
        self.queues: list[asyncio.Queue[str]] = []

    def endpoint(self) -> _Endpoint:
        return _Endpoint(self)


class _Endpoint:
    def __init__(self, hub: MemoryChannel) -> None:
        self.hub = hub

    async def publish(self, message: str, channel: str | None = None) -> None:
        for q in self.hub.queues:
            q.put_nowait(message)

    async def messages(self, channel: str | None = None) -> AsyncIterator[str]:
        q: asyncio.Queue[str] = asyncio.Queue()
        self.hub.queues.append(q)
        yield ""
        while True:
            yield await q.get()

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _cfg(url: str, prefix: str) -> StateConfig:
    return StateConfig(
        backend="redis",
        redis_url=url,
        redis_password_env=PW_ENV,
        key_prefix=prefix,
        op_timeout_s=0.2,  # (a loaded 2-core test host)
        replica_ttl_s=3.0,
        sweep_interval_s=0.2,
        retry_interval_s=0.2,
    )


def _replica(cfg: StateConfig, store: object, name: str) -> tuple[ProgramCore, AdmissionSync]:
    core = ProgramCore(P)
    core.ledger.observe_engine(E1, 0.0, max_total_num_tokens=10_000)
    loop = asyncio.get_running_loop()
    sync = AdmissionSync(
        cfg,
        store,
        core,
        replica=name,
        drain=lambda: None,
        clock=loop.time,  # type: ignore[arg-type]
    )
    return core, sync


async def _drive(stores: tuple[object, object], cfg: StateConfig) -> list[list[tuple]]:
    """Two replicas; a session's turns alternate between them; each one's ledger rows."""
    (ca, a), (cb, b) = _replica(cfg, stores[0], "a"), _replica(cfg, stores[1], "b")
    await a.start()
    await b.start()
    try:
        await wait_until(_both_hear(a, b), timeout_s=10, what="the replicas hear each other")
        now = asyncio.get_running_loop().time
        outcomes = []
        for i, (core, ctx) in enumerate([(ca, 1000), (cb, 1500), (ca, 2100), (cb, 2600)]):
            other = cb if core is ca else ca
            outcomes.append(core.request(f"t{i}", "s", E1, ctx, now()).outcome)
            core.observe_response(
                f"t{i}", now(), prompt_tokens=ctx, completion_tokens=100, cached_tokens=None
            )
            core.turn_ended(f"t{i}", now())

            async def seen(other: ProgramCore = other, turns: int = i + 1) -> bool:
                s = other.ledger.get("s")
                return s is not None and s.turns >= turns and not s.busy

            await wait_until(seen, timeout_s=10, what=f"turn {i} on the other replica")
        assert outcomes == [Outcome.NEW_ADMITTED] + [Outcome.CONTINUING_FORWARDED] * 3
        return [_rows(ca), _rows(cb)]
    finally:
        await a.stop()
        await b.stop()


def _both_hear(a: AdmissionSync, b: AdmissionSync):
    async def check() -> bool:
        return a.gauges()[admission_sync.PEERS] == 1 and b.gauges()[admission_sync.PEERS] == 1

    return check


def _rows(core: ProgramCore) -> list[tuple]:
    return sorted(
        (s.sid, s.engine, s.state.value, s.ctx, s.turns) for s in core.ledger.sessions.values()
    )


async def test_both_transports_give_the_same_ledgers(redis_server: RedisServer) -> None:
    os.environ[PW_ENV] = redis_server.password
    hub = MemoryChannel()
    in_memory = await _drive((hub.endpoint(), hub.endpoint()), _cfg("redis://unused", "m:"))
    cfg = _cfg(redis_server.url, f"as-{secrets.token_hex(4)}:")
    through_redis = await _drive((RedisStore(cfg), RedisStore(cfg)), cfg)
    assert in_memory == through_redis
    assert in_memory[0] == in_memory[1] == [("s", E1, "active", 2700, 4)]


@pytest.fixture
def own_redis(tmp_path: Path) -> tuple[Path, str]:
    return tmp_path, secrets.token_hex(16)


async def test_redis_down_is_one_warning_and_a_rejoin_exchanges_the_views(
    own_redis: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    logs, password = own_redis
    os.environ[PW_ENV] = password
    redis = stack.start_redis(log_dir=logs, password=password)
    port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
    cfg = _cfg(redis.url, "down:")
    (ca, a), (cb, b) = _replica(cfg, RedisStore(cfg), "a"), _replica(cfg, RedisStore(cfg), "b")
    caplog.set_level(logging.WARNING, logger=admission_sync.__name__)
    await a.start()
    await b.start()
    try:
        await wait_until(_both_hear(a, b), timeout_s=10, what="the replicas hear each other")
        now = asyncio.get_running_loop().time
        ca.request("t1", "s1", E1, 500, now())  # running on a

        async def busy_on_b() -> bool:
            s = cb.ledger.get("s1")
            return s is not None and s.busy

        await wait_until(busy_on_b, timeout_s=10, what="a's running turn seen on b")
        redis.stop()

        async def both_alone() -> bool:
            return not a.up and not b.up

        await wait_until(both_alone, timeout_s=10, what="both replicas fall back")
        s = cb.ledger.get("s1")
        assert s is not None and not s.busy  # a's claims no longer count on b
        # While Redis is down the replicas decide alone: a session only b knows.
        assert cb.request("u1", "s2", E1, 500, now()).outcome is Outcome.NEW_ADMITTED
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2  # one a replica
        assert not any(password in r.getMessage() for r in caplog.records)
        redis = stack.start_redis(log_dir=logs, password=password, port=port)

        async def rejoined() -> bool:
            s1, s2 = cb.ledger.get("s1"), ca.ledger.get("s2")
            return a.up and b.up and s1 is not None and s1.busy and s2 is not None

        await wait_until(rejoined, timeout_s=15, what="the rejoin exchanges both views")
        assert a.totals()[admission_sync.REJOINS] >= 1
        assert a.totals()[admission_sync.FALLBACKS] == 1
    finally:
        await a.stop()
        await b.stop()
        redis.stop()
