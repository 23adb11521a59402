"""Program admission end to end: simulated engines, the real router (smg) with
``--policy consistent_hashing --disable-worker-overload-protection``, kvproxy in front.

The ring mirror is checked against smg's own choices (with an engine unhealthy too);
then admission: a full engine holds its new sessions while another engine's pass (and
takes them once it has nothing in flight), continuing turns are never held, a paused
turn waits no longer than twice its bound,
``priority`` reaches the engines, the fail-open paths, and the ledger returns to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvlab import stack
from kvproxy.admission.program.ledger import SessionState
from kvproxy.fleet.ring import HashRing
from kvproxy.keys import ADMISSION

from .conftest import (
    Proxy,
    StartProxy,
    program_ready,
    recorded,
    reset_faults,
    set_faults,
    sim_state,
    wait_until,
)

POOL = 20_000
ENGINE_ARGS = ("--time-scale", "0.02", "--record-requests", "4096", "--enable-priority-scheduling")
DECISION = "X-KVProxy-Admission-Decision"
WAIT_MS = "X-KVProxy-Admission-Wait-Ms"
_ids = itertools.count()
# The prompt token of each session of this module (gen): a few hundred at most.
_SESSION_TOKENS: dict[str, int] = {}


@pytest.fixture(scope="module")
def ch_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[stack.ManagedProcess]]:
    with stack.sim_engines(
        3,
        max_total_tokens=POOL,
        mode="session-radix",
        eviction_policy="priority",
        extra_args=ENGINE_ARGS,
        log_dir=tmp_path_factory.mktemp("program-stack"),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def ch_router(
    ch_engines: list[stack.ManagedProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.ManagedProcess]:
    with stack.start_router(
        [e.url for e in ch_engines],
        policy="consistent_hashing",
        log_dir=Path(tmp_path_factory.mktemp("program-router")),
    ) as proc:
        yield proc


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # Longer than the suite's 30 s: an admitted request may be held up to max_wait_s (30 s).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture(autouse=True)
async def _clear_faults(ch_engines: list[stack.ManagedProcess]) -> AsyncIterator[None]:
    yield
    await reset_faults([e.url for e in ch_engines])


async def smg_workers(http: aiohttp.ClientSession, router_url: str) -> list[dict[str, Any]]:
    async with http.get(f"{router_url}/workers") as resp:
        assert resp.status == 200
        return orjson.loads(await resp.read())["workers"]


async def served_by(http: aiohttp.ClientSession, engine_urls: list[str], rid: str) -> list[str]:
    """Which engines recorded a request carrying ``rid``."""
    return [
        url for url in engine_urls if any(rid in e["body"] for e in await recorded(http, [url]))
    ]


async def recorded_bodies(
    http: aiohttp.ClientSession, engine_urls: list[str], marker: str
) -> list[tuple[str, dict[str, Any]]]:
    return [
        (url, orjson.loads(e["body"]))
        for url in engine_urls
        for e in await recorded(http, [url], path="/generate")
        if marker in e["body"]
    ]


async def test_ring_mirror_predicts_smg_including_with_an_engine_unhealthy(
    ch_router: stack.ManagedProcess, ch_engines: list[stack.ManagedProcess], http
) -> None:
    urls = [e.url for e in ch_engines]
    workers = await smg_workers(http, ch_router.url)
    registered = [w["url"] for w in workers]  # exactly as smg registered them
    ring = HashRing(registered)

    async def check(keys: list[str], available: list[str]) -> None:
        for key in keys:
            rid = f"ring-{next(_ids):08d}"
            body = {"rid": rid, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            async with http.post(
                f"{ch_router.url}/generate", json=body, headers={"X-SMG-Routing-Key": key}
            ) as resp:
                assert resp.status == 200, await resp.text()
            expected = ring.owner(key, available)
            assert expected is not None
            assert await served_by(http, urls, rid) == [expected.rstrip("/")], key

    await check([f"key-{i}" for i in range(40)], registered)
    # One engine unhealthy: smg keeps it on the ring and walks clockwise past it.
    down = urls[0]
    await set_faults(http, [down], status_503=True)

    async def unhealthy() -> bool:
        return any(
            w["url"].rstrip("/") == down and not w["is_healthy"]
            for w in await smg_workers(http, ch_router.url)
        )

    await wait_until(unhealthy, timeout_s=20, what="smg marking the engine unhealthy")
    available = [u for u in registered if u.rstrip("/") != down]
    await check([f"key-{i}" for i in range(40)], available)
    await set_faults(http, [down], reset=True)

    async def healthy() -> bool:
        return all(w["is_healthy"] for w in await smg_workers(http, ch_router.url))

    await wait_until(healthy, timeout_s=20, what="smg marking the engine healthy again")


@pytest.fixture
async def proxy(ch_router: stack.ManagedProcess, start_proxy: StartProxy) -> Any:
    async def factory(policy: str = "consistent_hashing", **admission: Any) -> Proxy:
        doc = {
            "server": {"log_level": "WARNING"},
            "router": {"url": ch_router.url, "policy": policy, "discovery_interval_s": 0.5},
            "session_lifecycle": {"enabled": True},
            "admission": {
                "enabled": True,
                "headroom": 1.0,
                "poll_interval_s": 0.2,
                "staleness_s": 0.6,
                "tick_s": 0.05,
                "default_completion_tokens": 8,
                "session_buffer_tokens": 0,
                "new_session_max_wait_s": 30.0,
                "max_wait_s": 30.0,
                # The gate's mechanics, engaged from the start (its floor: one turn in
                # flight); when it engages is the lab's and the unit tables'
                # (tests/unit/test_admission_engagement.py).
                "engage_on_thrash": False,
                **admission,
            },
        }
        p = await start_proxy(doc)
        await wait_until(
            program_ready(p) if policy == "consistent_hashing" else _noop,
            timeout_s=10,
            what="placement known",
        )
        return p

    return factory


async def _noop() -> bool:
    return True


def keys_on(p: Proxy, engine: str, n: int, prefix: str) -> list[str]:
    owner = p.app[ADMISSION].placement.owner
    out = [k for k in (f"{prefix}-{next(_ids)}" for _ in range(2000)) if owner(k) == engine]
    assert len(out) >= n
    return out[:n]


async def gen(
    http: aiohttp.ClientSession, p: Proxy, sid: str, tokens: int, *, new_tokens: int = 4
) -> aiohttp.ClientResponse:
    # One token value per session, never another's: sessions share no prefix. (The sum of
    # the id's bytes used before collided between ids of one shape; a session whose first
    # prompt matched an earlier test's cached KV gave its engine a shared-prefix credit,
    # and the pause test's pool never filled: its flake.)
    token = _SESSION_TOKENS.setdefault(sid, 10 + len(_SESSION_TOKENS))
    body = {"input_ids": [token] * tokens, "sampling_params": {"max_new_tokens": new_tokens}}
    async with http.post(f"{p.url}/generate", json=body, headers={"X-Session-ID": sid}) as resp:
        await resp.read()
        return resp


async def close(http: aiohttp.ClientSession, p: Proxy, sid: str) -> None:
    async with http.post(f"{p.url}/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200, await resp.text()


# How long an engine holds a streamed turn open past its [DONE] (a turn in flight).
HOLD_S = 6.0


@contextlib.asynccontextmanager
async def turn_in_flight(
    http: aiohttp.ClientSession, p: Proxy, engine: str, sid: str
) -> AsyncIterator[None]:
    """A streamed continuing turn of ``sid`` (small) kept in flight on ``engine`` while
    the block runs: its engine holds the stream open ``HOLD_S`` past [DONE]. An engine
    with nothing in flight takes its next held turn whatever the gate says (the
    work-conserving floor), so a test of holding keeps a turn in flight."""
    await set_faults(http, [engine], hold_after_done_s=HOLD_S)
    token = _SESSION_TOKENS.setdefault(sid, 10 + len(_SESSION_TOKENS))
    body = {"input_ids": [token] * 120, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    load = p.app[ADMISSION].program.ledger.engine(engine).load

    async def stream() -> None:
        async with http.post(f"{p.url}/generate", json=body, headers={"X-Session-ID": sid}) as resp:
            assert resp.status == 200 and resp.headers[DECISION] == "continuing_forwarded"
            await resp.read()

    task = asyncio.create_task(stream())
    try:

        async def running() -> bool:
            return load.inflight >= 1

        await wait_until(running, what=f"{sid}'s turn in flight on {engine}")
        yield
        assert not task.done(), f"{sid}'s turn ended before the block did: raise HOLD_S"
        await asyncio.wait_for(task, HOLD_S + 10)
    finally:
        task.cancel()
        await set_faults(http, [engine], reset=True)


async def fill(
    http: aiohttp.ClientSession, p: Proxy, engine: str, prefix: str
) -> tuple[str, str, str]:
    """Three sessions on ``engine``: the first (``blocker``: 100 tokens, for
    :func:`turn_in_flight`) and the second (~16k of 20k, target 0.92) through, the third
    not yet; returns (blocker, full, next)."""
    blocker, first, second = keys_on(p, engine, 3, prefix)
    r = await gen(http, p, blocker, 100)
    assert r.status == 200 and r.headers[DECISION] == "new_admitted"
    # The growth gate reserves the blocker's expected peak (before any growth is seen,
    # the engine's context length): held, and taken at once by the floor.
    r = await gen(http, p, first, 16_000)
    assert r.status == 200 and r.headers[DECISION] == "idle_engine"
    return blocker, first, second


async def hold(
    p: Proxy, http: aiohttp.ClientSession, sid: str, tokens: int
) -> asyncio.Task[aiohttp.ClientResponse]:
    """``sid``'s first turn, once admission holds it (the task)."""
    waiting = asyncio.create_task(gen(http, p, sid, tokens))

    async def held() -> bool:
        return p.app[ADMISSION].health().waiting_new == 1

    await wait_until(held, what=f"{sid} waiting")
    return waiting


