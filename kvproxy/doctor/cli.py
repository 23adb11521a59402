"""``kvproxy doctor``: check a live deployment, one line per check; exit 1 on a failure."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from typing import Any

from kvproxy import compiled, heap
from kvproxy.config import ServerConfig
from kvproxy.doctor.checks import (
    Intent,
    Line,
    build_lines,
    config_lines,
    engine_lines,
    fleet_lines,
    heap_lines,
    probe_lines,
    router_lines,
    speedup_lines,
    summary,
)
from kvproxy.doctor.store_checks import store_lines

EXAMPLE = "kvproxy doctor --router-url http://127.0.0.1:30000 --config configs/kvproxy.yaml --probe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = f"example:\n  {EXAMPLE}"
    parser.add_argument(
        "--router-url",
        metavar="URL",
        help="the router (smg) to check (default: router.url from --config, else "
        "http://127.0.0.1:30000)",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="kvproxy's YAML: validated, and its enabled features decide which checks "
        "fail (default: none, check for both features)",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="also send a one-token /generate with a session_id through the router and "
        "check that it reached an engine (default: off)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="per-request timeout in seconds (default: %(default)s)",
    )


def _features(cfg: Any) -> dict[str, str]:
    admission = "on" if cfg.admission.enabled else "off"
    mode = getattr(cfg.admission, "mode", None)
    if cfg.admission.enabled and mode:
        admission += f" (mode {mode})"
    return {
        "session_lifecycle": "on" if cfg.session_lifecycle.enabled else "off",
        "admission": admission,
        "router.policy": getattr(cfg.router, "policy", None) or "not set",
    }


async def diagnose(
    router_url: str | None, config_path: str | None, probe: bool, timeout_s: float
) -> list[Line]:
    """Every check's line, in report order."""
    import aiohttp

    from kvproxy.config import ConfigError, RouterConfig, load_config
    from kvproxy.doctor import gather

    lines: list[Line] = []
    cfg = None
    error: str | None = None
    if config_path is not None:
        try:
            cfg = load_config(config_path)
        except ConfigError as exc:
            error = str(exc)
    url = router_url or (cfg.router.url if cfg is not None else RouterConfig().url)
    lines += config_lines(
        config_path,
        error,
        _features(cfg) if cfg is not None else None,
        config_router_url=cfg.router.url if cfg is not None else None,
        router_url=router_url,
    )
    if cfg is not None:
        intent = Intent(
            lifecycle=cfg.session_lifecycle.enabled,
            admission=cfg.admission.enabled,
            policy=getattr(cfg.router, "policy", None),
            sticky_routing=cfg.session_lifecycle.sticky_routing,
            prefetch=cfg.admission.prefetch,
        )
    else:
        intent = Intent()
    static = cfg.router.engines if cfg is not None else ()
    async with aiohttp.ClientSession() as http:
        router = await gather.read_router(http, url, timeout_s, static)
        lines += router_lines(router, intent)
        engine_urls = sorted(router.engines.all) if router.engines is not None else []
        engines = await gather.read_engines(http, engine_urls, timeout_s)
        for facts in engines:
            lines += engine_lines(facts, intent)
        lines += fleet_lines(engines, intent)
        if probe and router.error is None:
            probed = await gather.probe(http, url, engine_urls, timeout_s)
            lines += probe_lines(probed)
    if cfg is not None and cfg.state.backend == "redis":
        lines += store_lines(await gather.read_store(cfg.state, timeout_s))
    # This host's own: where the doctor runs is where kvproxy runs, as a rule.
    lines += speedup_lines(importlib.util.find_spec("numpy") is not None, intent)
    retain = (cfg.server if cfg is not None else ServerConfig()).malloc_retain_bytes
    lines += heap_lines(heap.glibc_mallopt() is not None, retain)
    lines += build_lines(len(compiled.compiled_modules()), len(compiled.MODULES))
    return lines


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print(f"kvproxy doctor: --timeout must be > 0 (got {args.timeout})", file=sys.stderr)
        return 2
    lines = asyncio.run(diagnose(args.router_url, args.config, args.probe, args.timeout))
    for line in lines:
        print(line.render(), flush=True)
    text, code = summary(lines)
    print(text)
    return code
