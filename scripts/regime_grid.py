#!/usr/bin/env python3
"""The regime grid: program admission against off and the no-eviction ceiling, in the lab.

Every cell is one fleet (2 engines), one workload and one pool: fleet size (live
sessions per engine), working set / pool, workload (swe, rl, subagents) with short
(5k) or long (the preset's) contexts, and a signal fault on kvproxy's engine metrics.
``off`` and ``ceiling`` do not read the engines' metrics, so they run once per fleet;
``both`` runs once per fault. A cell reports sessions/min (output tokens/s for rl),
both / off, ceiling / off, the gap closed ((both - off) / (ceiling - off)), the
continuing-turn TTFT p99 of off and both, and both's first-turn wait p99.

    python scripts/regime_grid.py --jobs 2                     # the whole grid, seed 0
    python scripts/regime_grid.py --workloads swe --sizes 4,48 --ratios 2.5 --faults all
    python scripts/regime_grid.py --check results/regime_grid.json   # the criteria only
    python scripts/regime_grid.py --check seeds01.json seeds23.json  # several runs' seeds together
    python scripts/regime_grid.py --check long.json old.json:short    # one file's short rows only
    python scripts/regime_grid.py --check grid.json.gz                # a gzipped file as it is
    python scripts/regime_grid.py --hicache --out results/regime_grid_hicache.json

``--hicache`` runs the engines of off and both with SGLang's hierarchical cache
(``--enable-hierarchical-cache``, ``--hicache-ratio`` 2.0 unless ``--hicache-ratio R``);
ceiling never evicts, so it runs as before. Its rows carry ``hicache`` (true where it
was on), ``hicache_ratio`` and ``loaded_back_tokens``, and the JSON ``hicache_ratio``.
``--hicache-link-gb-s G`` sets the host link's bandwidth (a what-if; a very large G
makes every load-back free, the most any prefetch of host-resident KV could save);
``--hicache-write-policy P`` SGLang's write policy (default write_through).

``--caps 0.25,0.5`` runs, instead of off, both and ceiling, off with the live sessions
capped at those fractions of each fleet's size (same pool, same sessions in all): a fixed
cap chosen after the fact, the bound of a schedule that only limits concurrency (with
``--hicache``, off+HiCache capped). Its rows have policy ``cap`` and ``cap_per_engine``;
judged with a grid file of the same cells (``--check grid.json caps.json``), the KV-bound
cells' best cap is reported beside both.

``--peer KEY=VALUE`` sets a ThunderConfig field for the peers' runs (``thunder``,
``thunder-origin``, ``thunder-router``), e.g. ``--peer decay_scope=resume`` (the public
code's acting decay, for resume only); the JSON carries them as ``peer``.

Writes ``results/regime_grid.json`` (every row) and prints the markdown tables and the
acceptance criteria of docs/benchmarks.md ("The regime grid"): over the cells' medians,
and under ``by_seed`` run by run, both / off paired with the same seed's off (runs below
0.97x per seed, cells whose median is below it, the KV-bound cells' median and gap).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.lab.cli import hicache_ratio as engines_hicache_ratio
from kvlab.lab.faults import FAULTS
from kvlab.lab.runner import LabConfig, LabError, run_lab
from kvlab.peers import PEER_POLICIES
from kvlab.provenance import git_revision
from kvlab.regimes import CONTEXTS, ENGINES, RATIOS, SIZES, WORKLOADS, Fleet, parse_fleet
from kvlab.sim.config import HICACHE_WRITE_POLICIES

HICACHE_KEYS = ("hicache_ratio", "hicache_link_gb_s", "hicache_write_policy")
# The policies a grid runs per cell and seed (--policies picks some).
GRID_POLICIES = ("off", "ceiling", "both")
# Peers a grid may run beside them (--policies off,both,thunder,ceiling): run once per
# cell and seed like off, judged against both (``peers`` in the judgement).
PEERS = PEER_POLICIES
# Faults run on the KV-bound cells only unless --faults-everywhere.
FAULT_NAMES = tuple(FAULTS)
KEEP = (
    "sessions_per_min",
    "output_tokens_per_s",
    "ttft_p99_continuing_s",
    "first_turn_wait_p99_s",
    "recompute_share",
    "sessions",
    "makespan_s",
    "admission_counters",
    "wall_s",
)


@dataclass(frozen=True)
class Job:
    fleet: Fleet
    policy: str  # off | both | ceiling | cap | thunder | thunder-origin | thunder-router
    fault: str = "none"
    seed: int = 0
    admission: Mapping[str, Any] = field(default_factory=dict)
    hicache_ratio: float | None = None  # SGLang's HiCache on the engines; None: off
    hicache_link_gb_s: float | None = None  # its host link; None: the preset's
    hicache_write_policy: str | None = None  # its write policy; None: write_through
    cap: int | None = None  # policy "cap": off with this many live sessions per engine
    tool_hints: bool = False  # both: the workload tells kvproxy each tool call's length
    # How W3's subagents name themselves (own | parent | shared; every policy alike).
    subagent_identity: str = "own"
    # ThunderConfig fields for the peers thunder / thunder-origin (--peer).
    peer: Mapping[str, Any] = field(default_factory=dict)

    def config(self) -> LabConfig:
        sc = self.fleet.scenario()
        pool, _ = self.fleet.pool()
        workload = dict(sc.workload_overrides)
        if self.subagent_identity != "own":
            workload["subagent_identity"] = self.subagent_identity
        return LabConfig(
            workload=self.fleet.workload,
            engines=ENGINES,
            sessions_per_engine=self.cap or self.fleet.per_engine,
            # A cap runs the fleet's sessions (twice its live sessions) fewer at a time.
            sessions=None if self.cap is None else 2 * ENGINES * self.fleet.per_engine,
            policy="off" if self.policy == "cap" else self.policy,
            seed=self.seed,
            engine_overrides={"max_total_tokens": pool},
            workload_overrides=workload,
            admission_overrides=dict(self.admission),
            signal_fault=self.fault,
            hicache_ratio=self.hicache_ratio,
            hicache_link_gb_s=self.hicache_link_gb_s,
            hicache_write_policy=self.hicache_write_policy,
            tool_hints=self.tool_hints,
            peer_overrides=dict(self.peer),
        )


def run_job(job: Job) -> dict[str, Any]:
    logging.disable(logging.WARNING)  # the faults' scrape warnings, once per scrape
    try:
        summary = run_lab(job.config()).summary
    except LabError as exc:  # a run that never finishes is a finding, not a crash of the grid
        print(f"{job.fleet.key} {job.policy} {job.fault}: {exc}", file=sys.stderr)
        summary = {"error": str(exc)}
    row = {k: summary.get(k) for k in KEEP}
    row.update(fleet=job.fleet.key, policy=job.policy, fault=job.fault, seed=job.seed)
    if job.cap is not None:
        row["cap_per_engine"] = job.cap
    if job.hicache_ratio is not None:
        row.update(
            hicache=summary.get("hicache"),
            hicache_ratio=summary.get("hicache_ratio"),
            loaded_back_tokens=summary.get("loaded_back_tokens"),
        )
    if "error" in summary:
        row["error"] = summary["error"]
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fleets(
    workloads: Sequence[str], contexts: Sequence[str], sizes: Sequence[int], ratios: Sequence[float]
) -> list[Fleet]:
    """Every combination, less those whose pool had to be raised to the same size as a
    smaller ratio's (the longest context must fit): the same run twice."""
    out: list[Fleet] = []
    seen: set[tuple[str, str, int, int]] = set()
    for w in workloads:
        for c in contexts:
            for n in sizes:
                for r in sorted(ratios):
                    f = Fleet(w, c, n, r)
                    key = (w, c, n, f.pool()[0])
                    if key not in seen:
                        seen.add(key)
                        out.append(f)
    return out


