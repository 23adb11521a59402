"""Rollouts through the real stack: a scenario run off vs on, on fresh processes.

A :class:`Scenario` names a workload at a size (engines, cost model, token and time
scale, pool, live sessions, the router's policy, optionally SGLang's host tier); a
:class:`Variant` names kvproxy's features. :func:`run_config` starts two or more
simulated SGLang engines (session-radix cache, priority eviction and scheduling), the real
router (``smg``, worker overload protection off: the deployment contract of
docs/operations.md) and kvproxy in front, runs the workload once and stops every process
by its PID in a ``finally`` (also on Ctrl-C and SIGTERM: :func:`sigterm_as_interrupt`).
Every configuration, ``off`` included, sends the same routing key to the same router
policy (``X-SMG-Routing-Key: <session id>``, or a key that places the session as the lab
does: :func:`lab_routing_keys`). :func:`run_scenario` runs configurations x seeds, one
after the other or side by side (each on its own stack in its own process), and
:func:`medians`, :func:`report_lines`, :func:`verdict` and :func:`write_chart` compare
them with ``off``.

The library of ``kvproxy demo`` (:mod:`kvlab.demo`, its command line) and
``scripts/bench_rollout.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvlab.sim.config import HiCacheConfig, validate_hicache
from kvproxy.config import AdmissionConfig

ProgressFn = Callable[[str], None]


class PidSink(Protocol):
    """Where :func:`run_config` puts each PID as soon as it is known (a list will do)."""

    def append(self, pid: int, /) -> None: ...


@dataclass(frozen=True, slots=True)
class Variant:
    """One configuration of kvproxy in front of the router."""

    name: str
    lifecycle: bool = False
    admission: bool = False
    # admission.prefetch on, and the workload tells kvproxy each tool call's length.
    prefetch: bool = False


VARIANTS: tuple[Variant, ...] = (
    Variant("off"),
    Variant("lifecycle", lifecycle=True),
    Variant("admission", admission=True),
    Variant("both", lifecycle=True, admission=True),
    Variant("prefetch", lifecycle=True, admission=True, prefetch=True),
)
VARIANTS_BY_NAME: dict[str, Variant] = {v.name: v for v in VARIANTS}


@dataclass(frozen=True, slots=True)
class Scenario:
    """A workload on a fleet of simulated engines, sized by live working set / pool."""

    name: str
    workload: str = "swe"
    cost_model: str = "qwen3-8b-h100"
    token_scale: int = 16
    engines: int = 2
    sessions_per_engine: int = 8
    # Main sessions in a run; None: twice the concurrency (a closed loop of two waves).
    sessions: int | None = None
    # Live working set / fleet pool the pool is sized for; ignored with pool_tokens.
    pool_ratio: float | None = 2.0
    # KV tokens per engine (scaled); None: from pool_ratio, else the preset's.
    pool_tokens: int | None = None
    # Wall seconds per simulated second (engines, tool pauses and kvproxy's timers).
    time_scale: float = 0.25
    # WorkloadSpec parameters to override (real units, as ``kvproxy workload --set``).
    workload_overrides: Mapping[str, Any] = field(default_factory=dict)
    router_policy: str = "consistent_hashing"
    # Simulated seconds a run may take (sessions still running then count as failed).
    run_timeout_sim_s: float = 1800.0
    request_timeout_sim_s: float = 600.0
    # >0: the engines keep the last N requests as received (GET /sim/requests) and the
    # run reports what reached them (session ids, routing keys, closes, priorities).
    record_requests: int = 0
    # True: the sessions are placed on the engines as in the lab (lab_routing_keys),
    # whatever the engines' ports; False: as smg's ring over this run's ports places them.
    lab_placement: bool = False
    # SGLang's hierarchical cache on the engines (--enable-hierarchical-cache) with this
    # --hicache-ratio; None: off. The lab's `--hicache` through the real stack.
    hicache_ratio: float | None = None
    # Its --hicache-write-policy (one of HICACHE_WRITE_POLICIES); None: SGLang's default,
    # write_through. Only with hicache_ratio.
    hicache_write_policy: str | None = None
    # kvproxy replicas: above 1, that many behind nginx round robin (no affinity), their
    # state shared on a redis-server with a password (state.backend: redis).
    replicas: int = 1
    # Wall seconds after the run starts when the first replica is SIGKILLed (None: never).
    kill_replica_after_s: float | None = None
    # Times the clients send a turn again after an error (not after a timeout).
    client_retries: int = 0

    @property
    def concurrency(self) -> int:
        return self.sessions_per_engine * self.engines

    @property
    def total_sessions(self) -> int:
        return self.sessions if self.sessions is not None else 2 * self.concurrency

    def spec(self) -> Any:
        from kvlab.workload.spec import workload_spec

        return workload_spec(self.workload, self.token_scale, **dict(self.workload_overrides))

    def mean_context_per_call(self, samples: int = 300) -> float:
        """Mean KV context of a request (scaled tokens), over ``samples`` seeded sessions."""
        overrides = tuple(sorted(self.workload_overrides.items()))
        return _mean_context_per_call(self.workload, self.token_scale, overrides, samples)

    def live_working_set(self) -> int:
        """Per engine: live sessions x mean context per call (calibration.md's R numerator)."""
        return round(self.sessions_per_engine * self.mean_context_per_call())

    def pool(self) -> int:
        """KV tokens per engine (scaled)."""
        if self.pool_tokens is not None:
            return self.pool_tokens
        if self.pool_ratio is not None:
            return max(64, math.ceil(self.live_working_set() / self.pool_ratio))
        from kvlab.sim.presets import scheduler_config

        return int(scheduler_config(self.cost_model, self.token_scale).max_total_tokens)

    def check(self) -> None:
        """Raise ValueError for a scenario whose sessions could not run: a request can
        never be larger than an engine's pool (SGLang rejects it), so the workload's
        context length must fit the pool."""
        if self.engines < 1 or self.sessions_per_engine < 1 or self.total_sessions < 1:
            raise ValueError(f"{self.name}: engines, sessions per engine and sessions must be >= 1")
        if not 0 < self.time_scale <= 10:
            raise ValueError(f"{self.name}: time scale must be in (0, 10] (got {self.time_scale})")
        if self.hicache_ratio is not None:
            tier = HiCacheConfig(ratio=self.hicache_ratio)
            if self.hicache_write_policy is not None:
                tier = dataclasses.replace(tier, write_policy=self.hicache_write_policy)
            try:
                validate_hicache(tier)  # the simulated engine's own check
            except ValueError as exc:
                raise ValueError(f"{self.name}: {exc}") from None
        elif self.hicache_write_policy is not None:
            raise ValueError(f"{self.name}: a hicache write policy needs the hicache on")
        context = int(self.spec().context_length)
        pool = self.pool()
        if context > pool:
            raise ValueError(
                f"{self.name}: context length {context} (scaled) is larger than the engines' "
                f"pool of {pool} tokens; lower context_length or raise sessions_per_engine"
            )

    def describe(self) -> dict[str, Any]:
        pool = self.pool()
        ws = self.live_working_set()
        return {
            **dataclasses.asdict(self),
            "workload_overrides": dict(self.workload_overrides),
            "concurrency": self.concurrency,
            "total_sessions": self.total_sessions,
            "pool_tokens_per_engine": pool,
            "live_working_set_per_engine": ws,
            "working_set_over_pool": round(ws / pool, 2),
        }


@functools.lru_cache(maxsize=32)
def _mean_context_per_call(
    workload: str, token_scale: int, overrides: tuple[tuple[str, Any], ...], samples: int
) -> float:
    """:meth:`Scenario.mean_context_per_call`, drawn once per workload (sampling the
    plans takes a fraction of a second; the demo sizes its pool several times)."""
    from kvlab.workload.plan import session_plans
    from kvlab.workload.spec import workload_spec

    spec = workload_spec(workload, token_scale, **dict(overrides))
    calls: list[int] = []
    for plan in itertools.islice(session_plans(spec, 0), samples):
        ctx = 0
        for turn in plan.turns:
            ctx += len(turn.new_input_ids)
            calls.append(ctx)
            ctx += turn.max_new_tokens
    return statistics.fmean(calls) if calls else 0.0


# The demo's W1: the calibrated swe workload (qwen3-8b-h100, K=16, 2 engines) at its
# calibrated size, 48 live sessions per engine (192 sessions a run, two waves) on a pool
# sized for twice their working set, compressed in time (0.05 wall seconds per simulated
# second) so that off and both take about three minutes together. A smaller fleet has
# less to win: off comes close to the no-eviction bound (docs/benchmarks.md, the regime
# grid).
# The client's request timeout is above admission.new_session_max_wait_s plus a turn
# (docs/operations.md, "Client timeouts").
DEMO_W1 = Scenario(
    name="w1-swe-2x",
    sessions_per_engine=48,
    pool_ratio=2.0,
    time_scale=0.05,
    run_timeout_sim_s=7200.0,
    request_timeout_sim_s=AdmissionConfig().new_session_max_wait_s + 600.0,
)
DEMO_SEEDS: tuple[int, ...] = (0,)
# The quick demo: a smaller W1 that is still KV-bound: 24 live sessions per engine on a
# pool of half their working set, 56 sessions (more than one wave), tool calls capped at
# 60 s (W1 caps them at 300 s: in a run this short one session's slow tool calls would
# set the makespan, and off, both and the no-eviction ceiling would all end with it),
# sessions placed as in the lab, at 0.03 wall seconds per simulated second (at 0.02 the
# engines fell up to 9% behind their clock on a 2-core host). In the lab (seeds 0-2) the
# no-eviction ceiling is 1.88-1.97x off and both 1.41-1.45x.
QUICK_W1 = dataclasses.replace(
    DEMO_W1,
    name="w1-swe-quick",
    sessions_per_engine=24,
    pool_ratio=2.0,
    sessions=56,
    time_scale=0.03,
    workload_overrides={"tool_latency_cap_s": 60},
    record_requests=8000,
    lab_placement=True,
)
QUICK_SEEDS: tuple[int, ...] = (0,)


def proxy_config(
    variant: Variant,
    *,
    port: int,
    router_url: str,
    engine_urls: Sequence[str],
    router_policy: str,
    time_scale: float,
    token_scale: int = 1,
) -> dict[str, Any]:
    """kvproxy's YAML document (as a dict): the documented defaults with only the two
    features, the router's policy and the engines' time and token scales set."""
    return {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "log_level": "WARNING",
            "time_scale": time_scale,
            "token_scale": token_scale,
        },
        "router": {"url": router_url, "engines": list(engine_urls), "policy": router_policy},
        "session_lifecycle": {"enabled": variant.lifecycle},
        "admission": {"enabled": variant.admission}
        | ({"prefetch": True} if variant.prefetch else {}),
    }


