"""What each mechanism of program admission adds: ``both`` with one mechanism switched off
(or to its alternative) at a time, in the lab.

The one list of ablations: ``kvproxy demo --lab`` prints its table and
``scripts/bench_admission_lab.py --tables ablation`` measures it over seeds
(`kvproxy demo --lab`; today's measurements: docs/benchmarks.md, "Program admission:
safe to leave on").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.lab.runner import LabConfig, median_row, run_lab

# name -> the admission.* keys it overrides on top of ``both``'s documented defaults.
ABLATIONS: tuple[tuple[str, Mapping[str, Any]], ...] = (
    ("both (defaults)", {}),
    ("fleet ledger", {"ledger": "fleet"}),
    ("hold continuing", {"hold_continuing": True}),
    ("no growth reservation", {"growth_reservation": False}),
    ("no pause", {"pause": False}),
    ("priority steering on", {"priority_steering": True}),
    ("pause bound 8 s", {"paused_max_wait_s": 8.0}),
    ("no feedback", {"feedback": False}),
    ("request mode (Relax)", {"mode": "request"}),
)


def run_ablation(
    cfg: LabConfig,
    seeds: Sequence[int],
    ablations: Sequence[tuple[str, Mapping[str, Any]]] = ABLATIONS,
) -> dict[str, dict[str, Any]]:
    """``off`` and every ablation x seed: ``{name: {"median": row, "per_seed": {...}}}``.
    Each ablation runs policy ``both`` with its overrides on top of ``cfg``'s."""
    runs: list[tuple[str, LabConfig]] = [("off", dataclasses.replace(cfg, policy="off"))]
    for name, overrides in ablations:
        adm = {**cfg.admission_overrides, **overrides}
        runs.append((name, dataclasses.replace(cfg, policy="both", admission_overrides=adm)))
    out: dict[str, dict[str, Any]] = {}
    for name, base in runs:
        rows = {s: run_lab(dataclasses.replace(base, seed=s)).summary for s in seeds}
        out[name] = {"median": median_row(list(rows.values())), "per_seed": rows}
    return out


def _ratio(num: Any, den: Any) -> float | None:
    if not isinstance(num, int | float) or not isinstance(den, int | float) or den == 0:
        return None
    return float(num) / float(den)


# (column header, summary key) of the ablation table; each shown as a ratio to off.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("sessions/min", "sessions_per_min"),
    ("recompute", "recomputed_prefill_tokens"),
    ("cont. TTFT p99", "ttft_p99_continuing_s"),
    ("makespan", "makespan_s"),
)


def format_ablation(meds: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per configuration, each metric as a ratio of the medians to ``off``'s."""
    off = meds.get("off", {})
    width = max(len(n) for n in meds) if meds else 10
    head = f"{'x off':<{width}}  " + "  ".join(f"{h:>14}" for h, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, med in meds.items():
        if name == "off":
            continue
        cells = []
        for _, key in COLUMNS:
            r = _ratio(med.get(key), off.get(key))
            cells.append(f"{'-' if r is None else f'{r:.2f}x':>14}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
