"""In-process admission benchmark (no network).

Measures, through the public ``AdmissionController.admit`` API:

* fast path: admit + release with an empty FIFO, in one coroutine (decisions/s);
* queued: with N requests waiting behind an exhausted ledger, a steady state in which
  every release grants the FIFO head and a new request joins the tail, so the FIFO
  stays at N. Cost per decision (one grant or one wait), including the asyncio task
  wake-ups a real proxy pays;
* cancellation of waiters in the middle of a FIFO of N;
* ``parse_engine_metrics`` on a ~170-family SGLang metrics text, next to a
  line-by-line ``str.startswith`` filter for comparison.

Prints markdown tables. Usage::

    .venv/bin/python scripts/bench_admission.py [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

from multidict import CIMultiDict

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import AdmissionRequest
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.engine_metrics import parse_engine_metrics

ENGINE = "http://engine:1"
HEADERS: CIMultiDict[str] = CIMultiDict()


def request(ticket: str, tokens: int) -> AdmissionRequest:
    body = {"input_ids": [0] * tokens, "sampling_params": {"max_new_tokens": 0}}
    return AdmissionRequest(ticket, "/generate", HEADERS, body, None)


async def controller(capacity: int) -> AdmissionController:
    text = f"sglang:max_total_num_tokens {capacity}\nsglang:token_usage 0.1\n"

    async def fetch(_: str) -> str:
        return text

    cfg = AdmissionConfig(
        enabled=True,
        headroom=1.0,
        max_wait_s=3600.0,
        poll_interval_s=3600.0,
        max_queue=1_000_000,
    )
    ctl = AdmissionController(cfg, healthy_engines=lambda: [ENGINE], http=None, fetch_metrics=fetch)
    await ctl.start()
    return ctl


async def bench_fast_path(n: int) -> float:
    ctl = await controller(10**12)
    reqs = [request(f"t{i}", 64) for i in range(n)]
    gc.collect()
    t0 = time.perf_counter()
    for r in reqs:
        async with ctl.admit(r):
            pass
    elapsed = time.perf_counter() - t0
    await ctl.stop()
    return n / elapsed


async def bench_queued(waiters: int, cycles: int) -> float:
    """Seconds per decision with ``waiters`` queued (steady state)."""
    ctl = await controller(1)  # one request of 1 token fits at a time
    measured = asyncio.Event()
    drained = asyncio.Event()
    state = {"next": waiters, "left": cycles}
    tasks: set[asyncio.Task[None]] = set()

    async def one(ticket: str) -> None:
        async with ctl.admit(request(ticket, 1)):
            pass
        # Each exit granted the head; a new arrival keeps the FIFO at `waiters`.
        if state["left"] > 0:
            state["left"] -= 1
            if state["left"] == 0:
                measured.set()
            state["next"] += 1
            tasks.add(asyncio.create_task(one(f"r{state['next']}")))
        elif ctl.waiting == 0:
            drained.set()

    hold = ctl.admit(request("holder", 1))
    await hold.__aenter__()
    for i in range(waiters):
        tasks.add(asyncio.create_task(one(f"r{i}")))
    while ctl.waiting < waiters:  # noqa: ASYNC110 (let the tasks enqueue; no timing)
        await asyncio.sleep(0)
    gc.collect()
    t0 = time.perf_counter()
    await hold.__aexit__(None, None, None)  # starts the chain
    await measured.wait()
    elapsed = time.perf_counter() - t0
    await asyncio.wait_for(drained.wait(), 60)
    await ctl.stop()
    # `cycles` grants + `cycles` new waits.
    return elapsed / (2 * cycles)


async def bench_cancel(waiters: int, cancels: int) -> float:
    """Seconds per cancellation of a mid-FIFO waiter with ``waiters`` queued."""
    ctl = await controller(1)
    hold = ctl.admit(request("holder", 1))
    await hold.__aenter__()

    async def one(ticket: str) -> None:
        async with ctl.admit(request(ticket, 1)):
            pass

    tasks = [asyncio.create_task(one(f"r{i}")) for i in range(waiters)]
    while ctl.waiting < waiters:  # noqa: ASYNC110 (let the tasks enqueue; no timing)
        await asyncio.sleep(0)
    victims = random.Random(1).sample(tasks[1:], min(cancels, waiters - 1))
    gc.collect()
    t0 = time.perf_counter()
    for t in victims:
        t.cancel()
    await asyncio.gather(*victims, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    await ctl.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    await hold.__aexit__(None, None, None)
    return elapsed / len(victims)


def metrics_text(families: int = 170) -> str:
    """A 0.5.23-shaped text: the real KV gauges plus filler families and histograms."""
    labels = (
        'engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    )
    real = {
        "num_running_reqs": 24.0,
        "num_queue_reqs": 3.0,
        "token_usage": 0.42,
        "full_token_usage": 0.4219,
        "num_used_tokens": 191552.0,
        "kv_evictable_tokens": 141360.0,
        "max_total_num_tokens": 454000.0,
    }
    lines: list[str] = []
    for i in range(families):
        if i < len(real):
            name, value = list(real.items())[i]
        else:
            name, value = f"filler_metric_{i}", float(i)
        lines.append(f"# HELP sglang:{name} Help text of {name}.")
        if i % 10 == 9:  # every tenth family is a histogram
            lines.append(f"# TYPE sglang:{name} histogram")
            for le in ("0.005", "0.01", "0.05", "0.1", "0.5", "1.0", "5.0", "10.0", "+Inf"):
                lines.append(f'sglang:{name}_bucket{{{labels},le="{le}"}} 12.0')
            lines.append(f"sglang:{name}_count{{{labels}}} 12.0")
            lines.append(f"sglang:{name}_sum{{{labels}}} 3.5")
        else:
            lines.append(f"# TYPE sglang:{name} gauge")
            lines.append(f"sglang:{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


_NAMES = (
    "max_total_num_tokens",
    "token_usage",
    "full_token_usage",
    "num_used_tokens",
    "kv_evictable_tokens",
    "num_running_reqs",
    "num_queue_reqs",
)
_PREFIXES = tuple(p + n + s for p in ("sglang:", "sglang_") for n in _NAMES for s in ("{", " "))


def parse_by_lines(text: str) -> dict[str, float]:
    """Reference: split into lines, filter with str.startswith, split each kept line."""
    out: dict[str, float] = {}
    for line in text.split("\n"):
        if not line.startswith(_PREFIXES):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0][7:]
        try:
            v = float(value)
        except ValueError:
            continue
        if v > out.get(name, -1.0):
            out[name] = v
    return out


def time_call(fn: Callable[[], object], repeat: int = 7, number: int = 2000) -> float:
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best.append((time.perf_counter() - t0) / number)
    return statistics.median(best)


async def main_async() -> None:
    fast = [await bench_fast_path(100_000) for _ in range(3)]
    print("### Decisions, empty FIFO (admit + release, one coroutine)\n")
    print("| runs | decisions/s (median) | min | max |")
    print("|---|---|---|---|")
    print(f"| 3 x 100,000 | {statistics.median(fast):,.0f} | {min(fast):,.0f} | {max(fast):,.0f} |")

    print("\n### Cost per decision with N requests waiting (steady state)\n")
    print(
        "| waiters N | grant + wait: us / decision | decisions/s | cancel mid-FIFO: us / cancel |"
    )
    print("|---|---|---|---|")
    for n in (10, 100, 1_000, 10_000):
        per = statistics.median([await bench_queued(n, 20_000) for _ in range(3)])
        cancel = statistics.median([await bench_cancel(n, min(1_000, n - 1)) for _ in range(3)])
        print(f"| {n:,} | {per * 1e6:.2f} | {1 / per:,.0f} | {cancel * 1e6:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = ap.parse_args()
    loop_name = args.loop
    if loop_name == "uvloop":
        try:
            import uvloop
        except ImportError:
            loop_name = "asyncio"
        else:
            uvloop.install()
    print(
        f"Python {platform.python_version()} ({sys.implementation.name}), event loop {loop_name}, "
        f"{platform.machine()}\n"
    )
    asyncio.run(main_async())

    text = metrics_text()
    fams = sum(1 for ln in text.split("\n") if ln.startswith("# TYPE"))
    assert parse_engine_metrics(text).token_usage == 0.42
    t_parse = time_call(lambda: parse_engine_metrics(text))
    t_lines = time_call(lambda: parse_by_lines(text))
    print(f"\n### Parsing one engine's /metrics ({fams} families, {len(text):,} bytes)\n")
    print("| parser | us / parse |")
    print("|---|---|")
    print(f"| `parse_engine_metrics` (one whole-text regex) | {t_parse * 1e6:.1f} |")
    print(f"| line split + `str.startswith` filter (reference) | {t_lines * 1e6:.1f} |")


if __name__ == "__main__":
    main()
