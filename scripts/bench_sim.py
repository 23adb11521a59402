#!/usr/bin/env python3
"""Throughput of the engine simulator's bookkeeping.

Default mode drives the pure scheduler (``kvlab.sim.scheduler``) with a fake
clock through an agentic workload: ``--sessions`` concurrent conversations of
``--turns`` turns; every turn resends the shared system prompt, the whole history
(previous prompts and the engine's own output ids) and a new tool result, so the
radix tree, locking, eviction and decode bookkeeping all run as in a real rollout.
It reports simulated requests (and tokens) handled per wall-clock second on one
core; the simulator is meant to sustain >= 2,000 requests/s.

``--http`` instead runs the aiohttp app in-process (time_scale 0) and measures
end-to-end ``/generate`` requests per second through a local HTTP client; that
number is bounded by aiohttp, not by the simulator's bookkeeping.

    .venv/bin/python scripts/bench_sim.py
    .venv/bin/python scripts/bench_sim.py --cost-model qwen3-8b-h100
    .venv/bin/python scripts/bench_sim.py --http --requests 3000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.sim.config import SimConfig
from kvlab.sim.presets import PRESET_NAMES, scheduler_config
from kvlab.sim.scheduler import Scheduler, SimRequest


def bench_core(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    cfg = scheduler_config(
        args.cost_model,
        args.token_scale,
        max_total_tokens=args.max_total_tokens,
        mode=args.mode,
        eviction_policy=args.eviction_policy,
        max_running_requests=args.max_running,
    )
    s = Scheduler(cfg)
    system = [rng.randrange(150_000) for _ in range(args.system_tokens)]
    # Tool results are slices of a pre-generated pool, so generating the workload
    # costs next to nothing inside the measured loop.
    pool = [rng.randrange(150_000) for _ in range(1 << 20)]
    history: list[list[int]] = [list(system) for _ in range(args.sessions)]
    turns_left = [args.turns] * args.sessions
    owner: dict[str, int] = {}
    now = 0.0
    submitted = finished = 0
    prompt_tokens = 0

    def submit(i: int) -> None:
        nonlocal submitted, prompt_tokens
        n = rng.randint(args.tool_tokens // 2, args.tool_tokens * 3 // 2)
        start = rng.randrange(len(pool) - n)
        tool = pool[start : start + n]
        history[i] = history[i] + tool
        rid = f"s{i:05d}-t{args.turns - turns_left[i]:03d}-{submitted:08d}"
        owner[rid] = i
        r = SimRequest(
            rid=rid,
            input_ids=history[i],
            max_new_tokens=args.max_new_tokens,
            session_id=f"s{i}" if args.mode == "session-radix" else None,
        )
        s.submit(r, now)
        submitted += 1
        prompt_tokens += len(history[i])

    for i in range(args.sessions):
        submit(i)
    steps = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while s.busy:
        batch = s.schedule(now)
        done = list(s.finished_outside)
        s.finished_outside.clear()
        if batch is not None:
            now += batch.duration
            done += s.finish_batch(batch, now).finished
            steps += 1
        elif not done:
            break
        for r in done:
            finished += 1
            i = owner.pop(r.rid)
            turns_left[i] -= 1
            history[i] = r.input_ids + s.output_ids(r)
            if turns_left[i] > 0:
                submit(i)
            elif args.mode == "session-radix":
                s.close_session(f"s{i}", now)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    st = s.stats
    return {
        "requests": finished,
        "wall_s": wall,
        "requests_per_s": finished / wall,
        # CPU time of this process: the one-core figure when other jobs share the host.
        "cpu_s": cpu,
        "requests_per_cpu_s": finished / cpu,
        "steps": steps,
        "steps_per_s": steps / wall,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": st.cached_tokens_total,
        "generated_tokens": st.generation_tokens_total,
        "simulated_s": now,
        "retracted": st.num_retracted_requests_total,
        "evicted_tokens": s.kv.evicted_total,
    }


async def bench_http(args: argparse.Namespace) -> dict[str, float]:
    import aiohttp
    from aiohttp import web

    from kvlab.sim.server import create_sim_app

    app = create_sim_app(
        SimConfig(max_total_tokens=args.max_total_tokens, time_scale=0.0, mode=args.mode)
    )
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/generate"
    rng = random.Random(args.seed)
    system = [rng.randrange(150_000) for _ in range(args.system_tokens)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    ok = 0

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal ok
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {
                "input_ids": [*system, i, i + 1, i + 2],
                "sampling_params": {"max_new_tokens": args.max_new_tokens},
                "rid": f"r{i:08d}",
            }
            async with http.post(url, json=body) as resp:
                await resp.read()
                ok += resp.status == 200

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=args.concurrency)
    ) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    await runner.cleanup()
    return {"requests": ok, "wall_s": wall, "requests_per_s": ok / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=2_000)
    p.add_argument("--tool-tokens", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=400_000)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--mode", choices=("plain", "session-radix"), default="session-radix")
    p.add_argument("--eviction-policy", choices=("lru", "priority"), default="lru")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cost-model", choices=PRESET_NAMES, default="legacy")
    p.add_argument("--token-scale", type=int, default=1, help="divides the preset's chunk etc.")
    p.add_argument("--http", action="store_true", help="measure /generate over HTTP instead")
    p.add_argument("--requests", type=int, default=2_000, help="--http: number of requests")
    p.add_argument("--concurrency", type=int, default=64, help="--http: client concurrency")
    args = p.parse_args()
    res = asyncio.run(bench_http(args)) if args.http else bench_core(args)
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v:,.1f}" if isinstance(v, float) else f"{k:<{width}}  {v:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
