#!/usr/bin/env python3
"""Real-stack confirmation of issue #12's headline cells: simulated engines over HTTP
(calibrated presets), the real router (smg ``consistent_hashing``, the deployment
contract) and kvproxy with its documented defaults, each cell ``off`` vs ``both``
(optionally ``lifecycle`` / ``admission``) over seeds on a freshly started stack.

Cells (live working set / fleet pool, per engine: live sessions x mean context per call):
  w1            W1 swe on qwen3-8b-h100, ~2x the pool
  w2            W2 rl on qwen3-32b-h200, ~3.6x the pool
  w3            W3 subagents on qwen3-8b-h100, ~2x the pool (main sessions' context)
  not-kv-bound  W1 swe at 0.5x the pool (every configuration should match off)
  burst         the replication's step 06 (scripts/replication.py): one engine on the
                preset qwen3-coder-30b-a3b-fp8-h100-tp2 (its own pool), 80 burst sessions
                that start together (3 turns, ~61k tokens, about 2.2x the pool), time
                scale 0.1; the headline is output tokens/s, the target 1.4x
  w1-full, w2-full, w3-full, not-kv-bound-full
                the lab's tables' shapes (docs/benchmarks.md, "Program admission: safe to leave on"):
                each preset's sessions per engine and pool (W1 48, W2 64, W3 24, 10 for
                not-kv-bound), compressed to time scale 0.05
  workload/context/size/ratio
                a cell of the regime grid (scripts/regime_grid.py), e.g. swe/short/4/2.5:
                its pool, and its sessions placed on the engines as the lab places them,
                at time scale 0.25 (short contexts) or 0.05 (long); the target is the grid's
                0.97x of off

    python scripts/bench_rollout.py --cells w1 --seeds 0,1          # docs/benchmarks.md
    python scripts/bench_rollout.py                                  # every cell, seeds 0,1 (over an hour)
    python scripts/bench_rollout.py --cells w1 --variants off,lifecycle,admission,both
    python scripts/bench_rollout.py --cells swe/short/4/2.5,subagents/long/16/2.5
    python scripts/bench_rollout.py --cells swe/long/32/4 --hicache   # off+HiCache vs both+HiCache

Writes ``<out>/bench.json`` (every run, with provenance: commit, command, seeds, host
load, the engines' clock overrun) and ``<out>/bench.md`` (a table per cell), and prints
the markdown. The machinery is kvlab.rollout's (the same code as ``kvproxy demo``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvlab.lab.cli import seed_list
from kvlab.provenance import git_revision
from kvlab.regimes import parse_fleet
from kvlab.rollout import (
    DEMO_W1,
    METRICS,
    VARIANTS_BY_NAME,
    Scenario,
    Variant,
    parse_variants,
    pid_alive,
    ratio,
    run_scenario,
    sigterm_as_interrupt,
    verdict,
    with_host_tier,
)
from kvlab.sim.config import HICACHE_WRITE_POLICIES
from kvlab.workload.model import SUBAGENT_IDENTITIES
from kvproxy.config import AdmissionConfig

# Concurrency is scaled down from the presets' (48, 64 and 24 sessions per engine) and
# the pool with it, so the working set / pool ratio is the calibrated one and a run takes
# minutes at time scale 0.25.
CELLS: dict[str, Scenario] = {
    "w1": Scenario(name="w1", workload="swe", sessions_per_engine=16, pool_ratio=2.0),
    # The lab's headline shape (the swe preset's 48 live sessions per engine), compressed
    # in time: the demo's scenario.
    "w1-full": dataclasses.replace(DEMO_W1, name="w1-full"),
    "w2": Scenario(
        name="w2",
        workload="rl",
        cost_model="qwen3-32b-h200",
        sessions_per_engine=16,
        pool_ratio=3.6,
    ),
    "w3": Scenario(name="w3", workload="subagents", sessions_per_engine=8, pool_ratio=2.0),
    "not-kv-bound": Scenario(
        name="not-kv-bound", workload="swe", sessions_per_engine=16, pool_ratio=0.5
    ),
    # The lab's W2, W3 and not-kv-bound tables at their own size: the preset's pool
    # (pool_ratio None) and sessions per engine, the demo's time compression and timeouts.
    "w2-full": dataclasses.replace(
        DEMO_W1,
        name="w2-full",
        workload="rl",
        cost_model="qwen3-32b-h200",
        sessions_per_engine=64,
        pool_ratio=None,
        # off's makespan is about 7,200 simulated seconds (lab, 256 sessions).
        run_timeout_sim_s=14_400.0,
    ),
    "w3-full": dataclasses.replace(
        DEMO_W1, name="w3-full", workload="subagents", sessions_per_engine=24, pool_ratio=None
    ),
    "not-kv-bound-full": dataclasses.replace(
        DEMO_W1, name="not-kv-bound-full", sessions_per_engine=10, pool_ratio=None
    ),
    # The replication's step 06 (its lab arm: scripts/replication.py, experiment "06"):
    # one engine, the preset's pool, every session arriving at once. Off's makespan is
    # about 475 simulated seconds (lab), so a run takes under a minute of wall time.
    "burst": Scenario(
        name="burst",
        workload="burst",
        cost_model="qwen3-coder-30b-a3b-fp8-h100-tp2",
        engines=1,
        sessions_per_engine=80,
        sessions=80,
        pool_ratio=None,
        time_scale=0.1,
        run_timeout_sim_s=3600.0,
        request_timeout_sim_s=AdmissionConfig().new_session_max_wait_s + 600.0,
    ),
}
# A cell's headline metric and its issue #12 target for both / off (None: >= 0.98x).
HEADLINE: dict[str, tuple[str, float]] = {
    "w1": ("sessions_per_min", 2.0),
    "w1-full": ("sessions_per_min", 2.0),
    "w2": ("output_tokens_per_s", 1.5),
    "w3": ("sessions_per_min", 1.3),
    "not-kv-bound": ("sessions_per_min", 0.98),
    "w2-full": ("output_tokens_per_s", 1.5),
    "w3-full": ("sessions_per_min", 1.3),
    "not-kv-bound-full": ("sessions_per_min", 0.98),
    "burst": ("output_tokens_per_s", 1.4),
}
# A grid cell's target: the regime grid's, no run below 0.97x off.
GRID_TARGET = 0.97


def grid_cell(name: str) -> Scenario:
    """A regime grid cell (``workload/context/size/ratio``) through the real stack: the
    lab's pool and placement, a time scale the engines keep up with on 2 cores."""
    fleet = parse_fleet(name)
    pool, _ = fleet.pool()
    return dataclasses.replace(
        fleet.scenario(),
        pool_tokens=pool,
        lab_placement=True,
        time_scale=0.25 if fleet.context == "short" else 0.05,
        # rl's long fleets run for up to about 5,000 simulated seconds off (lab).
        run_timeout_sim_s=14_400.0,
        request_timeout_sim_s=2_400.0,
    )


