"""The measurement plan (:class:`Params`) and its runner (:class:`Bench`), one method per
measurement, every target interleaved per round."""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchproxy.common import (
    BODY_SIZES,
    LADDER_RATES,
    SESSIONS,
    SMALL_BODY_BYTES,
    WORKERS,
    feature_set,
    histogram_quantile,
    in_build_of,
    is_compiled,
    make_body,
    paired_delta,
    parse_histogram,
    summarize_ms,
)
from benchproxy.load import WRK_LUA, run_client_proc, run_wrk
from benchproxy.targets import (
    Proc,
    cpu_seconds,
    host_cpu_seconds,
    http_get,
    minor_faults,
    process_tree,
    rss_mb,
    start_proxy,
    tcp_listen_drops,
)


@dataclass
class Params:
    rounds: int = 3
    sat_warmup_s: float = 2.0
    sat_duration_s: float = 8.0
    sat_connections: int = 64
    wrk_threads: int = 1
    fixed_rate: float = 1000.0
    fixed_warmup_s: float = 2.0
    fixed_duration_s: float = 8.0
    stream_count: int = 100
    stream_chunks: int = 20
    stream_gap_ms: float = 50.0
    big_requests: int = 200
    big_warmup: int = 20
    ladder_rates: tuple[float, ...] = LADDER_RATES
    ladder_warmup_s: float = 1.0
    ladder_duration_s: float = 5.0
    open_streams: int = 2000
    open_chunks: int = 5
    open_gap_ms: float = 1000.0
    open_ramp_s: float = 1.0

    @classmethod
    def quick(cls) -> Params:
        return cls(
            rounds=1,
            sat_warmup_s=1.0,
            sat_duration_s=3.0,
            fixed_warmup_s=1.0,
            fixed_duration_s=3.0,
            stream_count=50,
            stream_chunks=10,
            big_requests=50,
            big_warmup=5,
            ladder_warmup_s=0.5,
            ladder_duration_s=1.5,
            open_streams=500,
            open_chunks=3,
            open_gap_ms=500.0,
            open_ramp_s=0.5,
        )


