"""``kvproxy serve``: run the proxy until SIGTERM / SIGINT; SIGHUP reloads the YAML."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from kvproxy import __version__, compiled, heap
from kvproxy.config import (
    CLI_OVERRIDES,
    ROUTER_POLICIES_MIRRORED,
    AdmissionConfig,
    Config,
    ConfigError,
    RouterConfig,
    ServerConfig,
    apply_overrides,
    load_config,
)

log = logging.getLogger("kvproxy")

EXAMPLE = (
    "kvproxy serve --config configs/kvproxy.yaml --router-url http://127.0.0.1:30000 "
    "--port 8100 --agentic-session-lifecycle"
)
_S, _R, _A = ServerConfig(), RouterConfig(), AdmissionConfig()


def _bool_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, help_text: str
) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="YAML config file (configs/kvproxy.yaml documents every key)",
    )
    parser.add_argument(
        "--host", metavar="ADDR", help=f"listen address (server.host; default {_S.host})"
    )
    parser.add_argument(
        "--port", type=int, metavar="PORT", help=f"listen port (server.port; default {_S.port})"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes sharing the port (SO_REUSEPORT; default 1). Above 1 the "
        "session lifecycle needs state.backend: redis, which shares program admission's "
        "ledger too",
    )
    parser.add_argument(
        "--router-url", metavar="URL", help=f"router base URL (router.url; default {_R.url})"
    )
    parser.add_argument(
        "--router-policy",
        metavar="POLICY",
        help=f"the router's policy as deployed, e.g. consistent_hashing (router.policy; default {_R.policy})",
    )
    parser.add_argument(
        "--admission-mode",
        choices=("program", "request"),
        help="admission.mode (default program)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        metavar="X",
        help=f"wall seconds per simulated second (server.time_scale; default {_S.time_scale})",
    )
    parser.add_argument(
        "--token-scale",
        type=int,
        metavar="K",
        help=f"real tokens per engine token, for simulated engines (server.token_scale; default {_S.token_scale})",
    )
    relax = parser.add_argument_group(
        "Relax-compatible feature flags (override the YAML; defaults are the YAML's defaults)"
    )
    _bool_flag(relax, "--agentic-session-lifecycle", "session_lifecycle.enabled (default off)")
    _bool_flag(relax, "--agentic-program-admission", "admission.enabled (default off)")
    relax.add_argument(
        "--agentic-admission-headroom",
        type=float,
        help=f"admission.headroom, in (0, 1] (default {_A.headroom})",
    )
    relax.add_argument(
        "--agentic-admission-pressure-threshold",
        type=float,
        help=f"admission.pressure_threshold, in (0, 1] (default {_A.pressure_threshold})",
    )
    relax.add_argument(
        "--agentic-admission-expected-decode-cap",
        type=int,
        help="admission.expected_decode_cap, > 0 (default: admission.default_completion_tokens, "
        f"{_A.default_completion_tokens})",
    )
    relax.add_argument(
        "--agentic-admission-max-wait-s",
        type=float,
        help=f"admission.max_wait_s, >= 0 (default {_A.max_wait_s})",
    )
    relax.add_argument(
        "--agentic-admission-scope",
        choices=("train", "all"),
        help=f"admission.scope (default {_A.scope})",
    )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name, None) for name in CLI_OVERRIDES}


def run(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    try:
        cfg = apply_overrides(load_config(args.config), overrides)
    except ConfigError as exc:
        print(f"kvproxy: invalid configuration: {exc}", file=sys.stderr)
        return 2
    workers = int(getattr(args, "workers", 1) or 1)
    problem, warning = workers_check(cfg, workers)
    if problem:
        print(f"kvproxy: --workers {workers}: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if warning:
        log.warning("--workers %d: %s", workers, warning)
    if workers > 1:
        return fork_workers(workers, lambda: _serve(cfg, overrides, reuse_port=True))
    return _serve(cfg, overrides, reuse_port=False)


def _serve(cfg: Config, overrides: dict[str, Any], *, reuse_port: bool) -> int:
    from aiohttp import web

    from kvproxy.admin.reload import reload_config
    from kvproxy.app import create_app, slow_client_guard
    from kvproxy.plane import exposure_warning
    from kvproxy.proxy.slow_clients import run_guarded_app

    apply_malloc_retain(cfg.server.malloc_retain_bytes)
    loop: asyncio.AbstractEventLoop | None = None
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        pass

    app = create_app(cfg, overrides=overrides)
    pending: set[asyncio.Task[Any]] = set()

    async def _reload() -> None:
        try:
            await reload_config(app)
        except ConfigError as exc:
            log.error("SIGHUP reload rejected, running config kept: %s", exc)

    async def _install_sighup(_: web.Application) -> None:
        loop = asyncio.get_running_loop()

        def on_hup() -> None:
            task = loop.create_task(_reload())
            pending.add(task)
            task.add_done_callback(pending.discard)

        loop.add_signal_handler(signal.SIGHUP, on_hup)

    app.on_startup.append(_install_sighup)

    def _started() -> None:
        # Called once the socket is bound and serving. What start-up built (modules, the
        # config, the metric families, the app) lives as long as the process: frozen out
        # of the collector's way, a full collection scans only what requests leave.
        gc.collect()
        gc.freeze()
        apply_gc_threshold(cfg.server.gc_threshold)
        log.info(
            "kvproxy %s listening on http://%s:%d -> router %s (session_lifecycle=%s, "
            "admission=%s, build=%s%s)",
            __version__,
            cfg.server.host,
            cfg.server.port,
            cfg.router.url,
            cfg.session_lifecycle.enabled,
            cfg.admission.enabled,
            compiled.build_name(compiled.compiled_modules()),
            "" if cfg.state.backend == "memory" else f", state={cfg.state.backend}",
        )

    exposed = exposure_warning(cfg.server.host, cfg.server.admin_token)
    if exposed:
        log.warning("%s", exposed)
    try:
        # web.run_app, with the server layer bounding slow clients (kvproxy.proxy.slow_clients).
        run_guarded_app(
            app,
            guard=slow_client_guard(app),
            host=cfg.server.host,
            port=cfg.server.port,
            shutdown_timeout=cfg.server.shutdown_grace_s,
            backlog=cfg.server.backlog,
            loop=loop,
            ready=_started,
            reuse_port=reuse_port,
        )
    except OSError as exc:
        print(f"kvproxy: {bind_error(cfg.server.host, cfg.server.port, exc)}", file=sys.stderr)
        return 2
    return 0


def workers_check(cfg: Config, workers: int) -> tuple[str | None, str | None]:
    """Whether ``workers`` processes may serve ``cfg``: (an error, or None; a warning,
    or None). Pure."""
    if workers < 1 or workers > 64:
        return f"must be in [1, 64] (got {workers})", None
    if workers == 1:
        return None, None
    if cfg.session_lifecycle.enabled and cfg.state.backend != "redis":
        return (
            "the session lifecycle needs state shared between the workers: set "
            "state.backend: redis (docs/operations.md, Running several replicas)",
            None,
        )
    if cfg.admission.enabled and cfg.state.backend != "redis":
        return None, (
            "admission state is per worker: each one bounds the engines from the share of "
            "the traffic it sees (state.backend: redis shares it)"
        )
    if cfg.admission.enabled and (cfg.admission.mode, cfg.admission.ledger) != (
        "program",
        "engine",
    ):
        return None, (
            "fleet-wide admission (leases) is per worker: only program admission's "
            "per-engine ledger is shared"
        )
    if cfg.admission.enabled and cfg.router.policy not in ROUTER_POLICIES_MIRRORED:
        return None, (
            f"router.policy {cfg.router.policy!r} cannot be mirrored: program admission "
            "accounts fleet-wide, per worker; its per-engine ledger, shared between the "
            "workers, needs the router's consistent_hashing (router.policy)"
        )
    return None, None


def fork_workers(workers: int, serve: Callable[[], int]) -> int:
    """Fork ``workers`` processes that each run ``serve`` (sharing the port through
    SO_REUSEPORT); forward SIGTERM, SIGINT and SIGHUP to them by PID; wait for all.
    Returns the worst exit code. A worker that dies is not restarted."""
    children: list[int] = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child serves, then leaves without cleanup
            code = 1
            try:
                code = serve()
            finally:
                os._exit(code)
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    worst = 0
    for child in children:
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        worst = max(worst, abs(code))
    return worst


def apply_gc_threshold(threshold: int) -> None:
    """Set the collector's young-generation threshold (``server.gc_threshold``; 0 leaves
    Python's own), keeping the older generations' thresholds."""
    if threshold:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(threshold, older, oldest)


def apply_malloc_retain(retain_bytes: int) -> None:
    """Keep freed request buffers for reuse (``server.malloc_retain_bytes``,
    :mod:`kvproxy.heap`), before the app allocates any; a refusal is logged."""
    outcome = heap.apply(retain_bytes)
    if outcome == "refused":
        log.warning(
            "server.malloc_retain_bytes=%d: mallopt refused it; glibc's own thresholds stay",
            retain_bytes,
        )
    else:
        log.debug("server.malloc_retain_bytes=%d: %s", retain_bytes, outcome)


def bind_error(host: str, port: int, exc: OSError) -> str:
    """One line naming the address and the fix, for an error binding the listen socket."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use: stop what listens there, or pass "
            "another --port (server.port)"
        )
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port}: use a port >= 1024 (--port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: not an address of this host (--host, server.host)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
