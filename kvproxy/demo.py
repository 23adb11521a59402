"""``kvproxy demo``: the agentic workload through the real stack, four ways.

Starts two simulated SGLang engines (session-radix cache, priority eviction) sized so
the workload is KV-bound, the real router (``smg``) in front of them and kvproxy in
front of the router, then runs the same seeded agentic workload with the proxy's
features off, lifecycle only, admission only and both. The whole stack is restarted
for every configuration so each run starts from a cold, identical cache. Prints a
side-by-side table and writes ``results.json`` and ``chart.png``.

Every process is started by :mod:`kvproxy.stack` and stopped by its PID in a
``finally`` (also on Ctrl-C and SIGTERM).

The machinery (:class:`StackSpec`, :class:`Variant`, :func:`run_variant`,
:func:`format_table`, :func:`write_chart`) is reused by ``scripts/bench_rollout.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvproxy.workload.legacy import WorkloadConfig


@dataclass(frozen=True, slots=True)
class Variant:
    """One configuration of the stack in front of the engines."""

    name: str
    lifecycle: bool = False
    admission: bool = False
    # False: the driver talks to the router directly (no proxy process at all).
    via_proxy: bool = True


VARIANTS: tuple[Variant, ...] = (
    Variant("off"),
    Variant("lifecycle", lifecycle=True),
    Variant("admission", admission=True),
    Variant("both", lifecycle=True, admission=True),
)
DIRECT = Variant("direct", via_proxy=False)


@dataclass(frozen=True, slots=True)
class StackSpec:
    """Engines and router in front of which the workload runs."""

    engines: int = 2
    max_total_tokens: int = 12_000
    mode: str = "session-radix"
    eviction_policy: str = "priority"
    # Simulator wall seconds per simulated second (the driver's tool latency uses the
    # same factor, so the dynamics do not change with it).
    sim_time_scale: float = 1.0
    engine_args: tuple[str, ...] = ()
    # Sessions are sticky at the router in every configuration (the agent's
    # X-Session-ID header is the routing key; a new session goes to the engine with
    # the fewest requests), so the comparison isolates the proxy.
    router_policy: str = "round_robin"
    router_args: tuple[str, ...] = (
        "--sticky-sessions",
        "--routing-key-headers",
        "X-Session-ID",
        "--assignment-mode",
        "min_load",
    )


@dataclass(frozen=True, slots=True)
class ProxyTuning:
    """The proxy's configuration knobs the demo and the benchmark set (YAML keys)."""

    on_close: str = "abort"
    close_timeout_s: float = 2.0
    headroom: float = 0.90
    pressure_threshold: float = 0.92
    max_wait_s: float = 30.0
    poll_interval_s: float = 0.25
    scope: str = "all"
    # None: the workload's max_new_tokens.
    expected_decode_cap: int | None = None
    # None: the proxy's defaults.
    session_residency: bool | None = None
    session_idle_s: float | None = None


@dataclass(frozen=True, slots=True)
class Preset:
    stack: StackSpec
    workload: WorkloadConfig
    proxy: ProxyTuning = field(default_factory=ProxyTuning)


ROLLOUT_WORKLOAD_DEFAULTS: dict[str, Any] = {
    "num_sessions": 96,
    "concurrency": 48,
    "turns_min": 4,
    "turns_max": 8,
    "system_prefix_tokens": 1024,
    "user_tokens": 128,
    "tool_result_tokens_min": 256,
    "tool_result_tokens_max": 512,
    "max_new_tokens": 48,
    "tool_latency": "lognormal",
    "tool_latency_median_s": 0.5,
    "tool_latency_sigma": 0.5,
    "time_scale": 0.5,
    "request_timeout_s": 60.0,
    "run_timeout_s": 180.0,
}


def rollout_workload(**changes: Any) -> WorkloadConfig:
    """The agentic rollout workload shared by the demo and ``scripts/bench_rollout.py``:
    48 agents at once, 4-8 turns, a 1k-token shared system prompt, 256-512-token tool
    results, 48-token replies, 0.5 s median tool latency."""
    from kvproxy.workload.legacy import WorkloadConfig

    return WorkloadConfig(**{**ROLLOUT_WORKLOAD_DEFAULTS, **changes})


