"""Process launchers for tests, the demo and benchmarks: simulated engines, the real
router (``smg``) and kvproxy itself, each a subprocess bound to 127.0.0.1.

Processes are tracked and stopped by PID only. Readiness polls are bounded in
count and time; a timeout raises :class:`StackError` with the tail of the
process's log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

HOST = "127.0.0.1"
POLL_INTERVAL_S = 0.1


class StackError(RuntimeError):
    """A process failed to start or become ready."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return data[-max_bytes:].decode("utf-8", errors="replace")


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log_path: Path
    _stopped: bool = field(default=False, repr=False)
    _signalled: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, max_bytes: int = 4000) -> str:
        return _tail(self.log_path, max_bytes)

    def terminate(self) -> None:
        """SIGTERM to this process's PID without waiting for it to exit (:meth:`stop`
        then waits). Idempotent."""
        if self._stopped or self._signalled:
            return
        self._signalled = True
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to this process's PID (unless :meth:`terminate` sent it), SIGKILL
        after ``timeout``. Idempotent."""
        if self._stopped:
            return
        self.terminate()
        self._stopped = True
        p = self.popen
        if p.poll() is None:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=timeout)
            except ProcessLookupError:
                pass
        log_file = getattr(p, "_kvproxy_log", None)
        if log_file is not None:
            log_file.close()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_all(procs: Sequence[ManagedProcess], timeout: float = 10.0) -> None:
    """Stop several processes at once: SIGTERM to every PID first, then wait for each
    (SIGKILL after ``timeout``), so that their shutdowns overlap."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop(timeout)


def _spawn(name: str, argv: Sequence[str], url: str, log_dir: Path) -> ManagedProcess:
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by ManagedProcess.stop
    log_file.write(f"$ {' '.join(argv)}\n".encode())
    log_file.flush()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    except OSError:
        log_file.close()
        raise
    popen._kvproxy_log = log_file  # type: ignore[attr-defined]
    return ManagedProcess(name=name, popen=popen, url=url, log_path=log_path)


# Never route loopback readiness probes through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method="GET")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


def _wait_ready(
    proc: ManagedProcess, check: Callable[[], bool], ready_timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + ready_timeout_s
    max_polls = int(ready_timeout_s / POLL_INTERVAL_S) + 10
    for _ in range(max_polls):
        if not proc.alive():
            tail = proc.log_tail()
            proc.stop()
            raise StackError(
                f"{proc.name} exited with code {proc.popen.returncode} before {what}; "
                f"log {proc.log_path}:\n{tail}"
            )
        if check():
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_INTERVAL_S)
    tail = proc.log_tail()
    proc.stop()
    raise StackError(
        f"{proc.name} not ready ({what}) after {ready_timeout_s:.0f}s; log {proc.log_path}:\n{tail}"
    )


def start_sim_engine(
    *,
    port: int | None = None,
    max_total_tokens: int | None,
    mode: str = "plain",
    eviction_policy: str = "lru",
    extra_args: Sequence[str] = (),
    log_dir: Path,
    ready_timeout_s: float = 30,
    name: str | None = None,
    cost_model: str | None = None,
    token_scale: int = 1,
) -> ManagedProcess:
    """Start ``python -m kvproxy sim-engine`` and wait until ``GET /health`` is 200.

    ``max_total_tokens=None`` leaves the pool to the cost-model preset (divided by
    ``token_scale``); ``cost_model=None`` keeps the engine's default (``legacy``).
    """
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    argv = [
        sys.executable,
        "-P",  # this interpreter's kvproxy (a compiled build), not a checkout in cwd
        "-m",
        "kvproxy",
        "sim-engine",
        "--host",
        HOST,
        "--port",
        str(port),
        "--mode",
        mode,
        "--eviction-policy",
        eviction_policy,
    ]
    if max_total_tokens is not None:
        argv += ["--max-total-tokens", str(max_total_tokens)]
    if cost_model is not None:
        argv += ["--cost-model", cost_model]
    if token_scale != 1:
        argv += ["--token-scale", str(token_scale)]
    argv += list(extra_args)
    proc = _spawn(name or f"sim-engine-{port}", argv, url, log_dir)
    _wait_ready(proc, lambda: _http_get(f"{url}/health")[0] == 200, ready_timeout_s, "GET /health")
    return proc


@contextlib.contextmanager
def sim_engines(count: int, *, log_dir: Path, **options: Any) -> Iterator[list[ManagedProcess]]:
    """``count`` engines of :func:`start_sim_engine` with the same ``options``, each
    stopped by PID on exit (also those started before one that failed to start)."""
    with contextlib.ExitStack() as running:
        yield [
            running.enter_context(start_sim_engine(log_dir=log_dir, **options))
            for _ in range(count)
        ]


def smg_command() -> list[str]:
    """The command that runs ``smg``: the console script next to this interpreter, else
    one on PATH, else ``python -m smg``."""
    exe_dir = Path(sys.executable).parent
    for candidate in (exe_dir / "smg", exe_dir / "smg.exe"):
        if candidate.exists():
            return [str(candidate)]
    found = shutil.which("smg")
    if found:
        return [found]
    return [sys.executable, "-m", "smg"]


def _workers_healthy(router_url: str, worker_urls: Sequence[str]) -> bool:
    status, _ = _http_get(f"{router_url}/readiness")
    if status != 200:
        return False
    status, body = _http_get(f"{router_url}/workers")
    if status != 200:
        return False
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    healthy = set()
    for w in data.get("workers", []) if isinstance(data, dict) else []:
        if isinstance(w, dict) and w.get("is_healthy"):
            url = str(w.get("url", ""))
            healthy.add(url.split("@", 1)[0].rstrip("/"))
    return all(u.rstrip("/") in healthy for u in worker_urls)