def distinct(
    cells: Mapping[str, dict[str, Any]], pools: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, Any]]:
    """``cells`` less the repeats of a smaller ratio's run (same fleet, same pool)."""
    seen: set[tuple[str, float]] = set()
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(cells, key=_sort_key):
        fleet = key.rsplit("/", 1)[0]
        pool = pools.get(key, {}).get("pool_tokens", float("nan"))
        if (fleet, pool) in seen:
            continue
        seen.add((fleet, pool))
        out[key] = cells[key]
    return out


def caps_for(fleet: Fleet, fractions: Sequence[float]) -> list[int]:
    """The distinct live sessions per engine that ``fractions`` of the fleet's size give,
    below its size. A grouped workload (rl: GRPO groups of 8) runs whole groups over the
    engines, so its caps are whole groups too."""
    step = max(1, fleet.scenario().spec().group_size // ENGINES)
    caps = {max(step, round(fleet.per_engine * f / step) * step) for f in fractions}
    return sorted(c for c in caps if c < fleet.per_engine)


def cap_jobs(
    cells: Sequence[Fleet],
    fractions: Sequence[float],
    seeds: Sequence[int],
    **hicache: Any,
) -> list[Job]:
    """Off at each cap of :func:`caps_for`, per fleet and seed (with the host tier of
    ``hicache``: :class:`Job`'s ``hicache_*`` fields), the largest fleets first."""
    out = [
        Job(f, "cap", seed=seed, cap=cap, **hicache)
        for f in cells
        for cap in caps_for(f, fractions)
        for seed in seeds
    ]
    out.sort(key=lambda j: -j.fleet.per_engine)
    return out


def jobs_for(
    cells: Sequence[Fleet],
    faults: Sequence[str],
    seeds: Sequence[int],
    admission: Mapping[str, Any],
    fault_cells: set[str] | None,
    hicache_ratio: float | None = None,
    hicache_link_gb_s: float | None = None,
    hicache_write_policy: str | None = None,
    policies: Sequence[str] = GRID_POLICIES,
    tool_hints: bool = False,
    subagent_identity: str = "own",
    peer: Mapping[str, Any] | None = None,
) -> list[Job]:
    """The runs of ``policies`` (of off, ceiling, both and the peers; faults run with
    both) per cell and seed; ``tool_hints``: both's workload tells kvproxy its tool
    calls' lengths; ``subagent_identity``: how W3's subagents name themselves, in every
    run; ``peer``: ThunderConfig fields for the peers' runs."""
    out: list[Job] = []
    h: dict[str, Any] = {
        "hicache_ratio": hicache_ratio,
        "hicache_link_gb_s": hicache_link_gb_s,
        "hicache_write_policy": hicache_write_policy,
        "subagent_identity": subagent_identity,
    }
    for f in cells:
        for seed in seeds:
            for name in ("off", "ceiling", *PEERS):
                if name in policies:
                    settings = dict(peer or {}) if name in PEERS else {}
                    out.append(Job(f, name, seed=seed, peer=settings, **h))
            if "both" not in policies:
                continue
            both = {"admission": admission, "tool_hints": tool_hints, **h}
            out.append(Job(f, "both", seed=seed, **both))
            for fault in faults:
                if fault == "none" or (fault_cells is not None and f.key not in fault_cells):
                    continue
                out.append(Job(f, "both", fault=fault, seed=seed, **both))
    # Longest first: big fleets first keeps both processes busy to the end.
    out.sort(key=lambda j: -j.fleet.per_engine)
    return out


def cell_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fleet: the median over seeds of each policy's (and fault's) metric."""
    by: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        name = r["policy"] if r["fault"] == "none" else f"both@{r['fault']}"
        by.setdefault((r["fleet"], name), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for (fleet, name), group in by.items():
        wl = fleet.split("/")[0]
        metric = "output_tokens_per_s" if wl == "rl" else "sessions_per_min"
        cell = out.setdefault(fleet, {"fleet": fleet, "metric": metric})
        cell[name] = {
            "value": _median(r.get(metric) for r in group),
            "ttft_p99": _median(r.get("ttft_p99_continuing_s") for r in group),
            "first_wait_p99": _median(r.get("first_turn_wait_p99_s") for r in group),
            "seeds": sorted(r["seed"] for r in group),
        }
    return out


def _median(values: Iterable[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, int | float) and not math.isnan(v)]
    return statistics.median(nums) if nums else None


def judge(cells: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The acceptance criteria of the admission issue, over the cells given."""
    worst: tuple[float, str] | None = None
    tail_bad: list[str] = []
    closed: list[float] = []
    fault_keep: dict[str, list[float]] = {}
    for key, c in sorted(cells.items()):
        off, both, ceil = (c.get(p, {}).get("value") for p in ("off", "both", "ceiling"))
        r = _ratio(both, off)
        if r is not None and (worst is None or r < worst[0]):
            worst = (r, key)
        bound = _ratio(ceil, off)
        if bound is not None and bound < 1.1:
            t = _ratio(c["both"]["ttft_p99"], c["off"]["ttft_p99"])
            if t is not None and t > 1.2 and c["both"]["ttft_p99"] > 1.0:
                tail_bad.append(f"{key} ({t:.2f}x)")
        if bound is not None and bound >= 1.3 and off and both is not None and ceil is not None:
            closed.append((both - off) / (ceil - off))
            for name, v in c.items():
                if name.startswith("both@") and isinstance(v, dict) and v.get("value"):
                    keep = _ratio(v["value"] - off, both - off) if both > off else None
                    if keep is not None:
                        fault_keep.setdefault(name[5:], []).append(keep)
    return {
        "worst_both_over_off": None if worst is None else {"ratio": worst[0], "cell": worst[1]},
        "tail_over_1_2x_where_not_kv_bound": tail_bad,
        "kv_bound_cells": len(closed),
        "median_gap_closed": _median(closed),
        "fault_gain_kept_median": {k: _median(v) for k, v in sorted(fault_keep.items())},
    }


