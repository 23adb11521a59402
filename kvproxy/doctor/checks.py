"""The doctor's checks: facts read from a deployment in, report lines out. Pure.

Each check yields one :class:`Line`: ``ok``, ``warn`` or ``fail``, what was found, and
for anything but ``ok`` the fix. A check *fails* when a feature the operator asked for
(the config's ``enabled`` flags; both features when no config is given) cannot work as
deployed, and *warns* when it works with less effect than it could, or when something
cannot be known from outside.

What the router tells about itself (probed on a live smg 1.13.0): ``/workers`` gives the worker list (its shape gives the package, see
:mod:`kvproxy.fleet.discovery`); ``/get_loads`` carries ``"version": "smg-X.Y.Z"``; no
endpoint reports the routing policy, so the policy comes from ``router.policy`` in the
config, or is unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from kvproxy.fleet.discovery import EngineList, RouterFlavor
from kvproxy.fleet.engine_info import (
    SESSION_ID_MIN_VERSION,
    EngineSessionMode,
    parse_server_info,
    parse_version,
)
from kvproxy.fleet.engine_metrics import parse_engine_metrics
from kvproxy.urls import base_url

ATTRIBUTING_POLICY = "consistent_hashing"
SMG_FIX = "install smg >= 1.5 (pip install 'smg>=1.5') and start it with `smg launch`"


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Line:
    status: Status
    subject: str
    message: str
    fix: str | None = None

    def render(self) -> str:
        text = f"{self.status.value:<4}  {self.subject}: {self.message}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


@dataclass(frozen=True, slots=True)
class Intent:
    """What the deployment should support, from the config (or both features)."""

    lifecycle: bool = True
    admission: bool = True
    policy: str | None = None  # router.policy from the config, if any
    sticky_routing: bool = False
    prefetch: bool = False  # admission.prefetch (off unless a config turns it on)


@dataclass(frozen=True, slots=True)
class RouterFacts:
    url: str
    error: str | None = None  # set when the router could not be reached at all
    engines: EngineList | None = None  # None: no worker listing in a known shape
    listing_error: str | None = None
    version: str | None = None  # "smg-1.13.0" from /get_loads


@dataclass(frozen=True, slots=True)
class EngineFacts:
    url: str
    error: str | None = None  # set when the engine could not be reached at all
    info: Mapping[str, Any] | None = None  # /server_info (or /get_server_info)
    info_error: str | None = None
    metrics_status: int | None = None  # HTTP status of /metrics; None: no answer
    metrics_text: str | None = None
    metrics_error: str | None = None


@dataclass(frozen=True, slots=True)
class ProbeFacts:
    session_id: str
    rid: str
    status: int | None = None  # the router's HTTP status for the probe
    error: str | None = None
    # Per engine: the request bodies it recorded (the simulator's GET /sim/requests);
    # None where the engine keeps no record (real SGLang).
    recorded: Mapping[str, Sequence[str] | None] = field(default_factory=dict)


def _sev(required: bool) -> Status:
    return Status.FAIL if required else Status.WARN


# ------------------------------------------------------------------------ config
def config_lines(
    path: str | None,
    error: str | None,
    features: Mapping[str, Any] | None,
    *,
    config_router_url: str | None = None,
    router_url: str | None = None,
) -> list[Line]:
    """The config file: valid or not, and what it turns on."""
    if path is None:
        return [
            Line(
                Status.OK,
                "config",
                "none given: checking the deployment for both features (lifecycle and admission)",
            )
        ]
    if error is not None:
        return [
            Line(
                Status.FAIL,
                "config",
                f"{path} is invalid: {error}",
                "correct that key (configs/kvproxy.yaml documents every key and its range)",
            )
        ]
    on = ", ".join(f"{k} {v}" for k, v in (features or {}).items())
    lines = [Line(Status.OK, "config", f"{path} is valid: {on}")]
    if (
        config_router_url is not None
        and router_url is not None
        and base_url(config_router_url) != base_url(router_url)
    ):
        lines.append(
            Line(
                Status.WARN,
                "config",
                f"router.url is {config_router_url}, but --router-url is {router_url}",
                "make them the same, or run kvproxy serve with --router-url",
            )
        )
    return lines


def speedup_lines(numpy_installed: bool, intent: Intent) -> list[Line]:
    """The optional numpy of this host: admission's count of big token-id arrays."""
    if numpy_installed:
        return [Line(Status.OK, "numpy", "installed: big token-id arrays are counted vectorised")]
    if not intent.admission:
        return [Line(Status.OK, "numpy", "not installed (only admission uses it)")]
    return [
        Line(
            Status.WARN,
            "numpy",
            "not installed: admission counts big token-id arrays with bytes.count "
            "(about 1 ms per MB of input_ids instead of 0.1)",
            "pip install 'kvproxy[fast]' (or numpy) where kvproxy runs",
        )
    ]


