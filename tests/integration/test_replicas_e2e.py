"""Two kvproxy replicas sharing the session state on a real ``redis-server``, behind a
real ``nginx`` round robin (no affinity), in front of the real router (``smg``) and two
simulated engines. Every process is a subprocess on 127.0.0.1, stopped by PID.

What is checked, counted on the engines' side (``GET /sim/requests``):

- a session's turns go through both replicas and its ``/close_session`` reaches every
  engine exactly once (the final turn's replica claims the close);
- a replica SIGKILLed mid-run: every session still gets its close on every engine (the
  survivor's shared sweep closes the idle ones, the dead replica's included), and the
  clients see errors only for the turns the dead replica had in flight;
- Redis stopped mid-run: requests go on without waiting on the store, the replicas fall
  back and rejoin when it returns, and no close is lost;
- a replica frozen (SIGSTOP: its connections stay open) with a request in flight: the
  survivor aborts that request on every engine after ``replica_ttl_s`` +
  ``orphan_abort_after_s``, not before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from kvlab import stack
from tests.helpers import new_marker, wait_until

PASSWORD_ENV = "KVPROXY_REPLICAS_TEST_REDIS_PASSWORD"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def engines(logs: Path) -> Iterator[list[stack.ManagedProcess]]:
    with stack.sim_engines(
        2,
        max_total_tokens=60_000,
        mode="session-radix",
        eviction_policy="priority",
        extra_args=("--time-scale", "0.05", "--record-requests", "8192"),
        log_dir=logs,
    ) as started:
        yield started


@pytest.fixture(scope="module")
def router(engines: list[stack.ManagedProcess], logs: Path) -> Iterator[stack.ManagedProcess]:
    with stack.start_router([e.url for e in engines], log_dir=logs) as proc:
        yield proc


@pytest.fixture(scope="module")
def redis_password() -> Iterator[str]:
    password = secrets.token_hex(16)
    os.environ[PASSWORD_ENV] = password  # the replicas' environment (inherited)
    yield password
    os.environ.pop(PASSWORD_ENV, None)


@pytest.fixture
def redis(logs: Path, redis_password: str) -> Iterator[stack.ManagedProcess]:
    with stack.start_redis(log_dir=logs / "redis", password=redis_password) as proc:
        yield proc


def _config(
    logs: Path,
    redis_url: str,
    router_url: str,
    *,
    admission: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    **lifecycle: Any,
) -> Path:
    doc: dict[str, Any] = {
        "server": {"log_level": "INFO"},
        "router": {"url": router_url},
        "session_lifecycle": {"enabled": True, "check_engines": False, **lifecycle},
        "state": {
            "backend": "redis",
            "redis_url": redis_url,
            "redis_password_env": PASSWORD_ENV,
            "key_prefix": f"t-{new_marker()[:8]}:",
            "replica_ttl_s": 1.0,
            "sweep_interval_s": 0.25,
            "retry_interval_s": 0.25,
            **(state or {}),
        },
    }
    if admission is not None:
        doc["router"]["policy"] = "consistent_hashing"
        doc["admission"] = {"enabled": True, **admission}
    path = logs / f"kvproxy-{new_marker()[:8]}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Stack:
    def __init__(self, replicas: list[stack.ManagedProcess], lb: stack.ManagedProcess) -> None:
        self.replicas = replicas
        self.lb = lb


def _start(logs: Path, config: Path, router_url: str) -> Stack:
    replicas = [
        stack.start_kvproxy(config_path=config, router_url=router_url, log_dir=logs)
        for _ in range(2)
    ]
    try:
        lb = stack.start_nginx(log_dir=logs, upstreams=[r.url for r in replicas])
    except Exception:
        stack.stop_all(replicas)
        raise
    return Stack(replicas, lb)


def _stop(s: Stack) -> None:
    stack.stop_all([s.lb, *s.replicas])


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        for line in (await resp.text()).splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                out[name] = float(value)
    return out


async def _closes(http: aiohttp.ClientSession, engines: Sequence[str], marker: str) -> Counter[str]:
    """(engine, session id) -> how many /close_session it received, for this test's ids."""
    got: Counter[str] = Counter()
    for url in engines:
        async with http.get(f"{url}/sim/requests") as resp:
            for entry in orjson.loads(await resp.read())["requests"]:
                if entry["path"] == "/close_session" and marker in entry["body"]:
                    sid = orjson.loads(entry["body"])["session_id"]
                    got[f"{url} {sid}"] += 1
    return got


