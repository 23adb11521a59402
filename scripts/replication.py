#!/usr/bin/env python3
"""The public ThunderAgent replication (zetxqx/thunderagent-original-verification) in the
lab, on its engine (``qwen3-coder-30b-a3b-fp8-h100-tp2``): one table, one row per
experiment, the real GPU numbers beside the lab's.

Experiments (the replication's own sizes, sessions per pod as it ran them):

- ``06``, ``06/exact``: one pod, the ``burst`` workload (80 sessions x 3 turns x ~61k
  unique tokens, 2.2x the pool), run to its end; throughput is output tokens / makespan;
  ThunderAgent's first-response token estimate at 4.5 chars per token, or exact.
- ``13/<n>``: four pods, ``claude-code``, n sessions per pod (12, 24, 32, 48, 64, 84:
  working set / pool 0.45 ... 1.85 in the replication), a 30-minute window measured
  from minute 10, closed loop.
- ``20A/<c>``: one pod, ``claude-code``, c sessions (32, 128, 256), no host tier; 30
  minutes from minute 10 (256: 45 from 15).
- ``20B/<c>``: the same with a 400 GiB host tier (HiCache ratio 3.9), c = 32, 128, 192,
  256 (hit rate: GPU and host together).

Policies: ``off`` (the real baseline: the router alone), ``thunder`` (ThunderAgent;
step 13 with the llm-d port's resume placement, origin-first), ``thunder-origin`` (step 13
only), ``both`` (kvproxy), ``cap:N`` at a few N (the best reported), ``ceiling``.

    python scripts/replication.py --seeds 0,1 --out results/replication.json
    python scripts/replication.py --only 06,13/48 --policies off,thunder --seeds 0
    python scripts/replication.py --table a.json b.json   # the markdown of runs together

Metrics per run, over the window's turns (those that end in it): output tokens/s (real
tokens), cache hit rate (cached / prompt tokens), TTFT p50 / p99 (from the client's
send, any hold by the scheduler included), the mean prompt (the emergent working set per
session); medians over the seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.demo import git_revision
from kvlab.lab.runner import LabConfig, LabError, run_lab

PRESET = "qwen3-coder-30b-a3b-fp8-h100-tp2"
POOL = 2_237_040
K = 16


@dataclass(frozen=True)
class Real:
    """A measured arm: output tok/s, hit rate, TTFT p50 / p99 (s); None: not reported."""

    tok_s: float | None
    hit: float | None
    ttft_p50: float | None = None
    ttft_p99: float | None = None


@dataclass(frozen=True)
class Experiment:
    name: str
    workload: str
    engines: int
    per_engine: int
    window: tuple[float, float] | None  # (warm-up end, deadline) s; None: run to the end
    real_off: Real
    real_thunder: Real
    real_origin: Real | None = None
    ws_over_pool: float | None = None  # the replication's working set / pool
    hicache_ratio: float | None = None
    thunder: Mapping[str, Any] = field(default_factory=dict)
    caps: tuple[int, ...] = ()
    source: str = ""


W30 = (600.0, 1800.0)
W45 = (900.0, 2700.0)
S13 = "13-llm-d-router-sweep/BENCHMARK-REPORT.md, section 6.1"
S20 = "20-cpu-offload-pool/results/analysis.md"
# The llm-d port's "most-room" resume (own pod if it fits, else the most room); its
# acting decay counts everywhere (the default decay_scope).
PORT = {"resume_placement": "origin-first"}

# fmt: off
EXPERIMENTS: tuple[Experiment, ...] = (
    # Step 06 ran the public ThunderAgent (decay for resume only). Its token count before
    # the first response is characters / 5.0; the preamble's characters per token are
    # not published: "06" assumes 4.5 (a 10% undercount), "06/exact" counts exactly.
    *(
        Experiment(
            name,
            "burst",
            1,
            80,
            None,
            # Output tok/s = 240 turns x 80 tokens / makespan (457.5 s, 315.3 s).
            Real(240 * 80 / 457.5, 0.000),
            Real(240 * 80 / 315.3, 0.345),
            ws_over_pool=2.2,
            thunder={"decay_scope": "resume", "chars_per_token": cpt},
            caps=(20, 30, 40),
            source="06-single-node-ab/results.md (tr + acting decay, no release)",
        )
        for name, cpt in (("06", 4.5), ("06/exact", 5.0))
    ),
    *(
        Experiment(
            f"13/{n}",
            "claude-code",
            4,
            n,
            W30,
            Real(*off),
            Real(*ta),
            None if org is None else Real(*org),
            ws_over_pool=ws,
            thunder=PORT,
            caps=tuple(c for c in (n // 4, n // 2, (3 * n) // 4) if c >= 4),
            source=S13,
        )
        for n, ws, off, ta, org in (
            (12, 0.45, (2014, 0.952, 0.4, 5.7), (1972, 0.948, 0.4, 6.1), None),
            (24, 0.75, (1541, 0.625, 0.5, 34.4), (1536, 0.602, 0.5, 26.6), (1813, 0.816, 0.5, 35.3)),
            (32, 0.87, (1151, 0.040, 8.2, 49.9), (1382, 0.353, 2.3, 65.5), (1571, 0.629, 1.3, 102.4)),
            (48, 1.18, (1065, 0.003, 36.0, 107.4), (1342, 0.301, 3.2, 516.7), (1639, 0.525, 3.0, 400.8)),
            (64, 1.48, (999, 0.002, 65.8, 156.3), (1438, 0.266, 3.4, 596.9), (1633, 0.456, 4.0, 587.7)),
            (84, 1.85, (1050, 0.002, 101.5, 199.1), (1538, 0.249, 3.5, 748.0), (1698, 0.422, 4.4, 748.3)),
        )
    ),
    # Step 20's ThunderAgent arm is the replication's lease variant ("lease, GPU capacity").
    Experiment("20A/32", "claude-code", 1, 32, W30, Real(359, 0.045, 3.9, 33.6),
               Real(516, 0.771, 0.5, 150.2), ws_over_pool=1.00, caps=(16, 24), source=S20),
    Experiment("20A/128", "claude-code", 1, 128, W30, Real(284, 0.000, 174.2, 266.5),
               Real(498, 0.654, 2.7, 1458.5), ws_over_pool=2.68, caps=(24, 32), source=S20),
    Experiment("20A/256", "claude-code", 1, 256, W45, Real(286, 0.000, 421.9, 564.5),
               Real(367, 0.382, 20.0, 1849.1), ws_over_pool=4.97, caps=(24, 32), source=S20),
    Experiment("20B/32", "claude-code", 1, 32, W30, Real(560, 0.913, 4.9, 35.1),
               Real(578, 0.912, 0.5, 198.4), ws_over_pool=1.12, hicache_ratio=3.9, source=S20),
    Experiment("20B/128", "claude-code", 1, 128, W30, Real(567, 0.856, 102.8, 237.2),
               Real(635, 0.865, 1.1, 1680.8), ws_over_pool=3.16, hicache_ratio=3.9, source=S20),
    Experiment("20B/192", "claude-code", 1, 192, W45, Real(366, 0.093, 230.9, 505.1),
               Real(551, 0.744, 2.9, 1834.7), ws_over_pool=4.18, hicache_ratio=3.9, source=S20),
    Experiment("20B/256", "claude-code", 1, 256, W45, Real(288, 0.003, 416.8, 576.4),
               Real(516, 0.692, 7.3, 1851.7), ws_over_pool=4.96, hicache_ratio=3.9, source=S20),
)
# fmt: on


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100.0 * len(s)))]


def measure(result: Any, exp: Experiment) -> dict[str, Any]:
    """The window's metrics of one lab run (real tokens)."""
    turns = [t for t in result.workload.turns if t.ok]
    if exp.window is None:
        span = result.workload.makespan_s
        inside = turns
    else:
        lo, hi = exp.window
        span = hi - lo
        inside = [t for t in turns if lo <= t.end_s <= hi]
    prompt = sum(t.prompt_tokens for t in inside)
    ttft = [t.ttft_s for t in inside if t.ttft_s is not None]
    return {
        "tok_s": round(K * sum(t.completion_tokens for t in inside) / span, 1) if span else None,
        "hit": round(sum(t.cached_tokens for t in inside) / prompt, 4) if prompt else None,
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p99": _percentile(ttft, 99),
        "mean_prompt": round(K * prompt / len(inside)) if inside else None,
        "turns": len(inside),
        "makespan_s": result.workload.makespan_s,
        "counters": result.summary.get("admission_counters"),
    }


