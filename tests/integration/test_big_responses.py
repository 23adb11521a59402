"""What a response over the buffered limit tells admission, through the real stack.

A ``/generate`` answer with ``return_logprob`` for 31,000 output tokens is over 1 MB: the
proxy relays it in chunks instead of buffering it, and its counts sit at the start of
``meta_info``, about a third of the way in, before the logprob list. Program admission
must still learn the session's context from them (prompt + completion as the engine
reported, not the request's budget).

One simulated engine (fast clock: the 31,000 tokens take well under a second) and the
real router with consistent hashing (program admission mirrors its ring), own fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvlab import stack
from kvproxy.keys import ADMISSION

from .conftest import Proxy, StartProxy, program_ready, wait_until

POOL = 100_000
OUTPUT_TOKENS = 31_000
ENGINE_ARGS = ("--time-scale", "0.001", "--record-requests", "64")


@pytest.fixture(scope="module")
def big_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.ManagedProcess]:
    with stack.sim_engines(
        1,
        max_total_tokens=POOL,
        extra_args=ENGINE_ARGS,
        log_dir=tmp_path_factory.mktemp("big-stack"),
    ) as started:
        yield started[0]


@pytest.fixture(scope="module")
def big_router(
    big_engine: stack.ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.ManagedProcess]:
    with stack.start_router(
        [big_engine.url],
        policy="consistent_hashing",
        log_dir=Path(tmp_path_factory.mktemp("big-router")),
    ) as proc:
        yield proc


async def _program_proxy(router: stack.ManagedProcess, start_proxy: StartProxy) -> Proxy:
    p = await start_proxy(
        {
            "server": {"log_level": "WARNING"},
            "router": {
                "url": router.url,
                "policy": "consistent_hashing",
                "discovery_interval_s": 0.5,
            },
            "session_lifecycle": {"enabled": True},
            "admission": {"enabled": True, "poll_interval_s": 0.2, "headroom": 1.0},
        }
    )
    await wait_until(program_ready(p), timeout_s=10, what="placement known")
    return p


async def test_a_chunked_response_over_a_megabyte_reports_its_counts_to_admission(
    big_router: stack.ManagedProcess, start_proxy: StartProxy, http: aiohttp.ClientSession
) -> None:
    p = await _program_proxy(big_router, start_proxy)
    sid = "big-response-1"
    prompt = [7 + i % 900 for i in range(300)]
    body: dict[str, Any] = {
        "input_ids": prompt,
        # A budget above what the engine will generate: the context must be the reported
        # one, not this estimate.
        "sampling_params": {
            "max_new_tokens": 40_000,
            "custom_params": {"sim_output_len": OUTPUT_TOKENS},
        },
        "return_logprob": True,
    }
    headers = {"X-Session-ID": sid}
    async with http.post(f"{p.url}/generate", json=body, headers=headers) as resp:
        data = await resp.read()
        assert resp.status == 200, data[:200]
    assert len(data) > 1024 * 1024  # over the buffered-response limit: relayed in chunks
    meta = orjson.loads(data)["meta_info"]
    assert meta["completion_tokens"] == OUTPUT_TOKENS
    # The counts are far from the end: a window over the body's tail would not see them.
    assert len(data) - data.find(b'"prompt_tokens"') > 512 * 1024

    session = p.app[ADMISSION].program.ledger.get(sid)
    assert session is not None
    assert session.turns == 1
    assert session.ctx == meta["prompt_tokens"] + OUTPUT_TOKENS
