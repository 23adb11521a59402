"""Every state operation against both backends: the pure memory store and a real
``redis-server`` (with a password), one table of scenarios, the same answers.

A step is ``(at, op, expected)``: ``at`` seconds after the scenario's start (the
operation's ``now``; against Redis the step also waits until the wall clock gets
there, since Redis expires keys on its own clock), the operation built for that
``now``, and the answer both backends must give.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvproxy.config import StateConfig
from kvproxy.state.core import (
    CLOSED,
    Begin,
    Claim,
    Due,
    End,
    Finish,
    Heartbeat,
    Lease,
    MemoryStore,
    Op,
    Orphans,
    Peek,
    Restore,
)
from kvproxy.state.redis_store import RedisStore, StoreUnavailable
from tests.integration.conftest import RedisServer

TTL = 60.0
SHORT = 0.3  # a heartbeat that is let expire

Step = tuple[float, Callable[[float], Op], Any]


def _in_flight(answer: dict[str, Any]) -> dict[str, int]:
    return dict(answer.get("in_flight", {}))


SCENARIOS: dict[str, list[Step]] = {
    "a session's turns on two replicas": [
        (0.0, lambda t: Heartbeat("A", t, TTL), 0),
        (0.0, lambda t: Heartbeat("B", t, TTL), 0),
        (0.0, lambda t: Begin("s", "A", t, TTL), "open"),
        (0.0, lambda t: Begin("s", "B", t, TTL), "open"),
        (0.0, lambda t: End("s", "A", t, TTL), True),
        (0.0, lambda t: Peek("s", t), {"last": 0.0, "in_flight": {"B": 1}, "owed": ""}),
        (0.0, lambda t: End("s", "B", t, TTL), True),
        (0.0, lambda t: Due(t, idle_timeout_s=None), []),
        (0.0, lambda t: Due(t + 10, idle_timeout_s=5.0), ["s"]),
        (0.0, lambda t: Due(t + 1, idle_timeout_s=5.0), []),
    ],
    "close exactly once, then a tombstone, then reopen": [
        (0.0, lambda t: Begin("s", "A", t, TTL), "open"),
        (0.0, lambda t: End("s", "A", t, TTL), True),
        (0.0, lambda t: Claim("s", "B", t, TTL), True),
        (0.0, lambda t: Claim("s", "A", t, TTL), False),
        (0.0, lambda t: Begin("s", "A", t, TTL), "closing"),
        (0.0, lambda t: Peek("s", t), {"last": 0.0, "in_flight": {}, "owed": "B", "close": "B"}),
        (0.0, lambda t: Finish("s", "B", t, 30.0), None),
        (0.0, lambda t: Claim("s", "A", t, TTL), False),
        (0.0, lambda t: End("s", "A", t, TTL), False),
        (0.0, lambda t: Peek("s", t), {"close": CLOSED}),
        (0.0, lambda t: Begin("s", "A", t, TTL), "reopened"),
        (0.0, lambda t: Claim("s", "A", t, TTL), True),
    ],
    "a busy session is not due while its replica lives": [
        (0.0, lambda t: Heartbeat("A", t, 1000.0), 0),
        (0.0, lambda t: Begin("s", "A", t, TTL), "open"),
        (0.0, lambda t: Due(t + 30, idle_timeout_s=1.0), []),
        (0.0, lambda t: Restore("s", "A", t, 0, t, TTL), True),
        (0.0, lambda t: Due(t + 30, idle_timeout_s=1.0), ["s"]),
    ],
    "a dead replica's turns and owed close": [
        (0.0, lambda t: Heartbeat("A", t, SHORT), 0),
        (0.0, lambda t: Heartbeat("B", t, TTL), 0),
        (0.0, lambda t: Begin("x", "A", t, TTL, final=True), "open"),
        (0.0, lambda t: Begin("y", "A", t, TTL), "open"),
        (0.0, lambda t: Due(t, idle_timeout_s=None), []),
        # A stops beating: its in-flight counts no longer hold the sessions.
        (SHORT + 0.2, lambda t: Due(t, idle_timeout_s=None), ["x"]),
        (SHORT + 0.2, lambda t: Due(t, idle_timeout_s=0.1), ["x", "y"]),
        (SHORT + 0.2, lambda t: Claim("x", "B", t, TTL), True),
        (SHORT + 0.2, lambda t: Due(t, idle_timeout_s=0.1), ["y"]),
    ],
    "a replica that dies while closing leaves its close due": [
        (0.0, lambda t: Heartbeat("A", t, SHORT), 0),
        (0.0, lambda t: Heartbeat("B", t, TTL), 0),
        (0.0, lambda t: Begin("s", "A", t, TTL), "open"),
        (0.0, lambda t: End("s", "A", t, TTL), True),
        (0.0, lambda t: Claim("s", "A", t, SHORT), True),
        (0.0, lambda t: Due(t, idle_timeout_s=None), []),
        # A dies mid fan-out: its claim and heartbeat expire, the close it owed is due.
        (SHORT + 0.2, lambda t: Due(t, idle_timeout_s=None), ["s"]),
        (SHORT + 0.2, lambda t: Claim("s", "B", t, TTL), True),
        (SHORT + 0.2, lambda t: Finish("s", "B", t, 30.0), None),
        (SHORT + 0.2, lambda t: Due(t, idle_timeout_s=None), []),
    ],
    "claims expire with their replica unless renewed": [
        (0.0, lambda t: Claim("a", "A", t, SHORT), True),
        (0.0, lambda t: Claim("b", "A", t, SHORT), True),
        (0.0, lambda t: Heartbeat("A", t, SHORT, closing=("a", "b", "c")), 2),
        (SHORT / 2, lambda t: Heartbeat("A", t, SHORT * 8, closing=("a",)), 1),
        (SHORT + 0.6, lambda t: Claim("b", "B", t, TTL), True),
        (SHORT + 0.6, lambda t: Claim("a", "B", t, TTL), False),
    ],
    "one sweep lease at a time": [
        (0.0, lambda t: Lease("sweep", "A", t, SHORT), True),
        (0.0, lambda t: Lease("sweep", "B", t, SHORT), False),
        (0.0, lambda t: Lease("sweep", "A", t, SHORT), True),
        # Late enough for a loaded machine's lag after the renewal above.
        (SHORT + 0.6, lambda t: Lease("sweep", "B", t, SHORT), True),
        (SHORT + 0.6, lambda t: Lease("sweep", "A", t, SHORT), False),
    ],
    "the requests of a replica gone: marked, then taken once after the grace": [
        (0.0, lambda t: Heartbeat("A", t, SHORT), 0),
        (0.0, lambda t: Heartbeat("B", t, TTL), 0),
        (0.0, lambda t: Begin("s", "A", t, TTL, rids=("a2", "a1", "a3")), "open"),
        (0.0, lambda t: Begin("s", "B", t, TTL, rids=("b1",)), "open"),
        (0.0, lambda t: End("s", "A", t, TTL, rids=("a3",)), True),
        (0.0, lambda t: Orphans(t, SHORT), []),  # A beats
        (SHORT + 0.2, lambda t: Orphans(t, SHORT), []),  # A gone: marked
        (SHORT + 0.3, lambda t: Orphans(t, SHORT), []),  # within the grace
        (2 * SHORT + 0.3, lambda t: Orphans(t, SHORT, limit=1), ["a1"]),
        (2 * SHORT + 0.3, lambda t: Orphans(t, SHORT), ["a2"]),
        (2 * SHORT + 0.3, lambda t: Orphans(t, SHORT), []),  # each once; B's stay
    ],
    "a replica that beats again within the grace keeps its requests": [
        (0.0, lambda t: Heartbeat("A", t, SHORT), 0),
        (0.0, lambda t: Begin("s", "A", t, TTL, rids=("a1",)), "open"),
        (SHORT + 0.2, lambda t: Orphans(t, 10.0), []),  # marked
        (SHORT + 0.2, lambda t: Heartbeat("A", t, TTL), 0),  # back
        (SHORT + 0.2, lambda t: Orphans(t + 20, 10.0), []),  # unmarked, not taken
        (SHORT + 0.2, lambda t: Orphans(t + 40, 10.0), []),
    ],
    "restore after an outage keeps the newest activity": [
        (0.0, lambda t: Begin("s", "A", t + 5, TTL), "open"),
        (0.0, lambda t: Restore("s", "B", t + 1, 2, t, TTL), True),
        (0.0, lambda t: Peek("s", t), {"last": 5.0, "in_flight": {"A": 1, "B": 2}, "owed": ""}),
        (0.0, lambda t: Claim("s", "A", t, TTL), True),
        (0.0, lambda t: Restore("s", "B", t, 0, t, TTL), False),
    ],
}


def _relative(answer: Any, base: float) -> Any:
    """Peek answers with ``last`` relative to the scenario's start (rounded)."""
    if isinstance(answer, dict) and "last" in answer:
        return {**answer, "last": round(answer["last"] - base, 3)}
    return answer


