#!/usr/bin/env python3
"""Big bodies one request at a time, interleaved across kvproxy processes: each proxy's
p50, its CPU time and its minor page faults per request.

``bench_proxy.py``'s body-size rows run each target's requests in a block, one target
after another; on a small, busy host what the host does meanwhile moves a block by as
much as the features cost. Here request i goes to every target in turn before request
i + 1, so drift falls on all of them alike, and each target's latency is compared with
the first target's *for the same i* (the median of those paired differences). Each proxy
is a ``kvproxy serve`` process (as ``bench_proxy.py`` starts it) in front of the same
fast upstream; a target can set ``server`` keys of its own, for an A/B of a setting:

    python scripts/bench_bodies_interleaved.py --body-kb 1024 \\
        --targets off+malloc_retain_bytes=0,off,lifecycle+malloc_retain_bytes=0,lifecycle

CPU time and minor faults are read from ``/proc/PID/stat`` (Linux) before and after, the
resident set size once the requests are done.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchproxy.common import PROXY_FEATURES, make_body, session_headers
from benchproxy.targets import (
    Proc,
    cpu_seconds,
    minor_faults,
    rss_mb,
    start_proxy,
    start_upstream,
)


@dataclass
class Target:
    label: str  # as given: NAME[+KEY=VALUE...]
    name: str  # feature set
    server_keys: dict[str, Any]
    url: str = ""
    proc: Proc | None = None
    latencies: list[float] = field(default_factory=list)


def parse_target(spec: str) -> Target:
    """``off`` or ``off+malloc_retain_bytes=0+gc_threshold=0`` (server keys, YAML values)."""
    name, *pairs = spec.split("+")
    if name not in PROXY_FEATURES:
        raise ValueError(f"{spec!r}: the feature set must be one of {', '.join(PROXY_FEATURES)}")
    keys: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{spec!r}: {pair!r} is not KEY=VALUE")
        keys[key] = yaml.safe_load(value)
    return Target(spec, name, keys)


def proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, minor faults) of ``pid`` so far."""
    return cpu_seconds(pid) or 0.0, minor_faults(pid) or 0


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, hdrs: Any) -> float:
    t0 = time.perf_counter()
    async with http.post(url + "/generate", data=body, headers=hdrs) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t0


async def run(targets: list[Target], body: bytes, requests: int, warmup: int) -> list[str]:
    hdrs = session_headers("big")
    with tempfile.TemporaryDirectory() as tmp:
        upstream = start_upstream(Path(tmp))
        direct = Target("direct", "direct", {}, url=upstream.url)
        try:
            for n, t in enumerate(targets):
                workdir = Path(tmp) / f"target-{n}"
                workdir.mkdir()
                t.proc = start_proxy(t.name, upstream.url, workdir, "auto", t.server_keys, "p")
                t.url = t.proc.url
            everyone = [direct, *targets]
            async with aiohttp.ClientSession() as http:
                for i in range(warmup):
                    for t in everyone:
                        await _post(http, t.url, body, hdrs[i % len(hdrs)])
                before = {t.label: proc_stat(t.proc.pid) for t in targets if t.proc}
                for i in range(requests):
                    for t in everyone:
                        t.latencies.append(await _post(http, t.url, body, hdrs[i % len(hdrs)]))
                after = {t.label: proc_stat(t.proc.pid) for t in targets if t.proc}
                rss = {t.label: rss_mb(t.proc.pid) for t in targets if t.proc}
        finally:
            for t in targets:
                if t.proc is not None:
                    t.proc.stop()
            upstream.stop()
    base = targets[0]
    rows = [
        f"| target | p50 ms | Δp50 vs {base.label} (paired, median) | CPU µs/request | "
        "minor faults/request | RSS MB after |",
        "|---|---|---|---|---|---|",
    ]
    for t in everyone:
        paired = [(a - b) * 1000 for a, b in zip(t.latencies, base.latencies, strict=True)]
        delta = "-" if t is base else f"{statistics.median(paired):+.3f}"
        if t.label in before:
            cpu = (after[t.label][0] - before[t.label][0]) * 1e6 / requests
            faults = (after[t.label][1] - before[t.label][1]) / requests
            cells = f"{cpu:.0f} | {faults:.1f} | {rss[t.label] or 0:.0f}"
        else:
            cells = "- | - | -"
        rows.append(
            f"| {t.label} | {statistics.median(t.latencies) * 1000:.3f} | {delta} | {cells} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--body-kb", type=int, default=1024, help="input_ids body size (KB)")
    p.add_argument("--requests", type=int, default=150, help="requests per target")
    p.add_argument("--warmup", type=int, default=30, help="requests per target not counted")
    p.add_argument(
        "--targets",
        default="off+malloc_retain_bytes=0,off",
        help="comma list of NAME[+KEY=VALUE...]; the first is the paired baseline",
    )
    a = p.parse_args(argv)
    try:
        targets = [parse_target(s) for s in a.targets.split(",") if s]
    except ValueError as exc:
        p.error(str(exc))
    if not targets or a.requests < 1 or a.warmup < 0 or a.body_kb < 1:
        p.error("at least one target; requests >= 1, warmup >= 0, body-kb >= 1")
    body = make_body(a.body_kb * 1024)
    rows = asyncio.run(run(targets, body, a.requests, a.warmup))
    print(
        f"\n{a.requests} requests per target, one at a time, interleaved ({a.warmup} warm-up), "
        f"{len(body):,}-byte bodies\n"
    )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
