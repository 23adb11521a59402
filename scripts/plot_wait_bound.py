#!/usr/bin/env python3
"""The first-turn wait bound's trade-off, in the lab: W1 both / off and both's first-turn
wait p99 against ``admission.new_session_max_wait_s``.

Runs ``kvproxy lab`` (the CLI, so the script does not depend on where the lab's code
lives): ``off`` once over the seeds, then ``both`` once per bound, W1 (``swe``) at 48
sessions per engine on 2 engines (the preset's pool, token scale 16), and plots both / off
per seed and the first-turn wait p99 per seed against the bound.

    python scripts/plot_wait_bound.py                              # bounds 300,600,1800,3600; seeds 0,1
    python scripts/plot_wait_bound.py --from docs/data/wait_bound-<commit>.json   # plot only

Writes ``--json`` (every run's numbers, the commands and the commit) and ``--png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BOUND_S = 1800.0  # admission.new_session_max_wait_s's default (dashed line)
BASE_ARGS = ("lab", "--workload", "swe", "--engines", "2", "--sessions-per-engine", "48")


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def run_lab(args: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Run ``kvproxy lab`` with ``args`` and return its command line and JSON document."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lab.json"
        argv = [sys.executable, "-m", "kvproxy", *BASE_ARGS, *args, "--json", str(out)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        doc = json.loads(out.read_text())
    return "kvproxy " + " ".join([*BASE_ARGS, *args]), doc


def per_seed(doc: dict[str, Any], policy: str) -> dict[str, dict[str, Any]]:
    seeds: dict[str, dict[str, Any]] = doc["policies"][policy]["per_seed"]
    return seeds


def measure(bounds: Sequence[int], seeds: str) -> dict[str, Any]:
    cmd, off_doc = run_lab(["--policy", "off", "--seeds", seeds])
    off = per_seed(off_doc, "off")
    result: dict[str, Any] = {
        "commit": commit(),
        "commands": [cmd],
        "off": {s: {"sessions_per_min": r["sessions_per_min"]} for s, r in off.items()},
        "bounds": {},
    }
    for bound in bounds:
        cmd, doc = run_lab(
            ["--policy", "both", "--seeds", seeds, "--admission", f"new_session_max_wait_s={bound}"]
        )
        result["commands"].append(cmd)
        rows = {}
        for seed, r in per_seed(doc, "both").items():
            rows[seed] = {
                "sessions_per_min": r["sessions_per_min"],
                "both_over_off": round(r["sessions_per_min"] / off[seed]["sessions_per_min"], 3),
                "first_turn_wait_p99_s": r.get("first_turn_wait_p99_s"),
                "ttft_p99_continuing_s": r.get("ttft_p99_continuing_s"),
            }
        result["bounds"][str(bound)] = rows
        print(f"bound {bound} s: {rows}", flush=True)
    return result


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    bounds = sorted(result["bounds"], key=float)
    xs = [float(b) for b in bounds]
    seeds = sorted(result["bounds"][bounds[0]])
    fig, (gain, wait) = plt.subplots(1, 2, figsize=(10, 3.8))
    for seed in seeds:
        gain.plot(
            xs,
            [result["bounds"][b][seed]["both_over_off"] for b in bounds],
            "o-",
            label=f"seed {seed}",
        )
        waits = [result["bounds"][b][seed]["first_turn_wait_p99_s"] or 0.0 for b in bounds]
        wait.plot(xs, waits, "o-", label=f"seed {seed}")
    wait.plot(xs, xs, ":", color="grey", label="the bound")
    for ax in (gain, wait):
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{int(x)}" for x in xs], rotation=45)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.axvline(DEFAULT_BOUND_S, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("admission.new_session_max_wait_s (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    gain.axhline(1.0, color="grey", lw=0.8)
    gain.set_ylabel("sessions/min, both / off")
    gain.set_title("throughput gain")
    wait.set_ylabel("first-turn wait p99 (simulated s)")
    wait.set_title("first-turn wait p99 (both)")
    fig.suptitle(
        f"W1 (swe), 48 sessions per engine, 2 engines, lab, commit {result['commit']}", fontsize=10
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bounds", default="300,600,1800,3600", help="seconds, comma-separated")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "wait_bound.json")
    ap.add_argument("--png", type=Path, default=ROOT / "results" / "wait_bound.png")
    ap.add_argument("--from", dest="source", type=Path, help="plot this JSON, run nothing")
    args = ap.parse_args(argv)
    if args.source:
        result = json.loads(args.source.read_text())
    else:
        result = measure([int(b) for b in args.bounds.split(",")], args.seeds)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    plot(result, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