def config(exp: Experiment, policy: str, seed: int) -> LabConfig:
    n = exp.engines * exp.per_engine
    peer = dict(exp.thunder) if policy.startswith("thunder") else {}
    if policy == "thunder-origin":
        peer.pop("resume_placement", None)
    return LabConfig(
        workload=exp.workload,
        engines=exp.engines,
        sessions_per_engine=exp.per_engine,
        # A window: enough sessions that the closed loop never runs dry.
        sessions=n if exp.window is None else 20 * n,
        policy=policy,
        token_scale=K,
        seed=seed,
        cost_model=PRESET,
        deadline_s=None if exp.window is None else exp.window[1],
        hicache_ratio=None if policy == "ceiling" else exp.hicache_ratio,
        peer_overrides=peer,
    )


def policies_for(exp: Experiment, wanted: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in wanted:
        if p == "cap":
            out += [f"cap:{c}" for c in exp.caps]
        elif p == "thunder-origin" and not exp.name.startswith("13/"):
            continue
        else:
            out.append(p)
    return out


def run(
    exps: Sequence[Experiment], wanted: Sequence[str], seeds: Sequence[int]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for exp in exps:
        for policy in policies_for(exp, wanted):
            for seed in seeds:
                t0 = time.perf_counter()
                try:
                    m = measure(run_lab(config(exp, policy, seed)), exp)
                except LabError as exc:
                    m = {"error": str(exc)}
                m.update(experiment=exp.name, policy=policy, seed=seed)
                m["wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(m)
                print(json.dumps(m), file=sys.stderr)
    return rows


def _median(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(vals) if vals else None


def cells(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """experiment -> policy -> median metrics (and the best cap as ``cap``)."""
    by: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["experiment"], r["policy"]), []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (exp, policy), group in by.items():
        out.setdefault(exp, {})[policy] = {
            k: _median(group, k) for k in ("tok_s", "hit", "ttft_p50", "ttft_p99", "mean_prompt")
        }
    for per in out.values():
        caps = {p: v for p, v in per.items() if p.startswith("cap:") and v["tok_s"] is not None}
        if caps:
            best = max(caps, key=lambda p: caps[p]["tok_s"])
            per["cap"] = {**caps[best], "name": best}
    return out


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else spec.format(v)


def _cell(m: Mapping[str, Any] | None) -> str:
    if m is None:
        return "-"
    return (
        f"{_f(m.get('tok_s'), '{:.0f}')} / {_f(m.get('hit'), '{:.2f}')} / "
        f"{_f(m.get('ttft_p50'), '{:.1f}')} / {_f(m.get('ttft_p99'), '{:.0f}')}"
    )


def _real(r: Real | None) -> dict[str, Any] | None:
    return None if r is None else dataclasses.asdict(r)


def _gain(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> float | None:
    if not a or not b or not a.get("tok_s") or not b.get("tok_s"):
        return None
    return float(a["tok_s"]) / float(b["tok_s"])


def markdown(table: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    head = (
        "| exp | ws/pool real (lab) | real off | real ThunderAgent | lab off | lab thunder | "
        "lab both | lab cap (best) | ceiling | gain real / lab |\n|" + "---|" * 10
    )
    lines = [head]
    for exp in EXPERIMENTS:
        per = table.get(exp.name)
        if not per:
            continue
        off = per.get("off")
        lab_ws = None
        if off and off.get("mean_prompt"):
            lab_ws = exp.per_engine * off["mean_prompt"] / POOL
        real_gain = _gain(_real(exp.real_thunder), _real(exp.real_off))
        lab_gain = _gain(per.get("thunder"), off)
        cap = per.get("cap")
        lines.append(
            f"| {exp.name} | {_f(exp.ws_over_pool, '{:.2f}')} ({_f(lab_ws, '{:.2f}')}) | "
            f"{_cell(_real(exp.real_off))} | {_cell(_real(exp.real_thunder))} | {_cell(off)} | "
            f"{_cell(per.get('thunder'))} | {_cell(per.get('both'))} | "
            f"{_cell(cap)}{'' if not cap else ' ' + str(cap.get('name'))} | "
            f"{_cell(per.get('ceiling'))} | {_f(real_gain, '{:.2f}')} / {_f(lab_gain, '{:.2f}')} |"
        )
    origin = [e for e in EXPERIMENTS if e.real_origin is not None and e.name in table]
    if origin:
        lines += [
            "",
            "| exp | real origin-only | lab thunder-origin | gain real / lab |",
            "|---|---|---|---|",
        ]
        for e in origin:
            per = table[e.name]
            lines.append(
                f"| {e.name} | {_cell(_real(e.real_origin))} | {_cell(per.get('thunder-origin'))} | "
                f"{_f(_gain(_real(e.real_origin), _real(e.real_off)), '{:.2f}')} / "
                f"{_f(_gain(per.get('thunder-origin'), per.get('off')), '{:.2f}')} |"
            )
    lines.append("")
    lines.append("Cells: output tok/s / hit rate / TTFT p50 (s) / TTFT p99 (s).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="experiments, e.g. 06,13/48,20A/32")
    ap.add_argument(
        "--policies",
        default="off,thunder,thunder-origin,both,cap,ceiling",
        help="of off, thunder, thunder-origin, both, cap (the experiment's caps), ceiling",
    )
    ap.add_argument(
        "--caps", default=None, help="cap:N values for every experiment (default: each one's)"
    )
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", type=Path, default=Path("results/replication.json"))
    ap.add_argument(
        "--table",
        type=Path,
        nargs="+",
        default=None,
        help="print the table of one or more JSONs (their rows together) and exit",
    )
    args = ap.parse_args(argv)
    if args.table is not None:
        rows = [r for path in args.table for r in json.loads(path.read_text())["rows"]]
        print(markdown(cells(rows)))
        return 0
    names = None if args.only is None else set(args.only.split(","))
    exps = [e for e in EXPERIMENTS if names is None or e.name in names]
    if args.caps is not None:
        caps = tuple(int(c) for c in args.caps.split(","))
        exps = [
            dataclasses.replace(e, caps=tuple(c for c in caps if c < e.per_engine)) for e in exps
        ]
    if not exps:
        ap.error(f"no experiment named {args.only!r}: {', '.join(e.name for e in EXPERIMENTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    wanted = [p.strip() for p in args.policies.split(",") if p.strip()]
    t0 = time.perf_counter()
    rows = run(exps, wanted, seeds)
    doc = {
        "command": "python scripts/replication.py " + " ".join(argv or sys.argv[1:]),
        "commit": git_revision(),
        "seeds": seeds,
        "token_scale": K,
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(cells(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