def build_lines(compiled: int, total: int) -> list[Line]:
    """Whether this install runs the request path compiled (:mod:`kvproxy.compiled`):
    ``compiled`` of its ``total`` modules are. Either is correct; compiled is faster."""
    if compiled == total:
        return [Line(Status.OK, "build", f"compiled: all {total} request-path modules")]
    if compiled == 0:
        return [
            Line(
                Status.OK,
                "build",
                "pure Python (the default; the compiled build runs a feature's share of "
                "a request in about a third fewer instructions)",
                "KVPROXY_COMPILE=1 pip install . (needs a C compiler) for the compiled one",
            )
        ]
    return [
        Line(
            Status.WARN,
            "build",
            f"only {compiled} of {total} request-path modules are compiled: a stale build "
            "next to a newer checkout?",
            "reinstall, with KVPROXY_COMPILE=1 or without",
        )
    ]


def heap_lines(glibc: bool, retain_bytes: int) -> list[Line]:
    """This host's C library and ``server.malloc_retain_bytes``: whether a big body's
    freed buffers are kept for the next request (:mod:`kvproxy.heap`)."""
    if not glibc:
        return [
            Line(
                Status.OK,
                "malloc",
                "not glibc: kvproxy serve leaves the C library's allocator as it is",
            )
        ]
    if retain_bytes == 0:
        return [
            Line(
                Status.WARN,
                "malloc",
                "server.malloc_retain_bytes is 0: glibc hands freed buffers back after "
                "big requests, and the next one's are page-faulted in again (about 2 ms "
                "per 1 MB body on a VM)",
                "leave server.malloc_retain_bytes at its default (64 MiB)",
            )
        ]
    return [
        Line(
            Status.OK,
            "malloc",
            f"glibc: kvproxy serve keeps up to {retain_bytes // (1024 * 1024)} MiB of freed "
            "buffers for reuse",
        )
    ]


