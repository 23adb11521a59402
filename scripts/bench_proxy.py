#!/usr/bin/env python3
"""Proxy overhead benchmark: one fast upstream, reached directly and through kvproxy.

Every measurement runs in one invocation, on the same machine, against the same
upstream process, for four targets:

  direct      the load generator talks to the upstream itself (no proxy process)
  floor       through a minimal aiohttp forwarder (read body, pooled upstream call, relay):
              the cost of one extra aiohttp hop, for reference; not kvproxy
  off         through kvproxy, both features off (a transparent streaming proxy)
  lifecycle   through kvproxy, session_lifecycle on (session_id and rid spliced in)
  admission   through kvproxy, admission on (poll_interval_s 0.5; the upstream's
              /metrics always has room, so every request is admitted)

Measurements (each reported per target, with the difference to direct):

  saturation    req/s with 4 KB ``input_ids`` bodies on POST /generate (wrk when
                installed, else a Python closed-loop generator; the table says which)
  fixed load    latency p50/p99 at 1,000 req/s open loop, timed from each request's
                scheduled send time (queueing counts), plus the proxy's own
                ``kvproxy_added_latency_seconds`` quantiles over the same window
  ladder        the same open loop at 100 / 500 / 1,000 / 2,000 req/s (``--ladder``):
                p50/p99 per rate and target, and what each target adds over direct
  streams       TTFT and inter-chunk gap p50/p99 of concurrent SSE streams; a gap under
                half the upstream's gap counts as a coalesced chunk
  big body      latency of 4 KB, 200 KB and 1 MB ``input_ids`` bodies, one request at a
                time, with the difference to direct and to kvproxy with features off
  open streams  2,000 concurrent slow streams through a freshly started proxy: every
                stream complete with the right chunk count, the proxy's peak RSS

The script starts every process itself (upstream, proxies, load generators) on
127.0.0.1 and stops them by PID in ``finally``. Usage:

    python scripts/bench_proxy.py                 # full run (docs/benchmarks.md)
    python scripts/bench_proxy.py --quick         # sanity run, about 1.5 minutes
    python scripts/bench_proxy.py --targets direct,off --skip open-streams
    python scripts/bench_proxy.py --quick --skip saturation,fixed,streams,open-streams
                                                  # QPS ladder and body sizes only
    python scripts/bench_proxy.py --profile results/profile   # also py-spy each proxy

Internal modes (started by the script itself):

    python scripts/bench_proxy.py --serve-upstream --port P
    python scripts/bench_proxy.py --client '<json spec>'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
HOST = "127.0.0.1"

TARGETS = ("direct", "floor", "off", "lifecycle", "admission")
PROXY_FEATURES: dict[str, tuple[bool, bool]] = {  # name -> (lifecycle, admission)
    "off": (False, False),
    "lifecycle": (True, False),
    "admission": (False, True),
}
MEASUREMENTS = ("saturation", "fixed", "ladder", "streams", "bigbody", "open-streams")

# Requests cycle through this many session ids (sent as X-Session-ID to every target).
SESSIONS = 256
SMALL_BODY_BYTES = 4 * 1024
BIG_BODY_BYTES = 200 * 1024
# The body sizes of the big-body measurement (200 KB is the one the targets name first).
BODY_SIZES: dict[str, int] = {"4KB": SMALL_BODY_BYTES, "200KB": BIG_BODY_BYTES, "1MB": 1024 * 1024}
LADDER_RATES: tuple[float, ...] = (100.0, 500.0, 1000.0, 2000.0)

# Targets from the issue, checked at the end of a run.
TARGET_ADDED_P50_MS = 0.3
TARGET_ADDED_P99_MS = 2.0
TARGET_SATURATION_RPS = 5000.0
TARGET_OPEN_STREAMS_RSS_MB = 300.0
TARGET_BIG_BODY_ADDED_MS = 2.0
# A feature on over features off, same body, one request at a time (p50).
TARGET_BODY_OVER_OFF_MS = {"200KB": 0.5, "1MB": 2.0}


# --------------------------------------------------------------------------- bodies
def make_body(target_bytes: int, *, stream: bool = False, seed: int = 0) -> bytes:
    """An SGLang ``/generate`` body with ``input_ids``, at most ``target_bytes`` long."""
    rng = random.Random(seed)
    head = b'{"input_ids":['
    tail = (
        b'],"sampling_params":{"max_new_tokens":16,"temperature":0.0},"stream":'
        + (b"true" if stream else b"false")
        + b"}"
    )
    budget = target_bytes - len(head) - len(tail)
    parts: list[bytes] = []
    used = -1  # no comma before the first id
    while True:
        tok = str(rng.randrange(100, 32000)).encode()
        if used + len(tok) + 1 > budget:
            break
        parts.append(tok)
        used += len(tok) + 1
    return head + b",".join(parts) + tail


def session_headers(prefix: str = "bench") -> list[dict[str, str]]:
    return [
        {"Content-Type": "application/json", "X-Session-ID": f"{prefix}-{i}"}
        for i in range(SESSIONS)
    ]


# ------------------------------------------------------------------------ statistics
def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile of ``values`` (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/max in milliseconds of durations given in seconds."""
    ms = [v * 1000.0 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": quantile(ms, 0.50),
        "p90_ms": quantile(ms, 0.90),
        "p99_ms": quantile(ms, 0.99),
        "max_ms": max(ms) if ms else None,
    }


def paired_delta(
    rounds: Mapping[str, Sequence[Mapping[str, Any]]], target: str, key: str, base: str = "direct"
) -> float | None:
    """Median over rounds of ``target``'s ``key`` minus ``base``'s in the same round.

    Rounds interleave the targets, so pairing by round cancels slow drifts of the machine;
    the median keeps one disturbed round from moving the result."""
    diffs = [
        mine[key] - ref[key]
        for mine, ref in zip(rounds.get(target, ()), rounds.get(base, ()), strict=False)
        if mine.get(key) is not None and ref.get(key) is not None
    ]
    return statistics.median(diffs) if diffs else None


_BUCKET_RE = re.compile(
    r'^kvproxy_added_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\}\s+(\S+)', re.M
)


def parse_histogram(text: str) -> dict[float, float]:
    """Cumulative bucket counts of ``kvproxy_added_latency_seconds`` by upper bound."""
    out: dict[float, float] = {}
    for le, value in _BUCKET_RE.findall(text):
        bound = float("inf") if le in ("+Inf", "inf") else float(le)
        out[bound] = out.get(bound, 0.0) + float(value)
    return out


def histogram_quantile(
    before: Mapping[float, float], after: Mapping[float, float], q: float
) -> float | None:
    """Prometheus-style quantile (linear within a bucket) of the observations in between."""
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    if not cum or cum[-1] <= 0:
        return None
    rank = q * cum[-1]
    prev_bound, prev_cum = 0.0, 0.0
    for bound, c in zip(bounds, cum, strict=True):
        if c >= rank:
            if bound == float("inf"):
                return prev_bound
            width = c - prev_cum
            frac = (rank - prev_cum) / width if width > 0 else 1.0
            return prev_bound + (bound - prev_bound) * frac
        prev_bound, prev_cum = bound, c
    return prev_bound


