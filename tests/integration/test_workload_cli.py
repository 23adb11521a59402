"""``kvproxy workload`` (the CLI, a subprocess) against simulated engines through the real
router (smg), with and without kvproxy in front, on a tiny run."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from kvlab import stack
from tests.helpers import header_of

from .conftest import MakeProxy, recorded, wait_until

pytestmark = pytest.mark.usefixtures("router")

# The engines run at time scale 0.05; the driver scales tool latencies the same way.
TINY = ("--set", "turns_median=3", "--set", "turns_lo=2", "--set", "turns_hi=4")


async def _cli(*args: str, timeout_s: float = 120.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy.workload",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode() + err.decode()


async def test_cli_runs_swe_through_kvproxy_and_closes_every_session(
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
    engine_urls: list[str],
    tmp_path: Path,
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    seed = random.randrange(10**8, 10**9)  # unique session ids on the shared engines
    out_path = tmp_path / "run.json"
    engines = [a for url in engine_urls for a in ("--engine", url)]
    rc, text = await _cli(
        "--base-url",
        proxy.url,
        "--workload",
        "swe",
        "--token-scale",
        "16",
        "--sessions",
        "4",
        "--concurrency",
        "2",
        "--seed",
        str(seed),
        "--time-scale",
        "0.05",
        *TINY,
        *engines,
        "--json",
        str(out_path),
        "--quiet",
    )
    assert rc == 0, text
    doc = json.loads(out_path.read_text())
    s = doc["summary"]
    assert doc["spec"]["name"] == "swe" and doc["spec"]["token_scale"] == 16
    assert s["sessions"] == 4 and s["sessions_failed"] == 0
    assert s["turns"] >= 8 and s["closes_ok"] == 4
    assert s["cached_tokens"] > 0  # at least the shared system prompt
    assert s["engine_prompt_tokens"] == s["prompt_tokens"]
    prefix = f"swe-{seed}-"
    gens = [
        r
        for r in await recorded(http, engine_urls, path="/generate")
        if str(orjson.loads(r["body"]).get("session_id", "")).startswith(prefix)
    ]
    assert len(gens) == s["requests"]
    for r in gens:
        body = orjson.loads(r["body"])
        # The routing key is the session id on every request and reaches the engine
        # through the router (smg forwards it; kvproxy put the id into the body).
        assert header_of(r, "X-SMG-Routing-Key") == body["session_id"]
        assert body["sampling_params"]["ignore_eos"] is True
        assert len(body["input_ids"]) + body["sampling_params"]["max_new_tokens"] <= 2560
    sids = {orjson.loads(r["body"])["session_id"] for r in gens}
    assert len(sids) == 4

    async def all_closed() -> bool:
        closes = await recorded(http, engine_urls, path="/close_session")
        closed = {orjson.loads(c["body"]).get("session_id") for c in closes}
        return sids <= closed

    # kvproxy's lifecycle tells the engines; the close completes asynchronously.
    await wait_until(all_closed, timeout_s=20, what="every session closed at the engines")


async def test_cli_replays_the_sample_trace_against_the_router(
    router: stack.ManagedProcess, tmp_path: Path
) -> None:
    out_path = tmp_path / "trace.json"
    seed = random.randrange(10**8, 10**9)
    rc, text = await _cli(
        "--base-url",
        router.url,
        "--workload",
        "trace:sample",
        "--token-scale",
        "16",
        "--concurrency",
        "4",
        "--seed",
        str(seed),
        "--time-scale",
        "0.05",
        "--json",
        str(out_path),
        "--quiet",
    )
    assert rc == 0, text
    s = json.loads(out_path.read_text())["summary"]
    assert s["workload"] == "trace" and s["sessions"] == 8 and s["sessions_failed"] == 0
    assert s["turns"] == 35  # every turn of the sample


async def test_cli_rejects_a_bad_parameter_with_exit_code_2() -> None:
    rc, text = await _cli("--base-url", "http://127.0.0.1:9", "--set", "turn_median=3")
    assert rc == 2
    assert "unknown workload parameter 'turn_median'" in text
