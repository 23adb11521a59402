"""``kvproxy lab``: policies x seeds of a workload in virtual time; a table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvlab.lab.faults import FAULTS
from kvlab.lab.router import ROUTER_POLICIES
from kvlab.lab.runner import ALL_POLICIES, POLICIES, LabConfig, LabError, format_table, run_matrix
from kvlab.peers import is_peer, parse_cap
from kvlab.sim.config import HICACHE_WRITE_POLICIES
from kvlab.workload.driver import parse_sets
from kvlab.workload.model import WorkloadError
from kvlab.workload.spec import resolve_token_scale

# --token-scale left out: presets and traces of counts run at 16; a trace with explicit
# token ids at its own scale.
DEFAULT_TOKEN_SCALE = 16


def seed_list(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2] (an argparse type; also the demo's and the benchmarks')."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return values


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(POLICIES)
    bad = [n for n in names if n not in POLICIES and not _peer_ok(n)]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"policies must be 'all' or a comma-separated subset of {', '.join(ALL_POLICIES)} "
            f"(cap:N: N live sessions per engine, N >= 1)"
        )
    return names


def _peer_ok(name: str) -> bool:
    if not is_peer(name):
        return False
    if name.startswith("cap:"):
        try:
            parse_cap(name)
        except ValueError:
            return False
    return True


def _add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """kvproxy's admission keys, the peers' settings and the measurement window."""
    parser.add_argument(
        "--admission",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an admission.* key (YAML/JSON value, e.g. paused_max_wait_s=30); repeatable",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="stop the workload at this simulated second (a measurement window; sessions "
        "still running count as failed); default: run every session to its end",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a ThunderAgent setting for the thunder peers (YAML value, e.g. "
        "acting_half_life_s=0, resume_placement=origin-first, force_after_s=600); repeatable",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default="swe",
        help="swe | rl | subagents | claude-code | burst | trace:PATH",
    )
    parser.add_argument("--engines", type=int, default=2, help="simulated engines (default 2)")
    parser.add_argument(
        "--sessions-per-engine",
        type=int,
        default=None,
        help="live sessions per engine (default: the workload preset's)",
    )
    parser.add_argument(
        "--sessions", type=int, default=None, help="sessions in the run (default 2x live)"
    )
    parser.add_argument(
        "--policy",
        type=_policies,
        default=list(POLICIES),
        help=f"'all' (= {', '.join(POLICIES)}) or a comma-separated list of "
        f"{', '.join(ALL_POLICIES)} (default all)",
    )
    parser.add_argument(
        "--token-scale",
        type=int,
        default=None,
        help=f"token scale K (default {DEFAULT_TOKEN_SCALE}; a trace with explicit ids: its own)",
    )
    parser.add_argument(
        "--seeds", type=seed_list, default=[0], help="comma-separated seeds (default 0)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--router-policy", choices=ROUTER_POLICIES, default="consistent_hashing")
    parser.add_argument(
        "--cost-model", default=None, help="engine preset (default: the workload's own)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload parameter (real units, e.g. turns_median=20); repeatable",
    )
    _add_peer_arguments(parser)
    parser.add_argument(
        "--pool-tokens",
        type=int,
        default=None,
        help="KV pool per engine in (scaled) tokens (default: the preset's)",
    )
    parser.add_argument(
        "--hicache",
        action="store_true",
        help="engines run SGLang's hierarchical cache (--enable-hierarchical-cache, "
        "write_through) in every policy but ceiling",
    )
    parser.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        metavar="R",
        help="the host pool as R x the device pool (SGLang's --hicache-ratio; default 2.0); "
        "implies --hicache",
    )
    parser.add_argument(
        "--hicache-link-gb-s",
        type=float,
        default=None,
        metavar="G",
        help="the host link's bandwidth in GB/s, a simulator what-if (default: the preset's, "
        "PCIe Gen5 x16 at 50; a very large G makes every load-back free: the most any "
        "prefetch could save); implies --hicache",
    )
    parser.add_argument(
        "--hicache-write-policy",
        choices=HICACHE_WRITE_POLICIES,
        default=None,
        help="SGLang's --hicache-write-policy (default: its default, write_through); "
        "implies --hicache",
    )
    parser.add_argument(
        "--tool-hints",
        action="store_true",
        help="the workload tells kvproxy each tool call's length as it starts "
        "(POST /kvproxy/sessions/{id}/prefetch), for admission.prefetch",
    )
    parser.add_argument(
        "--signal-fault",
        choices=tuple(FAULTS),
        default="none",
        help="a fault of kvproxy's /metrics scrapes: none, windows (two 8 s outages), "
        "periodic (8 s a minute), quarter (a quarter of the time), lag (late readings)",
    )


def hicache_ratio(args: argparse.Namespace) -> float | None:
    """The engines' --hicache-ratio from ``--hicache`` / ``--hicache-ratio``; None: off."""
    if args.hicache_ratio is not None:
        return float(args.hicache_ratio)
    implied = args.hicache_link_gb_s is not None or args.hicache_write_policy is not None
    return 2.0 if args.hicache or implied else None


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.pool_tokens is not None:
        overrides["max_total_tokens"] = args.pool_tokens
    try:
        workload_overrides = parse_sets(args.set)
        admission_values = parse_sets(args.admission, "--admission")
        peer_values = parse_sets(args.peer, "--peer")
        token_scale, note = resolve_token_scale(
            args.workload, args.token_scale, DEFAULT_TOKEN_SCALE
        )
    except WorkloadError as exc:
        print(f"kvproxy lab: {exc}", file=sys.stderr)
        return 2
    if note is not None:
        print(f"kvproxy lab: {note}", file=sys.stderr)
    admission: dict[str, Any] = {k: yaml.safe_load(v) for k, v in admission_values.items()}
    cfg = LabConfig(
        workload=args.workload,
        engines=args.engines,
        sessions_per_engine=args.sessions_per_engine,
        sessions=args.sessions,
        token_scale=token_scale,
        router_policy=args.router_policy,
        cost_model=args.cost_model,
        engine_overrides=overrides,
        workload_overrides=workload_overrides,
        admission_overrides=admission,
        peer_overrides={k: yaml.safe_load(v) for k, v in peer_values.items()},
        deadline_s=args.deadline_s,
        signal_fault=args.signal_fault,
        tool_hints=args.tool_hints,
        hicache_ratio=hicache_ratio(args),
        hicache_link_gb_s=args.hicache_link_gb_s,
        hicache_write_policy=args.hicache_write_policy,
    )
    try:
        results = run_matrix(cfg, args.policy, args.seeds)
    except LabError as exc:
        print(f"kvproxy lab: {exc}", file=sys.stderr)
        return 2
    medians = {name: r["median"] for name, r in results.items()}
    print(format_table(medians))
    if args.json is not None:
        doc = {
            "command": "kvproxy lab " + " ".join(sys.argv[2:]),
            "workload": args.workload,
            "engines": args.engines,
            "token_scale": token_scale,
            "router_policy": args.router_policy,
            "hicache_ratio": cfg.hicache_ratio,
            "hicache_link_gb_s": cfg.hicache_link_gb_s,
            "hicache_write_policy": cfg.hicache_write_policy,
            "tool_hints": cfg.tool_hints,
            "seeds": args.seeds,
            "policies": {
                name: {
                    "median": r["median"],
                    "per_seed": {str(k): v for k, v in r["per_seed"].items()},
                }
                for name, r in results.items()
            },
        }
        args.json.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return 0
