"""What the engine reports about its physics over HTTP: /server_info and /metrics."""

from __future__ import annotations

from typing import Any

import orjson

from kvlab.sim.presets import sim_config
from kvlab.sim.server import SIM_STATE, create_sim_app

LABELS = 'engine_type="unified",model_name="test/model",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


async def test_server_info_names_the_preset_scale_and_every_constant(aiohttp_client: Any) -> None:
    cfg = sim_config(
        "qwen3-8b-h100",
        16,
        time_scale=0.0,
        model_name="test/model",
        eviction_policy="priority",
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=4,
    )
    client = await aiohttp_client(create_sim_app(cfg))
    info = await (await client.get("/server_info")).json()
    assert info == await (await client.get("/get_server_info")).json()
    assert info["max_total_num_tokens"] == 22_938
    assert (info["chunked_prefill_size"], info["context_length"]) == (512, 2560)
    assert info["radix_eviction_policy"] == "priority"
    assert info["enable_priority_scheduling"] is True
    assert info["priority_scheduling_preemption_threshold"] == 4
    sim = info["kvproxy_sim"]
    assert (sim["cost_model"], sim["kind"], sim["token_scale"]) == (
        "qwen3-8b-h100",
        "calibrated",
        16,
    )
    expected = {
        "t0_prefill_s": 0.005,
        "tau_lin_s": 27.8e-6,
        "tau_att_s": 1.311e-9,
        "decode_a_s": 0.007,
        "decode_b_s": 0.02e-3,
        "decode_c_s_per_token": 0.0546e-6,
    }
    for key, value in expected.items():
        assert abs(sim[key] - value) <= 1e-12 * max(1.0, value), key
    assert (sim["retract_decode_steps"], sim["new_token_ratio_decay_steps"]) == (1, 38)
    assert sim["radix_eviction_policy"] == "priority"
    assert sim["priority_scheduling_preemption_threshold"] == 4
    assert set(sim["clock"][0]) >= {"dp_rank", "steps", "overrun_s", "lag_s", "late_steps"}


async def test_metrics_realtime_token_counters(aiohttp_client: Any) -> None:
    cfg = sim_config("legacy", time_scale=0.0, model_name="test/model", max_total_tokens=5_000)
    client = await aiohttp_client(create_sim_app(cfg))
    body = {"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 10}}
    await client.post("/generate", json=body)
    body2 = {
        "input_ids": list(range(300)) + list(range(9000, 9050)),
        "sampling_params": {"max_new_tokens": 5},
    }
    out = orjson.loads(await (await client.post("/generate", json=body2)).read())
    assert out["meta_info"]["cached_tokens"] == 300
    text = await (await client.get("/metrics")).text()
    assert "# TYPE sglang:realtime_tokens_total counter" in text
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:realtime_tokens_total")
    }

    def key(mode: str) -> str:
        return (
            'sglang:realtime_tokens_total{engine_type="unified",'
            f'mode="{mode}",model_name="test/model",moe_ep_rank="0",pp_rank="0",tp_rank="0"}}'
        )

    assert values == {key("prefill_compute"): 350, key("prefill_cache"): 300, key("decode"): 13}
    assert f'sglang:evicted_tokens_total{{cache_type="RadixCache",{LABELS}}} 0.0' in text


async def test_missing_priority_is_the_lowest_with_priority_scheduling(
    aiohttp_client: Any,
) -> None:
    cfg = sim_config(
        "legacy", time_scale=0.0, model_name="test/model", enable_priority_scheduling=True
    )
    app = create_sim_app(cfg)
    client = await aiohttp_client(app)
    body = {"input_ids": list(range(20)), "sampling_params": {"max_new_tokens": 2}}
    assert (await client.post("/generate", json=body)).status == 200
    assert (await client.post("/generate", json={**body, "priority": 3})).status == 200
    sched = app[SIM_STATE].ranks[0].sched
    node = sched.kv.match_prefix(list(range(20)), 0.0).node
    assert node.priority == 3  # the ratchet keeps the max (the first one was -2**63)
