"""The engine's simulated clock: back-to-back steps take exactly their modelled time.

Runs the app in-process at real time scales (1.0 and 0.2) and reads what the engine
itself reports: ``meta_info.e2e_latency`` and the TTFT histogram (both simulated
seconds). Between the first token and the end, a request only waits for decode steps,
so that span must equal the cost model's sum, however late the event loop wakes up.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvlab.sim.config import SimConfig
from kvlab.sim.presets import cost_model
from kvlab.sim.server import create_sim_app

PROMPT = 2000
OUTPUT = 60


@pytest.mark.parametrize("time_scale", [1.0, 0.2])
async def test_step_times_match_the_model_at_real_time_scales(
    aiohttp_client: Any, time_scale: float
) -> None:
    cost = cost_model("qwen3-8b-h100")
    cfg = SimConfig(
        time_scale=time_scale,
        cost=cost,
        max_total_tokens=50_000,
        model_name="test/model",
    )
    client = await aiohttp_client(create_sim_app(cfg))
    body = {"input_ids": list(range(PROMPT)), "sampling_params": {"max_new_tokens": OUTPUT}}
    resp = await client.post("/generate", json=body)
    assert resp.status == 200
    out = orjson.loads(await resp.read())
    assert out["meta_info"]["completion_tokens"] == OUTPUT
    e2e = out["meta_info"]["e2e_latency"]
    text = await (await client.get("/metrics")).text()
    ttft = next(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:time_to_first_token_seconds_sum")
    )
    # The prefill yields token 1; decode step j (1..OUTPUT-1) runs over PROMPT + j tokens.
    decode_model = sum(cost.decode_s(1, PROMPT + j) for j in range(1, OUTPUT))
    assert e2e - ttft == pytest.approx(decode_model, rel=0.02)
    prefill_model = cost.prefill_s([(PROMPT, 0)])
    assert ttft >= prefill_model * 0.999
    info = await (await client.get("/server_info")).json()
    clock = info["kvproxy_sim"]["clock"][0]
    assert clock["steps"] == OUTPUT  # one prefill step and OUTPUT - 1 decode steps
    assert clock["overrun_s"] >= 0 and clock["late_steps"] <= clock["steps"]
    state = orjson.loads(await (await client.get("/sim/state")).read())
    assert state["ranks"][0]["overrun_s"] == pytest.approx(clock["overrun_s"], abs=1e-3)


async def test_virtual_time_is_the_sum_of_step_durations(aiohttp_client: Any) -> None:
    cost = cost_model("qwen3-8b-h100", 16)
    cfg = SimConfig(time_scale=0.0, cost=cost, max_total_tokens=5_000, model_name="test/model")
    client = await aiohttp_client(create_sim_app(cfg))
    body = {"input_ids": list(range(125)), "sampling_params": {"max_new_tokens": 10}}
    out = orjson.loads(await (await client.post("/generate", json=body)).read())
    model = cost.prefill_s([(125, 0)]) + sum(cost.decode_s(1, 125 + j) for j in range(1, 10))
    assert out["meta_info"]["e2e_latency"] == pytest.approx(model, rel=1e-6)