def _write_yaml(path: Path, doc: Mapping[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(dict(doc), sort_keys=False))


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields_ and fields_[0] == "Z":
            return False
    return True


def _get_json(url: str, timeout_s: float = 5.0) -> Any:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def sim_overrun_s(engine_url: str, timeout_s: float = 2.0) -> float | None:
    """Wall seconds a simulated engine ran behind its cost model (``/sim/state``);
    None for a real engine or when it cannot be read. A large value means the host
    was too slow for the chosen time scale."""
    data = _get_json(f"{engine_url}/sim/state", timeout_s)
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list):
        return None
    return round(sum(float(r.get("overrun_s", 0.0)) for r in ranks if isinstance(r, dict)), 3)


def engine_clock(data: Any) -> dict[str, float] | None:
    """The simulator's clock block of an engine's ``/server_info`` document summed over
    ranks: ``overrun_s`` (wall seconds behind the cost model), ``max_lag_s``,
    ``late_steps``, ``steps``."""
    sim = data.get("kvproxy_sim") if isinstance(data, dict) else None
    ranks = sim.get("clock") if isinstance(sim, dict) else None
    if not isinstance(ranks, list) or not ranks:
        return None
    out = {"overrun_s": 0.0, "max_lag_s": 0.0, "late_steps": 0.0, "steps": 0.0}
    for r in ranks:
        if not isinstance(r, dict):
            continue
        out["overrun_s"] += float(r.get("overrun_s", 0.0))
        out["max_lag_s"] = max(out["max_lag_s"], float(r.get("max_lag_s", 0.0)))
        out["late_steps"] += float(r.get("late_steps", 0.0))
        out["steps"] += float(r.get("steps", 0.0))
    return {k: round(v, 3) for k, v in out.items()}


