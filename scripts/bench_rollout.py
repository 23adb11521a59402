#!/usr/bin/env python3
"""Rollout benchmark: the agentic workload through the real stack, by scenario, seed and
configuration, with medians and ratios to "off".

Scenarios:
  kv-bound      the sessions' live working set is several times the fleet's KV pool
  not-kv-bound  the same workload with a pool well above the working set

Configurations: off, lifecycle, admission, both (all through kvproxy) and direct (the
driver talks to the router; no proxy process), each on a freshly started stack.

    python scripts/bench_rollout.py                       # full run (see docs/benchmarks.md)
    python scripts/bench_rollout.py --seeds 0 --scenarios kv-bound --variants off,both
    python scripts/bench_rollout.py --png docs/img/rollout.png

Writes ``<out>/bench.json`` (every run's summary), ``<out>/bench.md`` (tables) and a
chart; prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvproxy.demo import (
    DIRECT,
    VARIANTS,
    Preset,
    ProxyTuning,
    StackSpec,
    Variant,
    pid_alive,
    rollout_workload,
    run_variant,
    sigterm_as_interrupt,
    working_set_tokens,
)

ALL_VARIANTS: dict[str, Variant] = {v.name: v for v in (*VARIANTS, DIRECT)}

# Metrics reported per (scenario, configuration); (key, label, higher_is_better).
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("sessions_per_min", "sessions/min", True),
    ("recomputed_prefill_tokens", "recomputed prefill", False),
    ("prefill_tokens", "prefill tokens", False),
    ("cache_hit_rate", "cache hit rate", True),
    ("evicted_tokens", "evicted tokens", False),
    ("retractions", "retractions", False),
    ("ttft_p50_s", "TTFT p50", False),
    ("ttft_p99_s", "TTFT p99", False),
    ("ttft_first_turn_p99_s", "TTFT p99, first turns", False),
    ("ttft_later_turns_p99_s", "TTFT p99, later turns", False),
    ("latency_p99_s", "request latency p99", False),
    ("admission_wait_p99_ms", "adm. wait p99 (ms)", False),
)


def scenarios() -> dict[str, Preset]:
    """One workload, three fleet sizes (see docs/benchmarks.md, "Rollout"). Working
    sets count the shared system prompt once (``working_set_tokens``)."""
    workload = rollout_workload(run_timeout_s=300.0)
    tuning = ProxyTuning(max_wait_s=30.0)

    def preset(kv_tokens_per_engine: int) -> Preset:
        stack = StackSpec(engines=2, max_total_tokens=kv_tokens_per_engine, sim_time_scale=0.5)
        return Preset(stack=stack, workload=workload, proxy=tuning)

    return {
        # live working set ~2.6x the fleet's KV pool on average, up to ~8x
        "kv-bound": preset(12_000),
        # ~1.3x on average, up to ~4x (the demo's default)
        "near-pool": preset(24_000),
        # ~0.1x on average, at most ~0.4x
        "not-kv-bound": preset(256_000),
    }


def git_revision() -> str | None:
    """The checkout's commit (with "+dirty" when files differ from it), for provenance."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _parse_value(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def median(values: Sequence[float | None]) -> float | None:
    data = [float(v) for v in values if v is not None]
    return statistics.median(data) if data else None


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{scenario: {variant: {metric: median over seeds, "<metric>_vs_off": ratio}}}."""
    grouped: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for r in runs:
        grouped.setdefault(r["scenario"], {}).setdefault(r["variant"], []).append(r["summary"])
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for scen, by_variant in grouped.items():
        out[scen] = {}
        for var, summaries in by_variant.items():
            row: dict[str, Any] = {"runs": len(summaries)}
            row["failed_sessions"] = sum(s["sessions_failed"] for s in summaries)
            for key, _, _ in METRICS:
                row[key] = median([s.get(key) for s in summaries])
            spm = [s["sessions_per_min"] for s in summaries]
            row["sessions_per_min_range"] = [min(spm), max(spm)]
            out[scen][var] = row
        base = out[scen].get("off")
        if base is None:
            continue
        for row in out[scen].values():
            for key, _, _ in METRICS:
                a, b = row.get(key), base.get(key)
                row[f"{key}_vs_off"] = (a / b) if a is not None and b else None
    return out


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key.endswith("_s"):
        return f"{value * 1000:,.0f} ms"
    if key == "cache_hit_rate":
        return f"{value:.3f}"
    if key in ("sessions_per_min", "admission_wait_p99_ms"):
        return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,.0f}"


def markdown(agg: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    lines: list[str] = []
    for scen, by_variant in agg.items():
        names = list(by_variant)
        lines.append(f"#### {scen}")
        lines.append("")
        lines.append("| metric (median) | " + " | ".join(names) + " |")
        lines.append("|---|" + "---:|" * len(names))
        for key, label, _ in METRICS:
            cells = []
            for n in names:
                row = by_variant[n]
                cell = _cell(row.get(key), key)
                ratio = row.get(f"{key}_vs_off")
                if n != "off" and ratio is not None:
                    cell += f" ({ratio:.2f}x)"
                cells.append(cell)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append(
            "| sessions/min, min-max | "
            + " | ".join(
                "{:.0f}-{:.0f}".format(*by_variant[n]["sessions_per_min_range"]) for n in names
            )
            + " |"
        )
        lines.append(
            "| failed sessions (all runs) | "
            + " | ".join(str(by_variant[n]["failed_sessions"]) for n in names)
            + " |"
        )
        lines.append("")
    return "\n".join(lines)


def write_chart(agg: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("sessions_per_min", "completed sessions / min"),
        ("recomputed_prefill_tokens", "recomputed prefill tokens"),
        ("ttft_p99_s", "TTFT p99 (s)"),
    )
    scen_names = list(agg)
    fig, axes = plt.subplots(
        len(scen_names), len(panels), figsize=(9.6, 2.5 * len(scen_names)), squeeze=False
    )
    colors = {
        "off": "#9e9e9e",
        "lifecycle": "#4c9be8",
        "admission": "#f2a93b",
        "both": "#3bb273",
        "direct": "#7f6fd1",
    }
    for i, scen in enumerate(scen_names):
        names = list(agg[scen])
        for j, (key, label) in enumerate(panels):
            ax = axes[i][j]
            values = [float(agg[scen][n].get(key) or 0.0) for n in names]
            ax.bar(names, values, color=[colors.get(n, "#555555") for n in names])
            ax.set_ylim(bottom=0, top=None if max(values) > 0 else 1)
            ax.set_title(f"{scen}: {label}", fontsize=8)
            ax.tick_params(axis="x", labelsize=7, rotation=20)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output directory (default results/bench-<time>)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated workload seeds")
    parser.add_argument("--scenarios", default=",".join(scenarios()), help="comma-separated")
    parser.add_argument(
        "--variants", default=",".join(ALL_VARIANTS), help="comma-separated configurations"
    )
    parser.add_argument("--sessions", type=int, help="override the number of sessions")
    parser.add_argument("--concurrency", type=int, help="override sessions at once")
    parser.add_argument("--png", help="also write the chart here (e.g. docs/img/rollout.png)")
    parser.add_argument(
        "--proxy-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a proxy tuning field for every scenario (e.g. pressure_threshold=1.0)",
    )
    args = parser.parse_args(argv)
    tuning_changes: dict[str, Any] = {}
    fields_ = {f.name: f for f in dataclasses.fields(ProxyTuning)}
    for item in args.proxy_set:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields_:
            parser.error(f"--proxy-set {item!r}: expected KEY=VALUE with KEY in {sorted(fields_)}")
        tuning_changes[key] = _parse_value(raw)

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    all_scen = scenarios()
    scen_names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    var_names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for s in scen_names:
        if s not in all_scen:
            parser.error(f"unknown scenario {s!r} (known: {', '.join(all_scen)})")
    for v in var_names:
        if v not in ALL_VARIANTS:
            parser.error(f"unknown configuration {v!r} (known: {', '.join(ALL_VARIANTS)})")

    out_dir = Path(args.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    pids: list[int] = []
    doc: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "command": ["python", "scripts/bench_rollout.py", *(argv or sys.argv[1:])],
        "scenarios": {},
        "runs": runs,
    }
    total = len(scen_names) * len(seeds) * len(var_names)
    n = 0
    t0 = time.monotonic()
    status = 0
    try:
        with sigterm_as_interrupt():
            for scen in scen_names:
                preset = all_scen[scen]
                changes: dict[str, Any] = {}
                if args.sessions is not None:
                    changes["num_sessions"] = args.sessions
                if args.concurrency is not None:
                    changes["concurrency"] = args.concurrency
                base_workload = dataclasses.replace(preset.workload, **changes)
                preset = dataclasses.replace(
                    preset, proxy=dataclasses.replace(preset.proxy, **tuning_changes)
                )
                pool = preset.stack.engines * preset.stack.max_total_tokens
                ws_mean, ws_max = working_set_tokens(base_workload)
                doc["scenarios"][scen] = {
                    "stack": dataclasses.asdict(preset.stack),
                    "workload": base_workload.to_dict(),
                    "proxy_tuning": dataclasses.asdict(preset.proxy),
                    "fleet_pool_tokens": pool,
                    "working_set_tokens": {"mean": ws_mean, "max": ws_max},
                }
                print(
                    f"== {scen}: live working set {ws_mean:,} tokens on average, up to {ws_max:,}; "
                    f"fleet pool {pool:,} tokens",
                    flush=True,
                )
                for seed in seeds:
                    workload = dataclasses.replace(base_workload, seed=seed)
                    for var in var_names:
                        n += 1
                        res = run_variant(
                            ALL_VARIANTS[var],
                            stack=preset.stack,
                            workload=workload,
                            tuning=preset.proxy,
                            out_dir=out_dir / scen / f"seed{seed}",
                            pids=pids,
                            progress=None,
                        )
                        s = res["summary"]
                        runs.append(
                            {
                                "scenario": scen,
                                "seed": seed,
                                "variant": var,
                                "summary": s,
                                "engine_deltas": res.get("engine_deltas"),
                                "sim_overrun_s": res.get("sim_overrun_s"),
                            }
                        )
                        print(
                            f"[{n}/{total}] {scen} seed={seed} {var:9s} "
                            f"{s['sessions_completed']}/{s['sessions_started']} sessions "
                            f"{s['sessions_per_min']:.1f}/min recomputed={s['recomputed_prefill_tokens']:,} "
                            f"hit={s['cache_hit_rate']:.3f} ttft_p99={s['ttft_p99_s']}s "
                            f"({time.monotonic() - t0:.0f} s)",
                            flush=True,
                        )
    except KeyboardInterrupt:
        print("interrupted: every process started has been stopped", file=sys.stderr)
        status = 130
    agg = aggregate(runs)
    doc["aggregate"] = agg
    doc["pids_alive_after"] = [p for p in pids if pid_alive(p)]
    (out_dir / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = markdown(agg)
    (out_dir / "bench.md").write_text(md + "\n")
    print()
    print(md)
    if agg:
        write_chart(agg, out_dir / "rollout.png")
        if args.png:
            write_chart(agg, Path(args.png))
    print(f"results: {out_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