async def test_a_full_engine_holds_its_new_sessions_while_the_others_pass(
    proxy, ch_engines, http
) -> None:
    p = await proxy()
    a_url, b_url = ch_engines[0].url, ch_engines[1].url
    blocker, a1, a2 = await fill(http, p, a_url, "full-a")
    (b1,) = keys_on(p, b_url, 1, "full-b")
    async with turn_in_flight(http, p, a_url, blocker):
        waiting = await hold(p, http, a2, 4_000)  # 16.2k + 4k > 0.92 x 20k: held
        r = await gen(http, p, b1, 4_000)  # another engine's new session passes
        assert r.headers[DECISION] == "new_admitted" and float(r.headers[WAIT_MS]) == 0.0
        for tokens in (16_010, 16_020):  # continuing turns of the full engine: never held
            r = await gen(http, p, a1, tokens)
            assert r.status == 200, r.headers
            assert r.headers[DECISION] == "continuing_forwarded"
            assert float(r.headers[WAIT_MS]) == 0.0
        assert not waiting.done()
        await close(http, p, a1)  # frees A
        r = await asyncio.wait_for(waiting, 10)
        assert r.status == 200 and r.headers[DECISION] == "new_waited"
        assert float(r.headers[WAIT_MS]) > 0
    for sid in (blocker, a2, b1):
        await close(http, p, sid)
    # Every request went to its session's ring owner, with the routing key set.
    bodies = await recorded_bodies(http, [e.url for e in ch_engines], "full-")
    assert bodies
    owner = p.app[ADMISSION].placement.owner
    for url, body in bodies:
        assert owner(body["session_id"]) == url