def working_set_tokens(w: WorkloadConfig) -> tuple[int, int]:
    """(mean, max) live working set in KV tokens: the shared system prefix once plus,
    for each of the ``concurrency`` live sessions, its own context (averaged over an
    average session's life, or at the end of the longest possible session)."""
    mean_tool = (w.tool_result_tokens_min + w.tool_result_tokens_max) / 2
    mean_turns = (w.turns_min + w.turns_max) / 2
    first = w.user_tokens + w.max_new_tokens  # a session's own tokens after turn 0
    mean_final = first + (mean_turns - 1) * (mean_tool + w.max_new_tokens)
    max_final = first + (w.turns_max - 1) * (w.tool_result_tokens_max + w.max_new_tokens)
    prefix = w.system_prefix_tokens
    return int(prefix + w.concurrency * (first + mean_final) / 2), int(
        prefix + w.concurrency * max_final
    )


def presets() -> dict[str, Preset]:
    """Demo sizes: ``quick`` (~20 s) and ``default`` (~2 min) on a 2-core machine.

    ``default`` is the benchmark's "near-pool" scenario: 48 agents at once on two
    engines of 24k KV tokens each; the live working set (the shared system prompt once
    plus every live session's own context) is about 1.3x the fleet's pool on average
    and up to 4x, and the engines are busy, so cache misses cost throughput.
    ``quick``: 8 agents at once on two 8k engines; the live working set is about half
    the pool on average and up to 1.8x, so what finished sessions leave behind decides
    which live sessions lose their cache.

    Both run the simulator faster than real time (``sim_time_scale``); the agents'
    tool latency is scaled by the same factor, so the dynamics are unchanged.
    """
    default = Preset(
        stack=StackSpec(engines=2, max_total_tokens=24_000, sim_time_scale=0.5),
        workload=rollout_workload(run_timeout_s=120.0),
        proxy=ProxyTuning(max_wait_s=30.0),
    )
    quick = Preset(
        stack=StackSpec(engines=2, max_total_tokens=8_000, sim_time_scale=0.25),
        workload=rollout_workload(
            num_sessions=16,
            concurrency=8,
            turns_min=3,
            turns_max=5,
            tool_result_tokens_max=768,
            tool_latency_median_s=1.0,
            time_scale=0.25,
            run_timeout_s=30.0,
        ),
        proxy=ProxyTuning(max_wait_s=10.0),
    )
    return {"default": default, "quick": quick}


def proxy_config(
    variant: Variant,
    *,
    port: int,
    router_url: str,
    engine_urls: Sequence[str],
    tuning: ProxyTuning,
    workload: WorkloadConfig,
) -> dict[str, Any]:
    """The YAML document (as a dict) for one configuration."""
    cap = tuning.expected_decode_cap or workload.max_new_tokens
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "WARNING"},
        "router": {"url": router_url, "engines": list(engine_urls)},
        "session_lifecycle": {
            "enabled": variant.lifecycle,
            "on_close": tuning.on_close,
            "close_timeout_s": tuning.close_timeout_s,
        },
        "admission": {
            "enabled": variant.admission,
            "headroom": tuning.headroom,
            "pressure_threshold": tuning.pressure_threshold,
            "max_wait_s": tuning.max_wait_s,
            "expected_decode_cap": cap,
            "default_completion_tokens": workload.max_new_tokens,
            "poll_interval_s": tuning.poll_interval_s,
            "scope": tuning.scope,
            **{
                key: value
                for key, value in (
                    ("session_residency", tuning.session_residency),
                    ("session_idle_s", tuning.session_idle_s),
                )
                if value is not None
            },
        },
    }


