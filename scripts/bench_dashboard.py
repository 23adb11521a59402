#!/usr/bin/env python3
"""What the dashboard costs kvproxy: one sample per second, and the data a page asks for.

Times, in process, with the real series definitions:
  record     Timeline.record of one reading (what the 1 Hz sampler does)
  first load since(0) + orjson.dumps of a full history (900 samples), as a page opening
  poll       since(last - 1) + orjson.dumps, as a page polling once a second

Usage:
    python scripts/bench_dashboard.py [--engines 8] [--repeat 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import orjson

from kvproxy.admin.dashboard import HISTORY, new_timeline
from kvproxy.admin.timeline import Reading
from kvproxy.admin.views import RATE_SERIES, RATIO_SERIES

GAUGES = [
    "waiting",
    "waiting_new",
    "waiting_continuing",
    "oldest_wait_s",
    "ceiling",
    "committed",
    "reserved",
    "resident",
    "sessions_open",
    "sessions_closing",
]


def reading(i: int, engines: int) -> Reading:
    counters = {c: float(i * 3) for c in RATE_SERIES.values()}
    for num, den in RATIO_SERIES.values():
        counters[num] = i * 0.5
        counters[den] = float(i)
    return Reading(
        counters=counters,
        gauges={g: float(i % 97) for g in GAUGES},
        engines={f"http://10.0.0.{e}:30000": (i % 100) / 100 for e in range(engines)},
    )


def timed_us(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e6)
    runs.sort()
    return statistics.median(runs), runs[int(len(runs) * 0.99) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()

    timeline = new_timeline()
    readings = [reading(i, a.engines) for i in range(HISTORY)]
    step = iter(range(10**9))
    for r in readings:
        timeline.record(float(next(step)), 0.0, r)

    def record() -> None:
        i = next(step)
        timeline.record(float(i), 0.0, readings[i % HISTORY])

    first = orjson.dumps({"samples": timeline.since(0)})
    poll = orjson.dumps({"samples": timeline.since(timeline.last_seq - 1)})
    rows = [
        ("record (1 Hz sampler)", timed_us(record, a.repeat), None),
        (
            f"first load ({HISTORY} samples)",
            timed_us(lambda: orjson.dumps({"samples": timeline.since(0)}), a.repeat),
            len(first),
        ),
        (
            "poll (1 new sample)",
            timed_us(
                lambda: orjson.dumps({"samples": timeline.since(timeline.last_seq - 1)}), a.repeat
            ),
            len(poll),
        ),
    ]
    print(f"engines: {a.engines}, repeat: {a.repeat}\n")
    print("| operation | p50 us | p99 us | JSON bytes |\n|---|---|---|---|")
    for name, (p50, p99), size in rows:
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {'-' if size is None else f'{size:,}'} |")


if __name__ == "__main__":
    main()