async def test_an_engine_with_nothing_in_flight_takes_its_held_turn(
    proxy, ch_engines, http
) -> None:
    """The work-conserving floor: held for room while a turn runs, a first turn goes
    once its engine has nothing in flight (``idle_engine``), the room notwithstanding.
    Idle sessions count fully here (a long lease), so the room stays short once the
    blocker's turn is done and only the floor can take the held turn."""
    p = await proxy(idle_lease_s=600.0)
    a_url = ch_engines[0].url
    blocker, a1, a2 = await fill(http, p, a_url, "idle-a")
    async with turn_in_flight(http, p, a_url, blocker):
        waiting = await hold(p, http, a2, 4_000)
    r = await asyncio.wait_for(waiting, 10)
    assert r.status == 200 and r.headers[DECISION] == "idle_engine"
    assert float(r.headers[WAIT_MS]) > 0
    for sid in (blocker, a1, a2):
        await close(http, p, sid)


async def test_a_session_closed_while_its_first_turn_waits_is_refused_and_never_forwarded(
    proxy, ch_engines, http
) -> None:
    """A held first turn is withdrawn by its session's close: 409 ``session_closed``,
    its admission ticket cancelled, nothing of it reaches an engine."""
    p = await proxy()
    a_url = ch_engines[0].url
    blocker, a1, a2 = await fill(http, p, a_url, "closed-held")
    async with turn_in_flight(http, p, a_url, blocker):
        waiting = await hold(p, http, a2, 4_000)
        await close(http, p, a2)
        r = await asyncio.wait_for(waiting, 10)
        assert r.status == 409, r.headers
        assert p.app[ADMISSION].health().waiting_new == 0
    for sid in (blocker, a1):
        await close(http, p, sid)
    assert not [b for _, b in await recorded_bodies(http, [a_url], a2) if "input_ids" in b]