def scenario_for(cell: str) -> Scenario:
    return CELLS[cell] if cell in CELLS else grid_cell(cell)


def configure(
    cell: str,
    *,
    time_scale: float | None = None,
    hicache: bool = False,
    hicache_write_policy: str | None = None,
    subagent_identity: str = "own",
) -> Scenario:
    """The cell's scenario with the command line's changes, checked: another time
    scale, engines with SGLang's host tier (a host pool twice the device pool, as
    the lab's ``--hicache``) in every configuration, and how W3's subagents name
    themselves (``own``, ``parent``: naming their lead, ``shared``: their lead's id)."""
    sc = scenario_for(cell)
    if time_scale is not None:
        sc = dataclasses.replace(sc, time_scale=time_scale)
    if subagent_identity != "own":
        overrides = {**sc.workload_overrides, "subagent_identity": subagent_identity}
        sc = dataclasses.replace(sc, workload_overrides=overrides)
    if hicache:
        sc = with_host_tier(sc, hicache_write_policy)
    sc.check()
    return sc


def headline(cell: str) -> tuple[str, float]:
    """A cell's headline metric and its target for both / off."""
    if cell in HEADLINE:
        return HEADLINE[cell]
    return parse_fleet(cell).metric(), GRID_TARGET


def _cells(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(CELLS)
    if not names:
        raise argparse.ArgumentTypeError(f"cells: 'all' or a subset of {', '.join(CELLS)}")
    for name in names:
        if name in CELLS:
            continue
        if "/" not in name:
            raise argparse.ArgumentTypeError(
                f"cells: {name!r} is neither one of {', '.join(CELLS)} nor a grid cell "
                "(workload/context/size/ratio)"
            )
        try:
            parse_fleet(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"cells: {exc}") from None
    return names


def markdown(cell: str, result: Mapping[str, Any], base: str = "off") -> str:
    """One cell as a markdown table: medians, ratios to ``base``, verdicts, provenance."""
    meds = result["medians"]
    names = list(meds)
    others = [n for n in names if n != base]
    sc = result["scenario"]
    lines = [
        f"#### {cell}: {sc['workload']} on {sc['engines']} x {sc['cost_model']} "
        f"(K={sc['token_scale']}), {sc['concurrency']} live sessions, {sc['total_sessions']} a "
        f"run, live working set {sc['working_set_over_pool']}x the pool "
        f"({sc['pool_tokens_per_engine']:,} tokens per engine), time scale {sc['time_scale']:g}",
        "",
        "| metric (median, simulated time) | "
        + " | ".join(names)
        + "".join(f" | {n}/{base}" for n in others)
        + " |",
        "|---" * (1 + len(names) + len(others)) + "|",
    ]
    for key, label, fmt, _ in METRICS:
        cells = ["-" if meds[n].get(key) is None else fmt.format(meds[n][key]) for n in names]
        for n in others:
            r = ratio(meds[n].get(key), meds[base].get(key))
            cells.append("-" if r is None else f"{r:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    if base in meds:
        for n in others:
            lines.append(f"- {verdict(n, meds[n], meds[base])}")
        key, target = headline(cell)
        for n in others:
            r = ratio(meds[n].get(key), meds[base].get(key))
            if r is not None:
                met = "met" if r >= target else "missed"
                lines.append(f"- {n}: {key} {r:.2f}x of off (target {target:g}x: {met})")
    overrun = result.get("clock_overrun_share")
    loads = [
        run["load"]["before"][0]
        for per in result["runs"].values()
        for run in per.values()
        if run.get("load")
    ]
    lines.append(
        f"- seeds {result['seeds']}; host load (1-min) {min(loads, default=0):.2f}-"
        f"{max(loads, default=0):.2f} at the runs' starts; engines' clock overrun at most "
        f"{'-' if overrun is None else f'{overrun:.1%}'} of a run's wall time"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cells",
        type=_cells,
        default=list(CELLS),
        help="'all' or a comma list of "
        + ",".join(CELLS)
        + " and regime grid cells (workload/context/size/ratio)",
    )
    p.add_argument(
        "--variants",
        type=parse_variants,
        default=[VARIANTS_BY_NAME["off"], VARIANTS_BY_NAME["both"]],
        help="configurations (default off,both; also lifecycle, admission)",
    )
    p.add_argument("--seeds", type=seed_list, default=[0, 1], help="seeds (default 0,1)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="wall seconds per simulated second (default: each cell's; 0.05 for the -full "
        "cells and long-context grid cells, else 0.25)",
    )
    p.add_argument(
        "--hicache",
        action="store_true",
        help="the engines run SGLang's hierarchical cache (host pool twice the device "
        "pool) in every configuration: off+HiCache against both+HiCache",
    )
    p.add_argument(
        "--hicache-write-policy",
        choices=HICACHE_WRITE_POLICIES,
        default=None,
        help="the engines' --hicache-write-policy (default: SGLang's, write_through); "
        "implies --hicache",
    )
    p.add_argument(
        "--subagent-identity",
        choices=SUBAGENT_IDENTITIES,
        default="own",
        help="how subagents name themselves in every configuration: own ids (default), "
        "own ids naming their lead as parent (X-Parent-Session-ID), or the lead's id",
    )
    p.add_argument("--out", type=Path, default=None, help="default results/rollout-<time>")
    a = p.parse_args(argv)
    out = a.out or Path("results") / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    variants: list[Variant] = a.variants
    if "off" not in {v.name for v in variants}:
        variants = [VARIANTS_BY_NAME["off"], *variants]
    doc: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_revision(),
        "command": [
            "python",
            "scripts/bench_rollout.py",
            *(argv if argv is not None else sys.argv[1:]),
        ],
        "seeds": a.seeds,
        "variants": [v.name for v in variants],
        "host": {"cpus": os.cpu_count(), "load_at_start": [round(x, 2) for x in os.getloadavg()]},
        "cells": {},
        "pids": [],
    }
    pids: list[int] = doc["pids"]

    def say(line: str) -> None:
        print(line, flush=True)

    sections: list[str] = []
    status = 0
    try:
        with sigterm_as_interrupt():
            for cell in a.cells:
                sc = configure(
                    cell,
                    time_scale=a.time_scale,
                    hicache=a.hicache or a.hicache_write_policy is not None,
                    hicache_write_policy=a.hicache_write_policy,
                    subagent_identity=a.subagent_identity,
                )
                say(f"== {cell}: {sc.describe()['working_set_over_pool']}x the pool")
                result = run_scenario(
                    sc, variants, a.seeds, out_dir=out / cell, pids=pids, progress=say
                )
                doc["cells"][cell] = result
                sections.append(markdown(cell, result))
                (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    except KeyboardInterrupt:
        say("interrupted: every process started has been stopped")
        status = 130
    except ValueError as exc:
        print(f"bench_rollout: {exc}", file=sys.stderr)
        status = 2
    doc["host"]["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["leaked_pids"] = [pid for pid in pids if pid_alive(pid)]
    (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    cmd = " ".join(doc["command"])
    md = "\n\n".join(
        [f"Commit {doc['commit']}, `{cmd}`, seeds {a.seeds}, {os.cpu_count()} CPUs.", *sections]
    )
    (out / "bench.md").write_text(md + "\n")
    say("")
    say(md)
    say(f"\nresults: {out / 'bench.json'}, {out / 'bench.md'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