# ------------------------------------------------------------------------ router
def _smg_version(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    return parse_version(version.removeprefix("smg-").removeprefix("smg "))


def router_lines(f: RouterFacts, intent: Intent) -> list[Line]:
    subject = f"router {f.url}"
    if f.error is not None:
        return [
            Line(
                Status.FAIL,
                subject,
                f"not reachable ({f.error})",
                "start the router, or pass the URL it listens on with --router-url",
            )
        ]
    lines = [Line(Status.OK, subject, "reachable")]
    if f.engines is None:
        lines.append(
            Line(
                Status.FAIL,
                subject,
                f"no worker list ({f.listing_error or 'neither /workers nor /list_workers'})",
                "point --router-url at smg (not at an engine or at kvproxy)",
            )
        )
        return lines
    lines.append(_package_line(subject, f, intent))
    n_healthy, n_unhealthy = len(f.engines.healthy), len(f.engines.unhealthy)
    if n_healthy + n_unhealthy == 0:
        lines.append(
            Line(
                Status.FAIL,
                subject,
                "lists no workers",
                "start smg with --worker-urls URL ..., or add workers (POST /workers)",
            )
        )
    elif n_unhealthy:
        lines.append(
            Line(
                Status.WARN,
                subject,
                f"{n_healthy} healthy, {n_unhealthy} unhealthy workers "
                f"({', '.join(f.engines.unhealthy)})",
                "check those engines; the router routes only to healthy ones",
            )
        )
    else:
        lines.append(Line(Status.OK, subject, f"{n_healthy} healthy workers"))
    lines.append(policy_line(subject, intent))
    return lines


def _package_line(subject: str, f: RouterFacts, intent: Intent) -> Line:
    assert f.engines is not None
    flavor = f.engines.flavor
    if flavor is RouterFlavor.SMG:
        ver = _smg_version(f.version)
        shown = f.version or "version not reported"
        if ver is not None and ver < (1, 5):
            return Line(
                _sev(intent.lifecycle),
                subject,
                f"smg {shown} (< 1.5 drops a top-level session_id)",
                SMG_FIX,
            )
        return Line(Status.OK, subject, f"package smg ({shown}): passes a top-level session_id")
    if f.engines.legacy:
        return Line(
            _sev(intent.lifecycle),
            subject,
            f"package sglang-router ({flavor.value} worker listing): it drops a top-level "
            "session_id on /generate and chat, so session lifecycle cannot tag requests",
            SMG_FIX,
        )
    return Line(
        Status.WARN,
        subject,
        "package unknown (the worker listing names no workers to tell it by)",
        "use smg >= 1.5",
    )


def policy_line(subject: str, intent: Intent) -> Line:
    """Whether admission can attribute each session's placement to an engine."""
    policy = intent.policy
    if policy is None:
        return Line(
            Status.WARN,
            subject,
            "routing policy unknown (the router does not report it)",
            "set router.policy in the config to the --policy smg was started with "
            f"({ATTRIBUTING_POLICY} lets admission attribute placement per engine)",
        )
    if policy == ATTRIBUTING_POLICY:
        if not intent.sticky_routing:
            return Line(
                Status.WARN,
                subject,
                f"policy {policy}, but session_lifecycle.sticky_routing is off: requests "
                "carry no X-SMG-Routing-Key, so placement cannot be attributed",
                "set session_lifecycle.sticky_routing: true",
            )
        return Line(
            Status.OK,
            subject,
            f"policy {policy} with X-SMG-Routing-Key: admission can attribute each "
            "session to its engine",
        )
    if intent.admission:
        return Line(
            Status.WARN,
            subject,
            f"policy {policy}: admission cannot attribute placement and budgets the "
            "fleet as one pool",
            f"start smg with --policy {ATTRIBUTING_POLICY} and set router.policy: "
            f"{ATTRIBUTING_POLICY}",
        )
    return Line(Status.OK, subject, f"policy {policy}")


# ------------------------------------------------------------------------ engines
def _int_field(info: Mapping[str, Any], key: str) -> int | None:
    value = info.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def engine_lines(f: EngineFacts, intent: Intent) -> list[Line]:
    subject = f"engine {f.url}"
    if f.error is not None:
        return [
            Line(
                Status.FAIL,
                subject,
                f"not reachable ({f.error})",
                "start the engine, or check that this host can reach the URL the router lists",
            )
        ]
    lines: list[Line] = [Line(Status.OK, subject, "reachable")]
    info = f.info
    if info is None:
        lines.append(
            Line(
                Status.WARN,
                subject,
                f"no /server_info ({f.info_error or 'no JSON object'}): engine flags unknown",
                "use SGLang >= 0.5.16 (it serves /server_info)",
            )
        )
    else:
        lines.extend(_info_lines(subject, info, intent))
    lines.append(_metrics_line(subject, f, intent))
    return lines


def _info_lines(subject: str, info: Mapping[str, Any], intent: Intent) -> list[Line]:
    mode = parse_server_info(subject, info)
    return [
        _version_line(subject, mode, intent),
        _cache_line(subject, mode, intent),
        *_scheduling_lines(subject, mode, info, intent),
        _pool_line(subject, info),
    ]


def _version_line(subject: str, mode: EngineSessionMode, intent: Intent) -> Line:
    ver = parse_version(mode.version)
    if ver is None:
        return Line(Status.WARN, subject, "SGLang version not reported", "use SGLang >= 0.5.16")
    if ver < SESSION_ID_MIN_VERSION:
        return Line(
            _sev(intent.lifecycle),
            subject,
            f"SGLang {mode.version} (< 0.5.16 ignores a top-level session_id)",
            "upgrade the engine to SGLang >= 0.5.16",
        )
    return Line(Status.OK, subject, f"SGLang {mode.version}")


_RADIX_FIX = "start the engine with --enable-session-radix-cache --radix-eviction-policy priority"


def _cache_line(subject: str, mode: EngineSessionMode, intent: Intent) -> Line:
    if not mode.recognised:
        return Line(
            Status.WARN,
            subject,
            "/server_info names no session settings (not SGLang, or too old)",
            _RADIX_FIX,
        )
    if mode.radix_disabled:
        return Line(
            _sev(intent.lifecycle),
            subject,
            "--disable-radix-cache: session ids cannot tag its KV",
            "drop --disable-radix-cache; " + _RADIX_FIX.removeprefix("start the engine "),
        )
    if mode.session_radix:
        return Line(Status.OK, subject, "session radix cache on")
    if mode.streaming:
        return Line(
            Status.WARN,
            subject,
            "streaming sessions only: close frees only sessions the client opened "
            "itself; the injected session_id does not tag KV",
            _RADIX_FIX,
        )
    return Line(
        _sev(intent.lifecycle),
        subject,
        "neither the session radix cache nor streaming sessions: close_session frees no KV there",
        _RADIX_FIX,
    )


def _scheduling_lines(
    subject: str, mode: EngineSessionMode, info: Mapping[str, Any], intent: Intent
) -> list[Line]:
    out: list[Line] = []
    if mode.eviction_policy == "priority":
        out.append(Line(Status.OK, subject, "radix eviction policy priority"))
    else:
        out.append(
            Line(
                Status.WARN,
                subject,
                f"radix eviction policy {mode.eviction_policy or 'not reported'}: request "
                "priorities do not steer eviction",
                "start the engine with --radix-eviction-policy priority",
            )
        )
    if mode.priority_scheduling:
        out.append(Line(Status.OK, subject, "priority scheduling on"))
    else:
        out.append(
            Line(
                Status.WARN,
                subject,
                "priority scheduling off: request priorities do not order its queue",
                "start the engine with --enable-priority-scheduling",
            )
        )
    if info.get("enable_metrics") is False:
        out.append(
            Line(
                _sev(intent.admission),
                subject,
                "enable_metrics is false: admission has no KV signal from it",
                "start the engine with --enable-metrics",
            )
        )
    return out


def _pool_line(subject: str, info: Mapping[str, Any]) -> Line:
    pool = _int_field(info, "max_total_num_tokens")
    tp = _int_field(info, "tp_size")
    dp = _int_field(info, "dp_size")
    shown = ", ".join(
        f"{name} {value if value is not None else 'not reported'}"
        for name, value in (("KV pool tokens", pool), ("tp", tp), ("dp", dp))
    )
    return Line(Status.OK, subject, shown)


def _metrics_line(subject: str, f: EngineFacts, intent: Intent) -> Line:
    # SGLang mounts /metrics only with --enable-metrics (http_server.py calls
    # add_prometheus_middleware under that flag), so without it the route is a 404.
    fix = "start the engine with --enable-metrics"
    if f.metrics_status is None:
        return Line(
            _sev(intent.admission),
            subject,
            f"/metrics did not answer ({f.metrics_error or 'no reply'})",
            fix,
        )
    if f.metrics_status != 200:
        return Line(
            _sev(intent.admission),
            subject,
            f"/metrics answered HTTP {f.metrics_status}: admission has no KV signal from it",
            fix if f.metrics_status == 404 else "check the engine's log for the /metrics error",
        )
    m = parse_engine_metrics(f.metrics_text or "")
    if m.token_usage is None or m.max_total_num_tokens is None:
        missing = " and ".join(
            name
            for name, value in (
                ("sglang:token_usage", m.token_usage),
                ("sglang:max_total_num_tokens", m.max_total_num_tokens),
            )
            if value is None
        )
        return Line(
            _sev(intent.admission),
            subject,
            f"/metrics is not parseable as SGLang's (no {missing})",
            "point the router at SGLang >= 0.5.16 engines started with --enable-metrics",
        )
    return Line(
        Status.OK,
        subject,
        f"/metrics parseable: token_usage {m.token_usage:.2f} of {m.max_total_num_tokens} tokens",
    )


def fleet_lines(engines: Sequence[EngineFacts], intent: Intent | None = None) -> list[Line]:
    """Checks across engines: mixed session modes; with ``admission.prefetch`` on, an
    engine with a host KV tier to prefetch from."""
    out = _mode_lines(engines)
    if intent is not None and intent.admission and intent.prefetch:
        out += _prefetch_lines(engines)
    return out


def _prefetch_lines(engines: Sequence[EngineFacts]) -> list[Line]:
    read = [
        parse_engine_metrics(f.metrics_text or "")
        for f in engines
        if f.error is None and f.metrics_status == 200
    ]
    hosts = sum(1 for m in read if m.hicache_host_total_tokens)
    if hosts:
        return [
            Line(
                Status.OK,
                "engines",
                f"{hosts} of {len(engines)} report a host KV tier to prefetch from",
            )
        ]
    return [
        Line(
            Status.WARN,
            "engines",
            "admission.prefetch is on but no engine reports a host KV tier "
            "(sglang:hicache_host_total_tokens): every prefetch would be skipped",
            "start the engines with --enable-hierarchical-cache, or turn admission.prefetch off",
        )
    ]


def _mode_lines(engines: Sequence[EngineFacts]) -> list[Line]:
    modes = {
        parse_server_info(f.url, f.info).mode
        for f in engines
        if f.error is None and f.info is not None
    }
    modes.discard("unknown")
    if len(modes) > 1:
        return [
            Line(
                Status.WARN,
                "engines",
                f"run different session modes ({', '.join(sorted(modes))})",
                "start every engine with the same session flags",
            )
        ]
    return []


# ------------------------------------------------------------------------ probe
def _carries(body: str, p: ProbeFacts) -> tuple[bool, bool]:
    """(is the probe, carries its session_id) for one recorded request body."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False, False
    if not isinstance(doc, dict):
        return False, False
    is_probe = doc.get("rid") == p.rid or doc.get("session_id") == p.session_id
    return is_probe, doc.get("session_id") == p.session_id


def probe_lines(p: ProbeFacts) -> list[Line]:
    subject = "probe"
    if p.status is None or p.status != 200:
        what = f"HTTP {p.status}" if p.status is not None else (p.error or "no answer")
        return [
            Line(
                Status.FAIL,
                subject,
                f"a one-token /generate with session_id {p.session_id} through the router "
                f"failed ({what})",
                "check the router's log and that its workers are healthy",
            )
        ]
    observable = {url: bodies for url, bodies in p.recorded.items() if bodies}
    if not observable:
        return [
            Line(
                Status.OK,
                subject,
                "the router answered a one-token /generate with session_id "
                f"{p.session_id}; the engines keep no request record, so whether the id "
                f"arrived cannot be read back (look for rid {p.rid} in the engine log)",
            )
        ]
    for url, bodies in observable.items():
        for body in bodies:
            is_probe, carries = _carries(body, p)
            if is_probe and carries:
                return [Line(Status.OK, subject, f"session_id {p.session_id} reached {url}")]
            if is_probe:
                return [
                    Line(
                        Status.FAIL,
                        subject,
                        f"the probe reached {url} without its session_id: the router drops it",
                        SMG_FIX,
                    )
                ]
    return [
        Line(
            Status.FAIL,
            subject,
            f"no engine recorded the probe (session_id {p.session_id})",
            "check that the router's workers are the engines listed above",
        )
    ]


# ------------------------------------------------------------------------ summary
def summary(lines: Iterable[Line]) -> tuple[str, int]:
    """The closing line and the exit code (1 when any check failed)."""
    counts = {s: 0 for s in Status}
    for line in lines:
        counts[line.status] += 1
    text = f"doctor: {counts[Status.OK]} ok, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail"
    return text, 1 if counts[Status.FAIL] else 0
