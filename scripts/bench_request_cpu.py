#!/usr/bin/env python3
"""kvproxy's own CPU per request, measured in one process.

A load generator and kvproxy (its real app, ``kvproxy.app.create_app``) share one event
loop in this process; the fast upstream of ``bench_proxy.py`` runs in its own process.
For each target the process's CPU time over N requests is divided by N; ``direct`` (the
same client straight to the upstream) is subtracted, so what is left is what kvproxy
costs per request: its server side, its upstream client and the features' work. Unlike
``bench_proxy.py``'s throughput, this does not depend on how the host schedules several
processes, so it separates changes of a few microseconds per request.

    python scripts/bench_request_cpu.py                      # 4 KB bodies, 5 rounds
    python scripts/bench_request_cpu.py --body-kb 200 --requests 1000
    python scripts/bench_request_cpu.py --profile out.prof   # cProfile of the feature runs

Targets alternate within each round (direct, floor, naive, off, lifecycle, admission, both:
floor and naive are ``bench_proxy.py``'s reference forwarders, in this process too); the table
gives the median and the min-max over rounds. The collector runs as ``kvproxy serve`` sets
it (start-up frozen, ``server.gc_threshold``; ``--gc-threshold 0`` for Python's own), and
malloc keeps freed buffers as it does (``server.malloc_retain_bytes``;
``--malloc-retain-bytes 0`` for glibc's own).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproxy.common import TARGETS, make_body, session_headers
from benchproxy.targets import start_in_process, start_upstream

from kvproxy.config import ServerConfig
from kvproxy.serve import apply_gc_threshold, apply_malloc_retain


async def _drive(url: str, body: bytes, n: int, concurrency: int) -> None:
    headers = session_headers()
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        counter = iter(range(n))

        async def worker() -> None:
            for i in counter:
                async with http.post(url, data=body, headers=headers[i % len(headers)]) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _measure(
    target: str,
    upstream: str,
    body: bytes,
    n: int,
    concurrency: int,
    profiler: cProfile.Profile | None,
    poll_s: float,
) -> float:
    """CPU seconds of this process per request for ``target``."""
    runner: web.AppRunner | None = None
    url = f"{upstream}/generate"
    if target != "direct":
        runner, base = await start_in_process(target, upstream, poll_s)
        url = f"{base}/generate"
    try:
        await _drive(url, body, min(200, n), concurrency)  # warm-up
        if profiler is not None and target != "direct":
            profiler.enable()
        cpu = time.process_time()
        await _drive(url, body, n, concurrency)
        cpu = time.process_time() - cpu
        if profiler is not None:
            profiler.disable()
    finally:
        if runner is not None:
            await runner.cleanup()
    return cpu / n


def _row(name: str, values: Sequence[float], base: Sequence[float] | None) -> str:
    us = [v * 1e6 for v in values]
    cells = [f"{statistics.median(us):.0f} ({min(us):.0f}-{max(us):.0f})"]
    if base is None:
        cells.append("-")
    else:
        added = [(v - b) * 1e6 for v, b in zip(values, base, strict=True)]
        cells.append(f"{statistics.median(added):+.0f} ({min(added):+.0f} to {max(added):+.0f})")
    return f"| {name} | " + " | ".join(cells) + " |"


async def _main(a: argparse.Namespace) -> int:
    body = make_body(a.body_kb * 1024)
    profiler = cProfile.Profile() if a.profile else None
    # As kvproxy serve once it listens: what start-up built is frozen out of the
    # collector's way, and the young generation collects every server.gc_threshold.
    gc.collect()
    gc.freeze()
    apply_gc_threshold(a.gc_threshold)
    # And malloc keeps freed buffers as kvproxy serve has it keep them (process-wide:
    # every target alike, the client's buffers too).
    apply_malloc_retain(a.malloc_retain_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        upstream = start_upstream(Path(tmp))
        try:
            results: dict[str, list[float]] = {t: [] for t in a.targets}
            for rnd in range(a.rounds):
                for target in a.targets:
                    per = await _measure(
                        target,
                        upstream.url,
                        body,
                        a.requests,
                        a.concurrency,
                        profiler,
                        a.poll_interval,
                    )
                    results[target].append(per)
                    print(f"  round {rnd + 1} {target}: {per * 1e6:.0f} us/request", flush=True)
        finally:
            upstream.stop()
    base = results.get("direct")
    print(
        f"\n{a.requests} requests x {a.rounds} rounds, {len(body):,}-byte bodies, "
        f"{a.concurrency} concurrent, collector threshold {gc.get_threshold()[0]}; CPU of this "
        "process (client + kvproxy) per request\n"
    )
    print("| target | CPU µs/request | over direct (kvproxy's own) |")
    print("|---|---|---|")
    for target, values in results.items():
        print(_row(target, values, None if target == "direct" or base is None else base))
    if profiler is not None:
        profiler.dump_stats(a.profile)
        print(f"\nprofile: {a.profile} (python -m pstats {a.profile})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests per target and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--body-kb", type=int, default=4, help="input_ids body size (KB)")
    p.add_argument(
        "--targets",
        type=lambda s: [t for t in s.split(",") if t],
        default=list(TARGETS),
        help=f"comma list of {','.join(TARGETS)}",
    )
    p.add_argument("--profile", default=None, help="write a cProfile of the kvproxy targets")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.5,
        help="admission.poll_interval_s (as bench_proxy.py; the first poll is awaited)",
    )
    p.add_argument(
        "--gc-threshold",
        type=int,
        default=ServerConfig().gc_threshold,
        help="server.gc_threshold, as kvproxy serve applies it (0: Python's own, 700)",
    )
    p.add_argument(
        "--malloc-retain-bytes",
        type=int,
        default=ServerConfig().malloc_retain_bytes,
        help="server.malloc_retain_bytes, as kvproxy serve applies it (0: glibc's own)",
    )
    a = p.parse_args(argv)
    bad = [t for t in a.targets if t not in TARGETS]
    if (
        bad
        or a.requests < 1
        or a.rounds < 1
        or a.concurrency < 1
        or a.poll_interval <= 0
        or a.gc_threshold < 0
        or a.malloc_retain_bytes < 0
    ):
        p.error(
            f"targets from {','.join(TARGETS)}; requests, rounds, concurrency >= 1; "
            "poll interval > 0; gc threshold, malloc retain bytes >= 0"
        )
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        pass
    return asyncio.run(_main(a))


if __name__ == "__main__":
    raise SystemExit(main())
