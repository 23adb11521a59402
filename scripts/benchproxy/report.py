"""The markdown tables, the issue's target checks, and the machine description."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from benchproxy.common import (
    TARGET_ADDED_P50_MS,
    TARGET_ADDED_P99_MS,
    TARGET_BIG_BODY_ADDED_MS,
    TARGET_BODY_OVER_OFF_MS,
    TARGET_C1_ADDED_P50_MS,
    TARGET_OPEN_STREAMS_RSS_MB,
    TARGET_OVER_NAIVE_RATIO,
    TARGET_OVER_OFF_RATIO,
    TARGET_SATURATION_RPS,
    TARGET_WORKERS_SCALING,
    WORKERS,
    feature_set,
    in_build_of,
    one_worker_of,
)
from benchproxy.runner import Params
from kvlab.provenance import git_revision


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _signed(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


DELTA_NOTE = "Δ = median over rounds of target minus direct in the same round"


def round_ratio(sat: Mapping[str, Any], target: str, base: str) -> float | None:
    """Median over rounds of ``target``'s saturation req/s over ``base``'s in the same
    round (rounds interleave the targets, so a drift of the machine cancels)."""
    runs = sat.get("runs") or {}
    pairs = zip(runs.get(target, ()), runs.get(base, ()), strict=False)
    ratios = [t["rps"] / b["rps"] for t, b in pairs if t.get("rps") and b.get("rps")]
    return statistics.median(ratios) if ratios else None


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_report(results: Mapping[str, Any], params: Params) -> str:
    parts: list[str] = []
    if sat := results.get("saturation"):
        t = sat["targets"]
        base = t.get("direct", {}).get("rps_median")
        rows = []
        for name, r in t.items():
            lat = r.get("latency") or {}
            rows.append(
                [
                    name,
                    f"{r['rps_median']:.0f}",
                    f"{r.get('rps_best', r['rps_median']):.0f}",
                    "-" if name == "direct" or not base else f"{r['rps_median'] / base:.2f}",
                    _ratio(
                        round_ratio(sat, name, in_build_of("off", name))
                        if feature_set(name) not in (None, "off")
                        else None
                    ),
                    _ratio(round_ratio(sat, name, "naive") if feature_set(name) else None),
                    _f(lat.get("p50_ms")),
                    _f(lat.get("p99_ms")),
                    str(r["errors"]),
                    _f(r.get("cpu_us_per_req"), 0),
                    _f(r.get("cpu_share"), 2),
                    _f(r.get("upstream_cpu_share"), 2),
                ]
            )
        parts.append(
            f"**Saturation** ({sat['generator']}, {params.sat_connections} connections, 4 KB `input_ids` bodies, "
            f"median of {params.rounds} x {params.sat_duration_s:.0f} s; vs off and vs naive: the "
            "median over rounds of the round's ratio, off of the same build)\n\n"
            + _table(
                [
                    "target",
                    "req/s (median)",
                    "req/s (best)",
                    "vs direct",
                    "vs off (rounds)",
                    "vs naive (rounds)",
                    "p50 ms",
                    "p99 ms",
                    "errors",
                    "server CPU µs/req",
                    "server CPU (cores)",
                    "upstream CPU (cores)",
                ],
                rows,
            )
        )
        if cores := cpu_table(sat):
            parts.append(cores)
    if fixed := results.get("fixed"):
        rows = []
        for name, r in fixed.items():
            lat, added = r["latency"], r.get("proxy_added") or {}
            rows.append(
                [
                    name,
                    f"{r['achieved_rps']:.0f}",
                    _f(lat["p50_ms"]),
                    _f(lat["p99_ms"]),
                    "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                    "-" if name == "direct" else _signed(r.get("delta_p99_ms")),
                    _f(added.get("p50_ms")),
                    _f(added.get("p99_ms")),
                    str(sum(r["errors"].values())),
                    _f(r.get("cpu_share"), 2),
                ]
            )
        parts.append(
            f"**Fixed load** ({params.fixed_rate:.0f} req/s open loop, 4 KB bodies, latency from the scheduled "
            f"send time; p50/p99 over {params.rounds} x {params.fixed_duration_s:.0f} s pooled, {DELTA_NOTE})\n\n"
            + _table(
                [
                    "target",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "Δp50 ms",
                    "Δp99 ms",
                    "in-proxy p50 ms",
                    "in-proxy p99 ms",
                    "errors",
                    "server CPU (cores)",
                ],
                rows,
            )
        )
    if ladder := results.get("ladder"):
        rows = []
        for rate, per_target in ladder.items():
            for name, r in per_target.items():
                lat = r["latency"]
                rows.append(
                    [
                        rate,
                        name,
                        f"{r['achieved_rps']:.0f}",
                        _f(lat["p50_ms"]),
                        _f(lat["p99_ms"]),
                        "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                        "-" if name == "direct" else _signed(r.get("delta_p99_ms")),
                        str(sum(r["errors"].values())),
                    ]
                )
        parts.append(
            f"**QPS ladder** (open loop, 4 KB bodies, latency from the scheduled send time; "
            f"{params.rounds} x {params.ladder_duration_s:.1f} s per rate, {DELTA_NOTE})\n\n"
            + _table(
                [
                    "offered req/s",
                    "target",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "Δp50 ms",
                    "Δp99 ms",
                    "errors",
                ],
                rows,
            )
        )
    if streams := results.get("streams"):
        rows = []
        for name, r in streams.items():
            rows.append(
                [
                    name,
                    f"{r['ok']}/{r['streams']}",
                    _f(r["ttft"]["p50_ms"]),
                    _f(r["ttft"]["p99_ms"]),
                    "-" if name == "direct" else _signed(r.get("delta_ttft_p50_ms")),
                    "-" if name == "direct" else _signed(r.get("delta_ttft_p99_ms")),
                    _f(r["gap"]["p50_ms"]),
                    _f(r["gap"]["p99_ms"]),
                    "-" if name == "direct" else _signed(r.get("delta_gap_p50_ms")),
                    "-" if name == "direct" else _signed(r.get("delta_gap_p99_ms")),
                    f"{r['coalesced']}/{r['gaps']}",
                ]
            )
        parts.append(
            f"**Streams** ({params.stream_count} concurrent x {params.stream_chunks} chunks + [DONE], "
            f"{params.stream_gap_ms:.0f} ms apart, {params.rounds} round(s) pooled, {DELTA_NOTE})\n\n"
            + _table(
                [
                    "target",
                    "complete",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "ΔTTFT p50",
                    "ΔTTFT p99",
                    "gap p50 ms",
                    "gap p99 ms",
                    "Δgap p50",
                    "Δgap p99",
                    f"gaps < {params.stream_gap_ms / 2:.0f} ms",
                ],
                rows,
            )
        )
    if (big := results.get("bigbody")) and not results.get("bodies"):
        t = big["targets"]
        rows = [
            [
                name,
                _f(r["latency"]["p50_ms"]),
                _f(r["latency"]["p99_ms"]),
                "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                "-" if name == "direct" else _signed(r.get("delta_p99_ms")),
                str(sum(r["errors"].values())),
            ]
            for name, r in t.items()
        ]
        parts.append(
            f"**200 KB body** ({big['body_bytes']} bytes, {big['input_ids']} `input_ids`, one request at a time, "
            f"X-Session-ID set, {params.rounds} x {params.big_requests} requests, {DELTA_NOTE})\n\n"
            + _table(["target", "p50 ms", "p99 ms", "Δp50 ms", "Δp99 ms", "errors"], rows)
        )
    if bodies := results.get("bodies"):
        rows = [
            [
                label,
                str(b["body_bytes"]),
                name,
                _f(r["latency"]["p50_ms"]),
                _f(r["latency"]["p99_ms"]),
                "-" if name == "direct" else _signed(r.get("delta_p50_ms")),
                "-"
                if name == "direct" or feature_set(name) == "off"
                else _signed(r.get("over_off_p50_ms")),
                _faults(r.get("minor_faults_per_request")),
                str(sum(r["errors"].values())),
            ]
            for label, b in bodies.items()
            for name, r in b["targets"].items()
        ]
        parts.append(
            f"**Body sizes** (`input_ids` bodies, one request at a time, {params.rounds} x "
            f"{params.big_requests} requests each; Δ: paired per round, median)\n\n"
            + _table(
                [
                    "body",
                    "bytes",
                    "target",
                    "p50 ms",
                    "p99 ms",
                    "Δp50 vs direct",
                    "Δp50 vs off",
                    "server page faults / req (rounds)",
                    "errors",
                ],
                rows,
            )
        )
    if (opened := results.get("open_streams")) and opened["targets"]:
        rows = [
            [
                name,
                f"{r['ok']}/{r['streams']}",
                str(r["open_peak"]),
                _f(r["rss_idle_mb"], 1),
                _f(r["rss_peak_mb"], 1),
                _f((r["rss_peak_mb"] or 0) - (r["rss_idle_mb"] or 0), 1),
                _f(r["ttft"]["p99_ms"], 1),
                _f(r["gap"]["p50_ms"], 1),
                _f(r["gap"]["p99_ms"], 1),
                str(r["coalesced"]),
                str(r.get("listen_overflows", "-")),
            ]
            for name, r in opened["targets"].items()
        ]
        parts.append(
            f"**Open streams** ({opened['streams']} concurrent, opened over {opened.get('ramp_s', 1.0):.1f} s, "
            f"through a freshly started proxy; {opened['chunks']} chunks + [DONE] "
            f"{opened['gap_ms']:.0f} ms apart; RSS is the server's: the proxy's, or the upstream's for direct; "
            "listen overflows: the kernel's TcpExt ListenOverflows during the run)\n\n"
            + _table(
                [
                    "target",
                    "complete",
                    "open at once",
                    "RSS idle MB",
                    "RSS peak MB",
                    "RSS growth MB",
                    "TTFT p99 ms",
                    "gap p50 ms",
                    "gap p99 ms",
                    "coalesced",
                    "listen overflows",
                ],
                rows,
            )
        )
    if checks := target_checks(results, params):
        parts.append(
            "**Targets**\n\n"
            + _table(
                ["target", "requirement", "measured", "met"],
                [[c[0], c[1], c[2], "yes" if c[3] else "**no**"] for c in checks],
            )
        )
    return "\n\n".join(parts) + "\n"


def target_checks(results: Mapping[str, Any], params: Params) -> list[tuple[str, str, str, bool]]:
    """(target, requirement, measured, met) for every target of the issue that was measured.

    A measurement with failed requests never counts as met, whatever its numbers."""
    checks: list[tuple[str, str, str, bool]] = []

    def errs(n: int) -> str:
        return f", {n} failed requests" if n else ""

    fixed = results.get("fixed") or {}
    base = (fixed.get("direct") or {}).get("latency", {})
    rate = f"{params.fixed_rate:.0f} req/s"
    for name, r in fixed.items():
        if not feature_set(name) or base.get("p50_ms") is None:
            continue
        n_err = sum(r["errors"].values())
        if r["latency"]["p50_ms"] is None:
            checks.append(
                (name, f"added p50/p99 at {rate}", f"no successful request{errs(n_err)}", False)
            )
            continue
        d50, d99 = r["delta_p50_ms"], r["delta_p99_ms"]
        checks.append(
            (
                name,
                f"added p50 <= {TARGET_ADDED_P50_MS} ms at {rate}",
                f"{d50:+.3f} ms{errs(n_err)}",
                d50 <= TARGET_ADDED_P50_MS and not n_err,
            )
        )
        checks.append(
            (
                name,
                f"added p99 <= {TARGET_ADDED_P99_MS} ms at {rate}",
                f"{d99:+.3f} ms{errs(n_err)}",
                d99 <= TARGET_ADDED_P99_MS and not n_err,
            )
        )
    sat = (results.get("saturation") or {}).get("targets", {})
    for name, r in sat.items():
        if feature_set(name):
            rps, n_err = r["rps_median"], r["errors"]
            best = r.get("rps_best", rps)
            checks.append(
                (
                    name,
                    f">= {TARGET_SATURATION_RPS:.0f} req/s at saturation (4 KB, median of rounds)",
                    f"{rps:.0f} req/s (best round {best:.0f}){errs(n_err)}",
                    rps >= TARGET_SATURATION_RPS and not n_err,
                )
            )
    checks += _ratio_checks(results.get("saturation") or {})
    checks += _one_at_a_time_checks(results)
    opened = (results.get("open_streams") or {}).get("targets", {})
    for name, r in opened.items():
        if not feature_set(name):
            continue
        ok = (
            r["ok"] == r["streams"]
            and r["coalesced"] == 0
            and r["rss_peak_mb"] < TARGET_OPEN_STREAMS_RSS_MB
        )
        checks.append(
            (
                name,
                f"{r['streams']} open streams under {TARGET_OPEN_STREAMS_RSS_MB:.0f} MB RSS, all complete, none coalesced",
                f"{r['rss_peak_mb']:.1f} MB, {r['ok']}/{r['streams']} complete, {r['coalesced']} coalesced",
                ok,
            )
        )
    streams = results.get("streams") or {}
    for name, r in streams.items():
        if feature_set(name):
            ok = r["ok"] == r["streams"] and r["coalesced"] == 0
            checks.append(
                (
                    name,
                    "streams complete, no coalescing",
                    f"{r['ok']}/{r['streams']} complete, {r['coalesced']} coalesced",
                    ok,
                )
            )
    big = (results.get("bigbody") or {}).get("targets", {})
    bbase = (big.get("direct") or {}).get("latency", {})
    for name, r in big.items():
        if not feature_set(name) or bbase.get("p50_ms") is None:
            continue
        n_err = sum(r["errors"].values())
        if r["latency"]["p50_ms"] is None:
            checks.append(
                (name, "200 KB body added latency", f"no successful request{errs(n_err)}", False)
            )
            continue
        d = r["delta_p50_ms"]
        checks.append(
            (
                name,
                f"200 KB body adds <= {TARGET_BIG_BODY_ADDED_MS} ms (p50)",
                f"{d:+.3f} ms{errs(n_err)}",
                d <= TARGET_BIG_BODY_ADDED_MS and not n_err,
            )
        )
    for label, limit in TARGET_BODY_OVER_OFF_MS.items():
        per_size = ((results.get("bodies") or {}).get(label) or {}).get("targets", {})
        for name, r in per_size.items():
            if feature_set(name) in (None, "off") or r.get("over_off_p50_ms") is None:
                continue
            n_err = sum(r["errors"].values())
            d = r["over_off_p50_ms"]
            checks.append(
                (
                    name,
                    f"{label} body adds <= {limit} ms over features off (p50)",
                    f"{d:+.3f} ms{errs(n_err)}",
                    d <= limit and not n_err,
                )
            )
    return checks


def _ratio_checks(sat: Mapping[str, Any]) -> list[tuple[str, str, str, bool]]:
    """A feature on at saturation against features off of the same build and against the
    naive splicing proxy, where those ran (median over rounds of the round's ratio)."""
    checks: list[tuple[str, str, str, bool]] = []
    targets = sat.get("targets") or {}
    for name in targets:
        if feature_set(name) in (None, "off"):
            continue
        for base, limit in (
            (in_build_of("off", name), TARGET_OVER_OFF_RATIO),
            ("naive", TARGET_OVER_NAIVE_RATIO),
        ):
            ratio = round_ratio(sat, name, base)
            if ratio is None:
                continue
            checks.append(
                (
                    name,
                    f">= {limit:.2f}x {base}'s req/s at saturation (median of round ratios)",
                    f"{ratio:.2f}x",
                    ratio >= limit,
                )
            )
    return checks + _workers_checks(sat)


def _workers_checks(sat: Mapping[str, Any]) -> list[tuple[str, str, str, bool]]:
    """N workers against one (same feature set and build) at saturation, where both ran:
    the median over rounds of the round's req/s ratio, and (not judged) the same ratio of
    req/s per core the proxy's processes used, which no other process's share of the
    host moves."""
    checks: list[tuple[str, str, str, bool]] = []
    for name in sat.get("targets") or {}:
        single = one_worker_of(name)
        features = feature_set(name)
        if single is None or features is None:
            continue
        limit = TARGET_WORKERS_SCALING.get(WORKERS[features])
        ratio = round_ratio(sat, name, single)
        if limit is None or ratio is None:
            continue
        per_core = [
            sat["targets"][t].get("cores", {}).get("rps_per_proxy_core") for t in (name, single)
        ]
        efficiency = (
            f"; req/s per proxy core {per_core[0] / per_core[1]:.2f}x {single}'s"
            if all(per_core)
            else ""
        )
        checks.append(
            (
                name,
                f">= {limit:.2f}x {single}'s req/s at saturation (median of round ratios)",
                f"{ratio:.2f}x{efficiency}",
                ratio >= limit,
            )
        )
    return checks


def cpu_table(sat: Mapping[str, Any]) -> str:
    """Where the host's cores went in each target's saturation rounds (medians over
    rounds), and the proxy's req/s per core it used."""
    rows = []
    for name, r in (sat.get("targets") or {}).items():
        c = r.get("cores") or {}
        if not c:
            continue
        workers = c.get("proxy_workers") or []
        rows.append(
            [
                name,
                f"{r['rps_median']:.0f}",
                _f(c.get("generator"), 2),
                _f(c.get("upstream"), 2),
                _f(c.get("redis"), 2),
                "-"
                if name == "direct"
                else _f(c.get("proxy"), 2)
                + (f" ({' + '.join(f'{w:.2f}' for w in workers)})" if len(workers) > 1 else ""),
                _f(c.get("irq"), 2),
                _f(c.get("other"), 2),
                _f(c.get("host"), 2),
                _f(c.get("rps_per_proxy_core"), 0),
            ]
        )
    if not rows:
        return ""
    return (
        "**Saturation, where the cores went** (CPU seconds per second of each process "
        "in the timed runs, medians over rounds; interrupts: the kernel's, loopback "
        "TCP's receive path among them, charged to no process; `other`: the rest of the "
        "host, the benchmark's parent and other jobs included)\n\n"
        + _table(
            [
                "target",
                "req/s",
                "load generator",
                "upstream",
                "redis-server",
                "kvproxy (workers)",
                "interrupts",
                "other",
                "host busy",
                "req/s per kvproxy core",
            ],
            rows,
        )
    )


def _one_at_a_time_checks(results: Mapping[str, Any]) -> list[tuple[str, str, str, bool]]:
    """Added p50 over direct with one 4 KB request at a time: features off, a feature on."""
    checks: list[tuple[str, str, str, bool]] = []
    small = ((results.get("bodies") or {}).get("4KB") or {}).get("targets", {})
    for name, r in small.items():
        features = feature_set(name)
        d = r.get("delta_p50_ms")
        if features is None or d is None:
            continue
        limit = TARGET_C1_ADDED_P50_MS["off" if features == "off" else "feature"]
        n_err = sum(r["errors"].values())
        checks.append(
            (
                name,
                f"4 KB, one at a time: added p50 <= {limit} ms over direct",
                f"{d:+.3f} ms" + (f", {n_err} failed requests" if n_err else ""),
                d <= limit and not n_err,
            )
        )
    return checks


def machine_info() -> dict[str, Any]:
    model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = git_revision()
    wrk_version = None
    if shutil.which("wrk"):
        with contextlib.suppress(Exception):
            res = subprocess.run(
                ["wrk", "--version"], capture_output=True, text=True, timeout=5, check=False
            )
            wrk_version = (res.stdout + res.stderr).split("\n")[0].strip()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "git_commit": commit,
        "wrk": wrk_version,
    }


def _faults(per_round: list[float] | None) -> str:
    """Minor page faults per request of each round, "-" when not read."""
    if not per_round:
        return "-"
    return " / ".join(f"{v:.1f}" for v in per_round)
