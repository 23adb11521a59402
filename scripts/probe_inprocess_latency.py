#!/usr/bin/env python3
"""One request at a time through kvproxy's app in this process: p50 latency per target.

``bench_proxy.py``'s body-size rows measure through separate processes (``kvproxy serve``,
the load generator, the upstream). This runs the same app (``kvproxy.app.create_app``,
the same per-target configs) in the client's own event loop, against the same fast
upstream (its own process), to tell what the app costs from what the separate-process
stack adds.

    python scripts/probe_inprocess_latency.py --body-kb 200
    python scripts/probe_inprocess_latency.py --body-kb 200 --targets off,both --uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproxy.common import make_body, session_headers
from benchproxy.targets import start_in_process, start_upstream


async def _p50_ms(target: str, upstream: str, body: bytes, n: int) -> float:
    runner, base = await start_in_process(target, upstream, poll_s=1.0)
    try:
        headers = session_headers()
        url = f"{base}/generate"
        latencies: list[float] = []
        async with aiohttp.ClientSession() as http:
            for i in range(n + 20):  # the first 20: warm-up, not counted
                started = time.perf_counter()
                async with http.post(url, data=body, headers=headers[i % len(headers)]) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{target}: HTTP {r.status}")
                if i >= 20:
                    latencies.append((time.perf_counter() - started) * 1000)
        return statistics.median(latencies)
    finally:
        await runner.cleanup()


async def _main(a: argparse.Namespace) -> None:
    body = make_body(a.body_kb * 1024)
    targets = a.targets.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        upstream = start_upstream(Path(tmp))
        try:
            rows: dict[str, list[float]] = {t: [] for t in targets}
            for _ in range(a.rounds):  # targets alternate within each round
                for t in targets:
                    rows[t].append(await _p50_ms(t, upstream.url, body, a.requests))
        finally:
            upstream.stop()
    print(f"\n{a.requests} requests one at a time x {a.rounds} rounds, {len(body):,}-byte bodies")
    print("\n| target | p50 ms (median of rounds) | rounds |\n|---|---|---|")
    for t, values in rows.items():
        cells = " / ".join(f"{v:.3f}" for v in values)
        print(f"| {t} | {statistics.median(values):.3f} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="off,lifecycle,admission,both")
    p.add_argument("--body-kb", type=int, default=200)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--uvloop", action="store_true", help="run on uvloop, as kvproxy serve does")
    a = p.parse_args()
    if a.uvloop:
        import uvloop

        uvloop.run(_main(a))
    else:
        asyncio.run(_main(a))


if __name__ == "__main__":
    main()
