#!/usr/bin/env python3
"""Program admission in the lab: the evidence tables of docs/benchmarks.md.

Every cell is a lab run (``kvlab.lab.runner.run_lab``: calibrated simulator engines
with the deployment contract's flags, smg's consistent-hashing placement keyed by the
session id, kvproxy's own session and admission objects) over several seeds; every
configuration, the baseline included, uses the same router policy and routing key.
Cells run in parallel over ``--jobs`` processes (one run per process at a time).

    python scripts/bench_admission_lab.py --tables all --seeds 8 --jobs 2
    python scripts/bench_admission_lab.py --tables w1 --seeds 2   # a quick look

Writes ``results/admission_lab.json`` (every per-seed row and the per-cell medians,
min and max), prints the markdown tables, and with ``--plot`` draws the trade-off
curves (matplotlib, the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvlab.lab.ablation import ABLATIONS
from kvlab.lab.runner import LabConfig, run_lab
from kvlab.provenance import git_revision

# Fields of a row kept in the JSON (the rest of the summary is dropped).
KEEP = (
    "policy",
    "seed",
    "sessions",
    "turns",
    "sessions_per_min",
    "output_tokens_per_s",
    "recomputed_prefill_tokens",
    "cache_hit_rate",
    "evicted_tokens",
    "retractions",
    "ttft_p99_continuing_s",
    "ttft_p50_continuing_s",
    "ttft_p99_first_s",
    "first_turn_wait_p99_s",
    "makespan_s",
    "admission_counters",
    "injected_priorities",
    "proxy_errors",
    "wall_s",
)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration: a lab config (seed set per run) and its label."""

    table: str
    name: str
    workload: str
    per_engine: int
    policy: str
    admission: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Sessions in the run; None: the lab's default (twice the live count). A fixed
    # batch (a synchronous RL step) is sessions = live count, all starting at once.
    batch: bool = False
    engines: int = 2

    def lab_config(self, seed: int) -> LabConfig:
        return LabConfig(
            workload=self.workload,
            engines=self.engines,
            sessions_per_engine=self.per_engine,
            sessions=self.per_engine * self.engines if self.batch else None,
            policy=self.policy,
            seed=seed,
            admission_overrides=dict(self.admission),
        )


def _pair(table: str, workload: str, per_engine: int, *, batch: bool = False) -> list[Cell]:
    return [
        Cell(table, p, workload, per_engine, p, batch=batch) for p in ("off", "both", "ceiling")
    ]


# Ablation on W1: each mechanism switched off (or to its alternative) alone.
ABLATION = ABLATIONS

# Trade-off: the hold bounds (paused turns, new sessions): (paused_max_wait_s,
# new_session_max_wait_s) points.
CURVE_POINTS: tuple[tuple[float, float], ...] = (
    (8.0, 3600.0),
    (30.0, 3600.0),
    (45.0, 3600.0),
    (60.0, 3600.0),
    (120.0, 3600.0),
    (30.0, 1800.0),
    (30.0, 600.0),
)


def cells(
    tables: Sequence[str],
    w1_per_engine: int,
    w2_per_engine: int,
    curve: Sequence[tuple[float, float]] = CURVE_POINTS,
) -> list[Cell]:
    out: list[Cell] = []
    if "w1" in tables:
        out += _pair("w1", "swe", w1_per_engine)
    if "w1_64" in tables:
        out += _pair("w1_64", "swe", 64)
    if "batch" in tables:
        out += _pair("batch", "swe", w1_per_engine, batch=True)
    if "w2" in tables:
        out += _pair("w2", "rl", w2_per_engine)
    if "w3" in tables:
        out += [Cell("w3", p, "subagents", 0, p) for p in ("off", "both", "ceiling")]
    if "notkv" in tables:
        out += [Cell("notkv", p, "swe", 10, p) for p in ("off", "lifecycle", "admission", "both")]
    if "ablation" in tables:
        out += [Cell("ablation", "off", "swe", w1_per_engine, "off")]
        out += [
            Cell("ablation", name, "swe", w1_per_engine, "both", admission=adm)
            for name, adm in ABLATION
        ]
    for tag, workload, per_engine in (("w1", "swe", w1_per_engine), ("w2", "rl", w2_per_engine)):
        if f"curve_{tag}" not in tables:
            continue
        out += [Cell(f"curve_{tag}", "off", workload, per_engine, "off")]
        out += [
            Cell(
                f"curve_{tag}",
                f"paused={paused:g} new={new:g}",
                workload,
                per_engine,
                "both",
                admission={"paused_max_wait_s": paused, "new_session_max_wait_s": new},
            )
            for paused, new in curve
        ]
    return out


