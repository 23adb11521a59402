"""``kvproxy demo``: the calibrated W1 scenario through the real stack, off vs both.

Starts two simulated SGLang engines (the ``qwen3-8b-h100`` cost model at token scale
16, session-radix cache, priority eviction, priority scheduling), the real router
(``smg --policy consistent_hashing``, worker overload protection off: the deployment
contract of docs/operations.md) and kvproxy in front, then runs the ``swe`` workload
(W1) with a live working set about twice the fleet's KV pool, once per configuration
and seed on a freshly started stack. kvproxy gets the documented defaults with only
``admission.enabled``, ``session_lifecycle.enabled``, ``router.policy`` and
``server.time_scale`` (= the engines' time scale, so its timers follow simulated time)
set. Every configuration, ``off`` included, sends the same routing key
(``X-SMG-Routing-Key: <session id>``, or with ``--quick`` and side by side a key that
places the session as the lab does: :func:`lab_routing_keys`) to the same router policy.
With 8 or more usable cores (``--parallel``/``--no-parallel`` to choose) the
configurations of a seed run side by side, each on its own stack in its own process.

Prints per-configuration medians over the seeds, ratios to ``off`` and a one-line
verdict per feature, and writes ``results.json`` and ``chart.png``.

``kvproxy demo --lab`` prints the lab's policy and ablation tables (virtual time, no
processes, about two minutes);
``kvproxy demo --quick`` is a KV-bound smoke run of the real stack (about 30 s on a host
with 8 or more cores, where off and both run side by side; about 50 s one after the other).
``kvproxy demo --replicas 2`` puts two kvproxy replicas behind nginx round robin (no
affinity), their state shared on a redis-server it starts with a password
(docs/operations.md, "Running several replicas"); ``--kill-replica-after S`` SIGKILLs one.

This module is the command line and the lab tables; the machinery (scenarios, stacks,
runs and their comparison) is :mod:`kvlab.rollout`, which ``scripts/bench_rollout.py``
uses too. Every process is started by :mod:`kvlab.stack` and stopped by its PID in a
``finally`` (also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvlab.provenance import git_revision
from kvlab.rollout import (
    DEMO_SEEDS,
    DEMO_W1,
    QUICK_SEEDS,
    QUICK_W1,
    SIDE_BY_SIDE_MIN_CORES,
    VARIANTS_BY_NAME,
    Scenario,
    parse_variants,
    report_lines,
    run_scenario,
    sigterm_as_interrupt,
    usable_cores,
    verdict,
    with_host_tier,
    write_chart,
)
from kvlab.sim.config import HICACHE_WRITE_POLICIES

# ------------------------------------------------------------------------------- lab

# The lab's W1 at the calibrated size: 48 live sessions per engine, the preset's pool
# (live working set about 2.05x the pool).
LAB_W1: dict[str, Any] = {
    "workload": "swe",
    "engines": 2,
    "sessions_per_engine": 48,
    "token_scale": 16,
}


def lab_policies() -> list[str]:
    """Every policy the lab runs (its ablations are :mod:`kvlab.lab.ablation`'s)."""
    from kvlab.lab import runner

    return list(runner.POLICIES)


def gap_closed(
    meds: Mapping[str, Mapping[str, Any]], key: str = "sessions_per_min"
) -> dict[str, float]:
    """(x - off) / (ceiling - off) of ``key`` per policy; {} without off and ceiling, or
    when the ceiling is no better than off."""
    off = meds.get("off", {}).get(key)
    ceiling = meds.get("ceiling", {}).get(key)
    if not isinstance(off, int | float) or not isinstance(ceiling, int | float) or ceiling <= off:
        return {}
    return {
        n: (float(m[key]) - off) / (ceiling - off)
        for n, m in meds.items()
        if n not in ("off", "ceiling") and isinstance(m.get(key), int | float)
    }


def run_lab_table(
    seeds: Sequence[int],
    *,
    quick: bool = False,
    policies: Sequence[str] | None = None,
    ablation: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The lab's policy table for W1 and, with ``ablation``, what each mechanism of
    program admission adds: (text, JSON document)."""
    from kvlab.lab.ablation import ABLATIONS, format_ablation, run_ablation
    from kvlab.lab.runner import LabConfig, run_matrix
    from kvlab.lab.runner import format_table as lab_table

    if quick:
        s = QUICK_W1
        cfg = LabConfig(
            workload=s.workload,
            engines=s.engines,
            sessions_per_engine=s.sessions_per_engine,
            sessions=s.total_sessions,
            token_scale=s.token_scale,
            cost_model=s.cost_model,
            engine_overrides={"max_total_tokens": s.pool()},
            workload_overrides=dict(s.workload_overrides),
        )
    else:
        cfg = LabConfig(**LAB_W1)
    names = list(policies) if policies else lab_policies()
    results = run_matrix(cfg, names, list(seeds))
    meds = {name: r["median"] for name, r in results.items()}
    lines = [lab_table(meds)]
    if "off" in meds:
        lines.append("")
        lines += [verdict(n, m, meds["off"]) for n, m in meds.items() if n != "off"]
        gap = gap_closed(meds)
        if gap:
            lines.append(
                "gap to ceiling closed, (x - off) / (ceiling - off) in sessions/min: "
                + ", ".join(f"{n} {g:.2f}" for n, g in gap.items())
            )
    doc: dict[str, Any] = {
        "lab_config": dataclasses.asdict(cfg),
        "seeds": list(seeds),
        "policies": _per_seed_doc(results),
    }
    if ablation:
        # ``off`` and ``both`` are already in the policy table: run only the rest.
        rest = [(n, o) for n, o in ABLATIONS if o]
        abl = run_ablation(cfg, seeds, rest)
        if "both" in results:
            abl = {"off": abl["off"], "both (defaults)": results["both"], **abl}
        lines += ["", "what each mechanism adds (both with one switched off), medians / off:"]
        lines.append(format_ablation({n: r["median"] for n, r in abl.items()}))
        doc["ablation"] = _per_seed_doc(abl)
    return "\n".join(lines), doc


def _per_seed_doc(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {
        name: {"median": r["median"], "per_seed": {str(k): v for k, v in r["per_seed"].items()}}
        for name, r in results.items()
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvlab.lab.cli import seed_list

    parser.add_argument(
        "--quick",
        action="store_true",
        help="a KV-bound smoke run of the real stack, off vs both (about 30 s side by side, "
        "50 s one after the other)",
    )
    parser.add_argument(
        "--lab",
        action="store_true",
        help="print the lab's policy and ablation tables for W1 (virtual time, no processes; "
        "about two minutes; with --quick the quick scenario's policies only)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="output directory (default results/demo-<time>)"
    )
    parser.add_argument(
        "--seeds",
        type=seed_list,
        default=None,
        help=f"comma-separated seeds (default {','.join(map(str, DEMO_SEEDS))}; --quick "
        f"{','.join(map(str, QUICK_SEEDS))}; --lab 0)",
    )
    parser.add_argument(
        "--only",
        type=parse_variants,
        default=None,
        metavar="NAMES",
        help="configurations (default off,both): a subset of off,lifecycle,admission,both",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help=f"wall seconds per simulated second (default {DEMO_W1.time_scale:g})",
    )
    parser.add_argument(
        "--parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the configurations of a seed side by side, each on its own stack "
        f"(default: on with {SIDE_BY_SIDE_MIN_CORES} or more cores, this host has "
        f"{usable_cores()})",
    )
    parser.add_argument(
        "--hicache",
        action="store_true",
        help="the engines run SGLang's hierarchical cache (--enable-hierarchical-cache, "
        "host pool twice the device pool): off+HiCache against both+HiCache",
    )
    parser.add_argument(
        "--hicache-write-policy",
        choices=HICACHE_WRITE_POLICIES,
        default=None,
        help="the engines' --hicache-write-policy (default: SGLang's, write_through); "
        "implies --hicache",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="kvproxy replicas (default 1): above 1, N replicas behind nginx round robin "
        "(no affinity) sharing their state on a redis-server with a password "
        "(state.backend: redis); redis-server and nginx must be installed",
    )
    parser.add_argument(
        "--kill-replica-after",
        type=float,
        default=None,
        metavar="S",
        help="with --replicas 2 or more: SIGKILL the first replica S wall seconds into "
        "each run (its sessions go on through the others; the clients send a turn that "
        "failed again, up to twice)",
    )
    parser.add_argument("--json-only", action="store_true", help="skip the PNG chart")


def _run_lab(args: argparse.Namespace) -> int:
    from kvlab.lab.runner import LabError

    seeds = args.seeds or [0]
    started = time.monotonic()
    size = "the demo's scaled W1" if args.quick else "W1, 2 engines x 48 live sessions"
    print(f"kvproxy demo --lab: {size}, K=16, seeds {seeds} (virtual time)", flush=True)
    try:
        text, doc = run_lab_table(seeds, quick=args.quick, ablation=not args.quick)
    except LabError as exc:
        print(f"kvproxy demo: {exc}", file=sys.stderr)
        return 2
    print(text)
    elapsed = time.monotonic() - started
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        doc["elapsed_s"] = round(elapsed, 2)
        (out_dir / "lab.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results: {out_dir / 'lab.json'}")
    print(f"({elapsed:.0f} s)")
    return 0


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario --quick, --time-scale and the host-tier flags name, checked; ValueError
    names the problem."""
    scenario = QUICK_W1 if args.quick else DEMO_W1
    if args.time_scale is not None:
        if not 0 < args.time_scale <= 10:
            raise ValueError("--time-scale must be in (0, 10]")
        scenario = dataclasses.replace(scenario, time_scale=args.time_scale)
    if args.hicache or args.hicache_write_policy is not None:
        scenario = with_host_tier(scenario, args.hicache_write_policy)
    replicas = getattr(args, "replicas", 1)
    kill = getattr(args, "kill_replica_after", None)
    if not 1 <= replicas <= 8:
        raise ValueError("--replicas must be in 1..8")
    if kill is not None and (replicas < 2 or kill <= 0):
        raise ValueError("--kill-replica-after needs --replicas 2 or more and S > 0")
    # A replica killed mid-run: its clients send the turns it held again (nginx sends
    # them to a survivor), as clients in front of several replicas do.
    retries = 0 if kill is None else 2
    scenario = dataclasses.replace(
        scenario, replicas=replicas, kill_replica_after_s=kill, client_retries=retries
    )
    scenario.check()
    return scenario


def _replicas_text(scenario: Scenario) -> str:
    if scenario.replicas <= 1:
        return ""
    kill = scenario.kill_replica_after_s
    killed = "" if kill is None else f", one SIGKILLed after {kill:g} s"
    return f"; {scenario.replicas} kvproxy replicas behind nginx round robin on Redis{killed}"


def _report(
    doc: Mapping[str, Any],
    meds: Mapping[str, Any],
    seeds: Sequence[int],
    say: Callable[[str], None],
) -> None:
    """The medians table, the verdicts and the engines' clock overrun."""
    say("")
    say(f"medians over seeds {list(seeds)} (simulated time):")
    for line in report_lines(meds):
        say(line)
    overrun = doc.get("clock_overrun_share")
    if overrun is not None:
        kept_up = (
            "the simulator kept up"
            if overrun < 0.05
            else "the host was too slow: use a larger --time-scale"
        )
        say(f"engine clock overrun: at most {overrun:.1%} of a run's wall time ({kept_up})")
    say("")


def run(args: argparse.Namespace) -> int:
    if args.lab:
        return _run_lab(args)
    try:
        scenario = scenario_from_args(args)
    except ValueError as exc:
        print(f"kvproxy demo: {exc}", file=sys.stderr)
        return 2
    seeds = args.seeds or list(QUICK_SEEDS if args.quick else DEMO_SEEDS)
    variants = args.only or [VARIANTS_BY_NAME["off"], VARIANTS_BY_NAME["both"]]
    out_dir = Path(args.out or f"results/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    parallel = args.parallel
    if parallel is None:
        parallel = usable_cores() >= SIDE_BY_SIDE_MIN_CORES
    side_by_side = bool(parallel) and len(variants) > 1

    def say(line: str) -> None:
        print(line, flush=True)

    d = scenario.describe()
    policy = "" if scenario.hicache_write_policy is None else f", {scenario.hicache_write_policy}"
    hicache = (
        ""
        if scenario.hicache_ratio is None
        else f" (HiCache, host {scenario.hicache_ratio:g}x{policy})"
    )
    say(
        f"kvproxy demo ({'quick' if args.quick else 'W1'}): workload {scenario.workload} on "
        f"{scenario.engines} x {scenario.cost_model} (K={scenario.token_scale}, "
        f"{d['pool_tokens_per_engine']:,} KV tokens each), {scenario.concurrency} live sessions, "
        f"{scenario.total_sessions} per run; live working set {d['working_set_over_pool']}x "
        f"the pool{hicache}; smg {scenario.router_policy}{_replicas_text(scenario)}; time scale {scenario.time_scale:g}; "
        f"{', '.join(v.name for v in variants)} x seeds {seeds}"
        f"{' side by side' if side_by_side else ''}; load "
        f"{os.getloadavg()[0]:.2f}; output in {out_dir}"
    )
    pids: list[int] = []
    doc: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["kvproxy", "demo", *sys.argv[2:]],
        "commit": git_revision(),
        "mode": "quick" if args.quick else "default",
        "pids": pids,
    }
    status = 0
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            doc.update(
                run_scenario(
                    scenario,
                    variants,
                    seeds,
                    out_dir=out_dir,
                    pids=pids,
                    progress=say,
                    side_by_side=side_by_side,
                )
            )
    except KeyboardInterrupt:
        say("interrupted: every process started has been stopped")
        status = 130
    except Exception as exc:
        print(f"kvproxy demo: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    doc["elapsed_s"] = round(time.monotonic() - started, 2)
    doc["status"] = status
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    meds = doc.get("medians") or {}
    if meds:
        _report(doc, meds, seeds, say)
        if not args.json_only:
            try:
                write_chart(meds, out_dir / "chart.png", title=f"kvproxy demo: {scenario.name}")
                say(f"chart:   {out_dir / 'chart.png'}")
            except ImportError:
                say("chart skipped: matplotlib is not installed (pip install 'kvproxy[lab]')")
    say(f"results: {out_dir / 'results.json'}  ({doc['elapsed_s']:.0f} s)")
    return status
