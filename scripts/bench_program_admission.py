"""Cost of program admission on the event loop: admit + observe_usage + exit per
continuing turn, and one tick, in-process (no network).

Usage: python scripts/bench_program_admission.py
"""

from __future__ import annotations

import asyncio
import time

from multidict import CIMultiDict

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import AdmissionRequest
from kvproxy.config import AdmissionConfig


async def main(sessions=200, turns=20_000):
    urls = ["http://a:1", "http://b:1"]
    text = 'sglang:max_total_num_tokens{m="x"} 100000000\nsglang:token_usage{m="x"} 0.1\n'

    async def fetch(url):
        return text

    ctl = AdmissionController(
        AdmissionConfig(enabled=True, poll_interval_s=3600, staleness_s=3600),
        healthy_engines=lambda: urls,
        http=None,
        fetch_metrics=fetch,
        router_policy="consistent_hashing",
        server_info={u: {"radix_eviction_policy": "priority"} for u in urls},
    )
    await ctl.start()
    body = {"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100}}
    reqs = [
        AdmissionRequest(f"t{i}", "/generate", CIMultiDict(), body, f"s{i % sessions}")
        for i in range(turns)
    ]
    for r in reqs[:sessions]:
        async with ctl.admit(r):
            ctl.observe_usage(r, 2000, 1900, 100)
    reqs = reqs[sessions:]
    turns = len(reqs)
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        async with ctl.admit(r):
            ctl.observe_usage(r, 2000 + i // sessions, 1900, 100)
    dt = time.perf_counter() - t0
    ctl.tick()
    print(
        f"{sessions} sessions, {turns} turns: {dt / turns * 1e6:.1f} us per turn (admit+observe+exit); tick {len(ctl.program.ledger.sessions)} sessions"
    )
    t0 = time.perf_counter()
    ctl.tick()
    print(f"one tick: {(time.perf_counter() - t0) * 1e3:.2f} ms")
    await ctl.stop()


asyncio.run(main())
asyncio.run(main(sessions=2000))