async def _turn(
    http: aiohttp.ClientSession, url: str, sid: str, *, final: bool = False, tries: int = 6
) -> tuple[int, int]:
    """One turn, retried on errors (bounded): (status, attempts that failed)."""
    headers = {"X-Session-ID": sid}
    if final:
        headers["X-Session-Final"] = "1"
    body = {"input_ids": list(range(7, 47)), "sampling_params": {"max_new_tokens": 4}}
    failed = 0
    for _ in range(tries):
        try:
            async with http.post(f"{url}/generate", json=body, headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    return 200, failed
        except aiohttp.ClientError:
            pass
        failed += 1
    return 0, failed


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def test_turns_alternate_replicas_and_each_close_reaches_every_engine_once(
    logs: Path,
    router: stack.ManagedProcess,
    engines: list[stack.ManagedProcess],
    redis: stack.ManagedProcess,
    http: aiohttp.ClientSession,
) -> None:
    s = _start(logs, _config(logs, redis.url, router.url), router.url)
    try:
        marker = new_marker()
        # An odd number of sessions, their turns one after another: round robin sends
        # each session's next turn to the other replica.
        sids = [f"{marker}-{i}" for i in range(11)]
        for turn in range(4):
            for sid in sids:
                assert await _turn(http, s.lb.url, sid, final=turn == 3) == (200, 0)
        engine_urls = [e.url for e in engines]
        expected = {f"{u} {sid}" for u in engine_urls for sid in sids}

        async def all_closed() -> bool:
            return set(await _closes(http, engine_urls, marker)) == expected

        await wait_until(all_closed, timeout_s=15, what="every session closed on every engine")
        per_replica = [await _metrics(http, r.url) for r in s.replicas]
        # Both replicas served turns of every session; one close fan-out per session.
        assert [m["agentic_kv_session_started_total"] for m in per_replica] == [len(sids)] * 2
        assert sum(m["agentic_kv_session_close_total"] for m in per_replica) == len(sids)
        assert all(m["agentic_kv_state_store_up"] == 1 for m in per_replica)
        counts = await _closes(http, engine_urls, marker)
        assert set(counts.values()) == {1}, counts
    finally:
        _stop(s)


_DECISION = "agentic_kv_admission_decision_"


async def test_admission_counts_a_session_once_whichever_replica_its_turns_reach(
    logs: Path,
    engines: list[stack.ManagedProcess],
    redis: stack.ManagedProcess,
    http: aiohttp.ClientSession,
) -> None:
    """Program admission on both replicas: a session whose turns alternate replicas is
    one new session fleet-wide (its later turns continuing on either replica), because
    each replica's ledger has the other's records folded in."""
    engine_urls = [e.url for e in engines]
    with stack.start_router(engine_urls, policy="consistent_hashing", log_dir=logs) as router:
        admission = {"engage_on_thrash": False, "poll_interval_s": 0.2, "tick_s": 0.05}
        s = _start(logs, _config(logs, redis.url, router.url, admission=admission), router.url)
        try:

            async def peers() -> bool:
                ms = [await _metrics(http, r.url) for r in s.replicas]
                return all(m.get("agentic_kv_state_admission_peers") == 1 for m in ms)

            await wait_until(peers, timeout_s=15, what="the replicas' admission hear each other")
            marker = new_marker()
            sids = [f"{marker}-{i}" for i in range(11)]  # odd: each next turn, the other one
            for _ in range(3):
                for sid in sids:
                    assert await _turn(http, s.lb.url, sid) == (200, 0)

            async def applied() -> bool:
                ms = [await _metrics(http, r.url) for r in s.replicas]
                return all(m["agentic_kv_state_admission_records_applied_total"] > 0 for m in ms)

            await wait_until(applied, timeout_s=10, what="records applied on both replicas")
            ms = [await _metrics(http, r.url) for r in s.replicas]
            decided = sum(
                v
                for m in ms
                for k, v in m.items()
                if k.startswith(_DECISION) and k.endswith("_total")
            )
            going = sum(m[f"{_DECISION}continuing_forwarded_total"] for m in ms)
            # Alone, a replica would take each session's turn after the other's for a
            # first turn: every later turn is a continuing one here.
            assert (decided, going) == (3 * len(sids), 2 * len(sids))
            assert all(m["agentic_kv_state_admission_up"] == 1 for m in ms)
        finally:
            _stop(s)


async def test_a_replica_killed_mid_run_loses_no_close(
    logs: Path,
    router: stack.ManagedProcess,
    engines: list[stack.ManagedProcess],
    redis: stack.ManagedProcess,
    http: aiohttp.ClientSession,
) -> None:
    config = _config(logs, redis.url, router.url, idle_timeout_s=1.5)
    s = _start(logs, config, router.url)
    try:
        marker = new_marker()
        sids = [f"{marker}-{i}" for i in range(20)]
        first = await asyncio.gather(*(_turn(http, s.lb.url, sid) for sid in sids))
        assert all(status == 200 for status, _ in first)
        # The second turns start; one replica dies while they run.
        second = [asyncio.create_task(_turn(http, s.lb.url, sid)) for sid in sids]
        await asyncio.sleep(0)  # the tasks start sending (not a synchronisation point)
        victim = s.replicas[0]
        victim.popen.kill()
        victim.popen.wait(timeout=10)
        results = await asyncio.gather(*second)
        assert all(status == 200 for status, _ in results), results
        third = await asyncio.gather(*(_turn(http, s.lb.url, sid) for sid in sids))
        assert all(status == 200 for status, _ in third)
        engine_urls = [e.url for e in engines]
        expected = {f"{u} {sid}" for u in engine_urls for sid in sids}

        async def all_closed() -> bool:
            return set(await _closes(http, engine_urls, marker)) == expected

        # Idle timeout 1.5 s, the dead replica's heartbeat gone after 1 s, sweeps 4/s.
        await wait_until(all_closed, timeout_s=20, what="every session closed on every engine")
        counts = await _closes(http, engine_urls, marker)
        assert max(counts.values()) == 1, counts
        survivor = await _metrics(http, s.replicas[1].url)
        assert survivor["agentic_kv_state_due_closes_total"] >= len(sids)
        # Only the turns the dead replica held failed (and were retried).
        failed = sum(f for _, f in (*first, *results, *third))
        assert failed <= len(sids)
    finally:
        _stop(s)


async def test_redis_stopped_mid_run_falls_back_and_rejoins(
    logs: Path,
    router: stack.ManagedProcess,
    engines: list[stack.ManagedProcess],
    redis_password: str,
    http: aiohttp.ClientSession,
) -> None:
    port = stack.free_port()
    redis = stack.start_redis(log_dir=logs / "redis2", password=redis_password, port=port)
    s = _start(logs, _config(logs, redis.url, router.url), router.url)
    try:
        marker = new_marker()
        sids = [f"{marker}-{i}" for i in range(10)]
        assert all(
            st == 200 for st, _ in await asyncio.gather(*(_turn(http, s.lb.url, x) for x in sids))
        )
        redis.stop()
        # Turns during the outage: none waits on the store.
        latencies: list[float] = []
        for sid in sids:
            start = time.perf_counter()
            status, failed = await _turn(http, s.lb.url, sid)
            latencies.append(time.perf_counter() - start)
            assert (status, failed) == (200, 0)

        async def fell_back() -> bool:
            ms = [await _metrics(http, r.url) for r in s.replicas]
            return all(m["agentic_kv_state_store_up"] == 0 for m in ms)

        await wait_until(fell_back, timeout_s=10, what="both replicas fell back")
        redis = stack.start_redis(log_dir=logs / "redis2", password=redis_password, port=port)

        async def rejoined() -> bool:
            ms = [await _metrics(http, r.url) for r in s.replicas]
            return all(m["agentic_kv_state_store_up"] == 1 for m in ms)

        await wait_until(rejoined, timeout_s=15, what="both replicas rejoined")
        finals = await asyncio.gather(*(_turn(http, s.lb.url, x, final=True) for x in sids))
        assert all(status == 200 for status, _ in finals)
        engine_urls = [e.url for e in engines]
        expected = {f"{u} {sid}" for u in engine_urls for sid in sids}

        async def all_closed() -> bool:
            return set(await _closes(http, engine_urls, marker)) == expected

        await wait_until(all_closed, timeout_s=15, what="every session closed on every engine")
        assert max(latencies) < 1.0, latencies
        ms = [await _metrics(http, r.url) for r in s.replicas]
        assert all(m["agentic_kv_state_fallbacks_total"] >= 1 for m in ms)
        assert all(m["agentic_kv_state_rejoins_total"] >= 1 for m in ms)
        # One WARNING per replica for the outage, and no password in any log.
        for replica in s.replicas:
            text = replica.log_tail(200_000)
            assert text.count("shared state: the store at") == 1, text[-3000:]
            assert redis_password not in text
    finally:
        _stop(s)
        redis.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def test_workers_share_one_port_and_close_once(
    logs: Path,
    router: stack.ManagedProcess,
    engines: list[stack.ManagedProcess],
    redis: stack.ManagedProcess,
) -> None:
    config = _config(logs, redis.url, router.url)
    proc = stack.start_kvproxy(
        config_path=config, router_url=router.url, log_dir=logs, extra_args=("--workers", "2")
    )
    try:
        workers = _children(proc.pid)
        assert len(workers) == 2
        # New connections are spread over the workers by the kernel once both listen:
        # each answers as its own replica (polled, bounded in time and count; the
        # second worker may still be starting when the first answers).
        replicas: set[str] = set()

        async def both_answered() -> bool:
            async with (
                aiohttp.ClientSession() as fresh,
                fresh.get(f"{proc.url}/kvproxy/health") as resp,
            ):
                replicas.add((await resp.json())["state"]["replica"])
            return len(replicas) == 2

        await wait_until(both_answered, timeout_s=20, what="both workers answering")
        marker = new_marker()
        sids = [f"{marker}-{i}" for i in range(8)]
        async with aiohttp.ClientSession() as http:
            for turn in range(3):
                for sid in sids:
                    # A connection per turn: turns land on either worker.
                    async with aiohttp.ClientSession() as fresh:
                        status, _ = await _turn(fresh, proc.url, sid, final=turn == 2)
                    assert status == 200
            engine_urls = [e.url for e in engines]
            expected = {f"{u} {sid}" for u in engine_urls for sid in sids}

            async def all_closed() -> bool:
                return set(await _closes(http, engine_urls, marker)) == expected

            await wait_until(all_closed, timeout_s=15, what="every session closed")
            counts = await _closes(http, engine_urls, marker)
            assert set(counts.values()) == {1}, counts
    finally:
        proc.stop()
    # SIGTERM to the parent stopped every worker (the parent reaped them).
    assert not [pid for pid in workers if _alive(pid)]


async def test_a_close_on_one_replica_aborts_the_request_another_holds(
    logs: Path,
    router: stack.ManagedProcess,
    engines: list[stack.ManagedProcess],
    redis: stack.ManagedProcess,
    http: aiohttp.ClientSession,
) -> None:
    s = _start(logs, _config(logs, redis.url, router.url), router.url)
    try:
        holder, closer = s.replicas
        marker = new_marker()
        sid = f"{marker}-long"
        body = {"text": f"long {marker}", "sampling_params": {"max_new_tokens": 2000}}

        async def long_turn() -> dict[str, Any]:
            headers = {"X-Session-ID": sid}
            async with http.post(f"{holder.url}/generate", json=body, headers=headers) as resp:
                assert resp.status == 200
                return dict(orjson.loads(await resp.read()))

        request = asyncio.create_task(long_turn())

        async def held() -> bool:
            m = await _metrics(http, holder.url)
            return m.get("agentic_kv_session_forwarded_requests", 0) == 1

        await wait_until(held, timeout_s=10, what="the long turn forwarded by the holder")
        async with http.post(f"{closer.url}/close_session", json={"session_id": sid}) as resp:
            assert resp.status == 200
            result = await resp.json()
        # The closer claimed the close and told the engines; the holder aborted its turn.
        assert result["engines_told"] == 2
        doc = await asyncio.wait_for(request, 15)
        assert doc["meta_info"]["finish_reason"]["type"] == "abort"
        assert doc["meta_info"]["completion_tokens"] < 2000
        m = await _metrics(http, holder.url)
        assert m["agentic_kv_state_remote_closes_total"] == 1
        assert m["agentic_kv_session_aborted_requests_total"] == 1
        assert m["agentic_kv_session_close_total"] == 0  # the fan-out was the closer's
        counts = await _closes(http, [e.url for e in engines], marker)
        assert sorted(counts.values()) == [1, 1]
    finally:
        _stop(s)


async def _engine_requests(
    http: aiohttp.ClientSession, engines: Sequence[str], path: str, marker: str
) -> list[dict[str, Any]]:
    """The bodies of the requests to ``path`` the engines recorded that hold ``marker``."""
    out: list[dict[str, Any]] = []
    for url in engines:
        async with http.get(f"{url}/sim/requests") as resp:
            for entry in orjson.loads(await resp.read())["requests"]:
                if entry["path"] == path and marker in entry["body"]:
                    out.append({"engine": url, **orjson.loads(entry["body"])})
    return out


async def _aborted_on_engines(http: aiohttp.ClientSession, engines: Sequence[str]) -> float:
    total = 0.0
    for url in engines:
        async with http.get(f"{url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("sglang:num_aborted_requests_total"):
                    total += float(line.rpartition(" ")[2])
    return total


async def test_a_frozen_replicas_request_is_aborted_on_the_engines_in_bounded_time(
    logs: Path,
    router: stack.ManagedProcess,
    engines: list[stack.ManagedProcess],
    redis: stack.ManagedProcess,
    http: aiohttp.ClientSession,
) -> None:
    """A replica that stops without closing its connections (SIGSTOP: a hung process or
    a lost host; a SIGKILLed one closes them and the engines abort on the disconnect):
    its upstream request would compute to the end for nobody. The survivor's sweep
    takes the rid the frozen replica recorded in flight and aborts it on every engine
    once the replica has been silent for replica_ttl_s (1 s here) and then
    orphan_abort_after_s (2 s here), not before."""
    config = _config(logs, redis.url, router.url, state={"orphan_abort_after_s": 2.0})
    s = _start(logs, config, router.url)
    holder, survivor = s.replicas
    engine_urls = [e.url for e in engines]
    request: asyncio.Task[Any] | None = None
    frozen = False
    try:
        marker = new_marker()
        sid = f"{marker}-frozen"
        body = {"text": f"long {marker}", "sampling_params": {"max_new_tokens": 20000}}
        aborted_before = await _aborted_on_engines(http, engine_urls)

        async def long_turn() -> None:
            async with http.post(
                f"{holder.url}/generate", json=body, headers={"X-Session-ID": sid}
            ) as resp:
                await resp.read()

        request = asyncio.create_task(long_turn())

        async def forwarded() -> bool:
            return bool(await _engine_requests(http, engine_urls, "/generate", marker))

        await wait_until(forwarded, timeout_s=10, what="the long turn on an engine")
        (sent,) = await _engine_requests(http, engine_urls, "/generate", marker)
        rid = sent["rid"]
        os.kill(holder.pid, signal.SIGSTOP)
        frozen = True
        stopped_at = time.monotonic()

        async def aborted() -> bool:
            got = await _engine_requests(http, engine_urls, "/abort_request", rid)
            return {g["engine"] for g in got} == set(engine_urls)

        # replica_ttl_s to be found gone (its last beat up to a sweep of 0.25 s before
        # the stop), orphan_abort_after_s of grace, then the next sweep.
        await wait_until(aborted, timeout_s=12, what="the frozen replica's rid aborted")
        took = time.monotonic() - stopped_at
        assert 2.5 <= took < 8.0, took
        assert [g["rid"] for g in await _engine_requests(http, engine_urls, "/abort_request", rid)]
        # The engine stopped computing it: an abort, not a finish.
        assert await _aborted_on_engines(http, engine_urls) == aborted_before + 1
        m = await _metrics(http, survivor.url)
        assert m["agentic_kv_state_orphan_aborts_total"] == 1
    finally:
        if frozen:
            os.kill(holder.pid, signal.SIGCONT)
        if request is not None:
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await request
        _stop(s)