def engine_hicache(data: Any) -> dict[str, Any] | None:
    """The engine's host tier as its ``/server_info`` document reports it (SGLang's
    server args): ``enable_hierarchical_cache``, ``hicache_ratio``,
    ``hicache_write_policy``."""
    if not isinstance(data, dict):
        return None
    keys = ("enable_hierarchical_cache", "hicache_ratio", "hicache_write_policy")
    return {k: data.get(k) for k in keys}


def reached_engines(engine_urls: Sequence[str]) -> dict[str, Any] | None:
    """What the engines received (``GET /sim/requests``, engines started with
    ``--record-requests``): generate requests, those with a top-level ``session_id``,
    a ``priority`` or an ``X-SMG-Routing-Key``, /close_session calls, and the sessions
    whose requests reached more than one engine. None when nothing was recorded."""
    total = {"generate": 0, "session_id": 0, "priority": 0, "routing_key": 0, "close_session": 0}
    engines_of: dict[str, set[int]] = {}
    any_recorded = False
    for i, url in enumerate(engine_urls):
        data = _get_json(f"{url}/sim/requests")
        reqs = data.get("requests") if isinstance(data, dict) else None
        if not isinstance(reqs, list):
            continue
        any_recorded = any_recorded or bool(reqs)
        for r in reqs:
            path = r.get("path")
            headers = {str(k).lower(): v for k, v in (r.get("headers") or {}).items()}
            if path == "/close_session":
                total["close_session"] += 1
                continue
            if path != "/generate":
                continue
            total["generate"] += 1
            try:
                body = json.loads(r.get("body") or "{}")
            except ValueError:
                body = {}
            if isinstance(body, dict):
                total["session_id"] += "session_id" in body
                total["priority"] += "priority" in body
            key = headers.get("x-smg-routing-key")
            if key:
                total["routing_key"] += 1
                engines_of.setdefault(str(key), set()).add(i)
    if not any_recorded:
        return None
    moved = sum(1 for e in engines_of.values() if len(e) > 1)
    return {**total, "sessions_seen": len(engines_of), "sessions_on_two_engines": moved}


