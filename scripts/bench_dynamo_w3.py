"""W3 (subagents) end to end with Dynamo's session control: open vs bind, +/- prefill.

Each configuration x seed on a freshly started stack: two simulated engines, the real
router (smg ``--policy consistent_hashing``) and kvproxy in process (session lifecycle
on), driven by the workload driver with ``nvext`` on the subagent sessions
(``--session-control-scope subagents``). Configurations:

- ``none``: engines in ``session-radix`` mode, no nvext (the driver's own close only);
- ``bind``: engines in ``session-radix`` mode, subagents ``bind`` ... ``close``;
- ``bind+prefill``: the same with ``agent_hints.speculative_prefill`` (not streamed);
- ``open``: engines in ``streaming`` mode, subagents ``open`` ... ``close``.

Prints one JSON line per run (sessions/min, subagent recompute, peak streaming held
tokens, kvproxy's Dynamo counters) and a median / min-max table per configuration.

    .venv/bin/python scripts/bench_dynamo_w3.py --seeds 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvlab.provenance import git_revision
from kvlab.workload.driver import run_http
from kvlab.workload.spec import workload_spec
from kvproxy.app import create_app
from kvproxy.config import from_mapping
from kvproxy.fleet.engine_metrics import parse_engine_metrics
from kvproxy.keys import DYNAMO

CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"mode": "session-radix", "control": "none", "prefill": False},
    "bind": {"mode": "session-radix", "control": "bind", "prefill": False},
    "bind+prefill": {"mode": "session-radix", "control": "bind", "prefill": True},
    "open": {"mode": "streaming", "control": "open", "prefill": False},
}


async def _sample_held(
    engines: list[str], peaks: dict[str, float], stop: asyncio.Event, every_s: float
) -> None:
    """Peak streaming-held tokens and KV usage over the engines, until ``stop``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        for _ in range(100_000):  # bounded; the run's own timeout ends it first
            held = 0
            for url in engines:
                try:
                    async with http.get(f"{url}/metrics") as resp:
                        m = parse_engine_metrics(await resp.text())
                except (aiohttp.ClientError, TimeoutError):
                    continue
                held += m.streaming_session_held_tokens or 0
                if m.token_usage is not None:
                    peaks["token_usage"] = max(peaks.get("token_usage", 0.0), m.token_usage)
            peaks["held_tokens"] = max(peaks.get("held_tokens", 0.0), float(held))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                return
            except TimeoutError:
                pass


async def one_run(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = CONFIGS[name]
    logs = Path(tempfile.mkdtemp(prefix="bench-w3-"))
    engines: list[stack.ManagedProcess] = []
    router = None
    server = None
    try:
        for _ in range(2):
            engines.append(
                stack.start_sim_engine(
                    max_total_tokens=args.pool,
                    mode=cfg["mode"],
                    extra_args=("--time-scale", str(args.time_scale)),
                    log_dir=logs,
                    token_scale=args.token_scale,
                )
            )
        router = stack.start_router(
            [e.url for e in engines],
            policy="consistent_hashing",
            extra_args=("--disable-worker-overload-protection",),
            log_dir=logs,
        )
        doc = {
            "server": {"log_level": "WARNING", "time_scale": args.time_scale},
            "router": {"url": router.url, "policy": "consistent_hashing"},
            "session_lifecycle": {"enabled": True, "check_engines": False},
        }
        server = TestServer(create_app(from_mapping(doc)), host="127.0.0.1")
        await server.start_server()
        ctl = server.app[DYNAMO]
        for _ in range(500):
            if ctl._owner("probe") is not None:
                break
            await asyncio.sleep(0.02)
        spec = workload_spec("subagents", args.token_scale)
        peaks: dict[str, float] = {}
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(_sample_held([e.url for e in engines], peaks, stop, 0.1))
        try:
            run = await run_http(
                spec,
                str(server.make_url("")).rstrip("/"),
                sessions=args.sessions,
                concurrency=args.concurrency,
                seed=seed,
                time_scale=args.time_scale,
                engine_urls=[e.url for e in engines],
                read_stats=False,
                request_timeout_s=args.request_timeout,
                run_timeout_s=args.run_timeout,
                session_control=cfg["control"],
                speculative_prefill=cfg["prefill"],
                session_timeout_s=600,
                session_control_scope="subagents",
            )
        finally:
            stop.set()
            await sampler
        s = run.summary()
        subs = [t for t in run.result.turns if t.role == "subagent" and t.ok]
        counters = ctl.counters
        return {
            "config": name,
            "seed": seed,
            "sessions_completed": s["sessions_completed"],
            "sessions_failed": s["sessions_failed"],
            "subagent_sessions": s["subagent_sessions"],
            "sessions_per_min": s["sessions_per_min"],
            "recomputed_prefill_tokens": s["recomputed_prefill_tokens"],
            "subagent_recomputed_tokens": sum(t.recomputed_tokens for t in subs),
            "subagent_cached_tokens": sum(t.cached_tokens or 0 for t in subs),
            "cache_hit_rate": s["cache_hit_rate"],
            "ttft_p99_s": s["ttft_p99_s"],
            "peak_streaming_held_tokens": peaks.get("held_tokens", 0.0),
            "peak_token_usage": round(peaks.get("token_usage", 0.0), 3),
            "streaming_opened": counters.total("agentic_kv/dynamo/streaming_opened"),
            "streaming_extended": counters.total("agentic_kv/dynamo/streaming_turns_extended"),
            "fallback_pool_share": counters.total(
                "agentic_kv/dynamo/streaming_fallback_pool_share"
            ),
            "released_for_room": counters.total(
                "agentic_kv/dynamo/streaming_fallback_released_for_room"
            ),
            "prefill_sent": counters.total("agentic_kv/dynamo/speculative_prefill_sent"),
            "errors": s["errors"],
            "failed_turns": [
                [t.role, t.turn, t.prompt_tokens, t.error] for t in run.result.turns if not t.ok
            ][:5],
        }
    finally:
        if server is not None:
            await server.close()
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


KEYS = (
    "sessions_per_min",
    "recomputed_prefill_tokens",
    "subagent_recomputed_tokens",
    "peak_streaming_held_tokens",
    "peak_token_usage",
    "ttft_p99_s",
    "sessions_failed",
)


def table(rows: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(r["config"] for r in rows))
    out = ["| metric (median [min, max]) | " + " | ".join(names) + " |"]
    out.append("|---|" + "---:|" * len(names))
    for key in KEYS:
        cells = []
        for n in names:
            vals = [float(r[key]) for r in rows if r["config"] == n and r.get(key) is not None]
            if not vals:
                cells.append("-")
                continue
            cells.append(f"{statistics.median(vals):,.3g} [{min(vals):,.3g}, {max(vals):,.3g}]")
        out.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for seed in [int(x) for x in args.seeds.split(",")]:
        for name in args.configs.split(","):
            row = await one_run(name, seed, args)
            rows.append(row)
            print(orjson.dumps(row).decode(), flush=True)
    print(table(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sessions", type=int, default=6, help="lead sessions per run")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--token-scale", type=int, default=16)
    ap.add_argument("--pool", type=int, default=6000, help="KV tokens per engine (scaled)")
    ap.add_argument("--time-scale", type=float, default=0.01)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--run-timeout", type=float, default=240.0)
    args = ap.parse_args()
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r} (one of {', '.join(CONFIGS)})")
    print(f"commit {git_revision()}", flush=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
