#!/usr/bin/env python3
"""When a grid cell's sessions complete, off against both: where in a run a gain or a
loss is made.

A cell's sessions/min is its sessions over the run's makespan, so a run is won or lost
by when its last session ends. For each seed this runs one cell of the regime grid
(``scripts/regime_grid.py``) in the lab with admission off and both, and reports:

* for each share q of the fleet's (main) sessions, the time by which both had completed
  q of them over the time off took (below 1: both was ahead there);
* the last sessions of both to end: when they started and ended, how long admission held
  their own turns (the first one apart), and the longest any one of their subagents was
  held (a lead waits for its subagents).

    python scripts/completion_timeline.py subagents/long/16/2.5 --seeds 2,5
    python scripts/completion_timeline.py swe/long/48/1.5 --seeds 0 --last 3 --out t.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvlab.lab.runner import run_lab
from kvlab.regimes import parse_fleet
from kvlab.workload.model import WorkloadResult

QUANTILES = (0.25, 0.5, 0.75, 0.9, 1.0)


def _grid() -> ModuleType:
    path = Path(__file__).resolve().parent / "regime_grid.py"
    spec = importlib.util.spec_from_file_location("regime_grid", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["regime_grid"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def time_to(ends: Sequence[float], q: float) -> float:
    """The time by which a share ``q`` (0-1] of ``ends`` had passed: the ceil(q x n)-th
    smallest end."""
    if not ends or not 0 < q <= 1:
        raise ValueError(f"need ends and 0 < q <= 1, got {len(ends)} ends, q={q}")
    ordered = sorted(ends)
    k = max(1, math.ceil(q * len(ordered) - 1e-9))  # (q x n may come out as 3.0000001)
    return ordered[min(k, len(ordered)) - 1]


def quantile_ratios(
    ends_both: Sequence[float], ends_off: Sequence[float], quantiles: Sequence[float] = QUANTILES
) -> dict[str, float]:
    """Per share q, both's time to complete it over off's (below 1: both ahead)."""
    out: dict[str, float] = {}
    for q in quantiles:
        off = time_to(ends_off, q)
        out[f"{q:g}"] = round(time_to(ends_both, q) / off, 3) if off > 0 else float("nan")
    return out


def last_sessions(result: WorkloadResult, n: int) -> list[dict[str, Any]]:
    """The ``n`` main sessions that ended last, with the admission waits on their path."""
    held: dict[str, float] = defaultdict(float)  # a session's turns after its first
    first: dict[str, float] = {}
    for t in result.turns:
        wait = (t.admission_wait_ms or 0.0) / 1000.0
        if t.first:
            first[t.session_id] = wait
        else:
            held[t.session_id] += wait
    subagent_wait: dict[str, float] = defaultdict(float)  # the longest of a lead's subagents
    for s in result.sessions:
        if s.parent is not None:
            total = first.get(s.session_id, 0.0) + held[s.session_id]
            subagent_wait[s.parent] = max(subagent_wait[s.parent], total)
    ended = sorted(
        (s for s in result.main_sessions if s.end_s is not None), key=lambda s: s.end_s or 0.0
    )
    return [
        {
            "session": s.session_id,
            "start_s": round(s.start_s, 1),
            "end_s": round(s.end_s or 0.0, 1),
            "turns": s.turns_done,
            "first_turn_wait_s": round(first.get(s.session_id, 0.0), 1),
            "later_turns_wait_s": round(held[s.session_id], 1),
            "longest_subagent_wait_s": round(subagent_wait[s.session_id], 1),
        }
        for s in ended[-n:]
    ]


def _ends(result: WorkloadResult) -> list[float]:
    return [s.end_s for s in result.main_sessions if s.ok and s.end_s is not None]


def run_seed(grid: ModuleType, fleet: Any, seed: int, last: int) -> dict[str, Any]:
    runs = {p: run_lab(grid.Job(fleet, p, seed=seed).config()) for p in ("off", "both")}
    off, both = runs["off"], runs["both"]
    metric = fleet.metric()
    return {
        "cell": fleet.key,
        "seed": seed,
        "both_over_off": round(both.summary[metric] / off.summary[metric], 3),
        "makespan_s": {p: r.summary["makespan_s"] for p, r in runs.items()},
        "time_to_share_both_over_off": quantile_ratios(_ends(both.workload), _ends(off.workload)),
        "last_of_both": last_sessions(both.workload, last),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cell", help="workload/context/size/ratio, as the grid names cells")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--last", type=int, default=4, help="how many of the last sessions")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    grid = _grid()
    try:
        fleet = parse_fleet(args.cell)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        ap.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not seeds or args.last < 1:
        ap.error("need at least one seed and --last of at least 1")
    rows = [run_seed(grid, fleet, seed, args.last) for seed in seeds]
    for row in rows:
        shares = " ".join(f"{q}: {v:.2f}" for q, v in row["time_to_share_both_over_off"].items())
        print(f"{row['cell']} seed {row['seed']}: both / off {row['both_over_off']:.3f}")
        print(f"  time to complete a share, both / off: {shares}")
        for s in row["last_of_both"]:
            print(
                f"  {s['session']}: {s['start_s']:.0f}-{s['end_s']:.0f} s, first turn held "
                f"{s['first_turn_wait_s']:.0f} s, later turns {s['later_turns_wait_s']:.0f} s, "
                f"its longest-held subagent {s['longest_subagent_wait_s']:.0f} s"
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": "python scripts/completion_timeline.py " + " ".join(argv or sys.argv[1:]),
            "commit": grid.git_revision(),
            "rows": rows,
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