BELOW = 0.97  # the admission issue's floor: both at least 0.97x off in every cell


def paired(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per cell and seed, both / off, ceiling / off and both's continuing-turn TTFT p99
    over off's, paired by seed (fault runs left out; a seed without all three, left out),
    and each fixed cap's run over off as ``cap/N`` (N live sessions per engine)."""
    by: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("fault", "none") == "none":
            name = r["policy"] if r["policy"] != "cap" else f"cap/{r['cap_per_engine']}"
            by.setdefault((r["fleet"], r["seed"]), {})[name] = r
    out: dict[str, dict[int, dict[str, float]]] = {}
    for (fleet, seed), runs in by.items():
        metric = "output_tokens_per_s" if fleet.split("/")[0] == "rl" else "sessions_per_min"
        off, both, ceil = (runs.get(p, {}).get(metric) for p in ("off", "both", "ceiling"))
        b, c = _ratio(both, off), _ratio(ceil, off)
        if b is None or c is None:
            continue
        seen: dict[str, float] = {"both": b, "ceiling": c}
        for name, run in runs.items():
            peer = name.startswith("cap/") or name in PEERS
            cap = _ratio(run.get(metric), off) if peer else None
            if cap is not None:
                seen[name] = cap
            if name in PEERS:
                tp = _ratio(
                    run.get("ttft_p99_continuing_s"), runs["off"].get("ttft_p99_continuing_s")
                )
                if tp is not None:
                    seen[f"{name}_ttft"] = tp
        tb, to = (runs[p].get("ttft_p99_continuing_s") for p in ("both", "off"))
        t = _ratio(tb, to)
        if t is not None and tb is not None and tb > 1.0:  # a tail under a second is no tail
            seen["ttft"] = t
        wait = runs["both"].get("first_turn_wait_p99_s")
        if isinstance(wait, int | float):
            seen["first_wait"] = float(wait)
        out.setdefault(fleet, {})[seed] = seen
    return out


def judge_seeds(rows: Iterable[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    """The criteria run by run and per cell over the seeds, ratios paired by seed: runs
    below 0.97x off (per seed), cells whose median is below it, and over the KV-bound
    cells (median ceiling / off at least 1.3) the median of the cells' medians and the
    gap closed of those medians; where fixed caps ran, the same for each KV-bound cell's
    best cap (:func:`best_cap`)."""
    runs = paired(rows)
    seeds = sorted({s for per in runs.values() for s in per})
    below: dict[int, int] = dict.fromkeys(seeds, 0)
    worst: tuple[float, str, int] | None = None
    cells_below: list[dict[str, Any]] = []
    kv: list[tuple[float, float]] = []
    capped: list[dict[str, Any]] = []
    tails: list[str] = []
    tail_runs = 0
    waits: list[float] = []
    for key in sorted(set(keys) & set(runs), key=_sort_key):
        per = runs[key]
        ratios = [per[s]["both"] for s in sorted(per)]
        for s, v in per.items():
            below[s] += v["both"] < BELOW
            if worst is None or v["both"] < worst[0]:
                worst = (v["both"], key, s)
            waits += [v["first_wait"]] if "first_wait" in v else []
        mid = statistics.median(ratios)
        bound = statistics.median(v["ceiling"] for v in per.values())
        if mid < BELOW:
            cells_below.append({"cell": key, "median": mid, "per_seed": ratios})
        if bound >= 1.3:
            kv.append((mid, bound))
            best = best_cap(per)
            if best is not None:
                capped.append({"cell": key, "both": mid, "ceiling": bound, **best})
        elif bound < 1.1:
            tail = [v["ttft"] for v in per.values() if "ttft" in v]
            tail_runs += sum(t > 1.2 for t in tail)
            if tail and statistics.median(tail) > 1.2:
                tails.append(key)
    return {
        "seeds": seeds,
        "runs": sum(len(runs[k]) for k in set(keys) & set(runs)),
        "runs_below": {"total": sum(below.values()), "by_seed": below},
        "worst_run": None
        if worst is None
        else {"ratio": worst[0], "cell": worst[1], "seed": worst[2]},
        "cells_median_below": cells_below,
        "kv_bound_cells": len(kv),
        "kv_bound_median_both_over_off": _median(m for m, _ in kv),
        "kv_bound_median_gap_closed": _median((m - 1) / (b - 1) for m, b in kv),
        "not_kv_bound_tail_over_1_2x": {"runs": tail_runs, "cells_by_median": tails},
        "first_turn_wait_p99_worst_s": max(waits, default=None),
        **({"kv_bound_best_cap": _caps_summary(capped)} if capped else {}),
        **peer_comparison(runs, keys),
    }


def peer_comparison(
    runs: Mapping[str, Mapping[int, Mapping[str, float]]], keys: Iterable[str]
) -> dict[str, Any]:
    """Per peer that ran (thunder, thunder-origin, thunder-router): both against it cell
    by cell, the ratios paired by seed (both / off over peer / off, i.e. both / peer):
    the cells where each wins by more than 3% (medians over the seeds), the median ratio
    over the cells, its tails (the worst and best cells, the 10th and 90th percentiles)
    and the median continuing-turn TTFT p99 of each over off's; KV-bound cells (ceiling /
    off >= 1.3) apart."""
    out: dict[str, Any] = {}
    cells = sorted(set(keys) & set(runs), key=_sort_key)
    for peer in PEERS:
        ratios: dict[str, float] = {}
        kv: list[float] = []
        for key in cells:
            per = [v for v in runs[key].values() if peer in v and v[peer] > 0]
            if not per:
                continue
            r = statistics.median(v["both"] / v[peer] for v in per)
            ratios[key] = r
            if statistics.median(v["ceiling"] for v in per) >= 1.3:
                kv.append(r)
        if not ratios:
            continue
        ordered = sorted(ratios.items(), key=lambda kv_: kv_[1])
        values = [v for _, v in ordered]
        deciles = statistics.quantiles(values, n=10) if len(values) >= 2 else values * 9
        tt_peer = [
            v[f"{peer}_ttft"] for k in cells for v in runs[k].values() if f"{peer}_ttft" in v
        ]
        tt_both = [v["ttft"] for k in cells for v in runs[k].values() if "ttft" in v]
        out[f"both_vs_{peer}"] = {
            "cells": len(ratios),
            "both_wins": [f"{k} {v:.2f}x" for k, v in ordered[::-1] if v > 1.03],
            f"{peer}_wins": [f"{k} {v:.2f}x" for k, v in ordered if v < 1 / 1.03],
            "median_both_over_peer": statistics.median(values),
            "p10": deciles[0],
            "p90": deciles[-1],
            "worst": f"{ordered[0][0]} {ordered[0][1]:.2f}x",
            "best": f"{ordered[-1][0]} {ordered[-1][1]:.2f}x",
            "kv_bound_cells": len(kv),
            "kv_bound_median_both_over_peer": _median(kv),
            "median_ttft_p99_over_off": {"both": _median(tt_both), peer: _median(tt_peer)},
        }
    return out


def best_cap(per: Mapping[int, Mapping[str, float]]) -> dict[str, Any] | None:
    """A cell's best fixed cap, chosen after the fact: the cap whose median over the seeds
    of cap / off is highest (no cap at all, off itself, when none beats 1.0); None where
    no cap ran."""
    names = {n for v in per.values() for n in v if n.startswith("cap/")}
    if not names:
        return None
    medians = {n: statistics.median(v[n] for v in per.values() if n in v) for n in names}
    name = max(sorted(medians, key=lambda n: int(n[4:])), key=lambda n: medians[n])
    if medians[name] <= 1.0:
        return {"cap_per_engine": None, "best_cap": 1.0}
    return {"cap_per_engine": int(name[4:]), "best_cap": medians[name]}


def _caps_summary(capped: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over the KV-bound cells with caps: the median of the best caps, their gap closed,
    both's median and gap closed on the same cells, and the cells where the best cap
    beats both by 10% or more."""
    return {
        "cells": len(capped),
        "median_best_cap_over_off": _median(c["best_cap"] for c in capped),
        "median_gap_closed": _median((c["best_cap"] - 1) / (c["ceiling"] - 1) for c in capped),
        "median_both_over_off": _median(c["both"] for c in capped),
        "median_gap_closed_both": _median((c["both"] - 1) / (c["ceiling"] - 1) for c in capped),
        "best_cap_beats_both_by_10pct": [
            f"{c['cell']}: cap {c['cap_per_engine']} {c['best_cap']:.2f}x, both {c['both']:.2f}x"
            for c in capped
            if c["best_cap"] >= 1.1 * c["both"]
        ],
    }


def read_grid(path: Path) -> Any:
    """A grid file's JSON; a name ending in ``.gz`` is read through gzip (docs/data keeps
    its grids compressed)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def check_arg(text: str) -> tuple[Path, frozenset[str] | None]:
    """A ``--check`` argument: ``FILE``, or ``FILE:CONTEXTS`` to take only the rows of those
    contexts (a comma list of short, long) from it."""
    path, sep, tail = text.rpartition(":")
    names = tail.split(",")
    if sep and path and tail and all(n in CONTEXTS for n in names):
        return Path(path), frozenset(names)
    return Path(text), None


def only_contexts(doc: Mapping[str, Any], contexts: frozenset[str] | None) -> dict[str, Any]:
    """The grid file ``doc`` with only the rows and pools of ``contexts`` (None: all)."""
    if contexts is None:
        return dict(doc)

    def kept(cell: str) -> bool:
        return parse_fleet(cell).context in contexts

    return {
        **doc,
        "rows": [r for r in doc["rows"] if kept(r["fleet"])],
        "pools": {k: v for k, v in doc.get("pools", {}).items() if kept(k)},
    }


def merge_grids(docs: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows and pools of several grid files of the same engines: a run (cell, policy,
    fault, seed) in two files, or files whose host tier differs, is refused."""
    rows: list[dict[str, Any]] = []
    pools: dict[str, Any] = {}
    seen: set[tuple[str, str, str, int, int | None]] = set()
    tier = [{k: d.get(k) for k in HICACHE_KEYS} for d in docs]
    if any(t != tier[0] for t in tier):
        raise ValueError(f"the grids' host tiers differ: {tier}")
    for doc in docs:
        for r in doc["rows"]:
            run = (
                r["fleet"],
                r["policy"],
                r.get("fault", "none"),
                r["seed"],
                r.get("cap_per_engine"),
            )
            if run in seen:
                named = "/".join(str(x) for x in run if x is not None)
                raise ValueError(f"run {named} is in two of the grids")
            seen.add(run)
            rows.append(r)
        for key, pool in doc.get("pools", {}).items():
            if pools.setdefault(key, pool) != pool:
                raise ValueError(f"cell {key} has two pools: {pools[key]}, {pool}")
    return rows, pools


def _fmt(v: float | None, spec: str = "{:.2f}") -> str:
    return "-" if v is None else spec.format(v)


def markdown(cells: Mapping[str, Mapping[str, Any]]) -> str:
    faults = sorted({n for c in cells.values() for n in c if n.startswith("both@")})
    head = [
        "cell (workload/context/per engine/ws:pool)",
        "off",
        "both",
        "ceiling",
        "both/off",
        "ceil/off",
        "gap closed",
        "TTFT p99 off / both (s)",
        "first wait p99 (s)",
        *(f"{f[5:]} both/off" for f in faults),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(cells, key=_sort_key):
        c = cells[key]
        off, both, ceil = (c.get(p, {}).get("value") for p in ("off", "both", "ceiling"))
        gap = None
        if off is not None and both is not None and ceil is not None and ceil - off > 1e-9:
            gap = (both - off) / (ceil - off)
        row = [
            key,
            _fmt(off),
            _fmt(both),
            _fmt(ceil),
            _fmt(_ratio(both, off)),
            _fmt(_ratio(ceil, off)),
            _fmt(gap) if _ratio(ceil, off) and (_ratio(ceil, off) or 0) >= 1.3 else "",
            f"{_fmt(c.get('off', {}).get('ttft_p99'), '{:.1f}')} / "
            f"{_fmt(c.get('both', {}).get('ttft_p99'), '{:.1f}')}",
            _fmt(c.get("both", {}).get("first_wait_p99"), "{:.0f}"),
            *(_fmt(_ratio(c.get(f, {}).get("value"), off)) for f in faults),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def compact(
    cells: Mapping[str, Mapping[str, Any]],
    by_seed: Mapping[str, Mapping[int, Mapping[str, float]]] | None = None,
) -> str:
    """One table per workload and context: both / off by fleet size (rows) and working
    set / pool (columns), the no-eviction bound ceiling / off in brackets; ``=`` marks a
    pool raised to the longest context (the cell to its left, run once). With
    ``by_seed`` (:func:`paired`) each ratio is the median over the seeds of the ratio
    paired by seed, else the ratio of the policies' medians."""
    out: list[str] = []
    groups: dict[tuple[str, str], dict[tuple[int, float], Mapping[str, Any]]] = {}
    for key, cell in cells.items():
        work, context, size, ratio = key.split("/")
        groups.setdefault((work, context), {})[(int(size), float(ratio))] = cell
    for (w, ctx), g in sorted(groups.items(), key=lambda kv: _sort_key("/".join(kv[0]) + "/0/0")):
        sizes = sorted({n for n, _ in g})
        ratios = sorted({r for _, r in g} | set(RATIOS))
        out.append(f"**{w}, {ctx} context** (both / off [ceiling / off])")
        out.append("")
        out.append("| per engine | " + " | ".join(f"ws/pool {r:g}" for r in ratios) + " |")
        out.append("|---|" + "---|" * len(ratios))
        for n in sizes:
            row = []
            for r in ratios:
                c = g.get((n, r))
                if c is None:
                    row.append("=")
                    continue
                per = by_seed.get(f"{w}/{ctx}/{n}/{r:g}") if by_seed else None
                if per:
                    b = statistics.median(v["both"] for v in per.values())
                    top = statistics.median(v["ceiling"] for v in per.values())
                    row.append(f"{_fmt(b)} [{_fmt(top)}]")
                    continue
                off, both, ceil = (c.get(p, {}).get("value") for p in ("off", "both", "ceiling"))
                row.append(f"{_fmt(_ratio(both, off))} [{_fmt(_ratio(ceil, off))}]")
            out.append(f"| {n} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def _sort_key(key: str) -> tuple[Any, ...]:
    w, c, n, r = key.split("/")
    return (WORKLOADS.index(w) if w in WORKLOADS else 9, c, int(n), float(r))


def _csv(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.split(",") if x]


def seed_list(text: str) -> list[int]:
    """``--seeds``: numbers and inclusive ranges, comma-separated (``0,1``, ``0-7``,
    ``0-3,8``), each seed once, in the order given."""
    want = f"seeds {text!r}: want numbers and ranges, e.g. 0,1 or 0-7"
    seeds: list[int] = []
    for part in filter(None, text.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise argparse.ArgumentTypeError(want) from None
        if last < first:
            raise argparse.ArgumentTypeError(f"{want} (a range runs upwards)")
        seeds.extend(range(first, last + 1))
    if not seeds:
        raise argparse.ArgumentTypeError(want)
    return list(dict.fromkeys(seeds))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--contexts", default=",".join(CONTEXTS))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    ap.add_argument(
        "--faults",
        default="none",
        help=f"comma-separated of {', '.join(FAULT_NAMES)}, or 'all' (default none)",
    )
    ap.add_argument(
        "--fault-cells",
        default="kv-bound",
        help="where faults run: 'kv-bound' (cells named by --kv-bound-from) or 'all'",
    )
    ap.add_argument(
        "--kv-bound-from",
        type=Path,
        default=None,
        help="an earlier grid's JSON: faults run on its cells with ceiling/off >= 1.3",
    )
    ap.add_argument("--seeds", type=seed_list, default=[0], help="e.g. 0,1 or 0-7 (default 0)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--admission",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an admission.* key for both (YAML value); repeatable",
    )
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a ThunderConfig field for the thunder peers (YAML value, "
        "e.g. decay_scope=resume); repeatable",
    )
    ap.add_argument(
        "--hicache",
        action="store_true",
        help="engines of off and both run SGLang's hierarchical cache (ratio 2.0)",
    )
    ap.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="the host pool / device pool; implies --hicache",
    )
    ap.add_argument(
        "--hicache-link-gb-s",
        type=float,
        default=None,
        help="the host link's GB/s (a what-if; default the preset's, 50); implies --hicache",
    )
    ap.add_argument(
        "--hicache-write-policy",
        choices=HICACHE_WRITE_POLICIES,
        default=None,
        help="SGLang's write policy (default write_through); implies --hicache",
    )
    ap.add_argument(
        "--caps",
        default=None,
        metavar="F1,F2,...",
        help="run only off with live sessions capped at these fractions of each fleet's size",
    )
    ap.add_argument(
        "--policies",
        default=",".join(GRID_POLICIES),
        help="which of off, ceiling, both and the peers thunder, thunder-origin, thunder-router "
        "to run (default off, ceiling, both; judge a partial grid beside the runs it lacks)",
    )
    ap.add_argument(
        "--tool-hints",
        action="store_true",
        help="both's workload tells kvproxy each tool call's length as it starts "
        "(POST /kvproxy/sessions/{id}/prefetch), for admission.prefetch",
    )
    ap.add_argument(
        "--subagent-identity",
        choices=("own", "parent", "shared"),
        default="own",
        help="how W3's subagents name themselves, in every policy's runs: own ids "
        "(default), own ids naming their lead as parent, or their lead's id (docs/adoption.md)",
    )
    ap.add_argument("--out", type=Path, default=Path("results/regime_grid.json"))
    ap.add_argument(
        "--check",
        type=check_arg,
        nargs="+",
        default=None,
        metavar="FILE[:CONTEXTS]",
        help="judge grid JSONs (several: their seeds together; FILE:short takes only that "
        "context's rows of FILE) and exit",
    )
    ap.add_argument(
        "--compact", action="store_true", help="with --check: one table per workload and context"
    )
    args = ap.parse_args(argv)

    if args.check is not None:
        docs = [only_contexts(read_grid(p), c) for p, c in args.check]
        try:
            merged, merged_pools = merge_grids(docs)
        except ValueError as exc:
            ap.error(str(exc))
        for (p, c), d in zip(args.check, docs, strict=True):
            seeds_run = ",".join(map(str, d.get("seeds", [])))
            taken = "" if c is None else f" ({','.join(sorted(c))} contexts)"
            print(
                f"{p}{taken}: commit {d.get('commit')}, seeds {seeds_run}, "
                f"admission {d.get('admission')}"
            )
        doc = docs[0]
        cells = distinct(cell_rows(merged), merged_pools)
        if doc.get("hicache_ratio") is not None:
            link = doc.get("hicache_link_gb_s")
            on = f"--hicache-ratio {doc['hicache_ratio']:g}"
            on += "" if link is None else f", host link {link:g} GB/s"
            policy = doc.get("hicache_write_policy")
            on += "" if policy is None else f", {policy}"
            print(f"HiCache on (off and both): {on}")
        print(compact(cells, paired(merged)) if args.compact else markdown(cells))
        print(json.dumps({**judge(cells), "by_seed": judge_seeds(merged, cells)}, indent=2))
        return 0

    import yaml

    admission = {}
    for item in args.admission:
        k, _, v = item.partition("=")
        admission[k.strip()] = yaml.safe_load(v)
    peer = {}
    for item in args.peer:
        k, _, v = item.partition("=")
        peer[k.strip()] = yaml.safe_load(v)
    faults = list(FAULT_NAMES) if args.faults == "all" else _csv(args.faults, str)
    bad = sorted(set(faults) - set(FAULT_NAMES))
    if bad:
        ap.error(f"unknown faults: {', '.join(bad)}")
    grid = fleets(
        _csv(args.workloads, str),
        _csv(args.contexts, str),
        _csv(args.sizes, int),
        _csv(args.ratios, float),
    )
    fault_cells: set[str] | None = None
    if args.fault_cells == "kv-bound" and args.kv_bound_from is not None:
        earlier = cell_rows(read_grid(args.kv_bound_from)["rows"])
        fault_cells = {
            k
            for k, c in earlier.items()
            if (_ratio(c.get("ceiling", {}).get("value"), c.get("off", {}).get("value")) or 0)
            >= 1.3
        }
    hicache_ratio = engines_hicache_ratio(args)  # the lab's flags, the lab's reading
    link = args.hicache_link_gb_s
    policy = args.hicache_write_policy
    seeds: list[int] = args.seeds
    policies = _csv(args.policies, str)
    if args.caps is not None:
        if faults != ["none"] or admission:
            ap.error("--caps runs off only: no faults or --admission")
        fractions = _csv(args.caps, float)
        if not fractions or any(not 0 < f < 1 for f in fractions):
            ap.error(f"--caps takes fractions between 0 and 1, got {args.caps!r}")
        jobs = cap_jobs(
            grid,
            fractions,
            seeds,
            hicache_ratio=hicache_ratio,
            hicache_link_gb_s=link,
            hicache_write_policy=policy,
        )
    else:
        if not policies or set(policies) - set(GRID_POLICIES) - set(PEERS):
            names = ", ".join((*GRID_POLICIES, *PEERS))
            ap.error(f"--policies takes some of {names}, got {args.policies!r}")
        jobs = jobs_for(
            grid,
            faults,
            seeds,
            admission,
            fault_cells,
            hicache_ratio,
            link,
            policy,
            policies=policies,
            tool_hints=args.tool_hints,
            subagent_identity=args.subagent_identity,
            peer=peer,
        )
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for i, row in enumerate(pool.map(run_job, jobs), 1):
            rows.append(row)
            if i % 25 == 0 or i == len(jobs):
                print(f"  {i}/{len(jobs)} runs, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    pools = {f.key: dict(zip(("pool_tokens", "ws_over_pool"), f.pool(), strict=True)) for f in grid}
    doc = {
        "command": "python scripts/regime_grid.py " + " ".join(argv or sys.argv[1:]),
        "commit": git_revision(),
        "seeds": seeds,
        "admission": admission,
        **({} if not args.tool_hints else {"tool_hints": True}),
        **({} if not peer else {"peer": peer}),
        **({} if args.caps is None else {"caps": _csv(args.caps, float)}),
        **({} if hicache_ratio is None else {"hicache_ratio": hicache_ratio}),
        **({} if link is None else {"hicache_link_gb_s": link}),
        **({} if policy is None else {"hicache_write_policy": policy}),
        "wall_s": round(time.perf_counter() - t0, 1),
        "pools": pools,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.caps is not None:
        print(f"{len(rows)} capped runs in {args.out}; judge them beside a grid: --check")
        return 0
    if set(GRID_POLICIES) - set(policies):
        print(f"{len(rows)} runs in {args.out}; judge them beside the runs they lack: --check")
        return 0
    cells = distinct(cell_rows(rows), pools)
    print(markdown(cells))
    print(json.dumps({**judge(cells), "by_seed": judge_seeds(rows, cells)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