def lab_routing_keys(engine_urls: Sequence[str]) -> Callable[[str], str]:
    """Routing keys under which smg's ring over ``engine_urls`` places every session
    on the engine the lab places it on. Pure.

    smg's consistent hashing places a session by its ``X-SMG-Routing-Key`` on a ring of
    the engines' URLs, so stacks on other ports (two side by side, or two invocations)
    place the same sessions differently, and placement moves a small run's numbers (in
    the lab, off of a 48-session quick run: up to 1.6x between port pairs on one seed).
    The key of session ``sid`` is ``sid`` itself when the ring sends it to engine ``i``,
    where the lab's ring (engines at ``http://127.0.0.1:30001``, ...) sends ``sid``;
    else ``sid~n`` for the first ``n`` that does. ValueError for fewer than one URL or
    more than 64 tries."""
    from kvlab.lab.runner import LabConfig
    from kvlab.lab.runner import engine_urls as lab_engine_urls
    from kvproxy.fleet.ring import HashRing

    real = HashRing(engine_urls)
    if len(real) < 1:
        raise ValueError("lab_routing_keys needs at least one engine URL")
    lab = HashRing(lab_engine_urls(LabConfig(engines=len(real))))
    real_index = {url: i for i, url in enumerate(real.urls)}
    lab_index = {url: i for i, url in enumerate(lab.urls)}
    keys: dict[str, str] = {}

    def routing_key(sid: str) -> str:
        key = keys.get(sid)
        if key is not None:
            return key
        want = lab_index[lab.owner(sid) or ""]
        for n in range(64):
            key = f"{sid}~{n}" if n else sid
            if real_index[real.owner(key) or ""] == want:
                keys[sid] = key
                return key
        raise ValueError(f"no routing key for {sid!r} reaches engine {want} in 64 tries")

    return routing_key


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


# Summary keys in loop (wall) seconds and per-second rates: converted to simulated time.
_DURATION_KEYS = (
    "makespan_s",
    "simulated_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_p99_first_s",
    "ttft_p50_continuing_s",
    "ttft_p99_continuing_s",
    "latency_p50_s",
    "latency_p99_s",
    "session_time_p50_s",
    "session_time_p99_s",
)
_WAIT_MS_KEYS = ("admission_wait_p50_ms", "admission_wait_p99_ms")
_RATE_KEYS = ("sessions_per_min", "output_tokens_per_s")


def to_simulated(summary: Mapping[str, Any], time_scale: float) -> dict[str, Any]:
    """The driver's summary (loop seconds) in simulated seconds: durations / time_scale,
    rates x time_scale. Token counts and ratios are unchanged."""
    out = dict(summary)
    for key in _DURATION_KEYS + _WAIT_MS_KEYS:
        if isinstance(out.get(key), int | float):
            out[key] = round(out[key] / time_scale, 4)
    for key in _RATE_KEYS:
        if isinstance(out.get(key), int | float):
            out[key] = round(out[key] * time_scale, 4)
    return out


def first_turn_wait_p99_s(result: Any, time_scale: float) -> float | None:
    """p99 of admission's wait of sessions' first requests, simulated seconds."""
    from kvlab.workload.report import percentile

    waits = [
        t.admission_wait_ms / 1000.0 / time_scale
        for t in result.turns
        if t.turn == 0 and t.admission_wait_ms is not None
    ]
    p99 = percentile(waits, 99)
    return None if p99 is None else round(p99, 4)


@dataclass(frozen=True)
class _Stack:
    """The processes of one run: engines, smg and kvproxy, with kvproxy's config."""

    engine_urls: list[str]
    proxy_url: str
    proxy_config: dict[str, Any]
    replica_pids: tuple[int, ...] = ()
    replica_urls: tuple[str, ...] = ()