@dataclass
class Bench:
    args: argparse.Namespace
    params: Params
    workdir: Path
    upstream: Proc | None = None
    redis: Any = None  # the redis-server of the redis targets (a pid), when started
    autogroups: str | None = None  # what --autogroup-nice did
    proxies: dict[str, Proc] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loadavg: dict[str, Any] = field(default_factory=dict)

    def say(self, line: str) -> None:
        print(line, flush=True)

    def python(self, target: str) -> str | None:
        """The interpreter that serves ``target`` when it is not this one's kvproxy."""
        return self.args.compiled_python if is_compiled(target) else None

    def url(self, target: str) -> str:
        if target == "direct":
            assert self.upstream is not None
            return self.upstream.url
        return self.proxies[target].url

    def targets(self) -> list[str]:
        return [t for t in self.args.targets if t == "direct" or t in self.proxies]

    def scrape(self, target: str) -> dict[float, float]:
        if target == "direct":
            return {}
        try:
            status, body = http_get(self.proxies[target].url + "/metrics", timeout=5.0)
        except OSError:
            return {}
        return parse_histogram(body.decode(errors="replace")) if status == 200 else {}

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds so far of the upstream and of each proxy, each process with its
        children (``--workers N``: the parent and its N workers; nginx: its worker)."""
        procs = {"upstream": self.upstream, **self.proxies}
        return {name: tree_cpu_seconds(p.pid) for name, p in procs.items() if p is not None}

    def cpu_snapshot(self, target: str) -> dict[str, Any]:
        """CPU seconds so far of every process in a saturation run of ``target``: the load
        generators this process ran and reaped (``generator``), the upstream, the
        redis-server, each process of the proxy measured (by PID: the parent, then its
        workers) and the whole host's busy time (``host``)."""
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        snap: dict[str, Any] = {
            "generator": usage.ru_utime + usage.ru_stime,
            "upstream": tree_cpu_seconds(self.upstream.pid) if self.upstream else None,
            "redis": cpu_seconds(self.redis.pid) if self.redis is not None else None,
            "proxy": {},
        }
        host = host_cpu_seconds() or {}
        snap["host"], snap["irq"] = host.get("busy"), host.get("irq")
        if target != "direct":
            for pid in process_tree(self.proxies[target].pid):
                snap["proxy"][pid] = cpu_seconds(pid)
        return snap

    # -------------------------------------------------------------- saturation
    def saturation(self) -> None:
        p = self.params
        use_wrk = shutil.which("wrk") is not None and not self.args.no_wrk
        generator = (
            f"wrk -t{p.wrk_threads} -c{p.sat_connections}"
            if use_wrk
            else f"python closed loop, {p.sat_connections} workers"
        )
        self.say(
            f"\n== saturation: 4 KB bodies, {generator}, {p.sat_duration_s:.0f} s x {p.rounds} round(s)"
        )
        lua = self.workdir / "generate.lua"
        body_path = self.workdir / "body-4k.json"
        body_path.write_bytes(make_body(SMALL_BODY_BYTES))
        lua.write_text(WRK_LUA.format(body=body_path, sessions=SESSIONS))
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in self.targets()}
        for rnd in range(p.rounds):
            for target in self.targets():
                url = self.url(target)
                if use_wrk:
                    run_wrk(url, lua, p.sat_warmup_s, p.sat_connections, p.wrk_threads)
                else:
                    self._closed(url, p.sat_warmup_s, 0.5)
                before_cpu = self.cpu()
                before_parts = self.cpu_snapshot(target)
                t0 = time.monotonic()
                if use_wrk:
                    res = run_wrk(url, lua, p.sat_duration_s, p.sat_connections, p.wrk_threads)
                else:
                    res = self._closed(url, p.sat_duration_s, 1.0)
                wall = time.monotonic() - t0
                after_parts = self.cpu_snapshot(target)
                after_cpu = self.cpu()
                server = "upstream" if target == "direct" else target
                b, a = before_cpu.get(server), after_cpu.get(server)
                ub, ua = before_cpu.get("upstream"), after_cpu.get("upstream")
                requests = res.get("requests") or res["rps"] * p.sat_duration_s
                if a is not None and b is not None and requests:
                    res["cpu_us_per_req"] = (a - b) / requests * 1e6
                    res["cpu_share"] = (a - b) / wall
                if ua is not None and ub is not None:
                    res["upstream_cpu_share"] = (ua - ub) / wall
                res["cores"] = cores_used(before_parts, after_parts, wall)
                runs[target].append(res)
                self.say(f"  {target:10s} {res['rps']:9.0f} req/s  errors={res['errors'] or 0}")
                if self.args.profile and feature_set(target) and rnd == p.rounds - 1:
                    self._profile(target, url, lua, use_wrk)
        summary: dict[str, Any] = {
            "generator": "wrk" if use_wrk else "python-closed-loop",
            "runs": runs,
            "targets": {},
        }
        for target, rs in runs.items():
            rps = sorted(r["rps"] for r in rs)
            median_run = min(rs, key=lambda r: abs(r["rps"] - rps[len(rps) // 2]))
            summary["targets"][target] = {
                "rps_median": rps[len(rps) // 2],
                "rps_best": rps[-1],
                "rps_all": rps,
                "latency": median_run.get("latency", {}),
                "errors": sum(sum(r["errors"].values()) for r in rs),
                "cpu_us_per_req": median_run.get("cpu_us_per_req"),
                "cpu_share": median_run.get("cpu_share"),
                "upstream_cpu_share": median_run.get("upstream_cpu_share"),
                "cores": median_cores(rs),
            }
        self.results["saturation"] = summary

    def _closed(self, url: str, duration_s: float, warmup_s: float) -> dict[str, Any]:
        spec = {
            "kind": "closed",
            "url": url,
            "concurrency": self.params.sat_connections,
            "warmup_s": warmup_s,
            "duration_s": duration_s,
            "body_bytes": SMALL_BODY_BYTES,
        }
        return run_client_proc(spec, duration_s + warmup_s + 60)

    def _profile(self, target: str, url: str, lua: Path, use_wrk: bool) -> None:
        pyspy = (
            os.environ.get("PY_SPY")
            or shutil.which("py-spy")
            or str(Path(sys.executable).parent / "py-spy")
        )
        if not Path(pyspy).exists():
            self.notes.append("profile: py-spy not installed (pip install py-spy)")
            return
        out_dir = Path(self.args.profile)
        out_dir.mkdir(parents=True, exist_ok=True)
        raw = out_dir / f"{target}.collapsed"
        secs = max(3, int(self.params.sat_duration_s))
        spy = subprocess.Popen(
            [
                pyspy,
                "record",
                "-p",
                str(self.proxies[target].pid),
                "-d",
                str(secs),
                "-r",
                "250",
                "-f",
                "raw",
                "-o",
                str(raw),
                # --workers N: the parent only waits; its workers serve.
                *(["--subprocesses"] if WORKERS.get(feature_set(target) or "", 1) > 1 else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            if use_wrk:
                run_wrk(url, lua, secs + 1, self.params.sat_connections, self.params.wrk_threads)
            else:
                self._closed(url, secs + 1, 0.5)
            spy.wait(timeout=secs + 30)
        finally:
            if spy.poll() is None:
                os.kill(spy.pid, signal.SIGINT)
                spy.wait(timeout=10)
        if raw.exists():
            self.results.setdefault("profile", {})[target] = summarize_profile(raw)
            self.say(f"  profile of {target}: {raw}")

    # ------------------------------------------------------------- fixed load
    def fixed(self) -> None:
        p = self.params
        self.say(
            f"\n== fixed load: {p.fixed_rate:.0f} req/s open loop, 4 KB bodies, {p.fixed_duration_s:.0f} s x {p.rounds} round(s)"
        )
        self.results["fixed"] = self._open_loop(p.fixed_rate, p.fixed_warmup_s, p.fixed_duration_s)

    def ladder(self) -> None:
        """The open loop at each rate of ``ladder_rates`` (targets interleaved per rate)."""
        p = self.params
        self.say(
            f"\n== QPS ladder: {', '.join(f'{r:.0f}' for r in p.ladder_rates)} req/s open loop, "
            f"4 KB bodies, {p.ladder_duration_s:.1f} s x {p.rounds} round(s) per rate"
        )
        ladder: dict[str, Any] = {}
        for rate in p.ladder_rates:
            self.say(f"  -- {rate:.0f} req/s")
            ladder[f"{rate:.0f}"] = self._open_loop(rate, p.ladder_warmup_s, p.ladder_duration_s)
        self.results["ladder"] = ladder

    def _open_loop(self, rate: float, warmup_s: float, duration_s: float) -> dict[str, Any]:
        """Each target at ``rate`` req/s open loop for ``rounds`` rounds: pooled summary."""
        p = self.params
        pooled: dict[str, dict[str, Any]] = {
            t: {
                "latencies_s": [],
                "sent": 0,
                "ok": 0,
                "errors": Tally(),
                "hist": [],
                "lag": 0.0,
                "cpu": [],
                "rounds": [],
            }
            for t in self.targets()
        }
        for _ in range(p.rounds):
            for target in self.targets():
                spec = {
                    "kind": "fixed",
                    "url": self.url(target),
                    "rate": rate,
                    "warmup_s": warmup_s,
                    "duration_s": duration_s,
                    "body_bytes": SMALL_BODY_BYTES,
                }
                # Warm-up requests are observed by the proxy too: scrape once they are done.
                server = "upstream" if target == "direct" else target
                state: dict[str, Any] = {
                    "at": time.monotonic() + warmup_s + 0.3,
                    "done": False,
                    "before": {},
                    "cpu0": None,
                    "t0": 0.0,
                }

                def sample(
                    target: str = target, server: str = server, state: dict[str, Any] = state
                ) -> None:
                    if not state["done"] and time.monotonic() >= state["at"]:
                        state["before"] = self.scrape(target)
                        state["cpu0"] = self.cpu().get(server)
                        state["t0"] = time.monotonic()
                        state["done"] = True

                res = run_client_proc(spec, warmup_s + duration_s + 60, sample=sample)
                cpu1, t1 = self.cpu().get(server), time.monotonic()
                after = self.scrape(target)
                acc = pooled[target]
                acc["latencies_s"].extend(res["latencies_s"])
                acc["sent"] += res["sent"]
                acc["ok"] += res["ok"]
                acc["errors"].update(res["errors"])
                acc["lag"] = max(acc["lag"], res["schedule_lag_max_ms"])
                if after and state["done"]:
                    acc["hist"].append((state["before"], after))
                if state["cpu0"] is not None and cpu1 is not None and t1 > state["t0"]:
                    acc["cpu"].append((cpu1 - state["cpu0"]) / (t1 - state["t0"]))
                lat = summarize_ms(res["latencies_s"])
                acc["rounds"].append(lat)
                self.say(
                    f"  {target:10s} p50 {lat['p50_ms'] or 0:.3f} ms  p99 {lat['p99_ms'] or 0:.3f} ms  "
                    f"ok {res['ok']}/{res['sent']}  errors={res['errors'] or 0}"
                )
        summary: dict[str, Any] = {}
        per_round = {t: acc["rounds"] for t, acc in pooled.items()}
        for target, acc in pooled.items():
            entry: dict[str, Any] = {
                "latency": summarize_ms(acc["latencies_s"]),
                "rounds": acc["rounds"],
                "delta_p50_ms": paired_delta(per_round, target, "p50_ms"),
                "delta_p99_ms": paired_delta(per_round, target, "p99_ms"),
                "sent": acc["sent"],
                "ok": acc["ok"],
                "errors": dict(acc["errors"]),
                "achieved_rps": acc["ok"] / (duration_s * p.rounds),
                "schedule_lag_max_ms": acc["lag"],
                "cpu_share": sorted(acc["cpu"])[len(acc["cpu"]) // 2] if acc["cpu"] else None,
            }
            if acc["hist"]:
                before_sum: dict[float, float] = {}
                after_sum: dict[float, float] = {}
                for b, a in acc["hist"]:
                    for k, v in b.items():
                        before_sum[k] = before_sum.get(k, 0.0) + v
                    for k, v in a.items():
                        after_sum[k] = after_sum.get(k, 0.0) + v
                entry["proxy_added"] = {
                    "count": after_sum.get(float("inf"), 0.0) - before_sum.get(float("inf"), 0.0),
                    "p50_ms": _ms(histogram_quantile(before_sum, after_sum, 0.50)),
                    "p99_ms": _ms(histogram_quantile(before_sum, after_sum, 0.99)),
                }
            summary[target] = entry
        return summary

    # ----------------------------------------------------------------- streams
    def streams(self) -> None:
        p = self.params
        self.say(
            f"\n== streams: {p.stream_count} concurrent x {p.stream_chunks} chunks, {p.stream_gap_ms:.0f} ms gap, "
            f"{p.rounds} round(s)"
        )
        pooled: dict[str, dict[str, Any]] = {
            t: {
                "ttft_s": [],
                "gaps_s": [],
                "ok": 0,
                "streams": 0,
                "coalesced": 0,
                "failures": Tally(),
                "reads": 0,
                "ttft_rounds": [],
                "gap_rounds": [],
            }
            for t in self.targets()
        }
        for _ in range(p.rounds):
            for target in self.targets():
                spec = {
                    "kind": "streams",
                    "url": self.url(target),
                    "streams": p.stream_count,
                    "chunks": p.stream_chunks,
                    "gap_ms": p.stream_gap_ms,
                    "ramp_s": 0.2,
                }
                res = run_client_proc(spec, p.stream_chunks * p.stream_gap_ms / 1000 + 60)
                acc = pooled[target]
                for key in ("ttft_s", "gaps_s"):
                    acc[key].extend(res[key])
                for key in ("ok", "streams", "coalesced", "reads"):
                    acc[key] += res[key]
                acc["failures"].update(res["failures"])
                acc["ttft_rounds"].append(summarize_ms(res["ttft_s"]))
                acc["gap_rounds"].append(summarize_ms(res["gaps_s"]))
                self.say(
                    f"  {target:10s} ok {res['ok']}/{res['streams']}  coalesced {res['coalesced']}  "
                    f"failures={res['failures'] or 0}"
                )
        ttft_rounds = {t: acc["ttft_rounds"] for t, acc in pooled.items()}
        gap_rounds = {t: acc["gap_rounds"] for t, acc in pooled.items()}
        self.results["streams"] = {
            target: {
                "ok": acc["ok"],
                "streams": acc["streams"],
                "failures": dict(acc["failures"]),
                "coalesced": acc["coalesced"],
                "gaps": len(acc["gaps_s"]),
                "reads": acc["reads"],
                "ttft": summarize_ms(acc["ttft_s"]),
                "gap": summarize_ms(acc["gaps_s"]),
                "delta_ttft_p50_ms": paired_delta(ttft_rounds, target, "p50_ms"),
                "delta_ttft_p99_ms": paired_delta(ttft_rounds, target, "p99_ms"),
                "delta_gap_p50_ms": paired_delta(gap_rounds, target, "p50_ms"),
                "delta_gap_p99_ms": paired_delta(gap_rounds, target, "p99_ms"),
            }
            for target, acc in pooled.items()
        }

    # ---------------------------------------------------------------- big body
    def bigbody(self) -> None:
        p = self.params
        self.say(
            f"\n== body sizes: {', '.join(BODY_SIZES)} input_ids, one at a time, "
            f"{p.big_requests} requests x {p.rounds} round(s) each"
        )
        bodies: dict[str, Any] = {}
        for label, size in BODY_SIZES.items():
            self.say(f"  -- {label}")
            bodies[label] = self._sequential(size)
        self.results["bodies"] = bodies
        self.results["bigbody"] = bodies["200KB"]  # the measurement's earlier name

    def _sequential(self, size: int) -> dict[str, Any]:
        p = self.params
        pooled: dict[str, list[float]] = {t: [] for t in self.targets()}
        errors: dict[str, Tally[str]] = {t: Tally() for t in self.targets()}
        per_round: dict[str, list[dict[str, Any]]] = {t: [] for t in self.targets()}
        faults: dict[str, list[float]] = {t: [] for t in self.targets()}
        body_bytes = 0
        for _ in range(p.rounds):
            for target in self.targets():
                server = self.upstream if target == "direct" else self.proxies[target]
                assert server is not None
                before = minor_faults(server.pid)
                spec = {
                    "kind": "sequential",
                    "url": self.url(target),
                    "body_bytes": size,
                    "requests": p.big_requests,
                    "warmup": p.big_warmup,
                }
                res = run_client_proc(spec, 300)
                after = minor_faults(server.pid)
                if before is not None and after is not None:  # warm-up included
                    faults[target].append((after - before) / (p.big_requests + p.big_warmup))
                pooled[target].extend(res["latencies_s"])
                errors[target].update(res["errors"])
                body_bytes = res["body_bytes"]
                lat = summarize_ms(res["latencies_s"])
                per_round[target].append(lat)
                self.say(
                    f"  {target:10s} p50 {lat['p50_ms'] or 0:.3f} ms  p99 {lat['p99_ms'] or 0:.3f} ms"
                )
        big = make_body(size)
        return {
            "body_bytes": body_bytes,
            "input_ids": big.count(b",", 0, big.index(b"]")) + 1,
            "targets": {
                t: {
                    "latency": summarize_ms(v),
                    "errors": dict(errors[t]),
                    "rounds": per_round[t],
                    "delta_p50_ms": paired_delta(per_round, t, "p50_ms"),
                    "delta_p99_ms": paired_delta(per_round, t, "p99_ms"),
                    "over_off_p50_ms": paired_delta(
                        per_round, t, "p50_ms", base=in_build_of("off", t)
                    ),
                    # The server's (the upstream's for direct), per request, per round.
                    "minor_faults_per_request": faults[t],
                }
                for t, v in pooled.items()
            },
        }

    # ------------------------------------------------------------ open streams
    def open_streams(self) -> None:
        p = self.params
        assert self.upstream is not None
        self.say(
            f"\n== open streams: {p.open_streams} concurrent x {p.open_chunks} chunks, "
            f"{p.open_gap_ms:.0f} ms gap, a fresh proxy for each configuration"
        )
        # The other proxies are stopped so that only the measured one runs.
        for proc in self.proxies.values():
            proc.stop()
        self.proxies.clear()
        out: dict[str, Any] = {}
        for name in self.args.targets:
            if name == "direct":
                # Baseline: the same client against the upstream (its RSS is the server's).
                out[name] = self._open_streams_on(self.upstream)
            else:
                try:
                    proxy = start_proxy(
                        name,
                        self.upstream.url,
                        self.workdir,
                        self.args.launcher,
                        python=self.python(name),
                    )
                except Exception as exc:
                    self.notes.append(f"open-streams/{name}: proxy did not start: {exc}")
                    continue
                try:
                    time.sleep(0.5)
                    out[name] = self._open_streams_on(proxy)
                finally:
                    proxy.stop()
            r = out[name]
            self.say(
                f"  {name:10s} ok {r['ok']}/{r['streams']}  open at once {r['open_peak']}  "
                f"RSS idle {r['rss_idle_mb'] or 0:.1f} MB peak {r['rss_peak_mb']:.1f} MB  "
                f"coalesced {r['coalesced']}  listen overflows {r['listen_overflows']}"
            )
        self.results["open_streams"] = {
            "streams": p.open_streams,
            "chunks": p.open_chunks,
            "gap_ms": p.open_gap_ms,
            "ramp_s": p.open_ramp_s,
            "targets": out,
        }

    def _open_streams_on(self, server: Proc) -> dict[str, Any]:
        p = self.params
        idle = rss_mb(server.pid)
        drops0 = tcp_listen_drops()
        peak = {"rss": idle or 0.0}

        def sample() -> None:
            value = rss_mb(server.pid)
            if value is not None and value > peak["rss"]:
                peak["rss"] = value

        spec = {
            "kind": "streams",
            "url": server.url,
            "streams": p.open_streams,
            "chunks": p.open_chunks,
            "gap_ms": p.open_gap_ms,
            "ramp_s": p.open_ramp_s,
            "timeout_s": 120.0,
        }
        res = run_client_proc(spec, p.open_chunks * p.open_gap_ms / 1000 + 120, sample=sample)
        drops1 = tcp_listen_drops()
        return {
            "streams": res["streams"],
            "ok": res["ok"],
            "failures": res["failures"],
            "open_peak": res["open_peak"],
            "coalesced": res["coalesced"],
            "rss_idle_mb": idle,
            "rss_peak_mb": peak["rss"],
            "rss_after_mb": rss_mb(server.pid),
            "listen_overflows": drops1.get("ListenOverflows", 0) - drops0.get("ListenOverflows", 0),
            "ttft": summarize_ms(res["ttft_s"]),
            "gap": summarize_ms(res["gaps_s"]),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def summarize_profile(path: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    total = 0
    self_counts: Tally[str] = Tally()
    incl_counts: Tally[str] = Tally()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    if not total:
        return {"samples": 0}

    def shares(c: Tally[str]) -> list[tuple[str, float]]:
        return [(name, n / total) for name, n in c.most_common(top)]

    kvproxy_incl = [(n, v) for n, v in incl_counts.most_common() if "kvproxy/" in n][:top]
    return {
        "samples": total,
        "self": shares(self_counts),
        "inclusive_kvproxy": [(name, n / total) for name, n in kvproxy_incl],
    }


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds so far of ``pid`` and its descendants (None when ``pid`` is gone)."""
    own = cpu_seconds(pid)
    if own is None:
        return None
    return own + sum(cpu_seconds(c) or 0.0 for c in process_tree(pid)[1:])


def cores_used(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Where the host's CPU went between two :meth:`Bench.cpu_snapshot`: cores (CPU seconds
    per wall second) of the load generator, the upstream, redis-server, the proxy (in all,
    and each of its workers: the processes that used any), interrupts (``irq``: loopback
    TCP's receive path, charged to no process), everything else on the host (``other``:
    the benchmark's own parent and other jobs) and the host in all. Pure."""

    def delta(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return None if a is None or b is None or wall_s <= 0 else max(0.0, (a - b) / wall_s)

    out: dict[str, Any] = {k: delta(k) for k in ("generator", "upstream", "redis", "irq", "host")}
    workers = []
    for pid, a in sorted(after.get("proxy", {}).items()):
        b = before.get("proxy", {}).get(pid)
        if a is not None and b is not None and wall_s > 0:
            workers.append(max(0.0, (a - b) / wall_s))
    # The parent of --workers N only waits for them: the workers are who used a core.
    busy = [w for w in workers if w >= 0.01] or workers
    out["proxy_workers"] = busy
    out["proxy"] = sum(workers) if workers else None
    parts = ("generator", "upstream", "redis", "proxy", "irq")
    known = sum(v for k, v in out.items() if k in parts and v)
    out["other"] = None if out["host"] is None else max(0.0, out["host"] - known)
    return out


def median_cores(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key of :func:`cores_used`, the median over ``runs`` (the workers' list from the
    round of the median proxy total). Pure."""
    rounds = [r["cores"] for r in runs if r.get("cores")]
    if not rounds:
        return {}
    out: dict[str, Any] = {}
    for key in ("generator", "upstream", "redis", "proxy", "irq", "other", "host"):
        values = sorted(v for r in rounds if (v := r.get(key)) is not None)
        out[key] = statistics.median(values) if values else None
    if out["proxy"] is not None:
        mid = min(rounds, key=lambda r: abs((r.get("proxy") or 0.0) - out["proxy"]))
        out["proxy_workers"] = mid.get("proxy_workers", [])
    rps_per_core = sorted(
        r["rps"] / r["cores"]["proxy"] for r in runs if r.get("cores") and r["cores"].get("proxy")
    )
    out["rps_per_proxy_core"] = statistics.median(rps_per_core) if rps_per_core else None
    return out
