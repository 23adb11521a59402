"""Subagent sessions with nvext ``open`` (streaming, pinned) vs ``bind`` (+ close).

Starts two simulated engines in streaming mode, smg with consistent hashing and kvproxy
(session lifecycle on) in process, runs the same concurrent subagent sessions twice
(same rids, so the same outputs) and prints prompt tokens, cached tokens and the wall
time of each run. A small lab check, not the W3 comparison.

    .venv/bin/python scripts/bench_dynamo_sessions.py --sessions 8 --turns 5 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvproxy.app import create_app
from kvproxy.config import from_mapping
from kvproxy.keys import DYNAMO


async def _session(
    http: aiohttp.ClientSession, url: str, mode: str, i: int, args: argparse.Namespace
) -> tuple[int, int]:
    rng = random.Random(args.seed * 1000 + i)
    sid = f"{mode}-{args.seed}-{i}"
    prompt = [rng.randrange(100, 30000) for _ in range(args.prompt)]
    prompt_total = cached_total = 0
    for turn in range(args.turns):
        action = "open" if mode == "open" and turn == 0 else "bind"
        if turn == args.turns - 1:
            action = "close"
        body: dict[str, Any] = {
            "rid": f"bench-{args.seed}-{i}-{turn}",
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": args.output, "temperature": 0},
            "nvext": {"session_control": {"session_id": sid, "action": action, "timeout": 600}},
        }
        async with http.post(f"{url}/generate", json=body) as resp:
            doc = orjson.loads(await resp.read())
            assert resp.status == 200, doc
        prompt_total += doc["meta_info"]["prompt_tokens"]
        cached_total += doc["meta_info"]["cached_tokens"]
        new = [rng.randrange(100, 30000) for _ in range(args.new)]
        prompt = [*prompt, *doc["output_ids"], *new]
    return prompt_total, cached_total


async def _run(router: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    doc = {
        "server": {"log_level": "WARNING"},
        "router": {"url": router, "policy": "consistent_hashing", "discovery_interval_s": 0.5},
        "session_lifecycle": {
            "enabled": True,
            "check_engines": False,
            "streaming_max_pool_share": args.pool_share,
        },
    }
    server = TestServer(create_app(from_mapping(doc)), host="127.0.0.1")
    await server.start_server()
    ctl = server.app[DYNAMO]
    url = str(server.make_url("")).rstrip("/")
    try:
        for _ in range(500):
            if ctl._owner("probe") is not None:
                break
            await asyncio.sleep(0.02)
        # Bounded: a request that gets no answer in --request-timeout s marks its
        # session stalled (pinned KV can fill a pool so that nothing more is admitted).
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(_session(http, url, mode, i, args) for i in range(args.sessions)),
                return_exceptions=True,
            )
            wall = time.monotonic() - t0
        done = [r for r in results if isinstance(r, tuple)]
        prompt = sum(p for p, _ in done)
        cached = sum(c for _, c in done)
        return {
            "mode": mode,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_fraction": round(cached / prompt, 3) if prompt else 0.0,
            "wall_s": round(wall, 2),
            "sessions_stalled": len(results) - len(done),
            "turns_extended": ctl.counters.total("agentic_kv/dynamo/streaming_turns_extended"),
            "fallback_pool_share": ctl.counters.total(
                "agentic_kv/dynamo/streaming_fallback_pool_share"
            ),
            "fallback_engine_error": ctl.counters.total(
                "agentic_kv/dynamo/streaming_fallback_engine_error"
            ),
        }
    finally:
        await server.close()


async def main_async(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-dynamo-"))
    engines: list[stack.ManagedProcess] = []
    router = None
    try:
        for _ in range(2):
            engines.append(
                stack.start_sim_engine(
                    max_total_tokens=args.pool,
                    mode="streaming",
                    extra_args=("--time-scale", str(args.time_scale)),
                    log_dir=logs,
                )
            )
        router = stack.start_router(
            [e.url for e in engines],
            policy="consistent_hashing",
            extra_args=("--disable-worker-overload-protection",),
            log_dir=logs,
        )
        for mode in ("bind", "open"):
            try:
                # Bounded: a run that does not finish in --run-timeout s is reported as
                # timed out instead of hanging.
                result = await asyncio.wait_for(_run(router.url, mode, args), args.run_timeout)
            except TimeoutError:
                result = {"mode": mode, "timed_out": True, "run_timeout_s": args.run_timeout}
            print(orjson.dumps(result).decode(), flush=True)
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=400, help="first prompt tokens")
    ap.add_argument("--new", type=int, default=200, help="new tokens per later turn")
    ap.add_argument("--output", type=int, default=50, help="max_new_tokens per turn")
    ap.add_argument("--pool", type=int, default=12_000, help="KV tokens per engine")
    ap.add_argument("--time-scale", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--pool-share", type=float, default=0.5, help="session_lifecycle.streaming_max_pool_share"
    )
    ap.add_argument("--request-timeout", type=float, default=20.0)
    ap.add_argument("--run-timeout", type=float, default=120.0, help="bound on one mode's run")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
