"""Program admission's ledger shared by two replicas through a real ``redis-server``
(password, 127.0.0.1, stopped by PID): a table of scenarios gives the same answers and
the same ledgers whether the records travel through Redis or are handed over in memory
(the two transports' conformance, as tests/integration/test_state_conformance.py is the
store operations'), and a Redis that stops and comes back is a fallback with one WARNING,
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
from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.records import Outcome
from kvproxy.config import StateConfig
from kvproxy.replication import sync as admission_sync
from kvproxy.replication.sync import AdmissionSync
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


class Side:
    """One replica: its core, its shell, the turns its drains released."""

    def __init__(self, cfg: StateConfig, store: object, name: str) -> None:
        self.core = ProgramCore(P)
        self.core.ledger.observe_engine(E1, 0.0, max_total_num_tokens=10_000)
        self.loop = asyncio.get_running_loop()
        self.released: list[str] = []
        self.sync = AdmissionSync(
            cfg,
            store,
            self.core,
            replica=name,
            drain=self._drain,
            clock=self.loop.time,  # type: ignore[arg-type]
        )

    def _drain(self) -> None:
        self.released += [r.outcome.value for r in self.core.drain(self.loop.time())]

    def turn(self, ticket: str, sid: str, tokens: int) -> str:
        v = self.core.request(ticket, sid, E1, tokens, self.loop.time())
        return "held" if v.outcome is None else v.outcome.value

    def answer(self, ticket: str, tokens: int) -> None:
        now = self.loop.time()
        self.core.observe_response(
            ticket, now, prompt_tokens=tokens, completion_tokens=100, cached_tokens=None
        )
        self.core.turn_ended(ticket, now)

    def rows(self) -> list[tuple]:
        return sorted(
            (s.sid, s.state.value, s.ctx, s.turns) for s in self.core.ledger.sessions.values()
        )


async def _settle(a: Side, b: Side) -> None:
    """Everything each replica sent has been applied by the other: a beat sent after
    its records (one channel keeps a sender's order) is heard."""
    for x, y in ((a, b), (b, a)):
        await x.sync.flush()
        sent = x.loop.time()
        await x.sync.beat()

        async def heard(x: Side = x, y: Side = y, sent: float = sent) -> bool:
            return y.sync.ledger.mirror.heard.get(x.sync.replica, -1.0) >= sent

        await wait_until(heard, timeout_s=10, what=f"{y.sync.replica} heard {x.sync.replica}")


async def _alternate(a: Side, b: Side) -> list[str]:
    out = []
    for i, (side, ctx) in enumerate([(a, 1000), (b, 1500), (a, 2100), (b, 2600)]):
        out.append(side.turn(f"t{i}", "s", ctx))
        side.answer(f"t{i}", ctx)
        await _settle(a, b)
    return out


async def _pause(a: Side, b: Side) -> list[str]:
    out = [a.turn("t0", "s", 1000)]
    a.answer("t0", 1000)
    await _settle(a, b)
    s = a.core.ledger.get("s")
    assert s is not None
    a.core.ledger.pause(s, a.loop.time())
    await _settle(a, b)
    out.append(b.turn("t1", "s", 1200))  # a paused session's turn: a resume on b
    await _settle(a, b)
    return out


async def _close(a: Side, b: Side) -> list[str]:
    out = [a.turn("t0", "s", 1000), a.turn("u0", "u", 500)]
    a.answer("t0", 1000)
    a.answer("u0", 500)
    await _settle(a, b)
    b.core.end_session("s", b.loop.time())
    await _settle(a, b)
    return out


async def _order(a: Side, b: Side) -> list[str]:
    out = [a.turn("f", "full", 8000)]  # 8,100 of the 9,000 the target allows
    a.answer("f", 8000)
    await _settle(a, b)
    out.append(a.turn("big", "s-big", 5000))  # does not fit: it waits on a
    await _settle(a, b)
    out.append(b.turn("small", "s-small", 500))  # fits, but a's came first
    a.core.cancel("big")
    await _settle(a, b)
    return out + b.released


# What each scenario's turns answered, and both ledgers after it: the same whether the
# records travel through Redis or in memory.
ADMISSION_SCENARIOS = {
    "a session's turns alternate replicas": (
        _alternate,
        ["new_admitted", "continuing_forwarded", "continuing_forwarded", "continuing_forwarded"],
        [("s", "active", 2700, 4)],
    ),
    "a pause on one replica holds on the other": (
        _pause,
        ["new_admitted", "resumed"],
        [("s", "active", 1100, 1)],
    ),
    "a close on one replica leaves both ledgers": (
        _close,
        ["new_admitted", "new_admitted"],
        [("u", "active", 600, 1)],
    ),
    "a first turn waits behind the other replica's earlier one": (
        _order,
        ["new_admitted", "held", "held", "new_waited"],
        [("full", "active", 8100, 1), ("s-small", "active", 0, 0)],
    ),
}


async def _run(scenario: str, stores: tuple[object, object], cfg: StateConfig) -> tuple:
    drive, _, _ = ADMISSION_SCENARIOS[scenario]
    a, b = Side(cfg, stores[0], "a"), Side(cfg, stores[1], "b")
    await a.sync.start()
    await b.sync.start()
    try:
        await wait_until(_both_hear(a.sync, b.sync), timeout_s=10, what="the replicas meet")
        outcomes = await drive(a, b)
        return outcomes, a.rows(), b.rows()
    finally:
        await a.sync.stop()
        await b.sync.stop()


def _both_hear(a: AdmissionSync, b: AdmissionSync):
    async def check() -> bool:
        return a.gauges()[admission_sync.PEERS] == 1 and b.gauges()[admission_sync.PEERS] == 1

    return check


@pytest.mark.parametrize("scenario", sorted(ADMISSION_SCENARIOS))
async def test_both_transports_answer_the_table(scenario: str, redis_server: RedisServer) -> None:
    os.environ[PW_ENV] = redis_server.password
    _, outcomes, rows = ADMISSION_SCENARIOS[scenario]
    hub = MemoryChannel()
    memory = await _run(scenario, (hub.endpoint(), hub.endpoint()), _cfg("redis://x", "m:"))
    cfg = _cfg(redis_server.url, f"as-{secrets.token_hex(4)}:")
    redis = await _run(scenario, (RedisStore(cfg), RedisStore(cfg)), cfg)
    assert memory == redis == (outcomes, rows, rows)


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
    sa, sb = Side(cfg, RedisStore(cfg), "a"), Side(cfg, RedisStore(cfg), "b")
    (ca, a), (cb, b) = (sa.core, sa.sync), (sb.core, sb.sync)
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