def start_router(
    worker_urls: Sequence[str],
    *,
    port: int | None = None,
    policy: str = "round_robin",
    extra_args: Sequence[str] = (),
    log_dir: Path,
    ready_timeout_s: float = 60,
    disable_circuit_breaker: bool = True,
    overload_protection: bool = False,
) -> ManagedProcess:
    """Start the real router (``smg launch``) and wait until every worker is healthy.

    The circuit breaker is disabled by default: it counts client 4xx answers as
    worker failures, so a burst of bad requests would take workers out of routing.
    Worker overload protection is off by default, as the deployment contract says
    (docs/operations.md): on, smg skips a worker with 8+ waiting requests or 0.8 KV
    usage even under consistent hashing, which moves sessions off their ring engine.
    """
    port = port or free_port()
    prom_port = free_port()
    while prom_port == port:
        prom_port = free_port()
    url = f"http://{HOST}:{port}"
    argv = [
        *smg_command(),
        "launch",
        "--host",
        HOST,
        "--port",
        str(port),
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(prom_port),
        "--policy",
        policy,
        "--health-check-interval-secs",
        "1",
        "--shutdown-grace-period-secs",
        "1",
    ]
    if disable_circuit_breaker:
        argv.append("--disable-circuit-breaker")
    if not overload_protection:
        argv.append("--disable-worker-overload-protection")
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    argv += list(extra_args)
    proc = _spawn(f"router-{port}", argv, url, log_dir)
    _wait_ready(
        proc,
        lambda: _workers_healthy(url, worker_urls),
        ready_timeout_s,
        f"/readiness and {len(worker_urls)} healthy workers in /workers",
    )
    return proc


def start_kvproxy(
    *,
    config_path: Path,
    router_url: str,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    log_dir: Path,
    ready_timeout_s: float = 30,
) -> ManagedProcess:
    """Start ``python -m kvproxy serve`` and wait until ``GET /kvproxy/health`` is 200."""
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    argv = [
        sys.executable,
        "-P",  # this interpreter's kvproxy (a compiled build), not a checkout in cwd
        "-m",
        "kvproxy",
        "serve",
        "--config",
        str(config_path),
        "--host",
        HOST,
        "--port",
        str(port),
        "--router-url",
        router_url,
        *extra_args,
    ]
    proc = _spawn(f"kvproxy-{port}", argv, url, log_dir)
    _wait_ready(
        proc,
        lambda: _http_get(f"{url}/kvproxy/health")[0] == 200,
        ready_timeout_s,
        "GET /kvproxy/health",
    )
    return proc


# ------------------------------------------------------------------ redis and nginx
def _require_binary(name: str, package: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise StackError(
            f"{name} not found: install Debian's {package} package (apt-get install -y "
            f"{package}; scripts/test.sh does this when it runs as root)"
        )
    return path


def _tcp_ready(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
        return True
    return False


def start_redis(
    *, log_dir: Path, password: str, port: int | None = None, ready_timeout_s: float = 15
) -> ManagedProcess:
    """Start ``redis-server`` on 127.0.0.1 with ``password`` (in a config file of its
    own, mode 0600, not on the command line), no persistence, and wait until it
    accepts connections. ``url`` is ``redis://127.0.0.1:PORT/0`` (no password)."""
    binary = _require_binary("redis-server", "redis-server")
    port = port or free_port()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    conf = log_dir / f"redis-{port}.conf"
    conf.touch(mode=0o600)
    conf.write_text(
        f'bind {HOST}\nport {port}\nrequirepass {password}\nsave ""\nappendonly no\n'
        f"dir {log_dir}\nprotected-mode yes\n"
    )
    proc = _spawn(f"redis-{port}", [binary, str(conf)], f"redis://{HOST}:{port}/0", log_dir)
    _wait_ready(proc, lambda: _tcp_ready(port), ready_timeout_s, f"a connection on port {port}")
    return proc


def start_nginx(
    *, log_dir: Path, upstreams: Sequence[str], port: int | None = None, ready_timeout_s: float = 15
) -> ManagedProcess:
    """Start ``nginx`` (its own config and prefix in ``log_dir``, ``daemon off``) on
    127.0.0.1 as a round-robin load balancer over ``upstreams`` (http URLs), no
    affinity, retrying a refused connection on the next upstream; ``url`` is its
    address."""
    binary = _require_binary("nginx", "nginx")
    port = port or free_port()
    prefix = Path(log_dir) / f"nginx-{port}"
    prefix.mkdir(parents=True, exist_ok=True)
    servers = "\n".join(
        f"    server {u.split('://', 1)[1].rstrip('/')} max_fails=0;" for u in upstreams
    )
    (prefix / "nginx.conf").write_text(
        f"""daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  upstream kvproxy {{
{servers}
    keepalive 64;
  }}
  server {{
    listen {HOST}:{port};
    location / {{
      proxy_pass http://kvproxy;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 120s;
      proxy_next_upstream error timeout;
      proxy_next_upstream_tries 2;
    }}
  }}
}}
"""
    )
    argv = [
        binary,
        "-p",
        str(prefix),
        "-c",
        str(prefix / "nginx.conf"),
        "-e",
        str(prefix / "error.log"),
    ]
    proc = _spawn(f"nginx-{port}", argv, f"http://{HOST}:{port}", Path(log_dir))
    _wait_ready(proc, lambda: _tcp_ready(port), ready_timeout_s, f"a connection on port {port}")
    return proc
