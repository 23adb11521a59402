"""kvproxy's start-up log: the listening line at INFO, and a router that is down at
start named in one WARNING, then one INFO line once it answers."""

from __future__ import annotations

import asyncio
import os
import platform
import re
import time
from pathlib import Path

from aiohttp import web

from kvlab import stack
from kvproxy import __version__


async def _wait_for_log(
    proc: stack.ManagedProcess, needle: str, count: int = 1, timeout_s: float = 20
) -> str:
    deadline = time.monotonic() + timeout_s
    for _ in range(2000):
        text = proc.log_tail(256_000)
        if text.count(needle) >= count:
            return text
        if time.monotonic() > deadline or not proc.alive():
            break
        await asyncio.sleep(0.05)
    raise AssertionError(f"{needle!r} not in the log:\n{proc.log_tail()}")


async def test_router_down_at_start_then_up(tmp_path: Path) -> None:
    router_port = stack.free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    cfg = tmp_path / "k.yaml"
    # DEBUG: each failed discovery round is logged, so the test can count rounds.
    cfg.write_text(
        "server:\n  log_level: DEBUG\n"
        "router:\n  discovery_interval_s: 0.1\n  connect_timeout_s: 1.0\n"
    )
    proc = stack.start_kvproxy(config_path=cfg, router_url=router_url, log_dir=tmp_path)
    runner: web.AppRunner | None = None
    try:
        # Several failed rounds, one WARNING.
        text = await _wait_for_log(proc, "engine discovery failed", count=4)
        assert (
            text.count(f"WARNING kvproxy.fleet.registry: router {router_url} is not reachable") == 1
        )
        assert (
            f"INFO kvproxy: kvproxy {__version__} listening on {proc.url} -> router {router_url}"
            in text
        )
        # The build it runs (scripts/check_compiled.sh runs this test on the compiled
        # one): a subprocess started from the checkout must not import its source.
        build = {"1": "compiled", "0": "python"}.get(
            os.environ.get("KVPROXY_EXPECT_COMPILED", ""), "compiled|python"
        )
        assert re.search(rf"admission=False, build=({build})\)", text), text[-2000:]
        # Freed buffers kept for reuse (kvproxy.heap), on glibc; said at DEBUG.
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            assert f"DEBUG kvproxy: server.malloc_retain_bytes={64 << 20}: applied" in text
        # A stand-in router appears on that port.
        app = web.Application()

        async def workers(_: web.Request) -> web.Response:
            return web.json_response({"workers": []})

        app.router.add_get("/workers", workers)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", router_port).start()
        text = await _wait_for_log(proc, f"router {router_url} is reachable now")
        assert text.count(f"INFO kvproxy.fleet.registry: router {router_url} is reachable now") == 1
        assert text.count(f"router {router_url} is not reachable") == 1
    finally:
        if runner is not None:
            await runner.cleanup()
        proc.stop()