# ------------------------------------------------------------------------- upstream
def serve_upstream(host: str, port: int) -> int:
    """A fast SGLang-shaped engine/router stand-in (aiohttp + uvloop)."""
    import orjson
    import uvloop
    from aiohttp import web

    self_url = f"http://{host}:{port}"
    generate_reply = orjson.dumps(
        {
            "text": " ok" * 16,
            "output_ids": list(range(16)),
            "meta_info": {
                "id": "bench",
                "prompt_tokens": 1000,
                "completion_tokens": 16,
                "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": 16},
                "e2e_latency": 0.0,
            },
        }
    )
    openai_reply = orjson.dumps(
        {
            "id": "bench",
            "object": "chat.completion",
            "model": "bench",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 16, "total_tokens": 1016},
        }
    )
    metrics_text = (
        b"# HELP sglang:max_total_num_tokens Maximum total number of tokens.\n"
        b"# TYPE sglang:max_total_num_tokens gauge\n"
        b'sglang:max_total_num_tokens{model_name="bench"} 1000000000.0\n'
        b"# HELP sglang:token_usage The token usage.\n"
        b"# TYPE sglang:token_usage gauge\n"
        b'sglang:token_usage{model_name="bench"} 0.1\n'
        b"# TYPE sglang:num_used_tokens gauge\n"
        b'sglang:num_used_tokens{model_name="bench"} 100000000.0\n'
        b"# TYPE sglang:num_running_reqs gauge\n"
        b'sglang:num_running_reqs{model_name="bench"} 0.0\n'
        b"# TYPE sglang:num_queue_reqs gauge\n"
        b'sglang:num_queue_reqs{model_name="bench"} 0.0\n'
    )
    server_info = orjson.dumps(
        {
            "model_path": "bench",
            "version": "0.5.23",
            "enable_session_radix_cache": True,
            "radix_eviction_policy": "priority",
            "enable_streaming_session": False,
            "enable_priority_scheduling": False,
            "disable_radix_cache": False,
        }
    )
    workers = orjson.dumps({"workers": [{"url": self_url, "is_healthy": True, "labels": {}}]})

    def wants_stream(body: bytes) -> bool:
        return b'"stream":true' in body or b'"stream": true' in body

    async def stream(request: web.Request) -> web.StreamResponse:
        chunks = int(request.headers.get("X-Bench-Chunks", "20"))
        gap = float(request.headers.get("X-Bench-Gap-Ms", "50")) / 1000.0
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for i in range(chunks):
            if i:
                await asyncio.sleep(gap)
            doc = {"text": f" t{i}", "meta_info": {"id": "bench", "completion_tokens": i + 1}}
            await resp.write(b"data: " + orjson.dumps(doc) + b"\n\n")
        await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if wants_stream(body):
            return await stream(request)
        reply = generate_reply if request.path == "/generate" else openai_reply
        return web.Response(body=reply, content_type="application/json")

    def fixed(
        payload: bytes, content_type: str = "application/json"
    ) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=payload, content_type=content_type)

        return handler

    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        app.router.add_post(path, generate)
    app.router.add_get("/metrics", fixed(metrics_text, "text/plain"))
    app.router.add_get("/health", fixed(b"{}"))
    app.router.add_get("/workers", fixed(workers))
    app.router.add_get("/server_info", fixed(server_info))
    app.router.add_get("/get_server_info", fixed(server_info))
    app.router.add_post("/close_session", fixed(b"{}"))
    app.router.add_post("/abort_request", fixed(b"{}"))
    app.router.add_route("*", "/{tail:.*}", fixed(b"{}"))
    web.run_app(
        app,
        host=host,
        port=port,
        backlog=4096,
        access_log=None,
        print=None,
        shutdown_timeout=1.0,
        loop=uvloop.new_event_loop(),
    )
    return 0