async def _run_memory(steps: list[Step], base: float) -> list[Any]:
    store = MemoryStore()
    return [_relative(store.apply(make(base + at)), base) for at, make, _ in steps]


async def _run_redis(steps: list[Step], base: float, server: RedisServer) -> list[Any]:
    store = _store(server, f"conf-{uuid.uuid4().hex[:8]}:")
    out: list[Any] = []
    try:
        for at, make, _ in steps:
            # Redis expires keys on its own clock: let it reach the step's time.
            for _ in range(200):
                if time.time() >= base + at:
                    break
                await asyncio.sleep(0.02)
            (answer,) = await store.execute([make(base + at)])
            out.append(_relative(answer, base))
    finally:
        await store.close()
    return out


def _store(server: RedisServer, prefix: str, password: str | None = None) -> RedisStore:
    import os

    os.environ["KVPROXY_TEST_REDIS_PASSWORD"] = password or server.password
    cfg = StateConfig(
        backend="redis",
        redis_url=server.url,
        redis_password_env="KVPROXY_TEST_REDIS_PASSWORD",
        key_prefix=prefix,
        op_timeout_s=0.5,
    )
    return RedisStore(cfg)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_both_backends_answer_the_table(name: str, redis_server: RedisServer) -> None:
    steps = SCENARIOS[name]
    expected = [answer for _, _, answer in steps]
    base = time.time()
    memory = await _run_memory(steps, base)
    redis = await _run_redis(steps, base, redis_server)
    assert memory == expected
    assert redis == expected


