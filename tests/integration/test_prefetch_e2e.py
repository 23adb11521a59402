"""Program admission's prefetch end to end: two simulated engines with SGLang's host
tier (``--enable-hierarchical-cache``), the real router (smg, consistent hashing) and
kvproxy with ``admission.prefetch`` on.

A client's hook (``POST /kvproxy/sessions/{id}/prefetch``) plans the prefetch; at its
time kvproxy sends the session's last prompt as one output token through the router,
which places it by the session's routing key on the engine its turns went to. The
hook's bad input is refused with a clear error, and nothing is sent with prefetch off.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvlab import stack
from kvlab.workload import workload_spec
from kvlab.workload.driver import run_http
from kvlab.workload.plan import session_plans
from kvproxy.keys import ADMISSION

from .conftest import Proxy, StartProxy, program_ready, recorded, wait_until

POOL = 20_000
ENGINE_ARGS = ("--time-scale", "0.02", "--record-requests", "4096", "--enable-hierarchical-cache")
_ids = itertools.count()
SENT = "agentic_kv/admission/event_prefetch_sent"


@pytest.fixture(scope="module")
def hc_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[stack.ManagedProcess]]:
    with stack.sim_engines(
        2,
        max_total_tokens=POOL,
        mode="session-radix",
        extra_args=ENGINE_ARGS,
        log_dir=tmp_path_factory.mktemp("prefetch-stack"),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def hc_router(
    hc_engines: list[stack.ManagedProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.ManagedProcess]:
    with stack.start_router(
        [e.url for e in hc_engines],
        policy="consistent_hashing",
        log_dir=Path(tmp_path_factory.mktemp("prefetch-router")),
    ) as proc:
        yield proc


async def start(
    start_proxy: StartProxy, router_url: str, time_scale: float = 1.0, **admission: Any
) -> Proxy:
    p = await start_proxy(
        {
            "server": {"log_level": "WARNING", "time_scale": time_scale},
            "router": {"url": router_url, "policy": "consistent_hashing"},
            "admission": {
                "enabled": True,
                "poll_interval_s": 0.2,
                "staleness_s": 1.0,
                "tick_s": 0.05,
                "prefetch": True,
                "prefetch_lead_s": 0.1,
                **admission,
            },
        }
    )
    await wait_until(program_ready(p), timeout_s=10, what="placement known")
    return p


async def turn(http: aiohttp.ClientSession, p: Proxy, sid: str, ids: list[int]) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with http.post(f"{p.url}/generate", json=body, headers={"X-Session-ID": sid}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def hint(
    http: aiohttp.ClientSession, p: Proxy, sid: str, body: Any = None
) -> tuple[int, dict[str, Any]]:
    data = b"" if body is None else orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    url = f"{p.url}/kvproxy/sessions/{sid}/prefetch"
    async with http.post(url, data=data, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def with_prompt(
    http: aiohttp.ClientSession, urls: list[str], prompt: list[int]
) -> list[tuple[str, dict[str, Any]]]:
    """The requests the engines recorded with exactly ``prompt`` (oldest first per engine)."""
    out = []
    for url in urls:
        for e in await recorded(http, [url], path="/generate"):
            doc = orjson.loads(e["body"])
            if doc.get("input_ids") == prompt:
                out.append((url, doc))
    return out


async def test_the_hook_plans_a_one_token_prefill_of_the_last_prompt_on_the_sessions_engine(
    hc_router: stack.ManagedProcess, hc_engines: list[stack.ManagedProcess], start_proxy
) -> None:
    urls = [e.url for e in hc_engines]
    p = await start(start_proxy, hc_router.url)
    adm = p.app[ADMISSION]

    async def host_tier_read() -> bool:
        return all(e.host_tokens > 0 for e in adm.program.ledger.engines.values())

    await wait_until(host_tier_read, what="the engines' host tiers read from /metrics")
    sid = f"pf-{next(_ids)}"
    prompt = list(range(1000, 3000))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        await turn(http, p, sid, prompt)
        status, doc = await hint(http, p, sid, {"in_s": 0.5})
        assert status == 202 and doc == {"session_id": sid, "in_s": 0.5, "planned": True}

        async def prefetched() -> bool:
            return len(await with_prompt(http, urls, prompt)) == 2

        await wait_until(prefetched, what="the prefetch reaching an engine")
        (turn_url, turn_body), (pf_url, pf_body) = await with_prompt(http, urls, prompt)
        assert pf_url == turn_url == adm.placement.owner(sid)  # placed by the router
        assert pf_body["input_ids"] == prompt
        assert pf_body["sampling_params"] == {"max_new_tokens": 1}
        assert pf_body["session_id"] == sid and "session_id" not in turn_body  # (lifecycle off)
        # (smg writes out its defaults: "stream": false)
        assert not pf_body.get("stream") and pf_body["rid"] != turn_body.get("rid")
        stats = adm.stats()
        assert stats[SENT] == 1
        assert adm.prefetcher.prompts.get(sid) is None  # sent once, then not kept
        assert stats.get("agentic_kv/admission/prefetch_failed", 0) == 0

        # Bad input: a clear error, nothing planned.
        status, doc = await hint(http, p, sid, {"in_s": -1})
        assert status == 400 and "in_s" in doc["error"]["message"]
        status, doc = await hint(http, p, sid, [1])
        assert status == 400 and doc["error"]["type"] == "invalid_request"
        status, doc = await hint(http, p, "never-seen", {"in_s": 1})
        assert status == 404 and doc["error"]["type"] == "session_not_found"
        assert sid not in adm.program.prefetch


async def test_with_prefetch_off_the_hook_is_refused_and_nothing_is_kept(
    hc_router: stack.ManagedProcess, hc_engines: list[stack.ManagedProcess], start_proxy
) -> None:
    p = await start(start_proxy, hc_router.url, prefetch=False)
    sid = f"pf-off-{next(_ids)}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        await turn(http, p, sid, list(range(5000, 5500)))
        status, doc = await hint(http, p, sid)
        assert status == 400 and "prefetch is off" in doc["error"]["message"]
    adm = p.app[ADMISSION]
    assert len(adm.prefetcher.prompts) == 0 and len(adm.program.prefetch) == 0


async def test_a_workload_with_tool_hints_plans_a_prefetch_per_long_tool_call(
    hc_router: stack.ManagedProcess, start_proxy
) -> None:
    # kvproxy on the engines' clock (time scale 0.02): a hint of s seconds is s x 0.02.
    p = await start(start_proxy, hc_router.url, time_scale=0.02, prefetch_lead_s=1.0)
    spec = workload_spec("swe", 16)
    run = await run_http(
        spec, p.url, sessions=2, concurrency=2, seed=7, time_scale=0.02, tool_hints=True
    )
    summary = run.summary()
    assert summary["sessions_failed"] == 0
    plans = [p for _, p in zip(range(2), session_plans(spec, 7), strict=False)]
    tools = [t.tool_latency_s for plan in plans for t in plan.turns[:-1]]
    assert summary["tool_hints"] == {"202": len(tools)}  # one per tool call, each taken
    long_tools = sum(1 for s in tools if s >= 2.0)  # twice the lead: planned for
    assert long_tools >= 1
    stats = p.app[ADMISSION].stats()
    assert stats["agentic_kv/admission/event_prefetch_planned"] >= long_tools