def serve_floor(host: str, port: int, upstream: str) -> int:
    """The reference forwarder: the least an aiohttp proxy does per request.

    Reads the body, sends it upstream on a pooled keep-alive session, relays the answer
    (chunk by chunk for SSE). No header hygiene, metrics, parsing or features: what
    kvproxy with its features off costs beyond this is kvproxy's own overhead."""
    import aiohttp
    import uvloop
    from aiohttp import web

    skip = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}

    async def client_ctx(app: web.Application) -> Any:
        app[http_key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        yield
        await app[http_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        http = request.app[http_key]
        async with http.request(
            request.method, upstream + request.path_qs, data=body or None, headers=headers
        ) as r:
            content_type = r.headers.get("Content-Type", "application/octet-stream")
            if content_type.startswith("text/event-stream"):
                resp = web.StreamResponse(status=r.status, headers={"Content-Type": content_type})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            data = await r.read()
            return web.Response(status=r.status, body=data, headers={"Content-Type": content_type})

    http_key = web.AppKey("http", aiohttp.ClientSession)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(client_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(
        app,
        host=host,
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=1.0,
        loop=uvloop.new_event_loop(),
    )
    return 0


# -------------------------------------------------------------------- load generators
def _client_session(timeout_s: float) -> Any:
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


async def client_fixed(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Open loop: request i is due at start + i/rate; latency counts from the due time."""
    url = spec["url"] + "/generate"
    rate = float(spec["rate"])
    warmup, duration = float(spec["warmup_s"]), float(spec["duration_s"])
    body = make_body(int(spec["body_bytes"]))
    hdrs = session_headers()
    latencies: list[float] = []
    errors: Tally[str] = Tally()
    lag_max = 0.0
    async with _client_session(float(spec.get("timeout_s", 10.0))) as http:
        start = time.perf_counter() + 0.05
        measure_from = start + warmup
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int, due: float) -> None:
            try:
                async with http.post(url, data=body, headers=hdrs[i % SESSIONS]) as r:
                    await r.read()
                    status = r.status
            except Exception as exc:
                status = -1
                if due >= measure_from:
                    errors[type(exc).__name__] += 1
            end = time.perf_counter()
            if due >= measure_from:
                if status == 200:
                    latencies.append(end - due)
                elif status != -1:
                    errors[f"http_{status}"] += 1

        total = int(rate * (warmup + duration))
        for i in range(total):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag_max = max(lag_max, -delay)
            task = asyncio.create_task(one(i, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=float(spec.get("timeout_s", 10.0)) + 5)
    sent = total - int(rate * warmup)
    return {
        "latencies_s": latencies,
        "sent": sent,
        "ok": len(latencies),
        "errors": dict(errors),
        "achieved_rps": len(latencies) / duration,
        "schedule_lag_max_ms": lag_max * 1000.0,
    }


async def client_closed(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Closed loop: ``concurrency`` workers send back to back (the fallback for wrk)."""
    url = spec["url"] + "/generate"
    warmup, duration = float(spec["warmup_s"]), float(spec["duration_s"])
    body = make_body(int(spec["body_bytes"]))
    hdrs = session_headers()
    done = 0
    errors: Tally[str] = Tally()
    latencies: list[float] = []
    async with _client_session(float(spec.get("timeout_s", 10.0))) as http:
        t0 = time.perf_counter()
        measure_from, stop_at = t0 + warmup, t0 + warmup + duration

        async def worker(w: int) -> None:
            nonlocal done
            i = w
            while True:
                sent = time.perf_counter()
                if sent >= stop_at:
                    return
                try:
                    async with http.post(url, data=body, headers=hdrs[i % SESSIONS]) as r:
                        await r.read()
                        ok = r.status == 200
                        if not ok and sent >= measure_from:
                            errors[f"http_{r.status}"] += 1
                except Exception as exc:
                    ok = False
                    if sent >= measure_from:
                        errors[type(exc).__name__] += 1
                end = time.perf_counter()
                if ok and measure_from <= sent and end <= stop_at:
                    done += 1
                    latencies.append(end - sent)
                i += int(spec["concurrency"])

        await asyncio.gather(*(worker(w) for w in range(int(spec["concurrency"]))))
    return {
        "rps": done / duration,
        "requests": done,
        "errors": dict(errors),
        "latency": summarize_ms(latencies),
    }


async def client_streams(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``n`` concurrent SSE streams (started over ``ramp_s``); per-event arrival times."""
    url = spec["url"] + "/generate"
    n, chunks, gap_ms = int(spec["streams"]), int(spec["chunks"]), float(spec["gap_ms"])
    ramp = float(spec["ramp_s"])
    body = make_body(512, stream=True)
    ttft: list[float] = []
    gaps: list[float] = []
    reads = 0
    failures: Tally[str] = Tally()
    open_now = 0
    open_peak = 0
    async with _client_session(float(spec.get("timeout_s", 120.0))) as http:

        async def one(i: int) -> None:
            nonlocal reads, open_now, open_peak
            await asyncio.sleep(ramp * i / n)
            headers = {
                "Content-Type": "application/json",
                "X-Session-ID": f"stream-{i}",
                "X-Bench-Chunks": str(chunks),
                "X-Bench-Gap-Ms": str(gap_ms),
            }
            events: list[tuple[float, bytes]] = []
            buf = b""
            t0 = time.perf_counter()
            opened = False
            try:
                async with http.post(url, data=body, headers=headers) as r:
                    open_now += 1
                    opened = True
                    open_peak = max(open_peak, open_now)
                    if r.status != 200:
                        failures[f"http_{r.status}"] += 1
                        return
                    async for data in r.content.iter_any():
                        now = time.perf_counter()
                        reads += 1
                        buf += data
                        while (idx := buf.find(b"\n\n")) >= 0:
                            events.append((now, buf[:idx]))
                            buf = buf[idx + 2 :]
            except Exception as exc:
                failures[type(exc).__name__] += 1
                return
            finally:
                if opened:
                    open_now -= 1
            if len(events) != chunks + 1 or events[-1][1] != b"data: [DONE]":
                failures["wrong_chunk_count"] += 1
                return
            ttft.append(events[0][0] - t0)
            gaps.extend(b[0] - a[0] for a, b in itertools.pairwise(events))

        await asyncio.gather(*(one(i) for i in range(n)))
    half = gap_ms / 2000.0
    return {
        "streams": n,
        "ok": len(ttft),
        "failures": dict(failures),
        "open_peak": open_peak,
        "reads": reads,
        "ttft_s": ttft,
        "gaps_s": gaps,
        "coalesced": sum(1 for g in gaps if g < half),
    }


async def client_sequential(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One request at a time (the 200 KB body): per-request latency."""
    url = spec["url"] + "/generate"
    body = make_body(int(spec["body_bytes"]))
    hdrs = session_headers("big")
    latencies: list[float] = []
    errors: Tally[str] = Tally()
    async with _client_session(float(spec.get("timeout_s", 10.0))) as http:
        for i in range(int(spec["warmup"]) + int(spec["requests"])):
            t0 = time.perf_counter()
            try:
                async with http.post(url, data=body, headers=hdrs[i % SESSIONS]) as r:
                    await r.read()
                    status = r.status
            except Exception as exc:
                errors[type(exc).__name__] += 1
                continue
            if i < int(spec["warmup"]):
                continue
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors[f"http_{status}"] += 1
    return {"latencies_s": latencies, "errors": dict(errors), "body_bytes": len(body)}


CLIENTS = {
    "fixed": client_fixed,
    "closed": client_closed,
    "streams": client_streams,
    "sequential": client_sequential,
}


def run_client(spec_json: str) -> int:
    import uvloop

    spec = json.loads(spec_json)
    raise_nofile()
    # A collector pause in the load generator would be charged to the target measured.
    gc.collect()
    gc.freeze()
    gc.disable()
    result = uvloop.run(CLIENTS[spec["kind"]](spec))
    sys.stdout.write(json.dumps(result))
    return 0


# ------------------------------------------------------------------------ processes
def raise_nofile(want: int = 65536) -> int:
    """Raise this process's open-file limit (inherited by the processes it starts)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# Loopback requests never go through an HTTP proxy named in the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def tcp_listen_drops() -> dict[str, int]:
    """The kernel's TcpExt ListenOverflows / ListenDrops counters (accept queue full)."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return {k: int(table[k]) for k in ("ListenOverflows", "ListenDrops") if k in table}
    return {}


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path
    stop_hook: Callable[[], None] | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.stop_hook is not None:
            with contextlib.suppress(Exception):
                self.stop_hook()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_ready(
    proc: Proc, path: str, timeout_s: float, want_status: str | None = None
) -> dict[str, Any] | None:
    """Poll ``proc.url + path`` until 200 (and JSON status == want_status, when given)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}"
            )
        try:
            status, body = http_get(proc.url + path, timeout=1.0)
        except OSError:
            status, body = 0, b""
        if status == 200:
            if want_status is None:
                return None
            with contextlib.suppress(ValueError):
                last = json.loads(body)
                if last.get("status") == want_status:
                    return last
        time.sleep(0.1)
    if want_status is not None and last is not None:
        return last  # up but not in the wanted state: the caller reports it
    raise RuntimeError(
        f"{proc.name} not ready on {path} after {timeout_s:.0f} s:\n{proc.log_tail()}"
    )


def start_upstream(workdir: Path, floor_of: str | None = None) -> Proc:
    """The fast upstream, or (``floor_of`` = the upstream's URL) the reference forwarder."""
    port = free_port()
    name = "floor" if floor_of else "upstream"
    log = workdir / f"{name}.log"
    mode = ["--serve-floor", "--upstream", floor_of] if floor_of else ["--serve-upstream"]
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, str(SCRIPT), *mode, "--host", HOST, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    proc = Proc(name, f"http://{HOST}:{port}", popen, log)
    try:
        wait_ready(proc, "/health", 20.0)
    except BaseException:
        proc.stop()
        raise
    return proc


def write_proxy_config(path: Path, name: str, upstream: str, port: int) -> None:
    lifecycle, admission = PROXY_FEATURES[name]
    path.write_text(
        "\n".join(
            [
                "server:",
                f"  port: {port}",
                "  log_level: WARNING",
                "  shutdown_grace_s: 1.0",
                "router:",
                f"  url: {upstream}",
                f"  engines: [{upstream}]",
                "session_lifecycle:",
                f"  enabled: {str(lifecycle).lower()}",
                "admission:",
                f"  enabled: {str(admission).lower()}",
                "  poll_interval_s: 0.5",
                "",
            ]
        )
    )


def start_proxy(name: str, upstream: str, workdir: Path, launcher: str) -> Proc:
    """Start kvproxy with feature set ``name``; through kvproxy.stack when available."""
    if name == "floor":
        return start_upstream(workdir, floor_of=upstream)
    port = free_port()
    cfg = workdir / f"kvproxy-{name}.yaml"
    write_proxy_config(cfg, name, upstream, port)
    log_dir = workdir / f"kvproxy-{name}"
    log_dir.mkdir(exist_ok=True)
    proc: Proc | None = None
    if launcher in ("auto", "stack"):
        try:
            from kvproxy.stack import start_kvproxy  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            if launcher == "stack":
                raise
        else:
            managed = start_kvproxy(
                config_path=cfg, router_url=upstream, port=port, log_dir=log_dir
            )
            proc = Proc(
                name,
                str(managed.url).rstrip("/"),
                managed.popen,
                Path(getattr(managed, "log_path", log_dir / "kvproxy.log")),
                stop_hook=managed.stop,
            )
    if proc is None:
        log = log_dir / "kvproxy.log"
        cmd = [sys.executable, "-m", "kvproxy", "serve", "--config", str(cfg), "--port", str(port)]
        cmd += ["--router-url", upstream]
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name, f"http://{HOST}:{port}", popen, log)
    try:
        wait_ready(proc, "/kvproxy/health", 30.0)
        if name == "admission":
            # Wait for the first /metrics poll so that measurements see a live ledger.
            doc = wait_ready(proc, "/kvproxy/health", 10.0, want_status="ok")
            if doc is not None and doc.get("status") != "ok":
                print(f"  note: {name} proxy health is {doc.get('status')!r}", flush=True)
    except BaseException:
        proc.stop()
        raise
    return proc


def client_cmd(spec: Mapping[str, Any]) -> list[str]:
    return [sys.executable, str(SCRIPT), "--client", json.dumps(spec)]


def run_client_proc(
    spec: Mapping[str, Any], timeout_s: float, sample: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Run a load generator in its own process; ``sample`` is called every 50 ms meanwhile."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        popen = subprocess.Popen(
            client_cmd(spec),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while popen.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"load generator {spec['kind']} ran past {timeout_s:.0f} s")
                if sample is not None:
                    sample()
                time.sleep(0.05)
        finally:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(popen.pid, signal.SIGKILL)
                popen.wait(timeout=5)
        out.seek(0)
        err.seek(0)
        if popen.returncode != 0:
            raise RuntimeError(
                f"load generator {spec['kind']} failed: {err.read().decode(errors='replace')[-2000:]}"
            )
        return json.loads(out.read())


# ---------------------------------------------------------------------- saturation
_WRK_LUA = """
local f = assert(io.open("{body}", "rb"))
local body = f:read("*a")
f:close()
local reqs = {{}}
local n = 0
init = function(args)
  for i = 1, {sessions} do
    reqs[i] = wrk.format("POST", "/generate",
      {{["Content-Type"] = "application/json", ["X-Session-ID"] = "bench-" .. (i - 1)}}, body)
  end
end
request = function()
  n = n % {sessions} + 1
  return reqs[n]
end
"""

_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _wrk_ms(text: str) -> float | None:
    m = re.match(r"([\d.]+)(us|ms|s)$", text.strip())
    return float(m.group(1)) * _UNIT[m.group(2)] if m else None


def parse_wrk(output: str) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": {}}
    if m := re.search(r"Requests/sec:\s+([\d.]+)", output):
        out["rps"] = float(m.group(1))
    if m := re.search(r"(\d+) requests in ([\d.]+)(\w+)", output):
        out["requests"] = int(m.group(1))
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output):
        out["errors"]["non_2xx"] = int(m.group(1))
    if m := re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    ):
        for key, value in zip(("connect", "read", "write", "timeout"), m.groups(), strict=True):
            if int(value):
                out["errors"][f"socket_{key}"] = int(value)
    lat: dict[str, float | None] = {}
    for pct, key in (("50", "p50_ms"), ("90", "p90_ms"), ("99", "p99_ms")):
        if m := re.search(rf"^\s+{pct}%\s+(\S+)", output, re.M):
            lat[key] = _wrk_ms(m.group(1))
    out["latency"] = lat
    return out


def run_wrk(
    url: str, lua: Path, duration_s: float, connections: int, threads: int
) -> dict[str, Any]:
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        "--latency",
        "-s",
        str(lua),
        url,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 30, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"wrk failed ({res.returncode}): {res.stderr[-2000:]}")
    parsed = parse_wrk(res.stdout)
    if "rps" not in parsed:
        raise RuntimeError(f"cannot read wrk output:\n{res.stdout}")
    return parsed


# -------------------------------------------------------------------------- runner
@dataclass
class Params:
    rounds: int = 3
    sat_warmup_s: float = 2.0
    sat_duration_s: float = 8.0
    sat_connections: int = 64
    wrk_threads: int = 1
    fixed_rate: float = 1000.0
    fixed_warmup_s: float = 2.0
    fixed_duration_s: float = 8.0
    stream_count: int = 100
    stream_chunks: int = 20
    stream_gap_ms: float = 50.0
    big_requests: int = 200
    big_warmup: int = 20
    ladder_rates: tuple[float, ...] = LADDER_RATES
    ladder_warmup_s: float = 1.0
    ladder_duration_s: float = 5.0
    open_streams: int = 2000
    open_chunks: int = 5
    open_gap_ms: float = 1000.0
    open_ramp_s: float = 1.0

    @classmethod
    def quick(cls) -> Params:
        return cls(
            rounds=1,
            sat_warmup_s=1.0,
            sat_duration_s=3.0,
            fixed_warmup_s=1.0,
            fixed_duration_s=3.0,
            stream_count=50,
            stream_chunks=10,
            big_requests=50,
            big_warmup=5,
            ladder_warmup_s=0.5,
            ladder_duration_s=1.5,
            open_streams=500,
            open_chunks=3,
            open_gap_ms=500.0,
            open_ramp_s=0.5,
        )


@dataclass
class Bench:
    args: argparse.Namespace
    params: Params
    workdir: Path
    upstream: Proc | None = None
    proxies: dict[str, Proc] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loadavg: dict[str, Any] = field(default_factory=dict)

    def say(self, line: str) -> None:
        print(line, flush=True)

    def url(self, target: str) -> str:
        if target == "direct":
            assert self.upstream is not None
            return self.upstream.url
        return self.proxies[target].url

    def targets(self) -> list[str]:
        return [t for t in self.args.targets if t == "direct" or t in self.proxies]

    def scrape(self, target: str) -> dict[float, float]:
        if target == "direct":
            return {}
        try:
            status, body = http_get(self.proxies[target].url + "/metrics", timeout=5.0)
        except OSError:
            return {}
        return parse_histogram(body.decode(errors="replace")) if status == 200 else {}

    def cpu(self) -> dict[str, float | None]:
        procs = {"upstream": self.upstream, **self.proxies}
        return {name: cpu_seconds(p.pid) for name, p in procs.items() if p is not None}

    # -------------------------------------------------------------- saturation
    def saturation(self) -> None:
        p = self.params
        use_wrk = shutil.which("wrk") is not None and not self.args.no_wrk
        generator = (
            f"wrk -t{p.wrk_threads} -c{p.sat_connections}"
            if use_wrk
            else f"python closed loop, {p.sat_connections} workers"
        )
        self.say(
            f"\n== saturation: 4 KB bodies, {generator}, {p.sat_duration_s:.0f} s x {p.rounds} round(s)"
        )
        lua = self.workdir / "generate.lua"
        body_path = self.workdir / "body-4k.json"
        body_path.write_bytes(make_body(SMALL_BODY_BYTES))
        lua.write_text(_WRK_LUA.format(body=body_path, sessions=SESSIONS))
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in self.targets()}
        for rnd in range(p.rounds):
            for target in self.targets():
                url = self.url(target)
                if use_wrk:
                    run_wrk(url, lua, p.sat_warmup_s, p.sat_connections, p.wrk_threads)
                else:
                    self._closed(url, p.sat_warmup_s, 0.5)
                before_cpu = self.cpu()
                t0 = time.monotonic()
                if use_wrk:
                    res = run_wrk(url, lua, p.sat_duration_s, p.sat_connections, p.wrk_threads)
                else:
                    res = self._closed(url, p.sat_duration_s, 1.0)
                wall = time.monotonic() - t0
                after_cpu = self.cpu()
                server = "upstream" if target == "direct" else target
                b, a = before_cpu.get(server), after_cpu.get(server)
                ub, ua = before_cpu.get("upstream"), after_cpu.get("upstream")
                requests = res.get("requests") or res["rps"] * p.sat_duration_s
                if a is not None and b is not None and requests:
                    res["cpu_us_per_req"] = (a - b) / requests * 1e6
                    res["cpu_share"] = (a - b) / wall
                if ua is not None and ub is not None:
                    res["upstream_cpu_share"] = (ua - ub) / wall
                runs[target].append(res)
                self.say(f"  {target:10s} {res['rps']:9.0f} req/s  errors={res['errors'] or 0}")
                if self.args.profile and target in PROXY_FEATURES and rnd == p.rounds - 1:
                    self._profile(target, url, lua, use_wrk)
        summary: dict[str, Any] = {
            "generator": "wrk" if use_wrk else "python-closed-loop",
            "runs": runs,
            "targets": {},
        }
        for target, rs in runs.items():
            rps = sorted(r["rps"] for r in rs)
            median_run = min(rs, key=lambda r: abs(r["rps"] - rps[len(rps) // 2]))
            summary["targets"][target] = {
                "rps_median": rps[len(rps) // 2],
                "rps_best": rps[-1],
                "rps_all": rps,
                "latency": median_run.get("latency", {}),
                "errors": sum(sum(r["errors"].values()) for r in rs),
                "cpu_us_per_req": median_run.get("cpu_us_per_req"),
                "cpu_share": median_run.get("cpu_share"),
                "upstream_cpu_share": median_run.get("upstream_cpu_share"),
            }
        self.results["saturation"] = summary

    def _closed(self, url: str, duration_s: float, warmup_s: float) -> dict[str, Any]:
        spec = {
            "kind": "closed",
            "url": url,
            "concurrency": self.params.sat_connections,
            "warmup_s": warmup_s,
            "duration_s": duration_s,
            "body_bytes": SMALL_BODY_BYTES,
        }
        return run_client_proc(spec, duration_s + warmup_s + 60)

    def _profile(self, target: str, url: str, lua: Path, use_wrk: bool) -> None:
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(pyspy).exists():
            self.notes.append("profile: py-spy not installed (pip install py-spy)")
            return
        out_dir = Path(self.args.profile)
        out_dir.mkdir(parents=True, exist_ok=True)
        raw = out_dir / f"{target}.collapsed"
        secs = max(3, int(self.params.sat_duration_s))
        spy = subprocess.Popen(
            [
                pyspy,
                "record",
                "-p",
                str(self.proxies[target].pid),
                "-d",
                str(secs),
                "-r",
                "250",
                "-f",
                "raw",
                "-o",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            if use_wrk:
                run_wrk(url, lua, secs + 1, self.params.sat_connections, self.params.wrk_threads)
            else:
                self._closed(url, secs + 1, 0.5)
            spy.wait(timeout=secs + 30)
        finally:
            if spy.poll() is None:
                os.kill(spy.pid, signal.SIGINT)
                spy.wait(timeout=10)
        if raw.exists():
            self.results.setdefault("profile", {})[target] = summarize_profile(raw)
            self.say(f"  profile of {target}: {raw}")

    # ------------------------------------------------------------- fixed load
    def fixed(self) -> None:
        p = self.params
        self.say(
            f"\n== fixed load: {p.fixed_rate:.0f} req/s open loop, 4 KB bodies, {p.fixed_duration_s:.0f} s x {p.rounds} round(s)"
        )
        self.results["fixed"] = self._open_loop(p.fixed_rate, p.fixed_warmup_s, p.fixed_duration_s)

    def ladder(self) -> None:
        """The open loop at each rate of ``ladder_rates`` (targets interleaved per rate)."""
        p = self.params
        self.say(
            f"\n== QPS ladder: {', '.join(f'{r:.0f}' for r in p.ladder_rates)} req/s open loop, "
            f"4 KB bodies, {p.ladder_duration_s:.1f} s x {p.rounds} round(s) per rate"
        )
        ladder: dict[str, Any] = {}
        for rate in p.ladder_rates:
            self.say(f"  -- {rate:.0f} req/s")
            ladder[f"{rate:.0f}"] = self._open_loop(rate, p.ladder_warmup_s, p.ladder_duration_s)
        self.results["ladder"] = ladder

    def _open_loop(self, rate: float, warmup_s: float, duration_s: float) -> dict[str, Any]:
        """Each target at ``rate`` req/s open loop for ``rounds`` rounds: pooled summary."""
        p = self.params
        pooled: dict[str, dict[str, Any]] = {
            t: {
                "latencies_s": [],
                "sent": 0,
                "ok": 0,
                "errors": Tally(),
                "hist": [],
                "lag": 0.0,
                "cpu": [],
                "rounds": [],
            }
            for t in self.targets()
        }
        for _ in range(p.rounds):
            for target in self.targets():
                spec = {
                    "kind": "fixed",
                    "url": self.url(target),
                    "rate": rate,
                    "warmup_s": warmup_s,
                    "duration_s": duration_s,
                    "body_bytes": SMALL_BODY_BYTES,
                }
                # Warm-up requests are observed by the proxy too: scrape once they are done.
                server = "upstream" if target == "direct" else target
                state: dict[str, Any] = {
                    "at": time.monotonic() + warmup_s + 0.3,
                    "done": False,
                    "before": {},
                    "cpu0": None,
                    "t0": 0.0,
                }

                def sample(
                    target: str = target, server: str = server, state: dict[str, Any] = state
                ) -> None:
                    if not state["done"] and time.monotonic() >= state["at"]:
                        state["before"] = self.scrape(target)
                        state["cpu0"] = self.cpu().get(server)
                        state["t0"] = time.monotonic()
                        state["done"] = True

                res = run_client_proc(spec, warmup_s + duration_s + 60, sample=sample)
                cpu1, t1 = self.cpu().get(server), time.monotonic()
                after = self.scrape(target)
                acc = pooled[target]
                acc["latencies_s"].extend(res["latencies_s"])
                acc["sent"] += res["sent"]
                acc["ok"] += res["ok"]
                acc["errors"].update(res["errors"])
                acc["lag"] = max(acc["lag"], res["schedule_lag_max_ms"])
                if after and state["done"]:
                    acc["hist"].append((state["before"], after))
                if state["cpu0"] is not None and cpu1 is not None and t1 > state["t0"]:
                    acc["cpu"].append((cpu1 - state["cpu0"]) / (t1 - state["t0"]))
                lat = summarize_ms(res["latencies_s"])
                acc["rounds"].append(lat)
                self.say(
                    f"  {target:10s} p50 {lat['p50_ms'] or 0:.3f} ms  p99 {lat['p99_ms'] or 0:.3f} ms  "
                    f"ok {res['ok']}/{res['sent']}  errors={res['errors'] or 0}"
                )
        summary: dict[str, Any] = {}
        per_round = {t: acc["rounds"] for t, acc in pooled.items()}
        for target, acc in pooled.items():
            entry: dict[str, Any] = {
                "latency": summarize_ms(acc["latencies_s"]),
                "rounds": acc["rounds"],
                "delta_p50_ms": paired_delta(per_round, target, "p50_ms"),
                "delta_p99_ms": paired_delta(per_round, target, "p99_ms"),
                "sent": acc["sent"],
                "ok": acc["ok"],
                "errors": dict(acc["errors"]),
                "achieved_rps": acc["ok"] / (duration_s * p.rounds),
                "schedule_lag_max_ms": acc["lag"],
                "cpu_share": sorted(acc["cpu"])[len(acc["cpu"]) // 2] if acc["cpu"] else None,
            }
            if acc["hist"]:
                before_sum: dict[float, float] = {}
                after_sum: dict[float, float] = {}
                for b, a in acc["hist"]:
                    for k, v in b.items():
                        before_sum[k] = before_sum.get(k, 0.0) + v
                    for k, v in a.items():
                        after_sum[k] = after_sum.get(k, 0.0) + v
                entry["proxy_added"] = {
                    "count": after_sum.get(float("inf"), 0.0) - before_sum.get(float("inf"), 0.0),
                    "p50_ms": _ms(histogram_quantile(before_sum, after_sum, 0.50)),
                    "p99_ms": _ms(histogram_quantile(before_sum, after_sum, 0.99)),
                }
            summary[target] = entry
        return summary

    # ----------------------------------------------------------------- streams
    def streams(self) -> None:
        p = self.params
        self.say(
            f"\n== streams: {p.stream_count} concurrent x {p.stream_chunks} chunks, {p.stream_gap_ms:.0f} ms gap, "
            f"{p.rounds} round(s)"
        )
        pooled: dict[str, dict[str, Any]] = {
            t: {
                "ttft_s": [],
                "gaps_s": [],
                "ok": 0,
                "streams": 0,
                "coalesced": 0,
                "failures": Tally(),
                "reads": 0,
                "ttft_rounds": [],
                "gap_rounds": [],
            }
            for t in self.targets()
        }
        for _ in range(p.rounds):
            for target in self.targets():
                spec = {
                    "kind": "streams",
                    "url": self.url(target),
                    "streams": p.stream_count,
                    "chunks": p.stream_chunks,
                    "gap_ms": p.stream_gap_ms,
                    "ramp_s": 0.2,
                }
                res = run_client_proc(spec, p.stream_chunks * p.stream_gap_ms / 1000 + 60)
                acc = pooled[target]
                for key in ("ttft_s", "gaps_s"):
                    acc[key].extend(res[key])
                for key in ("ok", "streams", "coalesced", "reads"):
                    acc[key] += res[key]
                acc["failures"].update(res["failures"])
                acc["ttft_rounds"].append(summarize_ms(res["ttft_s"]))
                acc["gap_rounds"].append(summarize_ms(res["gaps_s"]))
                self.say(
                    f"  {target:10s} ok {res['ok']}/{res['streams']}  coalesced {res['coalesced']}  "
                    f"failures={res['failures'] or 0}"
                )
        ttft_rounds = {t: acc["ttft_rounds"] for t, acc in pooled.items()}
        gap_rounds = {t: acc["gap_rounds"] for t, acc in pooled.items()}
        self.results["streams"] = {
            target: {
                "ok": acc["ok"],
                "streams": acc["streams"],
                "failures": dict(acc["failures"]),
                "coalesced": acc["coalesced"],
                "gaps": len(acc["gaps_s"]),
                "reads": acc["reads"],
                "ttft": summarize_ms(acc["ttft_s"]),
                "gap": summarize_ms(acc["gaps_s"]),
                "delta_ttft_p50_ms": paired_delta(ttft_rounds, target, "p50_ms"),
                "delta_ttft_p99_ms": paired_delta(ttft_rounds, target, "p99_ms"),
                "delta_gap_p50_ms": paired_delta(gap_rounds, target, "p50_ms"),
                "delta_gap_p99_ms": paired_delta(gap_rounds, target, "p99_ms"),
            }
            for target, acc in pooled.items()
        }

    # ---------------------------------------------------------------- big body
    def bigbody(self) -> None:
        p = self.params
        self.say(
            f"\n== body sizes: {', '.join(BODY_SIZES)} input_ids, one at a time, "
            f"{p.big_requests} requests x {p.rounds} round(s) each"
        )
        bodies: dict[str, Any] = {}
        for label, size in BODY_SIZES.items():
            self.say(f"  -- {label}")
            bodies[label] = self._sequential(size)
        self.results["bodies"] = bodies
        self.results["bigbody"] = bodies["200KB"]  # the measurement's earlier name

    def _sequential(self, size: int) -> dict[str, Any]:
        p = self.params
        pooled: dict[str, list[float]] = {t: [] for t in self.targets()}
        errors: dict[str, Tally[str]] = {t: Tally() for t in self.targets()}
        per_round: dict[str, list[dict[str, Any]]] = {t: [] for t in self.targets()}
        body_bytes = 0
        for _ in range(p.rounds):
            for target in self.targets():
                spec = {
                    "kind": "sequential",
                    "url": self.url(target),
                    "body_bytes": size,
                    "requests": p.big_requests,
                    "warmup": p.big_warmup,
                }
                res = run_client_proc(spec, 300)
                pooled[target].extend(res["latencies_s"])
                errors[target].update(res["errors"])
                body_bytes = res["body_bytes"]
                lat = summarize_ms(res["latencies_s"])
                per_round[target].append(lat)
                self.say(
                    f"  {target:10s} p50 {lat['p50_ms'] or 0:.3f} ms  p99 {lat['p99_ms'] or 0:.3f} ms"
                )
        big = make_body(size)
        return {
            "body_bytes": body_bytes,
            "input_ids": big.count(b",", 0, big.index(b"]")) + 1,
            "targets": {
                t: {
                    "latency": summarize_ms(v),
                    "errors": dict(errors[t]),
                    "rounds": per_round[t],
                    "delta_p50_ms": paired_delta(per_round, t, "p50_ms"),
                    "delta_p99_ms": paired_delta(per_round, t, "p99_ms"),
                    "over_off_p50_ms": paired_delta(per_round, t, "p50_ms", base="off"),
                }
                for t, v in pooled.items()
            },
        }

    # ------------------------------------------------------------ open streams
    def open_streams(self) -> None:
        p = self.params
        assert self.upstream is not None
        self.say(
            f"\n== open streams: {p.open_streams} concurrent x {p.open_chunks} chunks, "
            f"{p.open_gap_ms:.0f} ms gap, a fresh proxy for each configuration"
        )
        # The other proxies are stopped so that only the measured one runs.
        for proc in self.proxies.values():
            proc.stop()
        self.proxies.clear()
        out: dict[str, Any] = {}
        for name in self.args.targets:
            if name == "direct":
                # Baseline: the same client against the upstream (its RSS is the server's).
                out[name] = self._open_streams_on(self.upstream)
            else:
                try:
                    proxy = start_proxy(name, self.upstream.url, self.workdir, self.args.launcher)
                except Exception as exc:
                    self.notes.append(f"open-streams/{name}: proxy did not start: {exc}")
                    continue
                try:
                    time.sleep(0.5)
                    out[name] = self._open_streams_on(proxy)
                finally:
                    proxy.stop()
            r = out[name]
            self.say(
                f"  {name:10s} ok {r['ok']}/{r['streams']}  open at once {r['open_peak']}  "
                f"RSS idle {r['rss_idle_mb'] or 0:.1f} MB peak {r['rss_peak_mb']:.1f} MB  "
                f"coalesced {r['coalesced']}  listen overflows {r['listen_overflows']}"
            )
        self.results["open_streams"] = {
            "streams": p.open_streams,
            "chunks": p.open_chunks,
            "gap_ms": p.open_gap_ms,
            "ramp_s": p.open_ramp_s,
            "targets": out,
        }

    def _open_streams_on(self, server: Proc) -> dict[str, Any]:
        p = self.params
        idle = rss_mb(server.pid)
        drops0 = tcp_listen_drops()
        peak = {"rss": idle or 0.0}

        def sample() -> None:
            value = rss_mb(server.pid)
            if value is not None and value > peak["rss"]:
                peak["rss"] = value

        spec = {
            "kind": "streams",
            "url": server.url,
            "streams": p.open_streams,
            "chunks": p.open_chunks,
            "gap_ms": p.open_gap_ms,
            "ramp_s": p.open_ramp_s,
            "timeout_s": 120.0,
        }
        res = run_client_proc(spec, p.open_chunks * p.open_gap_ms / 1000 + 120, sample=sample)
        drops1 = tcp_listen_drops()
        return {
            "streams": res["streams"],
            "ok": res["ok"],
            "failures": res["failures"],
            "open_peak": res["open_peak"],
            "coalesced": res["coalesced"],
            "rss_idle_mb": idle,
            "rss_peak_mb": peak["rss"],
            "rss_after_mb": rss_mb(server.pid),
            "listen_overflows": drops1.get("ListenOverflows", 0) - drops0.get("ListenOverflows", 0),
            "ttft": summarize_ms(res["ttft_s"]),
            "gap": summarize_ms(res["gaps_s"]),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def summarize_profile(path: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    total = 0
    self_counts: Tally[str] = Tally()
    incl_counts: Tally[str] = Tally()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    if not total:
        return {"samples": 0}

    def shares(c: Tally[str]) -> list[tuple[str, float]]:
        return [(name, n / total) for name, n in c.most_common(top)]

    kvproxy_incl = [(n, v) for n, v in incl_counts.most_common() if "kvproxy/" in n][:top]
    return {
        "samples": total,
        "self": shares(self_counts),
        "inclusive_kvproxy": [(name, n / total) for name, n in kvproxy_incl],
    }


# ------------------------------------------------------------------------- report
def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _signed(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


DELTA_NOTE = "Δ = median over rounds of target minus direct in the same round"


def format_report(results: Mapping[str, Any], params: Params) -> str:
    parts: list[str] = []
    if sat := results.get("saturation"):
        t = sat["targets"]
        base = t.get("direct", {}).get("rps_median")
        rows = []
        for name, r in t.items():
            lat = r.get("latency") or {}
            rows.append(
                [
                    name,
                    f"{r['rps_median']:.0f}",
                    f"{r.get('rps_best', r['rps_median']):.0f}",
                    "-" if name == "direct" or not base else f"{r['rps_median'] / base:.2f}",
                    _f(lat.get("p50_ms")),
                    _f(lat.get("p99_ms")),
                    str(r["errors"]),
                    _f(r.get("cpu_us_per_req"), 0),
                    _f(r.get("cpu_share"), 2),
                    _f(r.get("upstream_cpu_share"), 2),
                ]
            )
        parts.append(
            f"**Saturation** ({sat['generator']}, {params.sat_connections} connections, 4 KB `input_ids` bodies, "
            f"median of {params.rounds} x {params.sat_duration_s:.0f} s)\n\n"
            + _table(
                [
                    "target",
                    "req/s (median)",
                    "req/s (best)",
                    "vs direct",
                    "p50 ms",
                    "p99 ms",
                    "errors",
                    "server CPU µs/req",
                    "server CPU (cores)",
                    "upstream CPU (cores)",
                ],
                rows,
            )
        )
    if fixed := results.get("fixed"):
        rows = []
        for name, r in fixed.items():
            lat, added = r["latency"], r.get("proxy_added") or {}
            rows.append(
                [
                    name,
                    f"{r['achieved_rps']:.0f}",
                    _f(lat["p50_ms"]),
                    _f(lat["p99_ms"]),
                    "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                    "-" if name == "direct" else _signed(r.get("delta_p99_ms")),
                    _f(added.get("p50_ms")),
                    _f(added.get("p99_ms")),
                    str(sum(r["errors"].values())),
                    _f(r.get("cpu_share"), 2),
                ]
            )
        parts.append(
            f"**Fixed load** ({params.fixed_rate:.0f} req/s open loop, 4 KB bodies, latency from the scheduled "
            f"send time; p50/p99 over {params.rounds} x {params.fixed_duration_s:.0f} s pooled, {DELTA_NOTE})\n\n"
            + _table(
                [
                    "target",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "Δp50 ms",
                    "Δp99 ms",
                    "in-proxy p50 ms",
                    "in-proxy p99 ms",
                    "errors",
                    "server CPU (cores)",
                ],
                rows,
            )
        )
    if ladder := results.get("ladder"):
        rows = []
        for rate, per_target in ladder.items():
            for name, r in per_target.items():
                lat = r["latency"]
                rows.append(
                    [
                        rate,
                        name,
                        f"{r['achieved_rps']:.0f}",
                        _f(lat["p50_ms"]),
                        _f(lat["p99_ms"]),
                        "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                        "-" if name == "direct" else _signed(r.get("delta_p99_ms")),
                        str(sum(r["errors"].values())),
                    ]
                )
        parts.append(
            f"**QPS ladder** (open loop, 4 KB bodies, latency from the scheduled send time; "
            f"{params.rounds} x {params.ladder_duration_s:.1f} s per rate, {DELTA_NOTE})\n\n"
            + _table(
                [
                    "offered req/s",
                    "target",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "Δp50 ms",
                    "Δp99 ms",
                    "errors",
                ],
                rows,
            )
        )
    if streams := results.get("streams"):
        rows = []
        for name, r in streams.items():
            rows.append(
                [
                    name,
                    f"{r['ok']}/{r['streams']}",
                    _f(r["ttft"]["p50_ms"]),
                    _f(r["ttft"]["p99_ms"]),
                    "-" if name == "direct" else _signed(r.get("delta_ttft_p50_ms")),
                    "-" if name == "direct" else _signed(r.get("delta_ttft_p99_ms")),
                    _f(r["gap"]["p50_ms"]),
                    _f(r["gap"]["p99_ms"]),
                    "-" if name == "direct" else _signed(r.get("delta_gap_p50_ms")),
                    "-" if name == "direct" else _signed(r.get("delta_gap_p99_ms")),
                    f"{r['coalesced']}/{r['gaps']}",
                ]
            )
        parts.append(
            f"**Streams** ({params.stream_count} concurrent x {params.stream_chunks} chunks + [DONE], "
            f"{params.stream_gap_ms:.0f} ms apart, {params.rounds} round(s) pooled, {DELTA_NOTE})\n\n"
            + _table(
                [
                    "target",
                    "complete",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "ΔTTFT p50",
                    "ΔTTFT p99",
                    "gap p50 ms",
                    "gap p99 ms",
                    "Δgap p50",
                    "Δgap p99",
                    f"gaps < {params.stream_gap_ms / 2:.0f} ms",
                ],
                rows,
            )
        )
    if (big := results.get("bigbody")) and not results.get("bodies"):
        t = big["targets"]
        rows = [
            [
                name,
                _f(r["latency"]["p50_ms"]),
                _f(r["latency"]["p99_ms"]),
                "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                "-" if name == "direct" else _signed(r.get("delta_p99_ms")),
                str(sum(r["errors"].values())),
            ]
            for name, r in t.items()
        ]
        parts.append(
            f"**200 KB body** ({big['body_bytes']} bytes, {big['input_ids']} `input_ids`, one request at a time, "
            f"X-Session-ID set, {params.rounds} x {params.big_requests} requests, {DELTA_NOTE})\n\n"
            + _table(["target", "p50 ms", "p99 ms", "Δp50 ms", "Δp99 ms", "errors"], rows)
        )
    if bodies := results.get("bodies"):
        rows = [
            [
                label,
                str(b["body_bytes"]),
                name,
                _f(r["latency"]["p50_ms"]),
                _f(r["latency"]["p99_ms"]),
                "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                "-" if name in ("direct", "off") else _signed(r.get("over_off_p50_ms")),
                str(sum(r["errors"].values())),
            ]
            for label, b in bodies.items()
            for name, r in b["targets"].items()
        ]
        parts.append(
            f"**Body sizes** (`input_ids` bodies, one request at a time, {params.rounds} x "
            f"{params.big_requests} requests each; Δ: paired per round, median)\n\n"
            + _table(
                [
                    "body",
                    "bytes",
                    "target",
                    "p50 ms",
                    "p99 ms",
                    "Δp50 vs direct",
                    "Δp50 vs off",
                    "errors",
                ],
                rows,
            )
        )
    if (opened := results.get("open_streams")) and opened["targets"]:
        rows = [
            [
                name,
                f"{r['ok']}/{r['streams']}",
                str(r["open_peak"]),
                _f(r["rss_idle_mb"], 1),
                _f(r["rss_peak_mb"], 1),
                _f((r["rss_peak_mb"] or 0) - (r["rss_idle_mb"] or 0), 1),
                _f(r["ttft"]["p99_ms"], 1),
                _f(r["gap"]["p50_ms"], 1),
                _f(r["gap"]["p99_ms"], 1),
                str(r["coalesced"]),
                str(r.get("listen_overflows", "-")),
            ]
            for name, r in opened["targets"].items()
        ]
        parts.append(
            f"**Open streams** ({opened['streams']} concurrent, opened over {opened.get('ramp_s', 1.0):.1f} s, "
            f"through a freshly started proxy; {opened['chunks']} chunks + [DONE] "
            f"{opened['gap_ms']:.0f} ms apart; RSS is the server's: the proxy's, or the upstream's for direct; "
            "listen overflows: the kernel's TcpExt ListenOverflows during the run)\n\n"
            + _table(
                [
                    "target",
                    "complete",
                    "open at once",
                    "RSS idle MB",
                    "RSS peak MB",
                    "RSS growth MB",
                    "TTFT p99 ms",
                    "gap p50 ms",
                    "gap p99 ms",
                    "coalesced",
                    "listen overflows",
                ],
                rows,
            )
        )
    if checks := target_checks(results, params):
        parts.append(
            "**Targets**\n\n"
            + _table(
                ["target", "requirement", "measured", "met"],
                [[c[0], c[1], c[2], "yes" if c[3] else "**no**"] for c in checks],
            )
        )
    return "\n\n".join(parts) + "\n"


def target_checks(results: Mapping[str, Any], params: Params) -> list[tuple[str, str, str, bool]]:
    """(target, requirement, measured, met) for every target of the issue that was measured.

    A measurement with failed requests never counts as met, whatever its numbers."""
    checks: list[tuple[str, str, str, bool]] = []

    def errs(n: int) -> str:
        return f", {n} failed requests" if n else ""

    fixed = results.get("fixed") or {}
    base = (fixed.get("direct") or {}).get("latency", {})
    rate = f"{params.fixed_rate:.0f} req/s"
    for name, r in fixed.items():
        if name not in PROXY_FEATURES or base.get("p50_ms") is None:
            continue
        n_err = sum(r["errors"].values())
        if r["latency"]["p50_ms"] is None:
            checks.append(
                (name, f"added p50/p99 at {rate}", f"no successful request{errs(n_err)}", False)
            )
            continue
        d50, d99 = r["delta_p50_ms"], r["delta_p99_ms"]
        checks.append(
            (
                name,
                f"added p50 <= {TARGET_ADDED_P50_MS} ms at {rate}",
                f"{d50:+.3f} ms{errs(n_err)}",
                d50 <= TARGET_ADDED_P50_MS and not n_err,
            )
        )
        checks.append(
            (
                name,
                f"added p99 <= {TARGET_ADDED_P99_MS} ms at {rate}",
                f"{d99:+.3f} ms{errs(n_err)}",
                d99 <= TARGET_ADDED_P99_MS and not n_err,
            )
        )
    sat = (results.get("saturation") or {}).get("targets", {})
    for name, r in sat.items():
        if name in PROXY_FEATURES:
            rps, n_err = r["rps_median"], r["errors"]
            best = r.get("rps_best", rps)
            checks.append(
                (
                    name,
                    f">= {TARGET_SATURATION_RPS:.0f} req/s at saturation (4 KB, median of rounds)",
                    f"{rps:.0f} req/s (best round {best:.0f}){errs(n_err)}",
                    rps >= TARGET_SATURATION_RPS and not n_err,
                )
            )
    opened = (results.get("open_streams") or {}).get("targets", {})
    for name, r in opened.items():
        if name not in PROXY_FEATURES:
            continue
        ok = (
            r["ok"] == r["streams"]
            and r["coalesced"] == 0
            and r["rss_peak_mb"] < TARGET_OPEN_STREAMS_RSS_MB
        )
        checks.append(
            (
                name,
                f"{r['streams']} open streams under {TARGET_OPEN_STREAMS_RSS_MB:.0f} MB RSS, all complete, none coalesced",
                f"{r['rss_peak_mb']:.1f} MB, {r['ok']}/{r['streams']} complete, {r['coalesced']} coalesced",
                ok,
            )
        )
    streams = results.get("streams") or {}
    for name, r in streams.items():
        if name in PROXY_FEATURES:
            ok = r["ok"] == r["streams"] and r["coalesced"] == 0
            checks.append(
                (
                    name,
                    "streams complete, no coalescing",
                    f"{r['ok']}/{r['streams']} complete, {r['coalesced']} coalesced",
                    ok,
                )
            )
    big = (results.get("bigbody") or {}).get("targets", {})
    bbase = (big.get("direct") or {}).get("latency", {})
    for name, r in big.items():
        if name not in PROXY_FEATURES or bbase.get("p50_ms") is None:
            continue
        n_err = sum(r["errors"].values())
        if r["latency"]["p50_ms"] is None:
            checks.append(
                (name, "200 KB body added latency", f"no successful request{errs(n_err)}", False)
            )
            continue
        d = r["delta_p50_ms"]
        checks.append(
            (
                name,
                f"200 KB body adds <= {TARGET_BIG_BODY_ADDED_MS} ms (p50)",
                f"{d:+.3f} ms{errs(n_err)}",
                d <= TARGET_BIG_BODY_ADDED_MS and not n_err,
            )
        )
    for label, limit in TARGET_BODY_OVER_OFF_MS.items():
        per_size = ((results.get("bodies") or {}).get(label) or {}).get("targets", {})
        for name, r in per_size.items():
            if name not in PROXY_FEATURES or name == "off" or r.get("over_off_p50_ms") is None:
                continue
            n_err = sum(r["errors"].values())
            d = r["over_off_p50_ms"]
            checks.append(
                (
                    name,
                    f"{label} body adds <= {limit} ms over features off (p50)",
                    f"{d:+.3f} ms{errs(n_err)}",
                    d <= limit and not n_err,
                )
            )
    return checks


def machine_info() -> dict[str, Any]:
    model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = None
    with contextlib.suppress(Exception):
        commit = (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
            or None
        )
    wrk_version = None
    if shutil.which("wrk"):
        with contextlib.suppress(Exception):
            res = subprocess.run(
                ["wrk", "--version"], capture_output=True, text=True, timeout=5, check=False
            )
            wrk_version = (res.stdout + res.stderr).split("\n")[0].strip()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "git_commit": commit,
        "wrk": wrk_version,
    }


# --------------------------------------------------------------------------- main
@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="kvproxy overhead benchmark: direct vs through kvproxy against one fast upstream.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="short sanity run (smaller and shorter everything)"
    )
    parser.add_argument(
        "--out", default="results/bench_proxy.json", help="JSON results (default %(default)s)"
    )
    parser.add_argument(
        "--md", default=None, help="also write the markdown tables here (default: --out with .md)"
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma list of %(default)s")
    parser.add_argument(
        "--skip", default="", help=f"comma list of measurements to skip: {', '.join(MEASUREMENTS)}"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds per measurement (default 3; --quick 1)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="fixed offered load in req/s (default 1000)"
    )
    parser.add_argument(
        "--ladder",
        default=None,
        metavar="RATES",
        help="comma list of open-loop rates for the QPS ladder (default 100,500,1000,2000)",
    )
    parser.add_argument(
        "--connections", type=int, default=None, help="saturation connections (default 64)"
    )
    parser.add_argument(
        "--no-wrk",
        action="store_true",
        help="use the Python closed-loop generator even if wrk is installed",
    )
    parser.add_argument(
        "--launcher",
        choices=("auto", "stack", "direct"),
        default="auto",
        help="start proxies with kvproxy.stack when importable (auto), always (stack), or with "
        "`python -m kvproxy serve` (direct)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also record a py-spy profile of each proxy under saturation",
    )
    parser.add_argument(
        "--workdir", default=None, help="configs and logs (default: a fresh temporary directory)"
    )
    # Internal modes.
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default=HOST, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown} (choose from {', '.join(TARGETS)})")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if bad := args.skip - set(MEASUREMENTS):
        parser.error(f"unknown measurements in --skip: {sorted(bad)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_upstream:
        return serve_upstream(args.host, args.port)
    if args.client is not None:
        return run_client(args.client)
    if args.serve_floor:
        return serve_floor(args.host, args.port, args.upstream)

    params = Params.quick() if args.quick else Params()
    if args.rounds is not None:
        params.rounds = max(1, args.rounds)
    if args.rate is not None:
        params.fixed_rate = args.rate
    if args.connections is not None:
        params.sat_connections = args.connections
    if args.ladder:
        try:
            params.ladder_rates = tuple(float(r) for r in args.ladder.split(",") if r.strip())
        except ValueError:
            print(f"bench_proxy: --ladder: not a list of numbers: {args.ladder!r}", file=sys.stderr)
            return 2
    nofile = raise_nofile()
    if nofile < params.open_streams * 2 + 256 and "open-streams" not in args.skip:
        print(
            f"warning: open-file limit is {nofile}; {params.open_streams} open streams may fail",
            file=sys.stderr,
        )
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_proxy_"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_proxy.py" + (
        " " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else ""
    )
    bench = Bench(args=args, params=params, workdir=workdir)
    started = time.time()
    bench.say(f"bench_proxy: workdir {workdir}")
    with _sigterm_as_interrupt():
        try:
            bench.upstream = start_upstream(workdir)
            bench.say(f"upstream {bench.upstream.url} (pid {bench.upstream.pid})")
            for name in (t for t in args.targets if t != "direct"):
                try:
                    proxy = start_proxy(name, bench.upstream.url, workdir, args.launcher)
                except Exception as exc:
                    bench.notes.append(f"proxy {name} did not start: {exc}")
                    bench.say(f"proxy {name} did not start: {exc}")
                    continue
                bench.proxies[name] = proxy
                bench.say(f"proxy {name} {proxy.url} (pid {proxy.pid})")
            steps: list[tuple[str, Callable[[], None]]] = [
                ("saturation", bench.saturation),
                ("fixed", bench.fixed),
                ("ladder", bench.ladder),
                ("streams", bench.streams),
                ("bigbody", bench.bigbody),
                ("open-streams", bench.open_streams),
            ]
            for key, step in steps:
                if key in args.skip:
                    continue
                load0 = os.getloadavg()
                try:
                    step()
                except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
                    bench.notes.append(f"{key}: {exc}")
                    bench.say(f"  {key} failed: {exc}")
                bench.loadavg[key] = {"before": load0, "after": os.getloadavg()}
        except KeyboardInterrupt:
            bench.notes.append("interrupted")
            bench.say("interrupted; stopping processes")
        finally:
            for proc in bench.proxies.values():
                proc.stop()
            if bench.upstream is not None:
                bench.upstream.stop()

    report = format_report(bench.results, params)
    doc = {
        "command": command,
        "machine": machine_info(),
        "params": params.__dict__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "results": bench.results,
        "loadavg": bench.loadavg,
        "checks": [
            {"target": c[0], "requirement": c[1], "measured": c[2], "met": c[3]}
            for c in target_checks(bench.results, params)
        ],
        "notes": bench.notes,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = Path(args.md) if args.md else out.with_suffix(".md")
    loads = ", ".join(
        f"{k} {v['before'][0]:.2f} -> {v['after'][0]:.2f}" for k, v in bench.loadavg.items()
    )
    md.write_text(
        f"Command: `{command}`\n\nLoad average (1 min) around each measurement: {loads}\n\n{report}"
    )
    bench.say("\n" + report)
    for note in bench.notes:
        bench.say(f"note: {note}")
    bench.say(f"results: {out}  tables: {md}  logs: {workdir}")
    return 0 if not bench.notes else 1


if __name__ == "__main__":
    sys.exit(main())