def _start_stack(
    variant: Variant,
    scenario: Scenario,
    *,
    tag: str,
    out_dir: Path,
    log_dir: Path,
    engine_ports: Sequence[int] | None,
    track: Callable[[Any], Any],
) -> _Stack:
    """Start the engines (in parallel), smg over them and kvproxy over smg; ``track``
    registers each process for stopping as soon as it is started."""
    from kvlab import stack as stk

    ts = scenario.time_scale
    engine_extra = ["--enable-priority-scheduling", "--time-scale", f"{ts:g}"]
    if scenario.record_requests:
        engine_extra += ["--record-requests", str(scenario.record_requests)]
    if scenario.hicache_ratio is not None:
        engine_extra += [
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            f"{scenario.hicache_ratio:g}",
        ]
        if scenario.hicache_write_policy is not None:
            engine_extra += ["--hicache-write-policy", scenario.hicache_write_policy]
    ports: Sequence[int | None] = engine_ports or [None] * scenario.engines
    pool = scenario.pool()  # sampled from the workload's plans: once, not per engine

    def engine_starter(port: int | None) -> Any:
        return stk.start_sim_engine(
            port=port,
            max_total_tokens=pool,
            mode="session-radix",
            eviction_policy="priority",
            cost_model=scenario.cost_model,
            token_scale=scenario.token_scale,
            extra_args=engine_extra,
            log_dir=log_dir,
        )

    starters = [functools.partial(engine_starter, port) for port in ports]
    engines = [track(p) for p in _start_parallel(starters)]
    engine_urls = [e.url for e in engines]
    router = track(stk.start_router(engine_urls, policy=scenario.router_policy, log_dir=log_dir))
    port = stk.free_port()
    doc = proxy_config(
        variant,
        port=port,
        router_url=router.url,
        engine_urls=engine_urls,
        router_policy=scenario.router_policy,
        time_scale=ts,
        token_scale=scenario.token_scale,
    )
    if scenario.replicas > 1:
        from kvlab import replicas

        lb_url, replica_doc, pids, urls = replicas.start(
            doc, scenario.replicas, router.url, tag=tag, out_dir=out_dir, log_dir=log_dir,
            track=track,
        )  # fmt: skip
        return _Stack(engine_urls, lb_url, replica_doc, pids, urls)
    cfg_path = out_dir / f"kvproxy-{tag}.yaml"
    _write_yaml(cfg_path, doc)
    proxy = track(
        stk.start_kvproxy(config_path=cfg_path, router_url=router.url, port=port, log_dir=log_dir)
    )
    return _Stack(engine_urls, proxy.url, doc, replica_urls=(proxy.url,))


def _session_progress(tag: str, progress: ProgressFn | None) -> Callable[[int, int, int], None]:
    """The driver's per-session callback: a progress line at most every 5 s, and at the end."""
    t0 = time.monotonic()
    last = [0.0]

    def on_session(done: int, failed: int, total: int) -> None:
        now = time.monotonic()
        if progress is not None and (now - last[0] >= 5.0 or done + failed == total):
            last[0] = now
            fail = f", {failed} failed" if failed else ""
            progress(f"  [{tag}] {done + failed}/{total} sessions{fail}, {now - t0:.0f} s")

    return on_session


