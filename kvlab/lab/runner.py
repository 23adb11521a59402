"""``run_lab(LabConfig) -> LabResult``: engines, router, kvproxy and a workload in virtual time.

One run builds N :class:`~kvlab.lab.engines.LabEngine` (the pure scheduler,
configured from a cost-model preset and a token scale), the router's placement, the
proxy's own session and admission objects (:class:`~kvlab.lab.proxy.LabProxy`) and
runs the workload branch's ``run_workload`` over an in-process transport, all on a
:class:`~kvlab.lab.vloop.VirtualTimeLoop`. Nothing sleeps and nothing reads the wall
clock except the ``wall_s`` measurement. The same config and seed give the same
result, exactly.

Policies: ``off`` (both proxy features off), ``lifecycle``, ``admission``, ``both``,
and ``ceiling`` (features off, pools so large that nothing is ever evicted: the bound
no policy can beat); and the peers in kvproxy's place (:mod:`kvlab.peers`):
``thunder``, ``thunder-origin``, ``thunder-router`` (ThunderAgent: most-room resume,
origin-only resume, and placed by the router as kvproxy must be) and
``cap:N`` (N live sessions per engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.lab.engines import LabEngine
from kvlab.lab.faults import FAULTS
from kvlab.lab.peer_proxy import PeerProxy
from kvlab.lab.proxy import LabProxy
from kvlab.lab.router import ROUTER_POLICIES, Placement
from kvlab.lab.vloop import run_virtual
from kvlab.peers import PEER_POLICIES, is_peer, parse_cap
from kvlab.peers.thunder import ThunderConfig
from kvlab.sim.config import HICACHE_WRITE_POLICIES
from kvproxy.config import AdmissionConfig, Config, ServerConfig, SessionLifecycleConfig

POLICIES = ("off", "lifecycle", "admission", "both", "ceiling")
# Every policy name a run accepts: POLICIES, the peers, and cap:N (any N >= 1).
ALL_POLICIES = (*POLICIES, *PEER_POLICIES, "cap:N")
# The ceiling's pool per engine: far beyond any run's total KV (a pure counter).
CEILING_POOL_TOKENS = 1 << 40


class LabError(ValueError):
    """A lab configuration that cannot run."""


@dataclass(frozen=True, slots=True)
class LabTuning:
    """The proxy's knobs (the YAML keys of the same name), as the demo sets them."""

    on_close: str = "abort"
    close_timeout_s: float = 2.0
    headroom: float = 0.90
    pressure_threshold: float = 0.92
    max_wait_s: float = 30.0
    poll_interval_s: float = 0.25
    scope: str = "all"
    session_residency: bool = True
    session_idle_s: float = 600.0


