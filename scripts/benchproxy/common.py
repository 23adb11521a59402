"""Constants, request bodies and the statistics every measurement shares."""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# The entry point: the benchmark starts its own helper processes through it.
SCRIPT = REPO / "scripts" / "bench_proxy.py"
HOST = "127.0.0.1"

TARGETS = (
    "direct",
    "raw",
    "floor",
    "naive",
    "off",
    "lifecycle",
    "admission",
    "both",
    "admission-ring",
    "both-ring",
    "lifecycle-redis",
    "both-redis",
    "both-redis-w2",
    "off-w2",
    "admission-ring-redis",
    "admission-ring-redis-w2",
    "both-ring-redis",
    "both-ring-redis-w2",
)
# Reference forwarders, not kvproxy: the raw hop (scripts/benchproxy/rawhop.py) and the
# aiohttp ones (scripts/benchproxy/targets.py: floor_app, naive_app).
REFERENCES = ("raw", "floor", "naive")
PROXY_FEATURES: dict[str, tuple[bool, bool]] = {  # name -> (lifecycle, admission)
    "off": (False, False),
    "lifecycle": (True, False),
    "admission": (False, True),
    "both": (True, True),
    "admission-ring": (False, True),
    "both-ring": (True, True),
    "lifecycle-redis": (True, False),
    "both-redis": (True, True),
    "both-redis-w2": (True, True),
    "off-w2": (False, False),
    "admission-ring-redis": (False, True),
    "admission-ring-redis-w2": (False, True),
    "both-ring-redis": (True, True),
    "both-ring-redis-w2": (True, True),
}
# Feature sets whose session state is on a redis-server the benchmark starts
# (state.backend: redis), and those served by several worker processes (--workers).
# Program admission's ledger is shared between workers only where it mirrors the ring
# (the *-ring-redis targets): under the default policy each worker accounts fleet-wide
# alone (kvproxy serve warns), as in both-redis-w2, whose shared state is the lifecycle's.
REDIS_TARGETS = frozenset(
    {
        "lifecycle-redis",
        "both-redis",
        "both-redis-w2",
        "admission-ring-redis",
        "admission-ring-redis-w2",
        "both-ring-redis",
        "both-ring-redis-w2",
    }
)
WORKERS: dict[str, int] = {
    "both-redis-w2": 2,
    "off-w2": 2,
    "admission-ring-redis-w2": 2,
    "both-ring-redis-w2": 2,
}
# Feature sets run with router.policy consistent_hashing: program admission mirrors the
# ring and decides per engine (the deployment the README recommends). The others keep
# the default policy, where placement is unknown and admission accounts fleet-wide.
RING_TARGETS = frozenset(
    {
        "admission-ring",
        "both-ring",
        "admission-ring-redis",
        "admission-ring-redis-w2",
        "both-ring-redis",
        "both-ring-redis-w2",
    }
)
MEASUREMENTS = ("saturation", "fixed", "ladder", "streams", "bigbody", "open-streams")

# A kvproxy target can also run the compiled build, beside the Python one in the same run
# (its rounds interleaved with theirs): ``lifecycle:compiled`` is the lifecycle feature
# set served by the interpreter given as ``--compiled-python`` (a virtualenv holding the
# ``KVPROXY_COMPILE=1`` build).
COMPILED_SUFFIX = ":compiled"


def feature_set(target: str) -> str | None:
    """The kvproxy feature set (a :data:`PROXY_FEATURES` key) ``target`` runs, in either
    build; None for ``direct`` and the reference forwarders."""
    base = target.removesuffix(COMPILED_SUFFIX)
    return base if base in PROXY_FEATURES else None


def features_of(target: str) -> str:
    """:func:`feature_set` of a target that must be kvproxy (ValueError otherwise)."""
    features = feature_set(target)
    if features is None:
        raise ValueError(f"{target!r} is not a kvproxy target")
    return features


def one_worker_of(target: str) -> str | None:
    """The target that serves ``target``'s feature set with one worker process
    (``both-redis`` for ``both-redis-w2``; ``off:compiled`` for ``off-w2:compiled``);
    None when ``target`` has one already."""
    features = feature_set(target)
    if features is None or WORKERS.get(features, 1) == 1:
        return None
    single = features.rsplit("-w", 1)[0]
    return in_build_of(single, target) if single in PROXY_FEATURES else None


def is_compiled(target: str) -> bool:
    return target.endswith(COMPILED_SUFFIX) and feature_set(target) is not None


def known_target(target: str) -> bool:
    return target in TARGETS or is_compiled(target)


def in_build_of(feature: str, target: str) -> str:
    """Feature set ``feature`` in ``target``'s build: ``off`` for ``lifecycle``,
    ``off:compiled`` for ``lifecycle:compiled``."""
    return feature + COMPILED_SUFFIX if is_compiled(target) else feature