def run_config(
    variant: Variant,
    scenario: Scenario,
    *,
    seed: int,
    out_dir: Path,
    pids: PidSink,
    progress: ProgressFn | None = None,
    engine_ports: Sequence[int] | None = None,
    lab_placement: bool | None = None,
) -> dict[str, Any]:
    """Start a fresh stack (engines, smg, kvproxy), run one seed of the scenario through
    it, stop every process. Every PID is appended to ``pids`` as soon as it is known.
    ``engine_ports`` (one per engine; default: free ports) fixes the engines' URLs, and
    with them smg's consistent-hashing placement, across the configurations compared;
    ``lab_placement`` (default: the scenario's) places the sessions as the lab does
    instead, whatever the ports (:func:`lab_routing_keys`).

    Returns ``{"summary" (simulated time), "wall_summary", "engine_deltas",
    "engine_clock", "reached_engines", "proxy_config", "load", "pids"}``.
    """
    import asyncio

    from kvlab import replicas
    from kvlab import stack as stk
    from kvlab.workload.driver import run_http

    tag = f"{variant.name}-s{seed}"
    log_dir = out_dir / "logs" / tag
    log_dir.mkdir(parents=True, exist_ok=True)
    ts = scenario.time_scale
    my_pids: list[int] = []
    load_before = os.getloadavg()
    procs: list[Any] = []
    with contextlib.ExitStack() as es:
        # Every process is stopped on the way out, all at once (their shutdowns overlap).
        es.callback(stk.stop_all, procs)

        def track(proc: Any) -> Any:
            procs.append(proc)
            pids.append(proc.pid)
            my_pids.append(proc.pid)
            return proc

        stack = _start_stack(
            variant,
            scenario,
            tag=tag,
            out_dir=out_dir,
            log_dir=log_dir,
            engine_ports=engine_ports,
            track=track,
        )
        engine_urls = stack.engine_urls
        if lab_placement is None:
            lab_placement = scenario.lab_placement
        killed = replicas.arm_kill(scenario.kill_replica_after_s, stack.replica_pids, es)
        run = asyncio.run(
            run_http(
                scenario.spec(),
                stack.proxy_url,
                sessions=scenario.total_sessions,
                concurrency=scenario.concurrency,
                seed=seed,
                time_scale=ts,
                engine_urls=engine_urls,
                progress=_session_progress(tag, progress),
                request_timeout_s=scenario.request_timeout_sim_s * ts,
                run_timeout_s=scenario.run_timeout_sim_s * ts,
                routing_key=lab_routing_keys(engine_urls) if lab_placement else None,
                tool_hints=variant.prefetch,
                retries=scenario.client_retries,
            )
        )
        wall = run.summary()
        infos = [_get_json(f"{u}/server_info") for u in engine_urls]
        summary = to_simulated(wall, ts)
        summary["first_turn_wait_p99_s"] = first_turn_wait_p99_s(run.result, ts)
        result: dict[str, Any] = {
            "variant": variant.name,
            "seed": seed,
            "lab_placement": lab_placement,
            "summary": summary,
            "wall_summary": {k: wall[k] for k in ("wall_s", "makespan_s") if k in wall},
            "engine_deltas": run.engine_deltas,
            "engine_clock": [engine_clock(info) for info in infos],
            "engine_hicache": (
                [engine_hicache(info) for info in infos]
                if scenario.hicache_ratio is not None
                else None
            ),
            "reached_engines": reached_engines(engine_urls) if scenario.record_requests else None,
            "proxy_config": stack.proxy_config,
            **replicas.facts(scenario.replicas, killed, run.retried_turns, stack.replica_urls),
            "load": {"before": [round(x, 2) for x in load_before]},
            "pids": my_pids,
        }
    result["load"]["after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def clock_overrun_share(runs: Sequence[Mapping[str, Any]]) -> float | None:
    """Worst engine overrun over all runs as a share of the run's wall time: how far the
    simulator fell behind its cost model (0.0: it kept up)."""
    worst: float | None = None
    for r in runs:
        wall = (r.get("wall_summary") or {}).get("wall_s") or 0.0
        for c in r.get("engine_clock") or []:
            if c is None or wall <= 0:
                continue
            share = float(c["overrun_s"]) / wall
            worst = share if worst is None else max(worst, share)
    return None if worst is None else round(worst, 4)


# Side by side, off and both run at once, each on its own stack (two engines, smg,
# kvproxy and a workload driver: five busy processes); below this many usable cores the
# engines fall behind their clock, so the default there is one after the other.
SIDE_BY_SIDE_MIN_CORES = 8


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _PidPipe:
    """``pids`` of :func:`run_config` in a side-by-side child: each PID goes to the
    parent as soon as it is known."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def append(self, pid: int, /) -> None:
        self._conn.send(("pid", pid))


def _run_config_child(conn: Any, variant: Variant, scenario: Scenario, kw: dict[str, Any]) -> None:
    """A side-by-side child process: one :func:`run_config`; its PIDs, progress lines and
    result (or error) go to the parent over ``conn``. SIGTERM stops its stack."""

    def say(line: str) -> None:
        conn.send(("say", line))

    try:
        with sigterm_as_interrupt():
            message: tuple[str, Any] = (
                "result",
                run_config(variant, scenario, pids=_PidPipe(conn), progress=say, **kw),
            )
    except KeyboardInterrupt:
        message = ("error", "interrupted")
    except Exception as exc:
        message = ("error", f"{type(exc).__name__}: {exc}")
    with contextlib.suppress(OSError):
        conn.send(message)
        conn.close()


def _stop_children(children: Sequence[Any], pids: Sequence[int]) -> None:
    """Stop side-by-side children still running (SIGTERM: each stops its own stack);
    if one must be killed, the processes it started (``pids``) are stopped by PID."""
    for child in children:
        if child.is_alive():
            child.terminate()
    killed = False
    for child in children:
        child.join(timeout=30)
        if child.is_alive():
            killed = True
            child.kill()
            child.join(timeout=10)
    if killed:
        for pid in pids:
            if pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)


def run_side_by_side(
    variants: Sequence[Variant],
    scenario: Scenario,
    *,
    seed: int,
    out_dir: Path,
    pids: PidSink,
    progress: ProgressFn | None = None,
    engine_ports: Sequence[Sequence[int]],
) -> dict[str, dict[str, Any]]:
    """One seed of every configuration at once: each :func:`run_config` in its own
    process (its own workload driver) on its own stack, on the engine ports
    ``engine_ports[i]`` of configuration ``i``. Two stacks cannot share ports, and smg's
    ring hashes them, so every session is placed as in the lab in every configuration
    (:func:`lab_routing_keys`). Returns ``{variant name: run}``; raises
    RuntimeError naming a configuration that failed. Every child is stopped before
    this returns or raises (also on Ctrl-C and SIGTERM)."""
    import multiprocessing
    from multiprocessing.connection import Connection, wait

    ctx = multiprocessing.get_context("spawn")
    say = progress or (lambda _line: None)
    conns: dict[Connection, str] = {}
    children: list[Any] = []
    mine: list[int] = []
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    try:
        for variant, ports in zip(variants, engine_ports, strict=True):
            recv, send = ctx.Pipe(duplex=False)
            kw = {
                "seed": seed,
                "out_dir": out_dir,
                "engine_ports": list(ports),
                "lab_placement": True,
            }
            child = ctx.Process(
                target=_run_config_child,
                args=(send, variant, scenario, kw),
                name=f"kvproxy-demo-{variant.name}-s{seed}",
                daemon=True,
            )
            child.start()
            send.close()
            children.append(child)
            conns[recv] = variant.name
        waiting = list(conns)
        while waiting:
            ready = wait(waiting)
            for conn in [c for c in waiting if c in ready]:
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    waiting.remove(conn)
                    continue
                if kind == "pid":
                    mine.append(payload)
                    pids.append(payload)
                elif kind == "say":
                    say(payload)
                elif kind == "result":
                    results[conns[conn]] = payload
                else:
                    errors[conns[conn]] = str(payload)
    finally:
        _stop_children(children, mine)
        for conn in conns:
            conn.close()
    missing = [v.name for v in variants if v.name not in results]
    if missing:
        why = "; ".join(f"{n}: {errors.get(n, 'exited without a result')}" for n in missing)
        raise RuntimeError(f"side by side, seed {seed}: {why}")
    return results


def _distinct_ports(count: int) -> list[int]:
    from kvlab import stack as stk

    ports: list[int] = []
    while len(ports) < count:
        port = stk.free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _run_done_line(i: int, n: int, res: Mapping[str, Any]) -> str:
    s = res["summary"]
    return (
        f"[{i}/{n}] {res['variant']} seed {res['seed']}: {s['sessions_completed']}/"
        f"{s['sessions_started']} sessions, {s['sessions_per_min']:.2f}/min simulated, "
        f"recomputed {s['recomputed_prefill_tokens']:,}, wall "
        f"{res['wall_summary'].get('wall_s', 0):.0f} s, load {res['load']['before'][0]}"
    )


def run_scenario(
    scenario: Scenario,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    *,
    out_dir: Path,
    pids: list[int],
    progress: ProgressFn | None = None,
    side_by_side: bool = False,
) -> dict[str, Any]:
    """Every configuration x seed on a fresh stack; seeds interleave so that a change
    of the host's load hits every configuration alike. ``side_by_side``: the
    configurations of a seed run at once (:func:`run_side_by_side`, sessions placed as
    in the lab), for hosts with the cores for it.

    Returns ``{"scenario", "seeds", "side_by_side", "runs": {variant: {seed: run}},
    "medians", "clock_overrun_share"}``.
    """
    say = progress or (lambda _line: None)
    runs: dict[str, dict[int, dict[str, Any]]] = {v.name: {} for v in variants}
    # The same engine URLs in every run of a configuration: smg's ring hashes them, so
    # every seed sees the same placement, not one drawn per run; one after the other,
    # every configuration shares them too (side by side each stack has its own, and
    # the sessions are placed as in the lab).
    shared = _distinct_ports(scenario.engines * (len(variants) if side_by_side else 1))
    ports = [
        shared[i * scenario.engines : (i + 1) * scenario.engines] for i in range(len(variants))
    ]
    n = len(variants) * len(seeds)
    i = 0
    for seed in seeds:
        if side_by_side:
            names = ", ".join(v.name for v in variants)
            say(
                f"[{i + 1}-{i + len(variants)}/{n}] {scenario.name} {names} seed {seed} side by "
                "side: starting the stacks"
            )
            per = run_side_by_side(
                variants,
                scenario,
                seed=seed,
                out_dir=out_dir,
                pids=pids,
                progress=progress,
                engine_ports=ports,
            )
            for variant in variants:
                i += 1
                runs[variant.name][seed] = per[variant.name]
                say(_run_done_line(i, n, per[variant.name]))
            continue
        for variant in variants:
            i += 1
            say(f"[{i}/{n}] {scenario.name} {variant.name} seed {seed}: starting the stack")
            res = run_config(
                variant,
                scenario,
                seed=seed,
                out_dir=out_dir,
                pids=pids,
                progress=progress,
                engine_ports=shared,
            )
            runs[variant.name][seed] = res
            say(_run_done_line(i, n, res))
    return {
        "scenario": scenario.describe(),
        "seeds": list(seeds),
        "side_by_side": side_by_side,
        "runs": {v: {str(k): r for k, r in per.items()} for v, per in runs.items()},
        "medians": medians(runs),
        "clock_overrun_share": clock_overrun_share(
            [r for per in runs.values() for r in per.values()]
        ),
    }


def medians(runs: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration, the median over seeds of every numeric summary field."""
    from kvlab.lab.runner import median_row

    return {
        name: median_row([r["summary"] for r in per.values()]) for name, per in runs.items() if per
    }


# ------------------------------------------------------------------------- reporting

# (key, label, format, higher is better)
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("sessions_per_min", "sessions/min (simulated)", "{:.2f}", True),
    ("makespan_s", "makespan (s)", "{:.0f}", False),
    ("cache_hit_rate", "cache hit rate", "{:.1%}", True),
    ("recompute_share", "recompute share", "{:.1%}", False),
    ("recomputed_prefill_tokens", "recomputed prefill tokens", "{:,.0f}", False),
    ("evicted_tokens", "evicted tokens", "{:,.0f}", False),
    ("ttft_p99_continuing_s", "TTFT p99 continuing (s)", "{:.2f}", False),
    ("ttft_p99_first_s", "TTFT p99 first turn (s)", "{:.2f}", False),
    ("first_turn_wait_p99_s", "first-turn wait p99 (s)", "{:.2f}", False),
    ("output_tokens_per_s", "output tokens/s", "{:.1f}", True),
    ("retractions", "retractions", "{:,.0f}", False),
    ("sessions_completed", "sessions completed", "{:.0f}", True),
    ("sessions_failed", "sessions failed", "{:.0f}", False),
)


