"""``kvproxy serve``: run the proxy until SIGTERM / SIGINT; SIGHUP reloads the YAML."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from kvproxy.config import CLI_OVERRIDES, ConfigError, apply_overrides, load_config

log = logging.getLogger("kvproxy")


def _bool_flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="YAML config file (configs/kvproxy.yaml documents every key)",
    )
    parser.add_argument("--host", help="listen address (server.host)")
    parser.add_argument("--port", type=int, help="listen port (server.port)")
    parser.add_argument("--router-url", help="router base URL (router.url)")
    relax = parser.add_argument_group("Relax-compatible feature flags (override the YAML)")
    _bool_flag(relax, "--agentic-session-lifecycle", "session_lifecycle.enabled")
    _bool_flag(relax, "--agentic-program-admission", "admission.enabled")
    relax.add_argument(
        "--agentic-admission-headroom", type=float, help="admission.headroom, in (0, 1]"
    )
    relax.add_argument(
        "--agentic-admission-pressure-threshold",
        type=float,
        help="admission.pressure_threshold, in (0, 1]",
    )
    relax.add_argument(
        "--agentic-admission-expected-decode-cap",
        type=int,
        help="admission.expected_decode_cap, > 0",
    )
    relax.add_argument(
        "--agentic-admission-max-wait-s", type=float, help="admission.max_wait_s, >= 0"
    )
    relax.add_argument(
        "--agentic-admission-scope", choices=("train", "all"), help="admission.scope"
    )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name, None) for name in CLI_OVERRIDES}


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvproxy.admin.reload import reload_config
    from kvproxy.app import RUNTIME, create_app, slow_client_guard
    from kvproxy.proxy.slow_clients import run_guarded_app

    overrides = overrides_from_args(args)
    try:
        cfg = apply_overrides(load_config(args.config), overrides)
    except ConfigError as exc:
        print(f"kvproxy: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        uvloop = None

    app = create_app(cfg, overrides=overrides)
    pending: set[asyncio.Task[Any]] = set()

    async def _reload() -> None:
        try:
            await reload_config(app[RUNTIME])
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
    log.warning(
        "kvproxy listening on http://%s:%d -> router %s (session_lifecycle=%s, admission=%s)",
        cfg.server.host,
        cfg.server.port,
        cfg.router.url,
        cfg.session_lifecycle.enabled,
        cfg.admission.enabled,
    )
    # web.run_app, with the server layer bounding slow clients (kvproxy.proxy.slow_clients).
    run_guarded_app(
        app,
        guard=slow_client_guard(app),
        host=cfg.server.host,
        port=cfg.server.port,
        shutdown_timeout=cfg.server.shutdown_grace_s,
        backlog=cfg.server.backlog,
        loop=uvloop.new_event_loop() if uvloop is not None else None,
    )
    return 0