# Requests cycle through this many session ids (sent as X-Session-ID to every target).
SESSIONS = 256
SMALL_BODY_BYTES = 4 * 1024
BIG_BODY_BYTES = 200 * 1024
# The body sizes of the big-body measurement (200 KB is the one the targets name first).
BODY_SIZES: dict[str, int] = {"4KB": SMALL_BODY_BYTES, "200KB": BIG_BODY_BYTES, "1MB": 1024 * 1024}
LADDER_RATES: tuple[float, ...] = (100.0, 500.0, 1000.0, 2000.0)

# Targets from the issue, checked at the end of a run.
# Saturation: a feature on against features off (same build) and the naive splicing
# proxy, each the median over rounds of the round's req/s ratio.
TARGET_OVER_OFF_RATIO = 0.85
TARGET_OVER_NAIVE_RATIO = 1.0
# One 4 KB request at a time, added p50 over direct: features off, and a feature on.
TARGET_C1_ADDED_P50_MS = {"off": 0.3, "feature": 0.4}
TARGET_ADDED_P50_MS = 0.3
TARGET_ADDED_P99_MS = 2.0
TARGET_SATURATION_RPS = 5000.0
# Saturation req/s of N workers over one worker's (same feature set and build), median of
# the round ratios, per extra worker: 2 workers at least 1.7x (issue #60).
TARGET_WORKERS_SCALING = {2: 1.7}
TARGET_OPEN_STREAMS_RSS_MB = 300.0
TARGET_BIG_BODY_ADDED_MS = 2.0
# A feature on over features off, same body, one request at a time (p50).
TARGET_BODY_OVER_OFF_MS = {"200KB": 0.5, "1MB": 2.0}


# --------------------------------------------------------------------------- bodies
def make_body(target_bytes: int, *, stream: bool = False, seed: int = 0) -> bytes:
    """An SGLang ``/generate`` body with ``input_ids``, at most ``target_bytes`` long."""
    rng = random.Random(seed)
    head = b'{"input_ids":['
    tail = (
        b'],"sampling_params":{"max_new_tokens":16,"temperature":0.0},"stream":'
        + (b"true" if stream else b"false")
        + b"}"
    )
    budget = target_bytes - len(head) - len(tail)
    parts: list[bytes] = []
    used = -1  # no comma before the first id
    while True:
        tok = str(rng.randrange(100, 32000)).encode()
        if used + len(tok) + 1 > budget:
            break
        parts.append(tok)
        used += len(tok) + 1
    return head + b",".join(parts) + tail


def session_headers(prefix: str = "bench") -> list[dict[str, str]]:
    return [
        {"Content-Type": "application/json", "X-Session-ID": f"{prefix}-{i}"}
        for i in range(SESSIONS)
    ]


# ------------------------------------------------------------------------ statistics
def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile of ``values`` (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/max in milliseconds of durations given in seconds."""
    ms = [v * 1000.0 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": quantile(ms, 0.50),
        "p90_ms": quantile(ms, 0.90),
        "p99_ms": quantile(ms, 0.99),
        "max_ms": max(ms) if ms else None,
    }


def paired_delta(
    rounds: Mapping[str, Sequence[Mapping[str, Any]]], target: str, key: str, base: str = "direct"
) -> float | None:
    """Median over rounds of ``target``'s ``key`` minus ``base``'s in the same round.

    Rounds interleave the targets, so pairing by round cancels slow drifts of the machine;
    the median keeps one disturbed round from moving the result."""
    diffs = [
        mine[key] - ref[key]
        for mine, ref in zip(rounds.get(target, ()), rounds.get(base, ()), strict=False)
        if mine.get(key) is not None and ref.get(key) is not None
    ]
    return statistics.median(diffs) if diffs else None


_BUCKET_RE = re.compile(
    r'^kvproxy_added_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\}\s+(\S+)', re.M
)


def parse_histogram(text: str) -> dict[float, float]:
    """Cumulative bucket counts of ``kvproxy_added_latency_seconds`` by upper bound."""
    out: dict[float, float] = {}
    for le, value in _BUCKET_RE.findall(text):
        bound = float("inf") if le in ("+Inf", "inf") else float(le)
        out[bound] = out.get(bound, 0.0) + float(value)
    return out


def histogram_quantile(
    before: Mapping[float, float], after: Mapping[float, float], q: float
) -> float | None:
    """Prometheus-style quantile (linear within a bucket) of the observations in between."""
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    if not cum or cum[-1] <= 0:
        return None
    rank = q * cum[-1]
    prev_bound, prev_cum = 0.0, 0.0
    for bound, c in zip(bounds, cum, strict=True):
        if c >= rank:
            if bound == float("inf"):
                return prev_bound
            width = c - prev_cum
            frac = (rank - prev_cum) / width if width > 0 else 1.0
            return prev_bound + (bound - prev_bound) * frac
        prev_bound, prev_cum = bound, c
    return prev_bound
