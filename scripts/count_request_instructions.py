#!/usr/bin/env python3
"""kvproxy's instructions per request, counted by valgrind: repeatable where time is not.

``bench_request_cpu.py`` measures CPU time per request, which moves by 20-40% between
rounds on a shared VM. This runs the same process (client and kvproxy in one event loop,
the upstream apart and not counted) under ``valgrind --tool=callgrind`` twice per target,
with ``--small`` and ``--large`` requests, and divides the difference of the two totals
by the difference of the request counts: start-up, imports and warm-up cancel out, and
what is left is the instructions one request costs. ``direct`` (the same client straight
to the upstream) is subtracted, so the last column is kvproxy's own.

    python scripts/count_request_instructions.py                 # 4 KB, every target
    python scripts/count_request_instructions.py --targets off,lifecycle --jobs 2

valgrind runs Python about 50 times slower: a target takes one to two minutes per run.
Work that runs by the clock runs about 50 times more often per request under valgrind
than at full speed: admission's metric poll is set to once every ``--poll-interval``
seconds (600: the first poll, awaited before the requests, is the only one), so that it
is not counted as the requests' cost; the dashboard's one-second sampler still runs. The
collector runs as ``kvproxy serve`` sets it (``--gc-threshold``, default
``server.gc_threshold``; 0 for Python's own).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchproxy.callgrind import count_instructions
from benchproxy.common import TARGETS

from kvproxy.config import ServerConfig

HERE = Path(__file__).resolve().parent


def _count(
    target: str, requests: int, body_kb: int, poll_s: float, gc_threshold: int, workdir: Path
) -> int:
    """Instructions of one ``bench_request_cpu.py`` run of ``requests`` to ``target``."""
    argv = [
        sys.executable,
        str(HERE / "bench_request_cpu.py"),
        f"--targets={target}",
        f"--requests={requests}",
        "--rounds=1",
        f"--body-kb={body_kb}",
        f"--poll-interval={poll_s}",
        f"--gc-threshold={gc_threshold}",
    ]
    out = workdir / f"{target}-{requests}.callgrind"
    return count_instructions(argv, out, f"{target} x {requests}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="comma list (direct first)")
    p.add_argument("--small", type=int, default=300, help="requests in the first run")
    p.add_argument("--large", type=int, default=900, help="requests in the second run")
    p.add_argument("--body-kb", type=int, default=4)
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=600.0,
        help="admission.poll_interval_s: long, so that the clock-driven poll (50x more "
        "often per request under valgrind) is not counted as the requests' cost",
    )
    p.add_argument(
        "--gc-threshold",
        type=int,
        default=ServerConfig().gc_threshold,
        help="server.gc_threshold, as kvproxy serve applies it (0: Python's own, 700)",
    )
    a = p.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    if (
        not targets
        or any(t not in TARGETS for t in targets)
        or a.large <= a.small
        or a.gc_threshold < 0
    ):
        p.error(
            f"targets from {','.join(TARGETS)}; --large must exceed --small; --gc-threshold >= 0"
        )
    if shutil.which("valgrind") is None:
        p.error("valgrind is not installed (Debian: apt-get install valgrind)")
    runs = [(t, n) for t in targets for n in (a.small, a.large)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        counted = pool.map(
            lambda r: _count(r[0], r[1], a.body_kb, a.poll_interval, a.gc_threshold, Path(tmp)),
            runs,
        )
        totals = dict(zip(runs, counted, strict=True))
    per = {t: (totals[t, a.large] - totals[t, a.small]) / (a.large - a.small) for t in targets}
    print(
        f"\ninstructions per request ({a.body_kb} KB bodies; "
        f"({a.large} - {a.small} requests) difference of callgrind totals; "
        f"collector threshold {a.gc_threshold or 'Python default'})\n"
    )
    print("| target | instructions / request | over direct (kvproxy's own) |")
    print("|---|---|---|")
    base = per.get("direct")
    for t in targets:
        over = "-" if base is None or t == "direct" else f"{per[t] - base:+,.0f}"
        print(f"| {t} | {per[t]:,.0f} | {over} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