def _key(cell: Cell, seed: int) -> tuple[Any, ...]:
    return (
        cell.workload,
        cell.per_engine,
        cell.policy,
        tuple(sorted(cell.admission.items())),
        cell.batch,
        cell.engines,
        seed,
    )


def _run_one(job: tuple[Cell, int]) -> tuple[Cell, int, dict[str, Any]]:
    cell, seed = job
    cfg = cell.lab_config(seed)
    if cell.per_engine == 0:
        cfg = dataclasses.replace(cfg, sessions_per_engine=None)
    summary = run_lab(cfg).summary
    return cell, seed, {k: summary.get(k) for k in KEEP}


def _stats(values: Sequence[float | None]) -> dict[str, float | None]:
    nums = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not nums:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(nums), "min": min(nums), "max": max(nums)}


METRICS = (
    "sessions_per_min",
    "output_tokens_per_s",
    "recomputed_prefill_tokens",
    "evicted_tokens",
    "retractions",
    "ttft_p99_continuing_s",
    "first_turn_wait_p99_s",
    "makespan_s",
    "cache_hit_rate",
)


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per metric: median, min, max over seeds; ratios to off per seed (paired)."""
    return {m: _stats([r.get(m) for r in rows]) for m in METRICS}


def paired_ratio(
    rows: Mapping[int, dict[str, Any]], base: Mapping[int, dict[str, Any]], metric: str
) -> dict[str, float | None]:
    """Median (min, max) over seeds of row/base, seed by seed (the same workload)."""
    ratios = []
    for seed, r in rows.items():
        b = base.get(seed)
        if b is None:
            continue
        num, den = r.get(metric), b.get(metric)
        if num is None or den in (None, 0):
            continue
        ratios.append(float(num) / float(den))
    return _stats(ratios)


def gap_closed(
    rows: Mapping[int, dict[str, Any]],
    off: Mapping[int, dict[str, Any]],
    ceiling: Mapping[int, dict[str, Any]],
    metric: str,
) -> dict[str, float | None]:
    """(x - off) / (ceiling - off) per seed."""
    vals = []
    for seed, r in rows.items():
        o, c = off.get(seed), ceiling.get(seed)
        if o is None or c is None:
            continue
        den = float(c[metric]) - float(o[metric])
        if den:
            vals.append((float(r[metric]) - float(o[metric])) / den)
    return _stats(vals)


def _fmt(s: Mapping[str, float | None], spec: str) -> str:
    if s.get("median") is None:
        return "-"
    med, lo, hi = s["median"], s["min"], s["max"]
    return f"{med:{spec}} ({lo:{spec}}-{hi:{spec}})"


TABLE_METRICS = (
    ("sessions/min", "sessions_per_min", ".2f"),
    ("output tok/s", "output_tokens_per_s", ".1f"),
    ("recomputed prefill", "recomputed_prefill_tokens", ",.0f"),
    ("cont. TTFT p99 (s)", "ttft_p99_continuing_s", ".2f"),
    ("first-turn wait p99 (s)", "first_turn_wait_p99_s", ".1f"),
    ("makespan (s)", "makespan_s", ".0f"),
    ("retractions", "retractions", ",.0f"),
)
RATIO_METRICS = (
    ("sessions/min", "sessions_per_min"),
    ("output tok/s", "output_tokens_per_s"),
    ("recomputed prefill", "recomputed_prefill_tokens"),
    ("cont. TTFT p99", "ttft_p99_continuing_s"),
    ("makespan", "makespan_s"),
    ("retractions", "retractions"),
)


def markdown(doc: Mapping[str, Any]) -> str:
    out: list[str] = []
    for table, cells_ in doc["tables"].items():
        names = list(cells_)
        out.append(f"### {table}\n")
        out.append("| metric | " + " | ".join(names) + " |")
        out.append("|---|" + "---|" * len(names))
        for label, key, spec in TABLE_METRICS:
            row = [_fmt(cells_[n]["stats"][key], spec) for n in names]
            out.append(f"| {label} | " + " | ".join(row) + " |")
        if "off" in cells_:
            for label, key in RATIO_METRICS:
                row = [_fmt(cells_[n]["ratio_to_off"].get(key, {}), ".2f") for n in names]
                out.append(f"| {label} / off | " + " | ".join(row) + " |")
        if "ceiling" in cells_ and "off" in cells_:
            row = [_fmt(cells_[n].get("gap_closed", {}), ".2f") for n in names]
            out.append("| gap closed (sessions/min) | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


ROW_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    # (header, metric, kind, format): kind "abs" (median (min-max)), "ratio" (to off,
    # paired by seed), "gap" (fraction of the off-ceiling gap closed)
    ("sessions/min", "sessions_per_min", "abs", ".2f"),
    ("x off", "sessions_per_min", "ratio", ".2f"),
    ("gap closed", "sessions_per_min", "gap", ".2f"),
    ("output tok/s x off", "output_tokens_per_s", "ratio", ".2f"),
    ("recomputed prefill x off", "recomputed_prefill_tokens", "ratio", ".2f"),
    ("cont. TTFT p99 (s)", "ttft_p99_continuing_s", "abs", ".1f"),
    ("cont. TTFT p99 x off", "ttft_p99_continuing_s", "ratio", ".2f"),
    ("first-turn wait p99 (s)", "first_turn_wait_p99_s", "abs", ".0f"),
    ("makespan x off", "makespan_s", "ratio", ".2f"),
    ("retractions", "retractions", "abs", ".0f"),
)


def markdown_rows(doc: Mapping[str, Any]) -> str:
    """One table per lab table: a row per configuration, median (min-max) over seeds."""
    out: list[str] = []
    for table, cells_ in doc["tables"].items():
        has_off = "off" in cells_
        has_gap = has_off and "ceiling" in cells_
        cols = [
            c for c in ROW_COLUMNS if (c[2] != "ratio" or has_off) and (c[2] != "gap" or has_gap)
        ]
        first = next(iter(cells_.values()))
        seeds = len(first["per_seed"])
        out.append(
            f"**{table}** ({first['workload']}, "
            f"{first['sessions_per_engine'] or 'preset'} sessions/engine"
            f"{', fixed batch' if first.get('batch') else ''}; {seeds} seeds)\n"
        )
        out.append("| configuration | " + " | ".join(c[0] for c in cols) + " |")
        out.append("|---|" + "---|" * len(cols))
        for name, c in cells_.items():
            vals = []
            for _, metric, kind, spec in cols:
                if kind == "abs":
                    vals.append(_fmt(c["stats"][metric], spec))
                elif kind == "ratio":
                    vals.append(_fmt(c["ratio_to_off"].get(metric, {}), spec))
                else:
                    vals.append(_fmt(c.get("gap_closed", {}), spec))
            out.append(f"| {name} | " + " | ".join(vals) + " |")
        out.append("")
    return "\n".join(out)


def curve_points(cells_: Mapping[str, Any]) -> list[tuple[float, float]]:
    """The (paused, new) bounds of a curve table's cells, from their names."""
    out: list[tuple[float, float]] = []
    for name in cells_:
        paused, sep, new = name.removeprefix("paused=").partition(" new=")
        if sep and name.startswith("paused="):
            out.append((float(paused), float(new)))
    return out


