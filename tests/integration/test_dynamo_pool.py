"""Streaming sessions on engines whose KV pool is too small for all of them pinned.

Eight concurrent subagent sessions (``action: open``, five turns each) on two simulated
streaming-mode engines of 4000 tokens: without a bound, the pinned contexts fill both
pools and the turns queue forever (docs/dynamo.md). With
``session_lifecycle.streaming_max_pool_share`` every session finishes, the sessions that
would pass the share go as ``bind`` (counted), and the engines never hold more pinned KV
than the share allows; closing frees it all.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvlab import stack
from kvproxy.dynamo import control as dynamo
from kvproxy.keys import DYNAMO

from .conftest import Proxy, StartProxy, wait_until

POOL = 4000
SHARE = 0.5


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.ManagedProcess]:
    logs = Path(tmp_path_factory.mktemp("dynamo-pool"))
    with (
        stack.sim_engines(
            2,
            max_total_tokens=POOL,
            mode="streaming",
            extra_args=("--time-scale", "0.02"),
            log_dir=logs,
        ) as engines,
        stack.start_router(
            [e.url for e in engines],
            policy="consistent_hashing",
            extra_args=("--disable-worker-overload-protection",),
            log_dir=logs,
        ) as router,
    ):
        yield router


@pytest.fixture
async def proxy(small_stack: stack.ManagedProcess, start_proxy: StartProxy) -> Proxy:
    doc = {
        "server": {"log_level": "WARNING"},
        "router": {"url": small_stack.url, "policy": "consistent_hashing"},
        "session_lifecycle": {
            "enabled": True,
            "check_engines": False,
            "streaming_max_pool_share": SHARE,
        },
    }
    p = await start_proxy(doc)
    ctl = p.app[DYNAMO]

    async def placed() -> bool:
        return ctl._owner("probe") is not None

    await wait_until(placed, timeout_s=10, what="placement known")
    return p


async def _session(
    http: aiohttp.ClientSession, url: str, i: int, peaks: dict[str, int], ctl: Any
) -> int:
    rng = random.Random(1000 + i)
    sid = f"pool-{i}"
    prompt = [rng.randrange(100, 30000) for _ in range(400)]
    for turn in range(5):
        action = "open" if turn == 0 else ("close" if turn == 4 else "bind")
        body = {
            "rid": f"pool-{i}-{turn}",
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 50, "temperature": 0},
            "nvext": {"session_control": {"session_id": sid, "action": action, "timeout": 600}},
        }
        async with http.post(f"{url}/generate", json=body) as resp:
            doc = orjson.loads(await resp.read())
            assert resp.status == 200, doc
        assert doc["meta_info"]["prompt_tokens"] == len(prompt)
        for slot in ctl.slots.items():
            held = ctl.slots.held_tokens(slot.engine)
            peaks[slot.engine] = max(peaks.get(slot.engine, 0), held)
        prompt = [*prompt, *doc["output_ids"], *(rng.randrange(100, 30000) for _ in range(200))]
    return 5


async def test_sessions_that_would_overfill_the_pool_go_as_bind_and_all_finish(
    proxy: Proxy,
) -> None:
    ctl = proxy.app[DYNAMO]
    url = proxy.url
    peaks: dict[str, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        done = await asyncio.wait_for(
            asyncio.gather(*(_session(http, url, i, peaks, ctl) for i in range(8))), 60
        )
    assert done == [5] * 8
    assert ctl.counters.total(dynamo.STREAM_FALLBACK + "pool_share") >= 1
    assert ctl.counters.total(dynamo.STREAM_EXTENDED) >= 1
    # kvproxy's view of what each engine pins stays within the share of its pool.
    assert peaks and max(peaks.values()) <= SHARE * POOL
    assert len(ctl.slots) == 0


async def test_idle_slots_are_released_when_an_ordinary_request_needs_the_room(
    proxy: Proxy,
) -> None:
    ctl = proxy.app[DYNAMO]
    url = proxy.url
    candidates = [f"room-{i}" for i in range(64)]
    engine = ctl._owner(candidates[0])
    same = [s for s in candidates if ctl._owner(s) == engine]
    assert len(same) >= 3
    first, second, big = same[:3]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        for k, sid in enumerate((first, second)):
            body = {
                "rid": f"{sid}-t0",
                "input_ids": [5000 + 1000 * k + i for i in range(900)],
                "sampling_params": {"max_new_tokens": 50, "temperature": 0},
                "nvext": {"session_control": {"session_id": sid, "action": "open"}},
            }
            async with http.post(f"{url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
        assert {s.session_id for s in ctl.slots.items()} == {first, second}
        # An ordinary session request too big for the pool's unpinned part.
        body = {
            "rid": f"{big}-t0",
            "input_ids": [20000 + i for i in range(2900)],
            "sampling_params": {"max_new_tokens": 50, "temperature": 0},
            "session_id": big,
        }
        async with http.post(f"{url}/generate", json=body) as resp:
            doc = orjson.loads(await resp.read())
            assert resp.status == 200, doc
        assert doc["meta_info"]["prompt_tokens"] == 2900
        # The least recently used idle slot was closed for it; the other one kept.
        assert {s.session_id for s in ctl.slots.items()} == {second}
        assert ctl.counters.total(dynamo.STREAM_FALLBACK + "released_for_room") == 1
        for sid in (second, big):
            async with http.post(f"{url}/close_session", json={"session_id": sid}) as resp:
                await resp.read()
