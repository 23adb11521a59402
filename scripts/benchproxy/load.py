"""Load generators: the Python clients (run as ``bench_proxy.py --client SPEC`` processes)
and wrk."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchproxy.common import SCRIPT, SESSIONS, make_body, session_headers, summarize_ms
from benchproxy.targets import raise_nofile


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
WRK_LUA = """
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