async def test_priority_reaches_the_engines_and_grows_with_the_context(
    proxy, ch_engines, http
) -> None:
    p = await proxy(priority_steering=True)
    assert p.app[ADMISSION].priority_steering
    (sid,) = keys_on(p, ch_engines[2].url, 1, "prio")
    for tokens in (1_000, 9_000, 17_000):
        assert (await gen(http, p, sid, tokens)).status == 200
    await close(http, p, sid)
    bodies = [b for _, b in await recorded_bodies(http, [ch_engines[2].url], sid)]
    assert [b["priority"] for b in bodies] == [0, 1, 2]
    off = await proxy(priority_steering=False)
    (sid2,) = keys_on(off, ch_engines[2].url, 1, "noprio")
    await gen(http, off, sid2, 9_000)
    await close(http, off, sid2)
    assert all(
        "priority" not in b for _, b in await recorded_bodies(http, [ch_engines[2].url], sid2)
    )


async def test_a_paused_sessions_turn_waits_no_longer_than_its_bound(
    proxy, ch_engines, http
) -> None:
    # The growth gate off: before any growth is seen it reserves the engine's context
    # length per session, which would hold big's first turn; this test is the pause's,
    # with the fixed hold (paused_max_wait_s = paused_soft_wait_s).
    p = await proxy(
        idle_lease_s=0.2,
        idle_half_life_s=600.0,
        paused_soft_wait_s=0.5,
        paused_max_wait_s=0.5,
        growth_reservation=False,
    )
    a_url = ch_engines[1].url
    prefix = f"pause{next(_ids)}"
    blocker, small, big = keys_on(p, a_url, 3, prefix)
    assert (await gen(http, p, blocker, 100)).headers[DECISION] == "new_admitted"
    # small 3k, big 12k then 14.25k (growth 2.25k: footprint ~16.5k). U ~19.5k passes
    # 0.95 x 20k, and pausing either brings it under 0.85 x 20k: big, the largest, if it
    # has been idle its lease (0.2 s) by the tick that sees the pressure, else small.
    # Either one's next turn (big 16k, small 3.1k) then does not fit beside the other
    # under the 0.92 target: it waits for its bound.
    assert (await gen(http, p, small, 3_000)).headers[DECISION] == "new_admitted"
    assert (await gen(http, p, big, 12_000)).headers[DECISION] == "new_admitted"
    r = await gen(http, p, big, 14_250)
    assert r.headers[DECISION] == "continuing_forwarded"

    async def paused() -> bool:
        return p.app[ADMISSION].health().to_json()["sessions"]["paused"] == 1

    try:
        await wait_until(paused, what="an idle session paused")
    except AssertionError:
        # Say what the engine and the proxy saw (a CI run once timed out here; the pause
        # needs both sessions on one engine, as the ring mirror predicts).
        engines = [e.url for e in ch_engines]
        placed = sorted(
            (b["session_id"], url) for url, b in await recorded_bodies(http, engines, prefix + "-")
        )
        health = p.app[ADMISSION].health().to_json()
        raise AssertionError(
            f"not paused; requests served by {placed}; admission {health}"
        ) from None
    sessions = p.app[ADMISSION].program.ledger.sessions
    (held,) = (sid for sid in (small, big) if sessions[sid].state is SessionState.PAUSED)
    async with turn_in_flight(http, p, a_url, blocker):  # (with none, the floor takes it)
        r = await gen(http, p, held, 16_000 if held == big else 3_100)
    assert r.status == 200
    assert r.headers[DECISION] == "paused_aged"
    # Bound 0.5 s, timer-driven; the engine answered nothing meanwhile (the blocker's
    # answer came first), so the hold ages at twice its bound.
    assert 900 <= float(r.headers[WAIT_MS]) <= 1_500
    for sid in (blocker, small, big):
        await close(http, p, sid)