@dataclass(frozen=True, slots=True)
class LabConfig:
    workload: str = "swe"  # swe | rl | subagents | trace:PATH
    engines: int = 2
    # Live sessions per engine (the closed loop's concurrency / engines); None: the
    # workload preset's default.
    sessions_per_engine: int | None = None
    # Sessions in the run; None: twice the concurrency.
    sessions: int | None = None
    policy: str = "off"
    token_scale: int = 16
    seed: int = 0
    router_policy: str = "consistent_hashing"
    # Cost-model preset of the engines; None: the one the workload is calibrated for.
    cost_model: str | None = None
    # SchedulerConfig fields to override (e.g. max_total_tokens), after the preset.
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    # WorkloadSpec fields to override, after the preset.
    workload_overrides: Mapping[str, Any] = field(default_factory=dict)
    tuning: LabTuning = field(default_factory=LabTuning)
    # AdmissionConfig fields to override after the tuning (the YAML keys of
    # ``admission``: ablation switches and hold bounds, e.g. {"pause": False}).
    admission_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Engine mode, eviction and scheduling: the deployment contract's engine flags
    # (--enable-session-radix-cache --radix-eviction-policy priority
    # --enable-priority-scheduling, preemption threshold SGLang's default 10), the same
    # in every policy, so configurations differ only in kvproxy.
    engine_mode: str = "session-radix"
    eviction_policy: str = "priority"
    priority_scheduling: bool = True
    # Engine URLs as the router lists them (placement hashes these strings);
    # None: http://127.0.0.1:30001, :30002, ...
    engine_urls: tuple[str, ...] | None = None
    # A fault of kvproxy's /metrics scrapes (kvlab.lab.faults: none, windows,
    # periodic, quarter, lag); off and ceiling do not scrape.
    signal_fault: str = "none"
    # The workload tells kvproxy each tool call's length as it starts
    # (POST /kvproxy/sessions/{id}/prefetch): the prefetch's client hook.
    tool_hints: bool = False
    # SGLang's hierarchical cache on the engines (--enable-hierarchical-cache) with this
    # --hicache-ratio; None: off. Never for ceiling (its pool never evicts).
    hicache_ratio: float | None = None
    # The host link's bandwidth in GB/s with HiCache on; None: the preset's (PCIe Gen5
    # x16). A what-if (a faster link, or none at all: what any prefetch could save).
    hicache_link_gb_s: float | None = None
    # SGLang's --hicache-write-policy with HiCache on; None: its default, write_through.
    hicache_write_policy: str | None = None
    # ThunderConfig fields for the thunder peers (e.g. {"acting_half_life_s": 0}),
    # after the lab's defaults (capacity the engine's pool, buffer 100 real tokens).
    peer_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Stop the workload at this simulated second (a measurement window, as a benchmark
    # of fixed length): sessions still running are cancelled and count as failed.
    # None: run every session to its end.
    deadline_s: float | None = None
    # Bound on simulated seconds; a run past it raises LabError.
    max_simulated_s: float = 7 * 24 * 3600.0


@dataclass(slots=True)
class LabResult:
    config: LabConfig
    summary: dict[str, Any]  # the JSON row (see docs/lab.md)
    engines: list[dict[str, Any]]  # per-engine counters
    workload: Any = None  # the workload's WorkloadResult


def _validate_policy(policy: str) -> None:
    if policy not in POLICIES and not is_peer(policy):
        raise LabError(f"policy must be one of {', '.join(ALL_POLICIES)}, got {policy!r}")
    if policy.startswith("cap:"):
        try:
            parse_cap(policy)
        except ValueError as exc:
            raise LabError(str(exc)) from None


def _validate(cfg: LabConfig) -> None:
    _validate_policy(cfg.policy)
    if cfg.deadline_s is not None and not cfg.deadline_s > 0:
        raise LabError(f"deadline must be > 0 simulated seconds, got {cfg.deadline_s}")
    if cfg.router_policy not in ROUTER_POLICIES:
        raise LabError(f"router policy must be one of {ROUTER_POLICIES}, got {cfg.router_policy!r}")
    if cfg.engines < 1:
        raise LabError(f"engines must be >= 1, got {cfg.engines}")
    if cfg.sessions_per_engine is not None and cfg.sessions_per_engine < 1:
        raise LabError(f"sessions per engine must be >= 1, got {cfg.sessions_per_engine}")
    if cfg.sessions is not None and cfg.sessions < 1:
        raise LabError(f"sessions must be >= 1, got {cfg.sessions}")
    if cfg.token_scale < 1:
        raise LabError(f"token scale must be >= 1, got {cfg.token_scale}")
    if cfg.hicache_ratio is not None and not cfg.hicache_ratio > 0:
        raise LabError(f"hicache ratio must be > 0, got {cfg.hicache_ratio}")
    if cfg.hicache_link_gb_s is not None and not cfg.hicache_link_gb_s > 0:
        raise LabError(f"hicache link bandwidth must be > 0 GB/s, got {cfg.hicache_link_gb_s}")
    if (
        cfg.hicache_write_policy is not None
        and cfg.hicache_write_policy not in HICACHE_WRITE_POLICIES
    ):
        raise LabError(
            f"hicache write policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
            f"got {cfg.hicache_write_policy!r}"
        )
    if cfg.signal_fault not in FAULTS:
        raise LabError(f"signal fault must be one of {', '.join(FAULTS)}, got {cfg.signal_fault!r}")
    if cfg.engine_urls is not None and len(set(cfg.engine_urls)) != cfg.engines:
        raise LabError("engine_urls must name exactly `engines` distinct URLs")


def engine_urls(cfg: LabConfig) -> tuple[str, ...]:
    if cfg.engine_urls is not None:
        return tuple(cfg.engine_urls)
    return tuple(f"http://127.0.0.1:{30001 + i}" for i in range(cfg.engines))


def proxy_config(
    policy: str,
    tuning: LabTuning,
    token_scale: int = 1,
    admission_overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The proxy's configuration for a policy (both features off for off/ceiling)."""
    policy = "off" if is_peer(policy) else policy
    lifecycle = policy in ("lifecycle", "both")
    admission = policy in ("admission", "both")
    adm = AdmissionConfig(
        enabled=admission,
        headroom=tuning.headroom,
        pressure_threshold=tuning.pressure_threshold,
        max_wait_s=tuning.max_wait_s,
        poll_interval_s=tuning.poll_interval_s,
        scope=tuning.scope,
        session_residency=tuning.session_residency,
        session_idle_s=tuning.session_idle_s,
    )
    if admission_overrides:
        names = {f.name for f in dataclasses.fields(AdmissionConfig)}
        bad = sorted(set(admission_overrides) - names)
        if bad:
            raise LabError(f"unknown admission keys: {', '.join(bad)}")
        adm = dataclasses.replace(adm, **dict(admission_overrides))
    # The engines' token scale, as the demo's kvproxy gets it: admission's token-valued
    # defaults are divided by it (server.token_scale).
    return Config(
        server=ServerConfig(token_scale=token_scale),
        session_lifecycle=SessionLifecycleConfig(
            enabled=lifecycle,
            on_close=tuning.on_close,
            close_timeout_s=tuning.close_timeout_s,
            check_engines=False,
        ),
        admission=adm,
    )


def build(cfg: LabConfig) -> tuple[Any, Any, int, int]:
    """(workload spec, scheduler config, sessions, concurrency) for ``cfg``."""
    from kvlab.sim.presets import hicache_config, scheduler_config
    from kvlab.workload.model import WorkloadError
    from kvlab.workload.spec import workload_spec

    _validate(cfg)
    try:
        spec = workload_spec(cfg.workload, cfg.token_scale, **dict(cfg.workload_overrides))
    except WorkloadError as exc:
        raise LabError(str(exc)) from None
    per_engine = cfg.sessions_per_engine or spec.sessions_per_engine
    concurrency = per_engine * cfg.engines
    sessions = cfg.sessions if cfg.sessions is not None else 2 * concurrency
    overrides: dict[str, Any] = {
        "mode": cfg.engine_mode,
        "eviction_policy": cfg.eviction_policy,
        "enable_priority_scheduling": cfg.priority_scheduling,
        **dict(cfg.engine_overrides),
    }
    preset = cfg.cost_model or spec.cost_model
    if cfg.policy == "ceiling":
        overrides["max_total_tokens"] = CEILING_POOL_TOKENS
    elif cfg.hicache_ratio is not None:
        overrides["hicache"] = hicache_config(
            preset,
            cfg.token_scale,
            ratio=cfg.hicache_ratio,
            write_policy=cfg.hicache_write_policy or "write_through",
            host_link_gb_s=cfg.hicache_link_gb_s,
        )
    try:
        sched_cfg = scheduler_config(preset, cfg.token_scale, **overrides)
    except (KeyError, TypeError, ValueError) as exc:
        raise LabError(f"engine configuration: {exc}") from None
    return spec, sched_cfg, sessions, concurrency


async def _run(cfg: LabConfig) -> LabResult:
    from kvlab.lab.transport import LabTransport
    from kvlab.workload.report import percentile, summarize
    from kvlab.workload.runner import run_workload

    spec, sched_cfg, sessions, concurrency = build(cfg)
    loop = asyncio.get_running_loop()
    urls = engine_urls(cfg)
    engines = [LabEngine(url, sched_cfg) for url in urls]
    proxy: LabProxy | PeerProxy = LabProxy(
        proxy_config(cfg.policy, cfg.tuning, cfg.token_scale, cfg.admission_overrides),
        engines,
        Placement(cfg.router_policy, urls),
        fault=FAULTS[cfg.signal_fault],
        seed=cfg.seed,
    )
    if is_peer(cfg.policy):
        proxy = _peer(cfg, engines, urls, sched_cfg.max_total_tokens)
    transport = LabTransport(proxy, subagent_identity=spec.subagent_identity)
    async with proxy.running():
        try:
            result = await asyncio.wait_for(
                run_workload(
                    spec,
                    transport,
                    sessions=sessions,
                    concurrency=concurrency,
                    seed=cfg.seed,
                    tool_hints=transport if cfg.tool_hints else None,
                    deadline_s=cfg.deadline_s,
                ),
                cfg.max_simulated_s,
            )
        except TimeoutError:
            raise LabError(
                f"the run passed max_simulated_s={cfg.max_simulated_s} simulated seconds"
            ) from None
        admission_counters: dict[str, float] = {}
        adm = proxy.admission
        if adm is not None and adm.enabled:
            from kvproxy.admission.catalogue import _PROGRAM_COUNTERS

            stats = adm.stats()
            admission_counters = {
                k.removeprefix("agentic_kv/admission/"): round(float(stats[k]), 3)
                for k in _PROGRAM_COUNTERS
                if stats.get(k)
            }
            admission_counters["program_active"] = float(adm.program_active)
        if isinstance(proxy, PeerProxy):
            admission_counters = {k: float(v) for k, v in proxy.counters().items()}
    simulated = loop.time()
    summary = dict(summarize(result))
    first_waits = [
        t.admission_wait_ms / 1000.0
        for t in result.turns
        if t.turn == 0 and t.admission_wait_ms is not None
    ]
    p99 = percentile(first_waits, 99)
    per_engine = [engine_counters(e) for e in engines]
    summary.update(
        policy=cfg.policy,
        seed=cfg.seed,
        engines=cfg.engines,
        sessions_per_engine=concurrency // cfg.engines,
        token_scale=cfg.token_scale,
        evicted_tokens=sum(e["evicted_tokens"] for e in per_engine),
        retractions=sum(e["retractions"] for e in per_engine),
        aborted_requests=sum(e["aborted_requests"] for e in per_engine),
        engine_steps=sum(e["steps"] for e in per_engine),
        pool_tokens_per_engine=sched_cfg.max_total_tokens,
        # HiCache on these engines (never for ceiling), its ratio, and what it moved.
        hicache=sched_cfg.hicache is not None,
        hicache_ratio=None if sched_cfg.hicache is None else sched_cfg.hicache.ratio,
        hicache_link_gb_s=None if sched_cfg.hicache is None else sched_cfg.hicache.host_link_gb_s,
        hicache_write_policy=None if sched_cfg.hicache is None else sched_cfg.hicache.write_policy,
        loaded_back_tokens=sum(e.get("loaded_back_tokens", 0) for e in per_engine),
        host_cached_tokens=sum(e.get("host_cached_tokens", 0) for e in per_engine),
        proxy_errors=dict(sorted(transport.errors.items())),
        admission_decisions=dict(sorted(proxy.decisions.items())),
        admission_counters=admission_counters,
        injected_priorities={str(k): v for k, v in sorted(proxy.priorities.items())},
        signal_fault=cfg.signal_fault,
        tool_hints=cfg.tool_hints,
        simulated_s=round(simulated, 6),
        # Admission's wait of sessions' first requests (None: admission off).
        first_turn_wait_p99_s=None if p99 is None else round(p99, 4),
    )
    return LabResult(cfg, summary, per_engine, result)


def _peer(cfg: LabConfig, engines: list[LabEngine], urls: Sequence[str], pool: int) -> PeerProxy:
    """The peer policy's shell: ThunderAgent with the engine's pool as its capacity and
    its 100-token buffer per program (in the run's scaled tokens), or a cap."""
    placement = Placement(cfg.router_policy, urls)
    if cfg.policy.startswith("cap:"):
        return PeerProxy(cfg.policy, engines, placement)
    base: dict[str, Any] = {
        "capacity_tokens": pool,
        "buffer_tokens": max(1, round(100 / cfg.token_scale)),
        "resume_placement": "most-room" if cfg.policy == "thunder" else "origin-only",
        # thunder-router: kvproxy's invariant, the router places every new program.
        "new_placement": "router" if cfg.policy == "thunder-router" else "least-loaded",
    }
    try:
        thunder = ThunderConfig(**{**base, **dict(cfg.peer_overrides)})
    except (TypeError, ValueError) as exc:
        raise LabError(f"thunder configuration: {exc}") from None
    return PeerProxy(cfg.policy, engines, placement, thunder=thunder)


def engine_counters(engine: LabEngine) -> dict[str, Any]:
    s = engine.sched
    st = s.stats
    out: dict[str, Any] = {
        "url": engine.url,
        "requests": st.num_requests_total,
        "prompt_tokens": st.prompt_tokens_total,
        "cached_tokens": st.cached_tokens_total,
        "generation_tokens": st.generation_tokens_total,
        "evicted_tokens": int(getattr(st, "evicted_tokens_total", s.kv.evicted_total)),
        "retractions": st.num_retracted_requests_total,
        "aborted_requests": st.num_aborted_requests_total,
        "prefill_batches": st.prefill_batches,
        "decode_steps": st.decode_steps,
        "busy_s": round(st.busy_time_s, 6),
        "steps": engine.steps,
        "metrics_scrapes": engine.scrapes,
    }
    for name in (
        "realtime_prefill_compute_tokens",
        "realtime_prefill_cache_tokens",
        "realtime_decode_tokens",
    ):
        if hasattr(st, name):
            out[name] = getattr(st, name)
    if s.hi is not None:
        out["loaded_back_tokens"] = s.hi.loaded_back_total
        out["host_cached_tokens"] = st.host_cached_tokens_total
        out["host_evicted_tokens"] = s.hi.host_evicted_total
        out["backed_up_tokens"] = s.hi.backed_up_total
    return out


def run_lab(cfg: LabConfig) -> LabResult:
    """Run one policy and seed; ``summary['wall_s']`` is the run's wall time."""
    t0 = time.perf_counter()
    result = run_virtual(_run(cfg))
    wall = time.perf_counter() - t0
    result.summary["wall_s"] = round(wall, 3)
    sim = result.summary.get("simulated_s") or 0.0
    result.summary["speedup"] = round(sim / wall, 1) if wall > 0 else None
    return result


def median_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-key median of the numeric fields of ``rows`` (others from the first row)."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        values = [r.get(key) for r in rows]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            nums = [float(v) for v in values if v is not None and not math.isnan(float(v))]
            out[key] = statistics.median(nums) if nums else None
        else:
            out[key] = value
    out["seeds"] = [r.get("seed") for r in rows]
    return out


def run_matrix(
    cfg: LabConfig, policies: Sequence[str], seeds: Sequence[int]
) -> dict[str, dict[str, Any]]:
    """Every policy x seed: ``{policy: {"median": row, "per_seed": {seed: row}}}``."""
    out: dict[str, dict[str, Any]] = {}
    for policy in policies:
        rows = {
            seed: run_lab(dataclasses.replace(cfg, policy=policy, seed=seed)).summary
            for seed in seeds
        }
        out[policy] = {"median": median_row(list(rows.values())), "per_seed": rows}
    return out


TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("sessions/min", "sessions_per_min", "{:.2f}"),
    ("cache hit rate", "cache_hit_rate", "{:.1%}"),
    ("recompute share", "recompute_share", "{:.1%}"),
    ("recomputed prefill tokens", "recomputed_prefill_tokens", "{:,.0f}"),
    ("evicted tokens", "evicted_tokens", "{:,.0f}"),
    ("TTFT p99 continuing (s)", "ttft_p99_continuing_s", "{:.2f}"),
    ("TTFT p99 first turn (s)", "ttft_p99_first_s", "{:.2f}"),
    ("first-turn wait p99 (s)", "first_turn_wait_p99_s", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
    ("retractions", "retractions", "{:,.0f}"),
    ("sessions", "sessions", "{:,.0f}"),
    ("turns", "turns", "{:,.0f}"),
    ("makespan (s)", "makespan_s", "{:.1f}"),
    ("simulated (s)", "simulated_s", "{:.1f}"),
    ("wall (s)", "wall_s", "{:.2f}"),
)


def format_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """Side-by-side text table, one column per policy (like the demo's)."""
    names = list(rows)
    body: list[tuple[str, list[str]]] = []
    for label, key, fmt in TABLE_ROWS:
        cells = []
        for name in names:
            v = rows[name].get(key)
            cells.append("-" if v is None else fmt.format(v))
        body.append((label, cells))
    widths = [max(len(label) for label, _ in body)]
    for i, name in enumerate(names):
        widths.append(max(len(name), *(len(cells[i]) for _, cells in body)))
    lines = [
        "  ".join([" " * widths[0], *(n.rjust(w) for n, w in zip(names, widths[1:], strict=True))])
    ]
    lines.append("  ".join("-" * w for w in widths))
    for label, cells in body:
        lines.append(
            "  ".join(
                [
                    label.ljust(widths[0]),
                    *(c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)),
                ]
            )
        )
    return "\n".join(lines)
