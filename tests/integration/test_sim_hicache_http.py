"""HiCache through the simulated engine's HTTP surface (in-process, app factory): a
turn whose prefix was evicted to host memory is served with that prefix loaded back, and
kvproxy's probe reads the host tier's write policy from its /server_info."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestClient

from kvlab.sim.presets import hicache_config, sim_config
from kvlab.sim.server import create_sim_app
from kvproxy.fleet.engine_info import probe

LABELS = (
    'engine_type="unified",model_name="kvproxy/sim-model",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
)


async def generate(client: TestClient, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
    resp = await client.post("/generate", json=body)
    assert resp.status == 200
    out: dict[str, Any] = orjson.loads(await resp.read())
    return out


async def second_turn(client: TestClient) -> dict[str, Any]:
    """Session 1 (2,000 tokens), session 2 (2,500 tokens) pushes it out of a 3,000-token
    pool, then session 1's next turn."""
    one = list(range(10_000, 12_000))
    r1 = await generate(client, one)
    await generate(client, list(range(20_000, 22_500)))
    return await generate(client, [*one, *r1["output_ids"], *range(30_000, 30_050)])


async def test_a_turn_evicted_to_host_is_loaded_back_faster_than_a_recompute(
    aiohttp_client: Any,
) -> None:
    base = {"max_total_tokens": 3_000, "time_scale": 0.0}
    off = await aiohttp_client(create_sim_app(sim_config("qwen3-8b-h100", 1, **base)))
    on = await aiohttp_client(
        create_sim_app(
            sim_config("qwen3-8b-h100", 1, hicache=hicache_config("qwen3-8b-h100"), **base)
        )
    )
    recomputed = await second_turn(off)
    loaded = await second_turn(on)
    assert recomputed["meta_info"]["cached_tokens"] == 0
    # The prompt and the first output tokens but the last one (which never got KV).
    assert loaded["meta_info"]["cached_tokens"] == 2_000 + 4 - 1
    assert loaded["meta_info"]["e2e_latency"] < recomputed["meta_info"]["e2e_latency"]

    text = await (await on.get("/metrics")).text()
    assert f"sglang:load_back_tokens_total{{{LABELS}}} 2003.0" in text
    assert f"sglang:hicache_host_total_tokens{{{LABELS}}} 6000.0" in text
    host = '{cache_source="host",engine_type="unified",model_name="kvproxy/sim-model"}'
    assert f"sglang:cached_tokens_total{host} 2003.0" in text
    info = orjson.loads(await (await on.get("/server_info")).read())
    assert info["enable_hierarchical_cache"] is True
    assert (info["hicache_ratio"], info["hicache_write_policy"]) == (2.0, "write_through")
    state = orjson.loads(await (await on.get("/sim/state")).read())
    assert state["ranks"][0]["hicache"]["loaded_back_total"] == 2003
    off_text = await (await off.get("/metrics")).text()
    assert "hicache" not in off_text and "load_back" not in off_text


async def test_the_proxy_reads_the_engines_write_policy_over_http(aiohttp_server: Any) -> None:
    # kvproxy's /server_info probe against the simulated engine's HTTP surface: the host
    # tier's write policy (what the growth gate's room and the cold start depend on).
    base = {"max_total_tokens": 3_000, "time_scale": 0.0}
    policies = {}
    for policy in (None, "write_through", "write_back"):
        hicache = None if policy is None else hicache_config("qwen3-8b-h100", write_policy=policy)
        server = await aiohttp_server(
            create_sim_app(sim_config("qwen3-8b-h100", 1, hicache=hicache, **base))
        )
        async with aiohttp.ClientSession() as http:
            mode = await probe(http, str(server.make_url("")), 5.0)
        policies[policy] = mode.hicache_write_policy
    assert policies == {None: None, "write_through": "write_through", "write_back": "write_back"}