def ratio(value: Any, base: Any) -> float | None:
    if not isinstance(value, int | float) or not isinstance(base, int | float):
        return None
    if base == 0:
        return 1.0 if value == 0 else None
    return float(value) / float(base)


def format_table(meds: Mapping[str, Mapping[str, Any]], base: str = "off") -> str:
    """Medians side by side, then each configuration's ratio to ``base``."""
    names = list(meds)
    others = [n for n in names if n != base and base in meds]
    header = ["", *names, *(f"{n}/{base}" for n in others)]
    body: list[list[str]] = []
    for key, label, fmt, _ in METRICS:
        cells = [label]
        for n in names:
            v = meds[n].get(key)
            cells.append("-" if v is None else fmt.format(v))
        for n in others:
            r = ratio(meds[n].get(key), meds[base].get(key))
            cells.append("-" if r is None else f"{r:.2f}x")
        body.append(cells)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if j else c.ljust(w)
            for j, (c, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in body:
        lines.append(
            "  ".join(
                c.rjust(w) if j else c.ljust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def verdict(name: str, med: Mapping[str, Any], base: Mapping[str, Any]) -> str:
    """One line from the measured medians: throughput, recompute and the continuing-turn
    tail against ``off``, and what they add up to."""
    spm = ratio(med.get("sessions_per_min"), base.get("sessions_per_min"))
    rec = ratio(med.get("recomputed_prefill_tokens"), base.get("recomputed_prefill_tokens"))
    tail = ratio(med.get("ttft_p99_continuing_s"), base.get("ttft_p99_continuing_s"))

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    if spm is None:
        word = "no result"
    elif spm >= 1.05 and (tail is None or tail <= 1.10):
        word = "faster"
    elif spm >= 1.05:
        word = "faster, with a worse tail"
    elif spm <= 0.95 and name in ("admission", "both", "prefetch"):
        # Admission is built never to cost throughput: this is a bug, not a verdict.
        word = "slower: a defect, please report it with results.json (docs/admission.md)"
    elif spm <= 0.95:
        word = "slower"
    elif rec is not None and rec <= 0.9:
        word = "same throughput, less recompute"
    else:
        word = "no measurable difference"
    return (
        f"{name}: {x(spm)} sessions/min, {x(rec)} recompute, "
        f"continuing-turn TTFT p99 {x(tail)} -> {word}"
    )


def report_lines(meds: Mapping[str, Mapping[str, Any]], base: str = "off") -> list[str]:
    """The table and one verdict line per configuration other than ``base``."""
    lines = [format_table(meds, base), ""]
    if base in meds:
        lines += [verdict(n, m, meds[base]) for n, m in meds.items() if n != base]
    return lines


CHART_METRICS: tuple[tuple[str, str], ...] = (
    ("sessions_per_min", "sessions / min"),
    ("recomputed_prefill_tokens", "recomputed prefill"),
    ("ttft_p99_continuing_s", "continuing-turn TTFT p99"),
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
    for ax, (key, label) in zip(axes, CHART_METRICS, strict=True):
        values = [float(summaries[n].get(key) or 0.0) for n in names]
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


def parse_variants(text: str) -> list[Variant]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS_BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"configurations must be a comma-separated subset of {', '.join(VARIANTS_BY_NAME)}"
        )
    return [VARIANTS_BY_NAME[n] for n in names]


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


def with_host_tier(scenario: Scenario, write_policy: str | None = None) -> Scenario:
    """The scenario with SGLang's host tier on its engines in every configuration: the
    host pool SGLang's default ratio of the device pool, written by ``write_policy``
    (None: SGLang's default, write_through), as the lab's ``--hicache``."""
    return dataclasses.replace(
        scenario, hicache_ratio=HiCacheConfig().ratio, hicache_write_policy=write_policy
    )