def plot(doc: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = [t for t in ("curve_w1", "curve_w2") if t in doc["tables"]]
    if not tags:
        return
    fig, axes = plt.subplots(len(tags), 2, figsize=(11, 4.2 * len(tags)), squeeze=False)
    for row, tag in enumerate(tags):
        cells_ = doc["tables"][tag]
        metric = "sessions_per_min" if tag == "curve_w1" else "output_tokens_per_s"
        off = cells_["off"]["stats"]
        for col, (xkey, xlabel) in enumerate(
            (
                ("ttft_p99_continuing_s", "continuing-turn TTFT p99 (s)"),
                ("first_turn_wait_p99_s", "first-turn wait p99 (s)"),
            )
        ):
            ax = axes[row][col]
            points = curve_points(cells_)
            for new in sorted({n for _, n in points}):
                xs, ys, labels = [], [], []
                for paused in sorted(p for p, n in points if n == new):
                    st = cells_[f"paused={paused:g} new={new:g}"]["stats"]
                    if st[xkey]["median"] is None:
                        continue
                    xs.append(st[xkey]["median"])
                    ys.append(st[metric]["median"])
                    labels.append(f"{paused:g}")
                ax.plot(xs, ys, marker="o", label=f"new_session_max_wait_s={new:g}")
                for x, y, lab in zip(xs, ys, labels, strict=True):
                    ax.annotate(lab, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            if off[xkey]["median"] is not None:
                ax.scatter([off[xkey]["median"]], [off[metric]["median"]], color="k", zorder=5)
                ax.annotate("off", (off[xkey]["median"], off[metric]["median"]), fontsize=8)
            else:
                ax.axhline(off[metric]["median"], color="k", ls="--", lw=0.8, label="off")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(metric.replace("_", " "))
            ax.set_title(f"{tag[6:].upper()}: labels = paused_max_wait_s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Program admission in the lab: throughput vs tail as the hold bounds vary")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tables",
        default="all",
        help="comma list of w1,w1_64,batch,w2,w3,notkv,ablation,curve_w1,curve_w2 or all",
    )
    ap.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 (default 8)")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--w1-per-engine", type=int, default=48)
    ap.add_argument("--w2-per-engine", type=int, default=64)
    ap.add_argument(
        "--curve-points",
        default=None,
        help="trade-off points as PAUSED:NEW,... (default: "
        + ",".join(f"{p:g}:{n:g}" for p, n in CURVE_POINTS)
        + ")",
    )
    ap.add_argument("--json", type=Path, default=Path("results/admission_lab.json"))
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the trade-off curves")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="admission override for every 'both' cell (JSON value), e.g. pause=false",
    )
    ap.add_argument(
        "--render",
        nargs="+",
        type=Path,
        default=None,
        help="only re-render the markdown (and --plot) from these result JSONs",
    )
    args = ap.parse_args(argv)
    if args.render:
        merged: dict[str, Any] = {"tables": {}}
        for path in args.render:
            merged["tables"].update(json.loads(path.read_text())["tables"])
        text = markdown_rows(merged)
        print(text)
        if args.markdown is not None:
            args.markdown.write_text(text)
        if args.plot is not None:
            plot(merged, args.plot)
        return 0
    all_tables = "w1,w1_64,batch,w2,w3,notkv,ablation,curve_w1,curve_w2"
    tables = (all_tables if args.tables == "all" else args.tables).split(",")
    extra: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        extra[key.strip()] = json.loads(value)
    curve = CURVE_POINTS
    if args.curve_points:
        curve = tuple(
            (float(a), float(b))
            for a, _, b in (x.partition(":") for x in args.curve_points.split(","))
        )
    todo = cells(tables, args.w1_per_engine, args.w2_per_engine, curve)
    if extra:
        todo = [
            dataclasses.replace(c, admission={**extra, **c.admission})
            if c.policy in ("both", "admission")
            else c
            for c in todo
        ]
    seeds = list(range(args.seeds))
    # Each distinct lab configuration runs once (the off baseline is shared by tables).
    unique: dict[Any, tuple[Cell, int]] = {}
    for c in todo:
        for seed in seeds:
            unique.setdefault(_key(c, seed), (c, seed))
    t0 = time.perf_counter()
    done: dict[Any, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for cell, seed, row in pool.map(_run_one, list(unique.values()), chunksize=1):
            done[_key(cell, seed)] = row
            print(
                f"  {cell.table:9s} {cell.name:28s} seed {seed}: "
                f"{row['sessions_per_min']:.2f} sess/min  {row['wall_s']:.1f}s wall",
                file=sys.stderr,
                flush=True,
            )
    rows: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for c in todo:
        for seed in seeds:
            rows.setdefault((c.table, c.name), {})[seed] = done[_key(c, seed)]
    wall = time.perf_counter() - t0
    commit = git_revision()
    doc: dict[str, Any] = {
        "command": "python scripts/bench_admission_lab.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "seeds": seeds,
        "wall_s": round(wall, 1),
        "tables": {},
    }
    for cell in todo:
        by_seed = rows[(cell.table, cell.name)]
        t = doc["tables"].setdefault(cell.table, {})
        t[cell.name] = {
            "workload": cell.workload,
            "sessions_per_engine": cell.per_engine or None,
            "policy": cell.policy,
            "admission": dict(cell.admission),
            "batch": cell.batch,
            "stats": aggregate(list(by_seed.values())),
            "per_seed": {str(k): v for k, v in sorted(by_seed.items())},
        }
    for table, cells_ in doc["tables"].items():
        off = {int(k): v for k, v in cells_.get("off", {}).get("per_seed", {}).items()}
        ceil = {int(k): v for k, v in cells_.get("ceiling", {}).get("per_seed", {}).items()}
        for c in cells_.values():
            mine = {int(k): v for k, v in c["per_seed"].items()}
            c["ratio_to_off"] = (
                {key: paired_ratio(mine, off, key) for _, key in RATIO_METRICS} if off else {}
            )
            metric = "makespan_s" if table == "batch" else "sessions_per_min"
            if off and ceil:
                c["gap_closed"] = gap_closed(mine, off, ceil, metric)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    text = markdown_rows(doc)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    if args.plot is not None:
        plot(doc, args.plot)
    print(f"wall {wall:.0f} s; JSON in {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