def _write_yaml(path: Path, doc: Mapping[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(dict(doc), sort_keys=False))


def _pid(proc: Any) -> int | None:
    pid = getattr(proc, "pid", None)
    if pid is None:
        popen = getattr(proc, "proc", None) or getattr(proc, "popen", None)
        pid = getattr(popen, "pid", None)
    return int(pid) if pid is not None else None


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (and is not a zombie)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        fields_ = stat.read_text().rsplit(")", 1)[1].split()
        if fields_ and fields_[0] == "Z":
            return False
    return True


ProgressFn = Callable[[str], None]


def sim_overrun_s(engine_url: str, timeout_s: float = 2.0) -> float | None:
    """Wall seconds a simulated engine ran behind its cost model (``/sim/state``);
    None for a real engine or when it cannot be read. A large value means the host
    was too slow for the chosen time scale."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{engine_url}/sim/state", timeout=timeout_s) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list):
        return None
    return round(sum(float(r.get("overrun_s", 0.0)) for r in ranks if isinstance(r, dict)), 3)


def _start_parallel(starters: Sequence[Callable[[], Any]]) -> list[Any]:
    """Start several processes at once (each starter waits for its own readiness).

    If one fails, the ones that started are stopped before the error propagates.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(starters))) as pool:
        futures = [pool.submit(s) for s in starters]
        started: list[Any] = []
        error: BaseException | None = None
        for fut in futures:
            try:
                started.append(fut.result())
            except BaseException as exc:
                error = error or exc
    if error is not None:
        for proc in started:
            with contextlib.suppress(Exception):
                proc.stop()
        raise error
    return started


def run_variant(
    variant: Variant,
    *,
    stack: StackSpec,
    workload: WorkloadConfig,
    tuning: ProxyTuning,
    out_dir: Path,
    pids: list[int],
    progress: ProgressFn | None = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """Start a fresh stack, run the workload through it, stop every process.

    Returns ``{"summary", "engine_delta", "proxy_config"?, "pids"}``. Every PID started
    is also appended to ``pids`` as soon as it is known (so a caller can check them
    even if this raises).
    """
    import asyncio

    from kvproxy import stack as stk
    from kvproxy.workload.legacy import run_legacy

    name = tag or variant.name
    log_dir = out_dir / "logs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    engine_extra = ("--time-scale", f"{stack.sim_time_scale:g}", *stack.engine_args)
    my_pids: list[int] = []
    with contextlib.ExitStack() as es:

        def track(proc: Any) -> Any:
            es.callback(proc.stop)
            pid = _pid(proc)
            if pid is not None:
                pids.append(pid)
                my_pids.append(pid)
            return proc

        def engine_starter() -> Any:
            return stk.start_sim_engine(
                max_total_tokens=stack.max_total_tokens,
                mode=stack.mode,
                eviction_policy=stack.eviction_policy,
                extra_args=engine_extra,
                log_dir=log_dir,
            )

        engines = [track(p) for p in _start_parallel([engine_starter] * stack.engines)]
        engine_urls = [e.url for e in engines]
        router = track(
            stk.start_router(
                engine_urls,
                policy=stack.router_policy,
                extra_args=stack.router_args,
                log_dir=log_dir,
            )
        )
        result: dict[str, Any] = {}
        base_url = router.url
        if variant.via_proxy:
            port = stk.free_port()
            doc = proxy_config(
                variant,
                port=port,
                router_url=router.url,
                engine_urls=engine_urls,
                tuning=tuning,
                workload=workload,
            )
            cfg_path = out_dir / f"kvproxy-{name}.yaml"
            _write_yaml(cfg_path, doc)
            result["proxy_config"] = doc
            proxy = track(
                stk.start_kvproxy(
                    config_path=cfg_path, router_url=router.url, port=port, log_dir=log_dir
                )
            )
            base_url = proxy.url

        t0 = time.monotonic()
        last = [0.0]

        def on_session(done: int, failed: int, total: int) -> None:
            now = time.monotonic()
            if progress is not None and (now - last[0] >= 2.0 or done + failed == total):
                last[0] = now
                fail = f", {failed} failed" if failed else ""
                progress(f"  [{name}] {done + failed}/{total} sessions{fail}, {now - t0:.0f} s")

        run = asyncio.run(
            run_legacy(
                workload,
                base_url,
                engine_urls=engine_urls,
                progress=on_session,
                read_stats=variant.via_proxy,
            )
        )
        result["summary"] = run.summary()
        result["engine_delta"] = run.engine_delta
        result["engine_deltas"] = run.engine_deltas
        overrun = [sim_overrun_s(u) for u in engine_urls]
        if any(o is not None for o in overrun):
            result["sim_overrun_s"] = overrun
        result["pids"] = my_pids
    return result


# ------------------------------------------------------------------------- reporting


def _stat(stats: Mapping[str, Any] | None, key: str) -> float | None:
    if not stats:
        return None
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) else None


