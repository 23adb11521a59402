#!/usr/bin/env python3
"""Proxy overhead benchmark: one fast upstream, reached directly and through kvproxy.

Every measurement runs in one invocation, on the same machine, against the same
upstream process, for these targets:

  direct      the load generator talks to the upstream itself (no proxy process)
  raw         through a forwarder on asyncio Protocols (uvloop) with no HTTP framework:
              it frames requests and responses and nothing more; what a Python hop
              costs without aiohttp's server and client, for reference; not kvproxy
  floor       through a minimal aiohttp forwarder (read body, pooled upstream call, relay):
              the cost of one extra aiohttp hop, for reference; not kvproxy
  naive       the floor, but a JSON body is parsed, given the X-Session-ID header as its
              session_id and re-encoded (request.json(), json=): the naive splicing proxy
  off         through kvproxy, both features off (a transparent streaming proxy)
  lifecycle   through kvproxy, session_lifecycle on (session_id and rid spliced in)
  admission   through kvproxy, admission on (poll_interval_s 0.5; the upstream's
              /metrics always has room, so every request is admitted)
  both        through kvproxy, both features on (as users run them)
  admission-ring, both-ring
              the same with router.policy consistent_hashing (program admission
              decides per engine, as the README recommends)
  lifecycle-redis, both-redis
              state.backend redis (a redis-server the script starts, password-protected)
  off-w2, both-redis-w2, admission-ring-redis[-w2], both-ring-redis[-w2]
              served by ``kvproxy serve --workers 2`` (SO_REUSEPORT), judged against the
              same feature set with one worker (>= 1.7x, issue #60). Program admission's
              ledger is shared between workers only where it mirrors the ring (the
              *-ring-redis targets); under the default policy each worker accounts alone
  off:compiled, lifecycle:compiled, ...
              any kvproxy target served by the compiled build (--compiled-python, an
              interpreter whose kvproxy is KVPROXY_COMPILE=1's build), in the same
              run: its rounds interleave with the Python build's

Measurements (each reported per target, with the difference to direct):

  saturation    req/s with 4 KB ``input_ids`` bodies on POST /generate (wrk when
                installed: ``apt-get install wrk``; else a Python closed-loop generator,
                itself 0.5-1 core; the table says which), 256 session ids in turn
                (X-Session-ID); and where the host's cores went: CPU seconds per
                second of the load generator, the upstream, redis-server, each kvproxy
                worker, interrupts and the rest of the host, and req/s per kvproxy core
  fixed load    latency p50/p99 at 1,000 req/s open loop, timed from each request's
                scheduled send time (queueing counts), plus the proxy's own
                ``kvproxy_added_latency_seconds`` quantiles over the same window
  ladder        the same open loop at 100 / 500 / 1,000 / 2,000 req/s (``--ladder``):
                p50/p99 per rate and target, and what each target adds over direct
  streams       TTFT and inter-chunk gap p50/p99 of concurrent SSE streams; a gap under
                half the upstream's gap counts as a coalesced chunk
  big body      latency of 4 KB, 200 KB and 1 MB ``input_ids`` bodies, one request at a
                time, with the difference to direct and to kvproxy with features off
  open streams  2,000 concurrent slow streams through a freshly started proxy: every
                stream complete with the right chunk count, the proxy's peak RSS

The script starts every process itself (upstream, proxies, load generators) on
127.0.0.1 and stops them by PID in ``finally``. Usage:

    python scripts/bench_proxy.py                 # full run (docs/benchmarks.md)
    python scripts/bench_proxy.py --quick         # sanity run, about 1.5 minutes
    python scripts/bench_proxy.py --targets direct,off --skip open-streams
    python scripts/bench_proxy.py --quick --skip saturation,fixed,streams,open-streams
                                                  # QPS ladder and body sizes only
    python scripts/bench_proxy.py --profile results/profile   # also py-spy each proxy
    python scripts/bench_proxy.py --quick --upstream-server nginx --autogroup-nice -19 \
        --targets off,off-w2,admission-ring-redis,admission-ring-redis-w2 \
        --skip fixed,ladder,streams,bigbody,open-streams --rounds 5
                                                  # 1 vs 2 workers (docs/benchmarks.md)

The upstream is Python (aiohttp) by default; ``--upstream-server nginx`` serves the same
answers from nginx at a fraction of the CPU (no streams), so that a saturated proxy does
not share its cores with it. ``--autogroup-nice -19``: where the kernel groups processes
by session for the scheduler (sched_autogroup_enabled), a ``nice -n 19`` job in another
session still takes a full share of the cores; this gives the run's sessions the weight
over it that nice 0 has over nice 19 (root).
    python scripts/bench_proxy.py --compiled-python /tmp/compiled/bin/python \
        --targets direct,naive,off,lifecycle,off:compiled,lifecycle:compiled
                                                  # both builds side by side

Internal modes (started by the script itself):

    python scripts/bench_proxy.py --serve-upstream --port P
    python scripts/bench_proxy.py --client '<json spec>'
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchproxy.cli import main

if __name__ == "__main__":
    sys.exit(main())
