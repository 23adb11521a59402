"""The processes measured: the fast upstream, the reference forwarder, kvproxy (and their
lifecycle: start, readiness, CPU and RSS readings, stop by PID)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchproxy.common import (
    HOST,
    PROXY_FEATURES,
    REDIS_TARGETS,
    REFERENCES,
    REPO,
    RING_TARGETS,
    SCRIPT,
    WORKERS,
    feature_set,
    features_of,
)


def upstream_replies(self_url: str) -> dict[str, bytes]:
    """What the fast upstream answers (either server: :func:`serve_upstream`,
    :func:`start_nginx_upstream`): ``generate`` (POST /generate), ``openai`` (the
    OpenAI-style routes), ``metrics`` (an engine with room: every request admitted),
    ``server_info`` and ``workers`` (one healthy worker, ``self_url``)."""
    import orjson

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
    return {
        "generate": generate_reply,
        "openai": openai_reply,
        "metrics": metrics_text,
        "server_info": server_info,
        "workers": workers,
    }


def serve_upstream(host: str, port: int) -> int:
    """A fast SGLang-shaped engine/router stand-in (aiohttp + uvloop). It keeps freed
    buffers for reuse as ``kvproxy serve`` does (:mod:`kvproxy.heap`): with glibc's own
    thresholds it page-faulted 70-100 times per 200 KB-1 MB body, which moved every
    target's big-body rows alike. The reference forwarders are left as they are."""
    import orjson
    import uvloop
    from aiohttp import web

    from kvproxy import heap
    from kvproxy.config import ServerConfig

    heap.apply(ServerConfig().malloc_retain_bytes)

    replies = upstream_replies(f"http://{host}:{port}")
    generate_reply, openai_reply = replies["generate"], replies["openai"]
    metrics_text, server_info, workers = (
        replies["metrics"],
        replies["server_info"],
        replies["workers"],
    )

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


