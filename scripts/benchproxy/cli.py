"""Command line: ``python scripts/bench_proxy.py`` (see that script's docstring)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchproxy.common import (
    COMPILED_SUFFIX,
    HOST,
    MEASUREMENTS,
    TARGETS,
    is_compiled,
    known_target,
)
from benchproxy.load import run_client
from benchproxy.rawhop import serve_raw
from benchproxy.report import format_report, machine_info, target_checks
from benchproxy.runner import Bench, Params
from benchproxy.targets import (
    UPSTREAM_SERVERS,
    autogroups_enabled,
    raise_nofile,
    serve_reference,
    serve_upstream,
    set_autogroup_nice,
    start_nginx_upstream,
    start_proxy,
    start_redis_for,
    start_upstream,
)

# Measurements that need the Python upstream (nginx's fixed answers do not stream).
STREAMING_MEASUREMENTS = frozenset({"streams", "open-streams"})


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="kvproxy overhead benchmark: direct vs through kvproxy against one fast upstream.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="short sanity run (smaller and shorter everything)"
    )
    parser.add_argument(
        "--out", default="results/bench_proxy.json", help="JSON results (default %(default)s)"
    )
    parser.add_argument(
        "--md", default=None, help="also write the markdown tables here (default: --out with .md)"
    )
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help="comma list of %(default)s; a kvproxy target with the suffix "
        f"{COMPILED_SUFFIX} (off{COMPILED_SUFFIX}, lifecycle{COMPILED_SUFFIX}, ...) runs the "
        "compiled build of --compiled-python in the same run",
    )
    parser.add_argument(
        "--compiled-python",
        default=None,
        metavar="PYTHON",
        help=f"the interpreter that serves the {COMPILED_SUFFIX} targets: one whose installed "
        "kvproxy is the compiled build (KVPROXY_COMPILE=1 pip install . in a virtualenv)",
    )
    parser.add_argument(
        "--skip", default="", help=f"comma list of measurements to skip: {', '.join(MEASUREMENTS)}"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds per measurement (default 3; --quick 1)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="fixed offered load in req/s (default 1000)"
    )
    parser.add_argument(
        "--ladder",
        default=None,
        metavar="RATES",
        help="comma list of open-loop rates for the QPS ladder (default 100,500,1000,2000)",
    )
    parser.add_argument(
        "--connections", type=int, default=None, help="saturation connections (default 64)"
    )
    parser.add_argument(
        "--no-wrk",
        action="store_true",
        help="use the Python closed-loop generator even if wrk is installed",
    )
    parser.add_argument(
        "--upstream-server",
        choices=UPSTREAM_SERVERS,
        default="python",
        help="what serves the fast upstream: python (aiohttp, the default; every "
        "measurement) or nginx (the same answers from `return`, at a fraction of the CPU, "
        "so that the upstream takes little of the cores the proxies saturate; no streams: "
        "skip streams,open-streams)",
    )
    parser.add_argument(
        "--autogroup-nice",
        type=int,
        default=None,
        metavar="N",
        help="set the scheduler autogroup niceness of this run's sessions (this one's, the "
        "upstream's, redis-server's, the proxies'; needs root below 0). Where the kernel "
        "groups by session (sched_autogroup_enabled), a `nice -n 19` job in another "
        "session still takes a full share of the cores: -19 gives this run the weight "
        "over it that nice 0 has over nice 19. Default: left as they are",
    )
    parser.add_argument(
        "--launcher",
        choices=("auto", "stack", "direct"),
        default="auto",
        help="start proxies with kvlab.stack when importable (auto), always (stack), or with "
        "`python -m kvproxy serve` (direct)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also record a py-spy profile of each proxy under saturation",
    )
    parser.add_argument(
        "--workdir", default=None, help="configs and logs (default: a fresh temporary directory)"
    )
    # Internal modes.
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default=HOST, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-naive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if not known_target(t)]
    if unknown:
        parser.error(
            f"unknown targets {unknown} (choose from {', '.join(TARGETS)}, or a kvproxy "
            f"target with {COMPILED_SUFFIX})"
        )
    if any(is_compiled(t) for t in args.targets):
        if args.compiled_python is None:
            parser.error(f"the {COMPILED_SUFFIX} targets need --compiled-python")
        problem = compiled_build_problem(args.compiled_python)
        if problem is not None:
            parser.error(f"--compiled-python {args.compiled_python}: {problem}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if bad := args.skip - set(MEASUREMENTS):
        parser.error(f"unknown measurements in --skip: {sorted(bad)}")
    if args.upstream_server == "nginx" and (streaming := STREAMING_MEASUREMENTS - args.skip):
        parser.error(
            f"--upstream-server nginx does not stream: add {','.join(sorted(streaming))} to --skip"
        )
    return args


def compiled_build_problem(python: str) -> str | None:
    """Why ``python`` cannot serve the compiled targets (None: its kvproxy is the
    compiled build). Asked the way the proxies start it: ``-P``, outside the checkout's
    source."""
    probe = (
        "from kvproxy.compiled import build_name, compiled_modules; "
        "print(build_name(compiled_modules()))"
    )
    try:
        done = subprocess.run(
            [python, "-P", "-c", probe], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as exc:
        return f"cannot run it ({exc})"
    if done.returncode != 0:
        return f"cannot import kvproxy ({done.stderr.strip().splitlines()[-1:]})"
    build = done.stdout.strip()
    return None if build == "compiled" else f"its kvproxy build is {build!r}, not 'compiled'"


def set_autogroups(bench: Bench, nice: int) -> str:
    """``nice`` for the autogroup of this process (its load generators and the processes
    started in its session) and of each process it started in a session of its own."""
    if not autogroups_enabled():
        return "the kernel does not group by session: nothing to set"
    pids = [os.getpid()]
    pids += [p.pid for p in (bench.upstream, *bench.proxies.values()) if p is not None]
    if bench.redis is not None:
        pids.append(bench.redis.pid)
    done = [pid for pid in pids if set_autogroup_nice(pid, nice)]
    return f"set for {len(done)} of {len(pids)} processes' sessions"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_upstream:
        return serve_upstream(args.host, args.port)
    if args.client is not None:
        return run_client(args.client)
    if args.serve_raw:
        return serve_raw(args.host, args.port, args.upstream)
    if args.serve_floor or args.serve_naive:
        kind = "naive" if args.serve_naive else "floor"
        return serve_reference(args.host, args.port, args.upstream, kind)

    params = Params.quick() if args.quick else Params()
    if args.rounds is not None:
        params.rounds = max(1, args.rounds)
    if args.rate is not None:
        params.fixed_rate = args.rate
    if args.connections is not None:
        params.sat_connections = args.connections
    if args.ladder:
        try:
            params.ladder_rates = tuple(float(r) for r in args.ladder.split(",") if r.strip())
        except ValueError:
            print(f"bench_proxy: --ladder: not a list of numbers: {args.ladder!r}", file=sys.stderr)
            return 2
    nofile = raise_nofile()
    if nofile < params.open_streams * 2 + 256 and "open-streams" not in args.skip:
        print(
            f"warning: open-file limit is {nofile}; {params.open_streams} open streams may fail",
            file=sys.stderr,
        )
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_proxy_"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_proxy.py" + (
        " " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else ""
    )
    bench = Bench(args=args, params=params, workdir=workdir)
    started = time.time()
    bench.say(f"bench_proxy: workdir {workdir}")
    redis = None
    with _sigterm_as_interrupt():
        try:
            redis = start_redis_for(args.targets, workdir)
            if args.upstream_server == "nginx":
                bench.upstream = start_nginx_upstream(workdir)
            else:
                bench.upstream = start_upstream(workdir)
            bench.redis = redis
            bench.say(
                f"upstream ({args.upstream_server}) {bench.upstream.url} (pid {bench.upstream.pid})"
            )
            for name in (t for t in args.targets if t != "direct"):
                try:
                    proxy = start_proxy(
                        name, bench.upstream.url, workdir, args.launcher, python=bench.python(name)
                    )
                except Exception as exc:
                    bench.notes.append(f"proxy {name} did not start: {exc}")
                    bench.say(f"proxy {name} did not start: {exc}")
                    continue
                bench.proxies[name] = proxy
                bench.say(f"proxy {name} {proxy.url} (pid {proxy.pid})")
            if args.autogroup_nice is not None:
                bench.autogroups = set_autogroups(bench, args.autogroup_nice)
                bench.say(f"autogroup niceness {args.autogroup_nice}: {bench.autogroups}")
            steps: list[tuple[str, Callable[[], None]]] = [
                ("saturation", bench.saturation),
                ("fixed", bench.fixed),
                ("ladder", bench.ladder),
                ("streams", bench.streams),
                ("bigbody", bench.bigbody),
                ("open-streams", bench.open_streams),
            ]
            for key, step in steps:
                if key in args.skip:
                    continue
                load0 = os.getloadavg()
                try:
                    step()
                except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
                    bench.notes.append(f"{key}: {exc}")
                    bench.say(f"  {key} failed: {exc}")
                bench.loadavg[key] = {"before": load0, "after": os.getloadavg()}
        except KeyboardInterrupt:
            bench.notes.append("interrupted")
            bench.say("interrupted; stopping processes")
        finally:
            for proc in bench.proxies.values():
                proc.stop()
            if bench.upstream is not None:
                bench.upstream.stop()
            if redis is not None:
                redis.stop()

    report = format_report(bench.results, params)
    doc = {
        "command": command,
        "machine": machine_info(),
        "upstream_server": args.upstream_server,
        "autogroups": {"enabled": autogroups_enabled(), "nice": args.autogroup_nice},
        "params": params.__dict__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "results": bench.results,
        "loadavg": bench.loadavg,
        "checks": [
            {"target": c[0], "requirement": c[1], "measured": c[2], "met": c[3]}
            for c in target_checks(bench.results, params)
        ],
        "notes": bench.notes,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = Path(args.md) if args.md else out.with_suffix(".md")
    loads = ", ".join(
        f"{k} {v['before'][0]:.2f} -> {v['after'][0]:.2f}" for k, v in bench.loadavg.items()
    )
    md.write_text(
        f"Command: `{command}`\n\nLoad average (1 min) around each measurement: {loads}\n\n{report}"
    )
    bench.say("\n" + report)
    for note in bench.notes:
        bench.say(f"note: {note}")
    bench.say(f"results: {out}  tables: {md}  logs: {workdir}")
    return 0 if not bench.notes else 1