async def test_every_key_has_a_ttl_and_closed_sessions_go(redis_server: RedisServer) -> None:
    prefix = f"ttl-{uuid.uuid4().hex[:8]}:"
    store = _store(redis_server, prefix)
    t = time.time()
    try:
        await store.execute(
            [
                Heartbeat("A", t, 5.0),
                Lease("sweep", "A", t, 5.0),
                Begin("s1", "A", t, TTL, final=True),
                Begin("s2", "A", t, TTL, rids=("r1", "r2")),
                End("s2", "A", t, TTL, rids=("r1",)),
                Begin("s3", "B", t - 10, TTL, rids=("r3",)),
                End("s3", "B", t - 10, TTL),
                Orphans(t, 1.0),
                Claim("s1", "A", t, 5.0),
                Finish("s1", "A", t, 30.0),
            ]
        )
        client = store._client
        keys = sorted(await client.keys(f"{prefix}*"))
        expected = ("r:A", "l:sweep", "s:s2", "s:s3", "c:s1", "idx", "f:A", "f:B", "fr", "g:B")
        assert keys == sorted(f"{prefix}{k}" for k in expected), keys
        for key in keys:
            assert await client.pttl(key) > 0, key
        # The closed session left nothing but its tombstone.
        assert await client.zscore(f"{prefix}idx", "s1") is None
        assert not await client.exists(f"{prefix}s:s1")
    finally:
        await store.close()


async def test_a_wrong_password_is_an_error_that_does_not_show_it(
    redis_server: RedisServer,
) -> None:
    store = _store(redis_server, "auth:", password="not-the-password-1234")
    try:
        with pytest.raises(StoreUnavailable) as err:
            await store.execute([Peek("s", time.time())])
        assert "not-the-password-1234" not in str(err.value)
        assert redis_server.password not in str(err.value)
    finally:
        await store.close()


async def test_doctor_reads_the_store(redis_server: RedisServer) -> None:
    import os

    from kvproxy.doctor.checks import Status
    from kvproxy.doctor.gather import read_store
    from kvproxy.doctor.store_checks import store_lines

    cfg = StateConfig(
        backend="redis", redis_url=redis_server.url, redis_password_env="KVPROXY_DOCTOR_TEST_PW"
    )
    os.environ["KVPROXY_DOCTOR_TEST_PW"] = redis_server.password
    try:
        ok = store_lines(await read_store(cfg, timeout_s=2.0))
        os.environ["KVPROXY_DOCTOR_TEST_PW"] = "wrong-password-5678"
        bad = store_lines(await read_store(cfg, timeout_s=2.0))
    finally:
        os.environ.pop("KVPROXY_DOCTOR_TEST_PW", None)
    assert ok[0].status is Status.OK and "answers" in ok[0].message
    # The round trip is measured (a WARN past 2 ms, as on a loaded machine).
    assert "round trip" in ok[1].message and len(ok) == 2
    assert bad[0].status is Status.FAIL and "KVPROXY_DOCTOR_TEST_PW" in (bad[0].fix or "")
    assert not any(redis_server.password in line.render() for line in ok + bad)
    assert not any("wrong-password-5678" in line.render() for line in bad)