async def test_a_streamed_first_turn_hung_up_on_after_its_done_still_reports_its_usage(
    proxy, ch_engines, http
) -> None:
    # A streaming client hangs up as soon as it has read [DONE], while the stream is
    # still open upstream (held here; a router may, for a moment). The answer is
    # complete: admission must learn its context, or the session's next turn finds
    # that context cached and it is taken for the engine's shared prefix.
    p = await proxy()
    url = ch_engines[0].url
    (sid,) = keys_on(p, url, 1, "hangup")
    hold_s = 2.0
    await set_faults(http, [e.url for e in ch_engines], hold_after_done_s=hold_s)
    token = _SESSION_TOKENS.setdefault(sid, 10 + len(_SESSION_TOKENS))
    body = {"input_ids": [token] * 500, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with http.post(f"{p.url}/generate", json=body, headers={"X-Session-ID": sid}) as resp:
        assert resp.status == 200 and resp.headers[DECISION] == "new_admitted"
        lines = [line async for line in _until_done(resp)]
        assert lines[-1] == b"data: [DONE]\n"
        resp.close()  # the connection, at once
    sessions = p.app[ADMISSION].program.ledger.sessions

    async def observed() -> bool:
        s = sessions.get(sid)
        return s is not None and s.turns == 1

    # Past the hold: an answer not lost but only late would be observed by then.
    await wait_until(observed, timeout_s=hold_s + 3, what="the first turn's usage observed")
    assert sessions[sid].ctx == 504
    # Read to its end, the hold included: reported once, not again at the end.
    body = {**body, "input_ids": [token] * 600}
    async with http.post(f"{p.url}/generate", json=body, headers={"X-Session-ID": sid}) as resp:
        assert resp.status == 200 and resp.headers[DECISION] == "continuing_forwarded"
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert sessions[sid].turns == 2 and sessions[sid].ctx == 604
    # It found the first turn's 500 tokens cached: the session's own context, no
    # shared prefix.
    (row,) = (e for e in p.app[ADMISSION].health().to_json()["program_engines"] if e["url"] == url)
    assert row["shared_prefix"] == 0
    # Gone before [DONE]: aborted on the engine and not reported, as before.
    body = {**body, "input_ids": [token] * 700, "sampling_params": {"max_new_tokens": 2000}}
    async with http.post(f"{p.url}/generate", json=body, headers={"X-Session-ID": sid}) as resp:
        assert resp.status == 200

        async def aborted() -> bool:
            state = await sim_state(http, url)
            return not any(r.get("running") or r.get("queued") for r in state["ranks"])

        assert (await resp.content.readline()).startswith(b"data: ")
        assert not await aborted()
        resp.close()

    await wait_until(aborted, timeout_s=5, what="the engine dropping the aborted turn")
    assert sessions[sid].turns == 2
    await set_faults(http, [e.url for e in ch_engines], reset=True)
    await close(http, p, sid)


async def _until_done(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The stream's lines up to its [DONE] (bounded: a few tokens' events)."""
    for _ in range(1000):
        line = await resp.content.readline()
        if line.strip():
            yield line
        if not line or line == b"data: [DONE]\n":
            return
    raise AssertionError("no [DONE] in 1000 lines")


async def test_fail_open_paths(proxy, ch_engines, http) -> None:
    # Unknown router policy: fleet-wide accounting, said in health; requests pass.
    fleet = await proxy(policy="round_robin")
    async with http.get(f"{fleet.url}/kvproxy/health") as resp:
        health = orjson.loads(await resp.read())
    assert "round_robin" in health["admission"]["fallback"]
    r = await gen(http, fleet, "fallback-1", 100)
    assert r.status == 200 and r.headers[DECISION] == "capacity_available"
    await close(http, fleet, "fallback-1")

    p = await proxy()
    url = ch_engines[0].url
    # Larger than the engine's whole capacity: forwarded at once.
    (big,) = keys_on(p, url, 1, "oversized")
    r = await gen(http, p, big, POOL + 10)
    assert r.headers[DECISION] == "bypass_oversized" and float(r.headers[WAIT_MS]) == 0.0
    await close(http, p, big)
    # Its /metrics failing: the engine goes stale, the last reading stands (a capacity does
    # not change while the engine runs) and the turn is decided on it, at once here.
    await set_faults(http, [url], metrics="error")

    async def stale() -> bool:
        return not any(
            e["fresh"]
            for e in p.app[ADMISSION].health().to_json()["program_engines"]
            if e["url"] == url
        )

    await wait_until(stale, what="the engine's reading going stale")
    (sid,) = keys_on(p, url, 1, "stale")
    r = await gen(http, p, sid, 100)
    assert r.status == 200 and r.headers[DECISION] == "new_admitted"
    await close(http, p, sid)
    # An engine whose capacity was never read (its /metrics failing since kvproxy
    # started): forwarded at once.
    fresh_proxy = await proxy()
    (sid,) = keys_on(fresh_proxy, url, 1, "nometrics")
    r = await gen(http, fresh_proxy, sid, 100)
    assert r.status == 200 and r.headers[DECISION] == "bypass_no_metrics"
    await close(http, fresh_proxy, sid)
    # No session id: nothing to attribute, forwarded at once.
    body = {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 1}}
    async with http.post(f"{p.url}/generate", json=body) as resp:
        assert resp.status == 200 and resp.headers[DECISION] == "bypass_no_session"


async def test_ledger_returns_to_zero_after_a_burst_with_disconnects_errors_and_closes(
    proxy, ch_engines, http
) -> None:
    p = await proxy()
    sids = [f"burst-{next(_ids)}" for _ in range(12)]

    async def session(i: int, sid: str) -> None:
        for t in range(3):
            if i % 4 == 1 and t == 1:  # a client that gives up mid-turn
                body = {"input_ids": [3] * 3000, "sampling_params": {"max_new_tokens": 400}}
                timeout = aiohttp.ClientTimeout(total=0.05)
                with pytest.raises(TimeoutError):
                    async with http.post(
                        f"{p.url}/generate",
                        json=body,
                        headers={"X-Session-ID": sid},
                        timeout=timeout,
                    ) as resp:
                        await resp.read()
                continue
            if i % 4 == 2 and t == 2:  # an engine-side error (bad request)
                bad = {"input_ids": "nope", "sampling_params": {"max_new_tokens": 1}}
                async with http.post(
                    f"{p.url}/generate", json=bad, headers={"X-Session-ID": sid}
                ) as resp:
                    assert resp.status >= 400
                continue
            await gen(http, p, sid, 2_000 * (t + 1))
        await close(http, p, sid)

    await asyncio.gather(*(session(i, s) for i, s in enumerate(sids)))

    async def drained() -> bool:
        h = p.app[ADMISSION].health().to_json()
        s = h["sessions"]
        return (
            h["waiting"] == 0
            and s["running"] == 0
            and s["active"] == 0
            and s["paused"] == 0
            and s["new"] == 0
        )

    await wait_until(drained, timeout_s=15, what="the session ledger back to zero")
    rows = p.app[ADMISSION].health().to_json()["program_engines"]
    assert all(r["footprint"] == 0 and r["committed"] == 0 for r in rows)


async def test_the_growth_gate_reads_the_engines_context_length_through_the_real_stack(
    proxy, ch_engines, http
) -> None:
    # Before any growth is seen a session is expected to grow to its engine's
    # context_length (from the engine's /server_info over HTTP: 40,960 here, past the
    # 20k pool): a second new session on the engine waits until the first closes.
    p = await proxy()
    a1, a2 = keys_on(p, ch_engines[2].url, 2, "growth")
    assert (await gen(http, p, a1, 100)).headers[DECISION] == "new_admitted"
    second = asyncio.create_task(gen(http, p, a2, 100))

    async def held() -> bool:
        return p.app[ADMISSION].health().to_json()["held"] is not None

    await wait_until(held, what="the second new session held")
    assert not second.done()
    await close(http, p, a1)
    r = await asyncio.wait_for(second, 10.0)
    assert r.status == 200 and r.headers[DECISION] == "new_waited"
    await close(http, p, a2)
