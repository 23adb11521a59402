"""``kvproxy doctor`` against real stacks: the real router (smg) and simulated engines.

The good stack is the session's shared one (session radix cache, priority eviction,
request recording). The bad stack has one engine per set of bad flags; each bad flag
must show up as its own non-ok line naming the fix. A legacy router is stood in for by
a tiny aiohttp app answering ``/workers`` in sglang-router 0.3's shape.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvproxy.doctor.checks import Line, Status
from kvproxy.doctor.cli import diagnose

from .conftest import ENGINE_ARGS, ENGINE_TOKENS


def _run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvproxy", "doctor", "--timeout", "5", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _hit(lines: list[Line], subject: str, needle: str) -> Line:
    hits = [ln for ln in lines if ln.subject == subject and needle in ln.message]
    assert len(hits) == 1, "\n".join(ln.render() for ln in lines)
    return hits[0]


def test_good_stack_passes_and_the_probe_reaches_an_engine(
    router: stack.ManagedProcess, engine_urls: list[str], tmp_path: Path
) -> None:
    cfg = tmp_path / "k.yaml"
    cfg.write_text(
        f"router:\n  url: {router.url}\nsession_lifecycle:\n  enabled: true\n"
        "admission:\n  enabled: true\n"
    )
    proc = _run_doctor("--router-url", router.url, "--config", str(cfg), "--probe")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert not [line for line in out if line.startswith("fail")], proc.stdout
    assert f"ok    config: {cfg} is valid: session_lifecycle on, admission on" in proc.stdout
    assert "package smg (smg-" in proc.stdout
    for url in engine_urls:
        assert f"ok    engine {url}: session radix cache on" in out
        assert f"ok    engine {url}: radix eviction policy priority" in out
        assert any(line.startswith(f"ok    engine {url}: /metrics parseable") for line in out)
        assert f"ok    engine {url}: KV pool tokens {ENGINE_TOKENS}, tp 1, dp 1" in out
    probes = [line for line in out if line.startswith("ok    probe: session_id kvproxy-doctor-")]
    assert len(probes) == 1, proc.stdout
    assert any(probes[0].endswith(f" reached {url}") for url in engine_urls), probes
    assert out[-1].startswith("doctor: ") and out[-1].endswith(" 0 fail")


@pytest.fixture(scope="module")
def bad_stack(stack_logs: Path) -> Iterator[tuple[stack.ManagedProcess, dict[str, str]]]:
    """Two engines, each with bad flags; the router in front of both."""
    specs = {
        # neither session mechanism, LRU eviction, /metrics failing (HTTP 500)
        "plain": ("plain", "lru", ("--fault-metrics", "error")),
        # streaming sessions only, /metrics not SGLang's; priority scheduling off in both
        "streaming": ("streaming", "priority", ("--fault-metrics", "garbage")),
    }
    started: list[stack.ManagedProcess] = []
    urls: dict[str, str] = {}
    try:
        for name, (mode, eviction, extra) in specs.items():
            proc = stack.start_sim_engine(
                max_total_tokens=ENGINE_TOKENS,
                mode=mode,
                eviction_policy=eviction,
                extra_args=(*ENGINE_ARGS, *extra),
                log_dir=stack_logs,
                name=f"doctor-{name}",
            )
            started.append(proc)
            urls[name] = proc.url
        router = stack.start_router(list(urls.values()), log_dir=stack_logs)
        started.append(router)
        yield router, urls
    finally:
        for proc in reversed(started):
            proc.stop()


async def test_each_bad_engine_flag_is_detected(
    bad_stack: tuple[stack.ManagedProcess, dict[str, str]],
) -> None:
    router, urls = bad_stack
    lines = await diagnose(router.url, None, False, 5.0)
    plain, streaming = f"engine {urls['plain']}", f"engine {urls['streaming']}"
    expected = [
        (
            plain,
            "neither the session radix cache nor streaming",
            Status.FAIL,
            "--enable-session-radix-cache",
        ),
        (plain, "radix eviction policy lru", Status.WARN, "--radix-eviction-policy priority"),
        (plain, "priority scheduling off", Status.WARN, "--enable-priority-scheduling"),
        (plain, "/metrics answered HTTP 500", Status.FAIL, "engine's log"),
        (streaming, "streaming sessions only", Status.WARN, "--enable-session-radix-cache"),
        (streaming, "priority scheduling off", Status.WARN, "--enable-priority-scheduling"),
        (streaming, "/metrics is not parseable", Status.FAIL, "--enable-metrics"),
        ("engines", "different session modes (none, streaming)", Status.WARN, "same session flags"),
    ]
    for subject, needle, status, fix in expected:
        line = _hit(lines, subject, needle)
        assert line.status is status, line.render()
        assert line.fix is not None and fix in line.fix, line.render()
    # The streaming engine evicts by priority: nothing to say about that there.
    assert not [
        ln
        for ln in lines
        if ln.subject == streaming and "eviction" in ln.message and ln.status is not Status.OK
    ]


def test_bad_stack_exits_1(bad_stack: tuple[stack.ManagedProcess, dict[str, str]]) -> None:
    router, _ = bad_stack
    proc = _run_doctor("--router-url", router.url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].endswith(" 3 fail")


def test_unreachable_router_and_invalid_config_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("admission:\n  headrom: 0.5\n")
    url = f"http://127.0.0.1:{stack.free_port()}"
    proc = _run_doctor("--router-url", url, "--config", str(bad))
    assert proc.returncode == 1
    out = proc.stdout.splitlines()
    assert out[0].startswith(
        f"fail  config: {bad} is invalid: admission.headrom: unknown key; "
        "did you mean admission.headroom?"
    )
    assert out[1].startswith(f"fail  router {url}: not reachable (")
    assert out[1].endswith("Fix: start the router, or pass the URL it listens on with --router-url")


@pytest.fixture
async def legacy_router(engine_urls: list[str]) -> AsyncIterator[str]:
    """sglang-router 0.3's /workers: the worker list with "metadata" instead of "labels"."""

    async def workers(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "workers": [
                    {"url": u, "model_id": "m", "is_healthy": True, "metadata": {}}
                    for u in engine_urls
                ]
            }
        )

    async def generate(request: web.Request) -> web.Response:
        # Like sglang-router 0.3: the typed request drops the top-level session_id.
        body = await request.json()
        body.pop("session_id", None)
        async with (
            aiohttp.ClientSession() as http,
            http.post(engine_urls[0] + "/generate", json=body) as resp,
        ):
            return web.Response(status=resp.status, body=await resp.read())

    app = web.Application()
    app.router.add_get("/workers", workers)
    app.router.add_post("/generate", generate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_a_legacy_router_fails_the_package_check(
    legacy_router: str, engine_urls: list[str]
) -> None:
    lines = await diagnose(legacy_router, None, False, 5.0)
    line = _hit(lines, f"router {legacy_router}", "package sglang-router")
    assert line.status is Status.FAIL
    assert "drops a top-level session_id" in line.message
    assert line.fix is not None and "smg >= 1.5" in line.fix
    # The engines behind it are still checked.
    for url in engine_urls:
        assert _hit(lines, f"engine {url}", "session radix cache on").status is Status.OK


async def test_the_probe_finds_a_router_that_drops_session_id(
    legacy_router: str, engine_urls: list[str]
) -> None:
    lines = await diagnose(legacy_router, None, True, 5.0)
    probe = [ln for ln in lines if ln.subject == "probe"]
    assert len(probe) == 1, [ln.render() for ln in lines]
    assert probe[0].status is Status.FAIL
    assert probe[0].message.endswith(
        f"reached {engine_urls[0]} without its session_id: the router drops it"
    )
    assert probe[0].fix is not None and "smg >= 1.5" in probe[0].fix
