"""The lab against the real stack on one small scenario.

Two simulated engines over HTTP (``qwen3-8b-h100`` at token scale 16, a pool small
enough that most continuing turns miss: at the knee the result swings with placement
and timing, above it it is stable), the real router (``smg --policy
consistent_hashing``), kvproxy in front (both features off) and the workload's HTTP
driver; then the same scenario in the lab, with the same engine URLs (placement hashes
them). Cache hit rate and recomputed prefill tokens agree within 15%, sessions/min
within 30% (measured: 0-25%; see docs/lab.md).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvlab.lab.runner import LabConfig, run_lab
from kvlab.rollout import sim_overrun_s
from kvlab.workload.driver import HttpTransport, scrape_engine
from kvlab.workload.model import WorkloadResult
from kvlab.workload.report import summarize
from kvlab.workload.runner import run_workload
from kvlab.workload.spec import workload_spec
from kvproxy.app import create_app
from kvproxy.config import from_mapping

TIME_SCALE = 0.35  # wall seconds per simulated second (engines and tool pauses alike)
POOL = 800  # KV tokens per engine (scaled): the live sessions' KV does not fit
K = 16
ENGINES = 2
PER_ENGINE = 8
SESSIONS = 48
SEED = 0
WORKLOAD = {
    "turns_median": 5,
    "turns_lo": 3,
    "turns_hi": 8,
    "tool_latency_slow_share": 0.0,
    "context_length": 12_288,
}


@pytest.fixture
def real_stack(tmp_path: Path) -> Iterator[tuple[list[str], str]]:
    started: list[stack.ManagedProcess] = []
    try:
        for _ in range(ENGINES):
            started.append(
                stack.start_sim_engine(
                    max_total_tokens=POOL,
                    mode="session-radix",
                    eviction_policy="priority",
                    cost_model="qwen3-8b-h100",
                    token_scale=K,
                    # The deployment contract's engine flags, as the lab's engines run.
                    extra_args=("--time-scale", str(TIME_SCALE), "--enable-priority-scheduling"),
                    log_dir=tmp_path,
                )
            )
        urls = [e.url for e in started]
        router = stack.start_router(urls, policy="consistent_hashing", log_dir=tmp_path)
        started.append(router)
        yield urls, router.url
    finally:
        for proc in reversed(started):
            proc.stop()


class LoopLag:
    """Wall seconds this process's event loop ran late (the host descheduled it): every
    tool pause and request of the driver and the in-process kvproxy waits that long too."""

    TICK_S = 0.01

    def __init__(self) -> None:
        self.lag_s = 0.0
        self.running = True

    async def run(self, limit_s: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + limit_s
        while self.running and loop.time() < end:  # bounded by limit_s
            t = loop.time()
            await asyncio.sleep(self.TICK_S)
            self.lag_s += max(0.0, loop.time() - t - self.TICK_S - 0.002)


def steady_per_min(result: WorkloadResult, time_scale: float) -> float:
    """Sessions per simulated minute by Little's law: live sessions / mean session time.

    ``sessions_per_min`` divides by the makespan, which in a run this small is the
    slowest slot's last session: a tail statistic that moves by 10-20% with the order in
    which sessions happen to finish. The mean session time is the same throughput
    without the tail."""
    durations = [s.duration_s for s in result.main_sessions if s.ok and s.duration_s]
    mean_s = statistics.fmean(durations) / time_scale
    return result.concurrency / mean_s * 60.0


async def test_the_lab_agrees_with_the_real_stack(real_stack: tuple[list[str], str]) -> None:
    urls, router_url = real_stack
    cfg = from_mapping(
        {
            "router": {"url": router_url, "engines": urls},
            "server": {"log_level": "WARNING"},
            "session_lifecycle": {"enabled": False},
            "admission": {"enabled": False},
        }
    )
    server = TestServer(create_app(cfg), host="127.0.0.1")
    await server.start_server()
    lag = LoopLag()
    monitor = asyncio.create_task(lag.run(limit_s=300.0))
    try:
        spec = workload_spec("swe", K, **WORKLOAD)
        async with aiohttp.ClientSession() as http:
            transport = HttpTransport(str(server.make_url("")).rstrip("/"), http)
            result = await run_workload(
                spec,
                transport,
                sessions=SESSIONS,
                concurrency=ENGINES * PER_ENGINE,
                seed=SEED,
                time_scale=TIME_SCALE,
            )
    finally:
        lag.running = False
        await monitor
        await server.close()
        # Wall seconds the engines ran behind their cost model (a loaded host).
        overrun = [sim_overrun_s(url) or 0.0 for url in urls]
        async with aiohttp.ClientSession() as http:
            served = [(await scrape_engine(http, url)).get("num_requests_total") for url in urls]
    real = summarize(result)
    assert real["sessions_failed"] == 0, real["errors"]
    real_per_min = real["sessions_per_min"] * TIME_SCALE  # per simulated minute
    real_steady = steady_per_min(result, TIME_SCALE)

    lab_cfg = LabConfig(
        workload="swe",
        engines=ENGINES,
        sessions_per_engine=PER_ENGINE,
        sessions=SESSIONS,
        token_scale=K,
        seed=SEED,
        policy="off",
        workload_overrides=WORKLOAD,
        engine_overrides={"max_total_tokens": POOL},
        engine_urls=tuple(urls),
    )
    # The lab runs its own (virtual-time) loop: not inside this test's running loop.
    lab_res = await asyncio.to_thread(run_lab, lab_cfg)
    lab = lab_res.summary
    lab_steady = steady_per_min(lab_res.workload, 1.0)
    assert lab["sessions"] == real["sessions"] == SESSIONS
    assert lab["recomputed_prefill_tokens"] > 0  # the scenario does thrash
    report = (
        f"real: {real_per_min:.2f}/min hit {real['cache_hit_rate']} recomputed "
        f"{real['recomputed_prefill_tokens']}; lab: {lab['sessions_per_min']:.2f}/min hit "
        f"{lab['cache_hit_rate']} recomputed {lab['recomputed_prefill_tokens']}; host stalls: "
        f"driver loop {lag.lag_s:.3f} s, engine overrun {overrun} s of a "
        f"{real['makespan_s']} s run; steady: real {real_steady:.2f}/min lab {lab_steady:.2f}/min; "
        f"requests per engine: real {served} lab {[e['requests'] for e in lab_res.engines]}"
    )
    # Tokens agree within 15%. Throughput within 30%, not the 15% aimed for: on a loaded
    # 2-core host the real stack ran 0-25% slower than the lab between runs (see
    # docs/lab.md, "Agreement with the real stack").
    assert lab_steady == pytest.approx(real_steady, rel=0.30), report
    assert lab["sessions_per_min"] == pytest.approx(real_per_min, rel=0.30), report
    assert lab["cache_hit_rate"] == pytest.approx(real["cache_hit_rate"], rel=0.15), report
    assert lab["recomputed_prefill_tokens"] == pytest.approx(
        real["recomputed_prefill_tokens"], rel=0.15
    ), report
