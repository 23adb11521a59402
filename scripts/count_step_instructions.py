"""Instructions per call of each pure step a feature adds to a request, counted by valgrind.

``count_request_instructions.py`` counts a whole request through the in-process stack;
this splits a feature's share of it into the pure steps the handler calls (the body
read, the plan, admission's decision with its release, the response headers), each
called in a loop on one 4 KB ``/generate`` body with an ``X-Session-ID``, 256 sessions
in turn, as ``bench_proxy.py`` sends. Each step runs under ``valgrind --tool=callgrind``
twice (``--small`` and ``--large`` calls); the difference of the totals over the
difference of the calls is the step's instructions per call (the loop's own cost
included: the ``loop`` row). Repeatable where time is not; about a minute per step.

    python scripts/count_step_instructions.py [--steps loop,scan,...] [--jobs 2]

Run with ``--step NAME --calls N`` it is the measured program itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchproxy.callgrind import count_instructions
from benchproxy.common import SESSIONS, SMALL_BODY_BYTES, make_body
from multidict import CIMultiDict, CIMultiDictProxy

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import AdmissionRequest
from kvproxy.config import Config
from kvproxy.proxy import pipeline
from kvproxy.proxy.handlers import _admission_headers

STEPS: dict[str, str] = {
    "loop": "the loop alone (subtract from the others)",
    "scan": "read_body with admission on (token ids located and counted)",
    "scan-lifecycle": "read_body with the lifecycle alone (located, not counted)",
    "plan": "plan_request, admission alone",
    "plan-lifecycle": "plan_request, the lifecycle alone",
    "decide": "AdmissionRequest, admit, decide_now, leave (an always-room ledger)",
    "decide-ring": "the same, program admission on a mirrored ring (one engine)",
    "headers": "the admission response headers' values",
}


async def _run_step(step: str, calls: int) -> None:
    raw = make_body(SMALL_BODY_BYTES)
    headers = [
        CIMultiDictProxy(
            CIMultiDict({"Content-Type": "application/json", "X-Session-ID": f"bench-{i}"})
        )
        for i in range(SESSIONS)
    ]
    sids = [f"bench-{i}" for i in range(SESSIONS)]
    tickets = [f"ticket-{i}" for i in range(calls)]
    base = Config()
    admission = dataclasses.replace(base.admission, enabled=True, poll_interval_s=3600.0)
    adm = dataclasses.replace(base, admission=admission)
    lc = dataclasses.replace(
        base, session_lifecycle=dataclasses.replace(base.session_lifecycle, enabled=True)
    )

    async def metrics(_: str) -> str:
        return "sglang:max_total_num_tokens 1000000000\nsglang:token_usage 0.1\n"

    engine = "http://127.0.0.1:1"
    ring = step == "decide-ring"
    ctl = AdmissionController(
        admission,
        healthy_engines=lambda: [engine],
        http=None,
        fetch_metrics=metrics,
        clock=asyncio.get_running_loop().time,
        # decide-ring: placement known, as with smg --policy consistent_hashing
        router_policy="consistent_hashing" if ring else None,
        workers=(lambda: ([engine], [engine])) if ring else None,
        server_info={engine: {"radix_eviction_policy": "priority"}} if ring else None,
    )
    await ctl.start()
    assert ctl.health().program.active == ring
    body = pipeline.read_body(adm, "/generate", raw)
    assert body is not None

    def decide(i: int) -> Any:
        req = AdmissionRequest(
            tickets[i], "/generate", headers[i % SESSIONS], body, sids[i % SESSIONS]
        )
        lease = ctl.admit(req)
        decision = lease.decide_now()
        lease.leave()
        return decision

    run: dict[str, Callable[[int], Any]] = {
        "loop": lambda i: None,
        "scan": lambda i: pipeline.read_body(adm, "/generate", raw),
        "scan-lifecycle": lambda i: pipeline.read_body(lc, "/generate", raw),
        "plan": lambda i: pipeline.plan_request(
            adm, "/generate", None, headers[i % SESSIONS], body
        ),
        "plan-lifecycle": lambda i: pipeline.plan_request(
            lc, "/generate", None, headers[i % SESSIONS], body
        ),
        "decide": decide,
        "decide-ring": decide,
        "headers": lambda i: _admission_headers("admit", "capacity_available", 0.0),
    }
    fn = run[step]
    for i in range(calls):
        fn(i)
    await ctl.stop()


def _count(step: str, calls: int, workdir: Path) -> int:
    argv = [sys.executable, __file__, "--step", step, "--calls", str(calls)]
    out = workdir / f"{step}-{calls}.callgrind"
    return count_instructions(argv, out, f"{step} x {calls}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEPS), help="comma list of %(default)s")
    p.add_argument("--small", type=int, default=2000, help="calls in the first run")
    p.add_argument("--large", type=int, default=6000, help="calls in the second run")
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    p.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.step is not None:  # the measured program
        asyncio.run(_run_step(a.step, a.calls))
        return 0
    steps = [s for s in a.steps.split(",") if s]
    if not steps or any(s not in STEPS for s in steps) or a.large <= a.small:
        p.error(f"steps from {','.join(STEPS)}; --large must exceed --small")
    if shutil.which("valgrind") is None:
        p.error("valgrind is not installed (Debian: apt-get install valgrind)")
    runs = [(s, n) for s in steps for n in (a.small, a.large)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        totals = dict(zip(runs, pool.map(lambda r: _count(*r, Path(tmp)), runs), strict=True))
    print(f"\ninstructions per call ({a.large} - {a.small} calls, 4 KB body)\n")
    print("| step | what | instructions / call |")
    print("|---|---|---|")
    for s in steps:
        per = (totals[s, a.large] - totals[s, a.small]) / (a.large - a.small)
        print(f"| {s} | {STEPS[s]} | {per:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