def _reference_app(upstream: str, *, splice: bool) -> Any:
    """A reference forwarder on aiohttp (not kvproxy): read the body, send it upstream on
    a pooled keep-alive session, relay the answer (chunk by chunk for SSE). ``splice``:
    a JSON-object body is parsed (``request.json()``), given the ``X-Session-ID``
    header's value as its top-level ``session_id`` and sent re-encoded (``json=``)."""
    import aiohttp
    from aiohttp import web

    skip = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}
    http_key = web.AppKey("http", aiohttp.ClientSession)

    async def client_ctx(app: web.Application) -> Any:
        app[http_key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        yield
        await app[http_key].close()

    async def outgoing(request: web.Request, headers: dict[str, str]) -> dict[str, Any]:
        sid = request.headers.get("X-Session-ID")
        if splice and request.method == "POST" and sid is not None:
            try:
                doc = await request.json()
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                doc["session_id"] = sid
                headers.pop("Content-Type", None)  # json= sets its own
                return {"json": doc}
        return {"data": await request.read() or None}

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        sent = await outgoing(request, headers)
        http = request.app[http_key]
        async with http.request(
            request.method, upstream + request.path_qs, headers=headers, **sent
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

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(client_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def floor_app(upstream: str) -> Any:
    """The reference forwarder: the least an aiohttp proxy does per request. No header
    hygiene, metrics, parsing or features: what kvproxy with its features off costs
    beyond this is kvproxy's own overhead."""
    return _reference_app(upstream, splice=False)


def naive_app(upstream: str) -> Any:
    """The naive splicing proxy: what one writes first to tag requests with a session
    (the floor, plus a parse and a re-encode of every JSON body; aiohttp's defaults
    throughout): the comparison the hot path's saturation target names. The floor is
    the stricter one."""
    return _reference_app(upstream, splice=True)


def serve_reference(host: str, port: int, upstream: str, kind: str) -> int:
    """Serve :func:`floor_app` (``kind`` floor) or :func:`naive_app` (naive) until stopped."""
    import uvloop
    from aiohttp import web

    web.run_app(
        (naive_app if kind == "naive" else floor_app)(upstream),
        host=host,
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=1.0,
        loop=uvloop.new_event_loop(),
    )
    return 0


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


def child_pids(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's), in PID order; [] when it is gone."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return sorted(found)


def process_tree(pid: int, max_depth: int = 4) -> list[int]:
    """``pid`` and its descendants (``kvproxy serve --workers N``: the parent, then its
    workers), at most ``max_depth`` levels down."""
    tree, level = [pid], [pid]
    for _ in range(max_depth):
        level = [c for p in level for c in child_pids(p)]
        if not level:
            break
        tree.extend(level)
    return tree


def host_cpu_seconds() -> dict[str, float] | None:
    """CPU seconds of the whole host so far, all cores (/proc/stat): ``busy`` (all but
    idle and iowait), and of it ``irq`` (hard and soft interrupts: loopback TCP's
    receive path runs there, charged to no process)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest times are inside user/nice)
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return {"busy": busy / _CLK_TCK, "irq": (ticks[5] + ticks[6]) / _CLK_TCK}


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Give the scheduler autogroup of ``pid`` (its session's) the niceness ``nice``;
    False where the kernel has no autogroups or refuses. With autogroups on
    (/proc/sys/kernel/sched_autogroup_enabled), a process's own niceness weighs only
    inside its session: a ``nice -n 19`` job started in another session still takes a
    full share of the cores from a benchmark at nice 0."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        return False
    return True


def autogroups_enabled() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def minor_faults(pid: int) -> int | None:
    """Minor page faults of ``pid`` so far (a fresh page each: docs/benchmarks.md, "Page
    faults of big bodies")."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return None


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


def start_upstream(workdir: Path, floor_of: str | None = None, kind: str = "floor") -> Proc:
    """The fast upstream, or (``floor_of`` = the upstream's URL) a reference forwarder
    (``kind``: raw, floor or naive)."""
    port = free_port()
    name = kind if floor_of else "upstream"
    log = workdir / f"{name}.log"
    mode = [f"--serve-{kind}", "--upstream", floor_of] if floor_of else ["--serve-upstream"]
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


# The upstream servers: ``python`` (:func:`serve_upstream`, the default: every
# measurement) or ``nginx`` (:func:`start_nginx_upstream`: fixed answers at a fraction of
# the CPU, so that a saturated proxy is not sharing its cores with a Python upstream; no
# streams).
UPSTREAM_SERVERS = ("python", "nginx")


def nginx_quote(payload: bytes) -> str:
    """``payload`` as an nginx single-quoted string (``return 200 '...'``): nginx reads
    back a backslash, quote or newline escaped this way; a ``$`` would start a variable,
    so a payload may hold none."""
    text = payload.decode()
    if "$" in text:
        raise ValueError("an nginx return text cannot hold '$' (a variable)")
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


def nginx_upstream_conf(prefix: Path, port: int) -> str:
    """nginx's configuration for the fast upstream on 127.0.0.1:``port`` (its files under
    ``prefix``): :func:`upstream_replies` from ``return`` (a request body is read and
    dropped), one worker process, keep-alive connections kept as long as a run."""
    r = upstream_replies(f"http://{HOST}:{port}")
    temp = "\n".join(
        f"  {kind}_temp_path {prefix}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 16384; }}
http {{
  access_log off;
{temp}
  client_max_body_size 64m;
  client_body_buffer_size 2m;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  default_type application/json;
  server {{
    listen {HOST}:{port} backlog=4096;
    location = /generate {{ return 200 {nginx_quote(r["generate"])}; }}
    location = /v1/chat/completions {{ return 200 {nginx_quote(r["openai"])}; }}
    location = /v1/completions {{ return 200 {nginx_quote(r["openai"])}; }}
    location = /metrics {{ default_type text/plain; return 200 {nginx_quote(r["metrics"])}; }}
    location = /workers {{ return 200 {nginx_quote(r["workers"])}; }}
    location = /server_info {{ return 200 {nginx_quote(r["server_info"])}; }}
    location = /get_server_info {{ return 200 {nginx_quote(r["server_info"])}; }}
    location / {{ return 200 '{{}}'; }}
  }}
}}
"""


def start_nginx_upstream(workdir: Path) -> Proc:
    """The fast upstream served by ``nginx`` (:func:`nginx_upstream_conf`), started on
    127.0.0.1 in the foreground (``daemon off``) and stopped by PID."""
    binary = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/bin/nginx") if os.access(p, os.X_OK)), None
    )
    if binary is None:
        raise RuntimeError("no nginx for --upstream-server nginx (apt-get install nginx)")
    port = free_port()
    prefix = workdir / "nginx-upstream"
    prefix.mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_upstream_conf(prefix, port))
    log = workdir / "upstream.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    proc = Proc("upstream", f"http://{HOST}:{port}", popen, prefix / "error.log")
    try:
        wait_ready(proc, "/health", 20.0)
    except BaseException:
        proc.stop()
        raise
    return proc


def proxy_config_doc(
    name: str,
    upstream: str,
    port: int | None = None,
    poll_interval_s: float = 0.5,
    server_keys: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """kvproxy's configuration for feature set ``name`` in front of ``upstream``: the one
    document every proxy benchmark uses (this one and ``scripts/bench_request_cpu.py``),
    with ``server_keys`` over its ``server`` section."""
    features = features_of(name)
    lifecycle, admission = PROXY_FEATURES[features]
    server: dict[str, Any] = {"log_level": "WARNING", "shutdown_grace_s": 1.0}
    server.update(server_keys or {})
    if port is not None:
        server["port"] = port
    return {
        "server": server,
        "router": {
            "url": upstream,
            "engines": [upstream],
            "policy": "consistent_hashing" if features in RING_TARGETS else "cache_aware",
        },
        "session_lifecycle": {"enabled": lifecycle},
        "admission": {"enabled": admission, "poll_interval_s": poll_interval_s},
        "state": _state_section(features),
    }


# The redis-server the benchmark started for the REDIS_TARGETS (start_redis_for).
_REDIS: dict[str, Any] = {}
REDIS_PASSWORD_ENV = "KVPROXY_BENCH_REDIS_PASSWORD"


def _state_section(features: str) -> dict[str, Any]:
    if features not in REDIS_TARGETS:
        return {"backend": "memory"}
    if "url" not in _REDIS:
        raise RuntimeError(f"{features}: no redis-server started (start_redis_for)")
    return {
        "backend": "redis",
        "redis_url": _REDIS["url"],
        "redis_password_env": REDIS_PASSWORD_ENV,
        "key_prefix": f"bench-{features}:",
    }


def start_redis_for(targets: Sequence[str], workdir: Path) -> Any:
    """A password-protected redis-server on 127.0.0.1 when a target needs one (kvlab's
    launcher; stop it by PID with ``.stop()``); None otherwise."""
    if not any(feature_set(t) in REDIS_TARGETS for t in targets):
        return None
    import secrets

    from kvlab.stack import start_redis  # type: ignore[import-not-found,unused-ignore]

    password = secrets.token_hex(16)
    os.environ[REDIS_PASSWORD_ENV] = password  # the proxies inherit it
    proc = start_redis(log_dir=workdir / "redis", password=password)
    _REDIS["url"] = proc.url
    _REDIS["proc"] = proc
    return proc


async def start_in_process(target: str, upstream: str, poll_s: float) -> tuple[Any, str]:
    """``target`` (a reference forwarder, or kvproxy's app with the target's config) served
    in this process's event loop: its ``web.AppRunner`` (clean it up) and base URL. Once
    admission has its first poll, what start-up built is frozen out of the collector's
    way, as ``kvproxy serve`` does once it listens."""
    import gc

    from aiohttp import web

    from kvproxy.app import create_app
    from kvproxy.config import from_mapping
    from kvproxy.keys import ADMISSION

    if target == "raw":
        return await _start_raw_in_process(upstream)
    if target == "floor":
        app = floor_app(upstream)
    elif target == "naive":
        app = naive_app(upstream)
    else:
        app = create_app(from_mapping(proxy_config_doc(target, upstream, poll_interval_s=poll_s)))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    if PROXY_FEATURES.get(target, (False, False))[1]:  # admission: its first poll
        for _ in range(1200):  # 60 s at most (valgrind runs this slowly)
            if not app[ADMISSION].health().degraded:
                break
            await asyncio.sleep(0.05)
    gc.collect()
    gc.freeze()
    return runner, f"http://{HOST}:{port}"


class _RawServer:
    """The raw hop served in this event loop, stopped as a runner is (``cleanup``)."""

    def __init__(self, server: asyncio.AbstractServer) -> None:
        self._server = server

    async def cleanup(self) -> None:
        self._server.close()
        await self._server.wait_closed()


async def _start_raw_in_process(upstream: str) -> tuple[_RawServer, str]:
    from benchproxy.rawhop import forwarder_factory

    port = free_port()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(forwarder_factory(upstream), HOST, port, backlog=4096)
    return _RawServer(server), f"http://{HOST}:{port}"


def write_proxy_config(
    path: Path,
    name: str,
    upstream: str,
    port: int,
    server_keys: Mapping[str, Any] | None = None,
) -> None:
    # JSON is YAML: kvproxy reads the file with its YAML loader.
    doc = proxy_config_doc(name, upstream, port, server_keys=server_keys)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def start_proxy(
    name: str,
    upstream: str,
    workdir: Path,
    launcher: str,
    server_keys: Mapping[str, Any] | None = None,
    label: str | None = None,
    python: str | None = None,
) -> Proc:
    """Start kvproxy as target ``name`` (and ``server_keys``); through kvlab.stack when
    available. ``label`` names its files (default: ``name``); ``python`` serves it with
    that interpreter's kvproxy (a compiled build) instead of this one's."""
    if name in REFERENCES:
        return start_upstream(workdir, floor_of=upstream, kind=name)
    features = features_of(name)
    label = (label or name).replace(":", "-")
    port = free_port()
    cfg = workdir / f"kvproxy-{label}.yaml"
    write_proxy_config(cfg, name, upstream, port, server_keys)
    log_dir = workdir / f"kvproxy-{label}"
    log_dir.mkdir(exist_ok=True)
    proc: Proc | None = None
    if launcher in ("auto", "stack") and python is None:
        try:
            from kvlab.stack import start_kvproxy  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            if launcher == "stack":
                raise
        else:
            managed = start_kvproxy(
                config_path=cfg,
                router_url=upstream,
                port=port,
                log_dir=log_dir,
                extra_args=("--workers", str(WORKERS.get(features, 1))),
            )
            proc = Proc(
                label,
                str(managed.url).rstrip("/"),
                managed.popen,
                Path(getattr(managed, "log_path", log_dir / "kvproxy.log")),
                stop_hook=managed.stop,
            )
    if proc is None:
        log = log_dir / "kvproxy.log"
        # -P: the kvproxy this interpreter has installed (a compiled build included),
        # not the checkout's source that cwd would put first on sys.path.
        cmd = [python or sys.executable, "-P", "-m", "kvproxy", "serve", "--config", str(cfg)]
        cmd += ["--port", str(port)]
        cmd += ["--router-url", upstream, "--workers", str(WORKERS.get(features, 1))]
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(label, f"http://{HOST}:{port}", popen, log)
    try:
        wait_ready(proc, "/kvproxy/health", 30.0)
        if PROXY_FEATURES[features][1]:  # admission on
            # Wait for the first /metrics poll so that measurements see a live ledger.
            doc = wait_ready(proc, "/kvproxy/health", 10.0, want_status="ok")
            if doc is not None and doc.get("status") != "ok":
                print(f"  note: {label} proxy health is {doc.get('status')!r}", flush=True)
    except BaseException:
        proc.stop()
        raise
    return proc