def bypasses(stats: Mapping[str, Any] | None) -> dict[str, float]:
    """``agentic_kv/admission/bypass_<reason>`` counters by reason (non-zero only)."""
    prefix = "agentic_kv/admission/bypass_"
    out: dict[str, float] = {}
    for key, value in (stats or {}).items():
        if key.startswith(prefix) and isinstance(value, int | float) and value:
            out[key[len(prefix) :]] = float(value)
    return out


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if digits == 0:
            return f"{value:,.0f}"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table_rows(summaries: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("sessions completed", lambda s: f"{s['sessions_completed']}/{s['sessions_started']}"),
        ("sessions / min", lambda s: _fmt(s["sessions_per_min"], 1)),
        ("wall time (s)", lambda s: _fmt(s["wall_s"], 1)),
        ("prefill tokens", lambda s: _fmt(s["prefill_tokens"])),
        ("recomputed prefill tokens", lambda s: _fmt(s["recomputed_prefill_tokens"])),
        ("cache hit rate", lambda s: _fmt(s["cache_hit_rate"], 3)),
        ("evicted tokens", lambda s: _fmt(s["evicted_tokens"])),
        ("retractions", lambda s: _fmt(s["retractions"])),
        ("TTFT p50 (ms)", lambda s: _ms(s["ttft_p50_s"])),
        ("TTFT p99 (ms)", lambda s: _ms(s["ttft_p99_s"])),
        ("admission wait p50 (ms)", lambda s: _fmt(s["admission_wait_p50_ms"], 1)),
        ("admission wait p99 (ms)", lambda s: _fmt(s["admission_wait_p99_ms"], 1)),
        (
            "bypasses by reason",
            lambda s: (
                ", ".join(f"{k}={v:g}" for k, v in bypasses(s.get("proxy_stats")).items()) or "-"
            ),
        ),
        (
            "session closes / failures",
            lambda s: _closes(s.get("proxy_stats")),
        ),
    ]
    return [(label, [fn(s) for s in summaries.values()]) for label, fn in rows]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _closes(stats: Mapping[str, Any] | None) -> str:
    close = _stat(stats, "agentic_kv/session/close")
    fail = _stat(stats, "agentic_kv/session/close_failure")
    if close is None and fail is None:
        return "-"
    return f"{_fmt(close)} / {_fmt(fail or 0.0)}"


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Side-by-side text table, one column per configuration."""
    rows = table_rows(summaries)
    headers = ["", *summaries.keys()]
    widths = [max(len(headers[0]), *(len(label) for label, _ in rows))]
    for i, name in enumerate(summaries):
        widths.append(max(len(name), *(len(cells[i]) for _, cells in rows)))
    lines = [
        "  ".join(
            h.rjust(w) if j else h.ljust(w)
            for j, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for label, cells in rows:
        parts = [label.ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)
        ]
        lines.append("  ".join(parts))
    return "\n".join(lines)


CHART_METRICS: tuple[tuple[str, str, float], ...] = (
    ("sessions_per_min", "completed sessions / min", 1.0),
    ("recomputed_prefill_tokens", "recomputed prefill tokens", 1.0),
    ("ttft_p99_s", "TTFT p99 (ms)", 1000.0),
)


def write_chart(
    summaries: Mapping[str, Mapping[str, Any]], path: Path, title: str | None = None
) -> None:
    """Small bar chart (one panel per metric, one bar per configuration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    colors = ["#9e9e9e", "#4c9be8", "#f2a93b", "#3bb273", "#7f6fd1"]
    fig, axes = plt.subplots(1, len(CHART_METRICS), figsize=(3.2 * len(CHART_METRICS), 2.8))
    for ax, (key, label, scale) in zip(axes, CHART_METRICS, strict=True):
        values = [float(summaries[n].get(key) or 0.0) * scale for n in names]
        ax.bar(names, values, color=[colors[i % len(colors)] for i in range(len(names))])
        ax.set_ylim(bottom=0, top=None if max(values, default=0.0) > 0 else 1)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small workload (about 20 s)")
    parser.add_argument(
        "--out", metavar="DIR", help="output directory (default results/demo-<time>)"
    )
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--sessions", type=int, help="number of agent sessions")
    parser.add_argument("--concurrency", type=int, help="sessions running at once")
    parser.add_argument("--json-only", action="store_true", help="skip the PNG chart")
    parser.add_argument(
        "--only",
        metavar="NAMES",
        help="comma-separated subset of configurations (off,lifecycle,admission,both)",
    )


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks stop the stack."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _workload_from_args(preset: Preset, args: argparse.Namespace) -> WorkloadConfig:
    """The preset's workload with --seed / --sessions / --concurrency applied, validated."""
    changes: dict[str, Any] = {}
    for arg, name in (
        ("seed", "seed"),
        ("sessions", "num_sessions"),
        ("concurrency", "concurrency"),
    ):
        if getattr(args, arg) is not None:
            changes[name] = getattr(args, arg)
    workload = dataclasses.replace(preset.workload, **changes)
    workload.validate()
    return workload


def _variants_from_args(only: str | None) -> list[Variant]:
    """The configurations --only names (all of them without it); ValueError for unknown ones."""
    if not only:
        return list(VARIANTS)
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    known = {v.name: v for v in VARIANTS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown configuration(s): {', '.join(unknown)}")
    return [known[n] for n in wanted]


def run(args: argparse.Namespace) -> int:
    preset = presets()["quick" if args.quick else "default"]
    try:
        workload = _workload_from_args(preset, args)
        variants = _variants_from_args(args.only)
    except ValueError as exc:
        print(f"kvproxy demo: {exc}", file=sys.stderr)
        return 2

    out_dir = Path(args.out or f"results/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, flush=True)

    pool = preset.stack.engines * preset.stack.max_total_tokens
    ws_mean, ws_max = working_set_tokens(workload)
    say(
        f"kvproxy demo ({'quick' if args.quick else 'default'}): {workload.num_sessions} sessions, "
        f"{workload.concurrency} at once, {workload.turns_min}-{workload.turns_max} turns, "
        f"{preset.stack.engines} engines x {preset.stack.max_total_tokens:,} KV tokens; live "
        f"working set {ws_mean / pool:.1f}x the fleet's KV pool on average, up to "
        f"{ws_max / pool:.1f}x; output in {out_dir}"
    )
    pids: list[int] = []
    results: dict[str, Any] = {}
    doc: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["kvproxy", "demo", *sys.argv[2:]] if len(sys.argv) > 1 else ["kvproxy", "demo"],
        "mode": "quick" if args.quick else "default",
        "stack": dataclasses.asdict(preset.stack),
        "proxy_tuning": dataclasses.asdict(preset.proxy),
        "workload": workload.to_dict(),
        "fleet_pool_tokens": pool,
        "working_set_tokens": {"mean": ws_mean, "max": ws_max},
        "configurations": results,
        "pids": pids,
    }
    status = 0
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            for i, variant in enumerate(variants, start=1):
                say(
                    f"[{i}/{len(variants)}] {variant.name}: starting {preset.stack.engines} "
                    "engines, router, kvproxy"
                )
                res = run_variant(
                    variant,
                    stack=preset.stack,
                    workload=workload,
                    tuning=preset.proxy,
                    out_dir=out_dir,
                    pids=pids,
                    progress=say,
                )
                results[variant.name] = res
                s = res["summary"]
                say(
                    f"[{i}/{len(variants)}] {variant.name}: {s['sessions_completed']}/"
                    f"{s['sessions_started']} sessions in {s['wall_s']:.1f} s, "
                    f"{s['sessions_per_min']:.1f}/min, recomputed prefill "
                    f"{s['recomputed_prefill_tokens']:,} tokens"
                )
    except KeyboardInterrupt:
        say("interrupted: every process started has been stopped")
        status = 130
    except Exception as exc:
        print(f"kvproxy demo: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    doc["elapsed_s"] = round(time.monotonic() - started, 2)
    doc["status"] = status
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    summaries = {name: r["summary"] for name, r in results.items()}
    if summaries:
        say("")
        say(format_table(summaries))
        say("")
        if not args.json_only:
            try:
                write_chart(
                    summaries, out_dir / "chart.png", title="kvproxy demo (simulated engines)"
                )
                say(f"chart:   {out_dir / 'chart.png'}")
            except ImportError:
                say("chart skipped: matplotlib is not installed (pip install -e '.[demo]')")
    say(f"results: {out_dir / 'results.json'}  ({doc['elapsed_s']:.0f} s)")
    return status
