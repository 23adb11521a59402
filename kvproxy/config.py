"""Configuration: typed, frozen dataclasses loaded from one YAML file.

Pure: no I/O except :func:`load_config`, which reads the file. Validation errors
name the offending key and its allowed range. A feature's constraints are only
checked when that feature is enabled, so a half-filled ``admission:`` block never
stops a proxy that runs with admission off.

Precedence: defaults < YAML < CLI overrides (``apply_overrides``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from kvproxy.urls import base_url
from kvproxy.yamlload import DuplicateKeyError, load_yaml


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


SESSION_ID_SOURCES = ("body", "header", "nvext", "routing_key", "path")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    max_body_bytes: int = 64 * 1024 * 1024
    # When set, the admin endpoints (reload, session close, stats reset) require
    # "Authorization: Bearer <token>" and the dashboard asks for it once (then a
    # cookie). Data-plane requests never do.
    admin_token: str | None = None
    # With admin_token set: whether GET /kvproxy/stats and /metrics stay readable
    # without it. /kvproxy/health always does (probes).
    public_stats: bool = True
    # Seconds to let in-flight requests finish on SIGTERM / SIGINT.
    shutdown_grace_s: float = 10.0
    # Listen backlog: bursts of new connections beyond it wait for SYN retransmits.
    backlog: int = 2048
    # The start-up line and router reachability changes are logged at INFO.
    log_level: str = "INFO"
    # Wall seconds per simulated second: multiplies every kvproxy timer and duration
    # (admission poll interval, staleness, waits, leases, idle times, tick). 1.0 in
    # production; a benchmark against simulated engines running faster than real time
    # sets it below 1 so the dynamics stay the same.
    time_scale: float = 1.0
    # Real tokens per token of the engines: 1 in production. Simulated engines run at a
    # token scale K (docs/simulator.md) where one token stands for K; kvproxy's
    # token-valued admission settings (default_completion_tokens, expected_decode_cap,
    # priority_unit_tokens, session_buffer_tokens) are then divided by K, as time_scale
    # multiplies its durations, so the dynamics stay the same.
    token_scale: int = 1
    # Slow clients: a request head must arrive within header_read_timeout_s (else 408
    # and the connection is closed), a request body within body_read_timeout_s of the
    # head's end (else the connection is closed). 0 disables a bound.
    header_read_timeout_s: float = 15.0
    body_read_timeout_s: float = 60.0
    # The garbage collector's young-generation threshold once serving (the first value
    # of gc.set_threshold; 0 keeps Python's 700). Python's default is below what a few
    # dozen requests in flight hold: each young collection then promotes objects that die
    # soon after, and collections cost 46-91 µs per request at 64 concurrent requests
    # (docs/benchmarks.md, "Garbage collection").
    gc_threshold: int = 10_000
    # Freed memory glibc's malloc keeps for reuse instead of handing it back to the
    # kernel (its trim threshold; buffers up to min(this, 32 MiB) come from the heap):
    # a big body's buffers are then not fresh pages, each a page fault, on every request
    # (kvproxy.heap; docs/benchmarks.md, "Page faults of big bodies"). 0 keeps glibc's
    # own; nothing is done on another C library.
    malloc_retain_bytes: int = 64 * 1024 * 1024


# server.malloc_retain_bytes: 0, or from 1 MiB to what mallopt's int takes.
MIN_MALLOC_RETAIN = 1024 * 1024
MAX_MALLOC_RETAIN = 2**31 - 1

ROUTER_POLICIES_MIRRORED = ("consistent_hashing",)
ADMISSION_MODES = ("program", "request")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    url: str = "http://127.0.0.1:30000"
    # Static engine base URLs. When non-empty they override discovery through the router.
    engines: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    # Whole-request limit for one upstream attempt (streams included); 0 disables it.
    request_timeout_s: float = 3600.0
    # Limit on the silence between two chunks of an upstream response; 0 disables it.
    read_timeout_s: float = 600.0
    # Connection pool size to the router (0 = unlimited).
    max_connections: int = 0
    # How often the engine list is re-read from the router's /workers.
    discovery_interval_s: float = 5.0
    # The router's load-balancing policy as deployed (smg --policy). With
    # consistent_hashing kvproxy mirrors the router's ring and keeps a ledger per
    # engine; with any other policy placement is unknown and program admission falls
    # back to fleet-wide accounting (said at start and in /kvproxy/health).
    policy: str = "cache_aware"
    # smg's Prometheus endpoint (smg --prometheus-host/--prometheus-port), e.g.
    # http://127.0.0.1:29000/metrics. When set, program admission reads smg's
    # consistent-hashing branch counter and counts and warns about requests smg routed
    # off the ring (random_fallback, no_healthy_workers, target_worker_miss).
    metrics_url: str | None = None


@dataclass(frozen=True, slots=True)
class SessionLifecycleConfig:
    enabled: bool = False
    # Ordered sources of a request's session id.
    id_sources: tuple[str, ...] = SESSION_ID_SOURCES
    id_header: str = "X-Session-ID"
    # A request carrying this header with a true value (kvproxy.vocab.TRUTHY: "1",
    # "true", "yes", "on") is the session's last turn: it closes once that completes.
    final_header: str = "X-Session-Final"
    id_max_length: int = 128
    sticky_routing: bool = False
    on_close: str = "abort"  # abort | wait
    close_timeout_s: float = 2.0
    # on_close=wait: how long to wait for forwarded requests before aborting them anyway.
    wait_timeout_s: float = 60.0
    # Close a session after this many idle seconds; None disables the idle timeout.
    idle_timeout_s: float | None = None
    # Session table bound: past it the least recently active idle session is forgotten
    # (not closed) and counted.
    max_sessions: int = 100_000
    # Closed session ids are remembered this long so that repeated closes are no-ops.
    closed_ttl_s: float = 600.0
    # Read each engine's /server_info at start and report its session mode.
    check_engines: bool = True
    # Dynamo's nvext (docs/dynamo.md). Each switch turns one behaviour off; all default on.
    # agent_hints.priority -> top-level priority; agent_hints.osl -> expected growth.
    agent_hints: bool = True
    # session_control bind (and chat open): sticky routing + sliding inactivity close.
    bind_timeouts: bool = True
    # session_control open on /generate with input_ids: SGLang streaming sessions.
    streaming_sessions: bool = True
    max_streaming_sessions: int = 10_000
    # A streaming session is opened (and kept) only while the KV the engine's streaming
    # sessions hold plus this session's next turn stays within this share of the
    # engine's max_total_num_tokens; past it the session behaves as bind.
    streaming_max_pool_share: float = 0.5
    # agent_hints.speculative_prefill: warm the next turn's prefix after the response.
    speculative_prefill: bool = True
    speculative_prefill_max_in_flight: int = 4
    # Paths on which the nvext block is removed before forwarding (SGLang ignores it on
    # all of them, so none by default).
    strip_nvext_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = False
    headroom: float = 0.90
    pressure_threshold: float = 0.92
    # Cap on the completion part of a reservation; None means default_completion_tokens.
    expected_decode_cap: int | None = None
    max_wait_s: float = 30.0
    scope: str = "train"  # train | all
    # Completion budget when a request states none (the rollout's max response length).
    default_completion_tokens: int = 4096
    poll_interval_s: float = 2.0
    # A fresh snapshot is one younger than this; None means 3 poll intervals (min 5 s).
    staleness_s: float | None = None
    metrics_timeout_s: float = 5.0
    lease_ttl_s: float = 600.0
    # FIFO bound: past it a request bypasses (reason queue_full).
    max_queue: int = 10_000
    # Requests whose header eval_header equals "eval", or whose path starts with
    # eval_path_prefix, are eval traffic (out of scope when scope=train).
    eval_header: str = "X-KVProxy-Mode"
    eval_path_prefix: str | None = None
    # Requests carrying protected_header with a true value, or a priority at or above
    # protected_priority, bypass admission without touching the ledger.
    protected_header: str = "X-KVProxy-Protected"
    protected_priority: int | None = None
    # Prompt-size estimate for text / chat bodies (no input_ids): characters per token
    # before calibration from the engines' reported prompt_tokens.
    chars_per_token: float = 4.0
    # program: program-aware admission (per-engine session ledgers when the router's
    # placement can be mirrored, see router.policy; else the fleet-wide residency
    # ledger). request: every request admitted on its own (Relax per-request semantics).
    mode: str = "program"
    # Fleet-wide fallback only: count a session's KV between its turns. The YAML key
    # session_residency is accepted as an alias of mode (true -> program,
    # false -> request); see _build_section.
    session_residency: bool = True
    # --- program mode, per-engine ledger (docs/admission.md#program-mode) ---
    # engine: one ledger per engine from the mirrored ring; fleet: the fleet-wide
    # residency ledger even when placement is known (ablation).
    ledger: str = "engine"
    # Ablation: hold continuing turns of active sessions for capacity like new ones
    # (false, the default: a continuing turn is forwarded at once, never held).
    hold_continuing: bool = False
    # Pause idle sessions under growth pressure; a paused session's next turn waits at
    # most paused_max_wait_s (then goes anyway), ahead of new sessions. 30 s: chosen in
    # the lab (docs/admission.md#defaults): the bound is the lever of the gain and sets
    # the continuing-turn TTFT tail; 30 s is the largest that keeps that tail no worse
    # than without kvproxy on W1 (8 s gains nothing; 60 s more throughput, worse tail).
    pause: bool = True
    paused_max_wait_s: float = 30.0
    # A new session waits in its engine's FIFO at most this long, then goes anyway (the
    # first-turn wait bound). 1800 s: the measured trade-off (docs/admission.md#defaults):
    # over the regime grid the first-turn wait p99 reached 1,870 s without a tighter
    # bound, and 600 s cost the largest fleets up to 27% of their gain (swe, 64 per engine).
    new_session_max_wait_s: float = 1800.0
    # Inject a size-based top-level priority when every engine evicts by priority. Off by
    # default: with --enable-priority-scheduling (required for priority eviction) the
    # priority also orders the engine's waiting queue, which starves small sessions
    # (W2 continuing-turn TTFT p99 9x in the lab) for no throughput gain.
    priority_steering: bool = False
    # Tokens per priority step: priority = floor(log2(context / priority_unit_tokens)),
    # clamped to [0, priority_max] and monotone per session.
    priority_unit_tokens: int = 4096
    priority_max: int = 9
    # Adapt each engine's admission target from its eviction and retraction counters
    # and the cached fraction of continuing turns.
    feedback: bool = True
    tick_s: float = 1.0
    # An idle session counts fully for idle_lease_s after its last turn, then decays
    # with idle_half_life_s (0: it stops counting at once); after idle_ttl_s it leaves.
    idle_lease_s: float = 5.0
    idle_half_life_s: float = 10.0
    idle_ttl_s: float = 600.0
    # Pause when the undecayed footprint passes pause_high x capacity, down to pause_low.
    pause_high: float = 0.95
    pause_low: float = 0.85
    # Admission target theta (fraction of capacity): start and bounds.
    target_start: float = 0.92
    target_min: float = 0.60
    target_max: float = 0.95
    # The gate stays off while the undecayed footprint is under this fraction.
    gate_off_below: float = 0.75
    # Thrash: continuing turns' cached fraction under this over a feedback window.
    thrash_cached_fraction: float = 0.85
    feedback_window_s: float = 5.0
    # Per-session constant added to its footprint (tokens).
    session_buffer_tokens: int = 100
    # Hold work on an engine only while holding is measured to pay
    # (docs/admission.md#when-admission-holds): permissive (nothing held, nothing
    # paused) until engage_windows feedback windows in a row spent at least engage_cost
    # of the engine's work recomputing evicted context (a decoded token weighing
    # decode_token_weight prefill tokens) while a turn was in flight at least
    # engage_busy of the time; permissive again after release_windows windows busy less
    # than release_busy. false: the gate is always engaged (earlier versions).
    engage_on_thrash: bool = True
    engage_cost: float = 0.4
    engage_busy: float = 0.75
    decode_token_weight: float = 16.0
    release_busy: float = 0.5
    engage_windows: int = 2
    release_windows: int = 6
    # Cold start: a permissive engine also engages, before any thrash is measured, after
    # engage_windows busy windows in a row in which it ran at least cold_start_sessions
    # sessions expected to grow to more than 1.5 x its capacity, whose contexts would
    # cost at least 0.5 of its work to recompute were they all evicted. 0: off.
    cold_start_sessions: int = 24
    # Growth-aware admission of new sessions: a new session starts only if what the
    # engine's admitted sessions and it are expected to grow to (each: max(footprint,
    # expected peak context)) fits growth_target x capacity. The expected peak is the
    # growth_quantile of the last growth_window closed sessions' final contexts once
    # growth_min_closed have closed; before, context + the fleet's per-turn growth x
    # growth_horizon_turns (the engine's context length before any growth is seen),
    # capped by the engine's context length. Continuing turns are never held by it.
    growth_reservation: bool = True
    growth_target: float = 0.92
    growth_quantile: float = 0.25
    growth_window: int = 256
    growth_min_closed: int = 16
    growth_horizon_turns: float = 16.0
    # Bound of the per-engine session table (least recently active idle session first).
    max_sessions: int = 100_000
    # A session with no request for this long stops being counted resident (its KV is
    # evictable anyway); this releases residency when sessions never close explicitly.
    session_idle_s: float = 600.0

    @property
    def effective_staleness_s(self) -> float:
        if self.staleness_s is not None:
            return self.staleness_s
        return max(3 * self.poll_interval_s, 5.0)

    @property
    def completion_cap(self) -> int:
        return self.expected_decode_cap or self.default_completion_tokens


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    session_lifecycle: SessionLifecycleConfig = field(default_factory=SessionLifecycleConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    source: str | None = None  # path of the YAML file this came from

    def replace(self, section: str, **changes: Any) -> Config:
        return dataclasses.replace(
            self, **{section: dataclasses.replace(getattr(self, section), **changes)}
        )


@dataclass
class LiveConfig:
    """The running config of one application: a reload swaps :attr:`config` in place
    (:mod:`kvproxy.admin.reload`), so every reader sees the new one on its next request."""

    config: Config
    # The CLI overrides, re-applied on every reload.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    reloads: int = 0
    # router.url is restart-only, so its base is fixed for the application's life.
    router_base: str = field(init=False)

    def __post_init__(self) -> None:
        self.router_base = base_url(self.config.router.url)


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "router": RouterConfig,
    "session_lifecycle": SessionLifecycleConfig,
    "admission": AdmissionConfig,
}

# Keys that were renamed: old key -> message naming the replacement.
_SESSION_RESIDENCY = "session_residency"


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: must be true or false (got {value!r})")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer (got {value!r})")
    return value


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: must be a number (got {value!r})")
    return float(value)


def _as_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string (got {value!r})")
    return value


def _as_str_tuple(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: must be a list (got {value!r})")
    if not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: must be a list of strings (got {value!r})")
    return tuple(value)


# Field annotation (without ``| None``) -> the coercion of a YAML value to it.
_COERCIONS: dict[str, Callable[[str, Any], Any]] = {
    "bool": _as_bool,
    "int": _as_int,
    "float": _as_float,
    "str": _as_str,
}


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Coerce a YAML scalar to the field's annotated type, or raise ConfigError."""
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError(f"{key}: must be set (got null)")
    base = annotation.replace(" | None", "").strip()
    coerce = _COERCIONS.get(base)
    if coerce is None and base.startswith("tuple"):
        coerce = _as_str_tuple
    if coerce is None:
        raise AssertionError(f"unhandled annotation {annotation} for {key}")
    return coerce(key, value)


def _did_you_mean(key: str, valid: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean admission.headroom?"`` for the closest valid key, or ``""``."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{match[0]}?" if match else ""


def _build_section(name: str, raw: Any, base: Any) -> Any:
    cls = _SECTIONS[name]
    if raw is None:
        return base
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}: must be a mapping (got {type(raw).__name__})")
    known = {f.name: f for f in fields(cls)}
    changes: dict[str, Any] = {}
    if name == "admission" and _SESSION_RESIDENCY in raw:
        # The old key keeps working: true is mode program, false is mode request.
        raw = dict(raw)
        old = _coerce("admission.session_residency", raw.pop(_SESSION_RESIDENCY), "bool")
        implied = "program" if old else "request"
        if "mode" in raw and raw["mode"] != implied:
            raise ConfigError(
                f"admission.session_residency: {str(old).lower()} contradicts admission.mode: "
                f"{raw['mode']!r}; session_residency is replaced by mode (true -> program, "
                "false -> request): set only mode"
            )
        changes["mode"] = implied
        changes["session_residency"] = old
    for key, value in raw.items():
        if key not in known:
            allowed = ", ".join(sorted(known))
            hint = _did_you_mean(str(key), known, prefix=f"{name}.")
            raise ConfigError(f"{name}.{key}: unknown key{hint} (allowed: {allowed})")
        changes[key] = _coerce(f"{name}.{key}", value, str(known[key].type))
    return dataclasses.replace(base, **changes)


def from_mapping(raw: Mapping[str, Any] | None, source: str | None = None) -> Config:
    """Build and validate a Config from a parsed YAML document."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError("top level: must be a mapping of sections")
    for key in raw:
        if key not in _SECTIONS:
            hint = _did_you_mean(str(key), _SECTIONS)
            raise ConfigError(f"{key}: unknown section{hint} (allowed: {', '.join(_SECTIONS)})")
    defaults = Config()
    cfg = Config(
        **{
            name: _build_section(name, raw.get(name), getattr(defaults, name)) for name in _SECTIONS
        },
        source=source,
    )
    validate(cfg)
    return cfg


def load_config(path: str | Path | None) -> Config:
    """Read and validate the YAML file at ``path`` (defaults when ``path`` is None)."""
    if path is None:
        return from_mapping({})
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from exc
    try:
        raw = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from exc
    return from_mapping(raw, source=str(p))


_URL_RE = re.compile(r"^https?://[^/\s]+(/.*)?$")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first key out of range."""
    s, r, sl, a = cfg.server, cfg.router, cfg.session_lifecycle, cfg.admission
    _check(1 <= s.port <= 65535, f"server.port: must be in [1, 65535] (got {s.port})")
    _check(
        s.max_body_bytes >= 1024, f"server.max_body_bytes: must be >= 1024 (got {s.max_body_bytes})"
    )
    _check(
        s.shutdown_grace_s >= 0, f"server.shutdown_grace_s: must be >= 0 (got {s.shutdown_grace_s})"
    )
    _check(
        s.admin_token is None or (s.admin_token.strip() == s.admin_token != ""),
        "server.admin_token: must be null or a non-empty string without surrounding spaces",
    )
    _check(0 < s.time_scale <= 100, f"server.time_scale: must be in (0, 100] (got {s.time_scale})")
    _check(
        1 <= s.token_scale <= 1024,
        f"server.token_scale: must be an integer in [1, 1024] (got {s.token_scale})",
    )
    _check(
        bool(re.match(r"^[a-z_]+$", r.policy)),
        f"router.policy: must be a policy name such as consistent_hashing (got {r.policy!r})",
    )
    _check(
        s.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"},
        f"server.log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (got {s.log_level!r})",
    )
    for key in ("header_read_timeout_s", "body_read_timeout_s"):
        value = getattr(s, key)
        _check(value >= 0, f"server.{key}: must be >= 0 (0 = no bound) (got {value})")
    _check(
        s.gc_threshold == 0 or 100 <= s.gc_threshold <= 10_000_000,
        f"server.gc_threshold: must be 0 (Python's default) or in [100, 10000000] "
        f"(got {s.gc_threshold})",
    )
    _check(
        s.malloc_retain_bytes == 0
        or MIN_MALLOC_RETAIN <= s.malloc_retain_bytes <= MAX_MALLOC_RETAIN,
        f"server.malloc_retain_bytes: must be 0 (glibc's own) or in [{MIN_MALLOC_RETAIN}, "
        f"{MAX_MALLOC_RETAIN}] (got {s.malloc_retain_bytes})",
    )
    _check(bool(_URL_RE.match(r.url)), f"router.url: must be an http(s) URL (got {r.url!r})")
    _check(
        r.metrics_url is None or bool(_URL_RE.match(r.metrics_url)),
        f"router.metrics_url: must be null or an http(s) URL (got {r.metrics_url!r})",
    )
    for i, url in enumerate(r.engines):
        _check(
            bool(_URL_RE.match(url)), f"router.engines[{i}]: must be an http(s) URL (got {url!r})"
        )
    _check(
        r.connect_timeout_s > 0,
        f"router.connect_timeout_s: must be > 0 (got {r.connect_timeout_s})",
    )
    _check(
        r.request_timeout_s >= 0,
        f"router.request_timeout_s: must be >= 0 (got {r.request_timeout_s})",
    )
    _check(r.read_timeout_s >= 0, f"router.read_timeout_s: must be >= 0 (got {r.read_timeout_s})")
    _check(
        r.max_connections >= 0, f"router.max_connections: must be >= 0 (got {r.max_connections})"
    )
    _check(
        r.discovery_interval_s > 0,
        f"router.discovery_interval_s: must be > 0 (got {r.discovery_interval_s})",
    )
    if sl.enabled:
        for src in sl.id_sources:
            _check(
                src in SESSION_ID_SOURCES,
                f"session_lifecycle.id_sources: unknown source {src!r} (allowed: {', '.join(SESSION_ID_SOURCES)})",
            )
        _check(bool(sl.id_sources), "session_lifecycle.id_sources: must not be empty")
        _check(
            sl.on_close in ("abort", "wait"),
            f"session_lifecycle.on_close: must be abort or wait (got {sl.on_close!r})",
        )
        _check(
            0 < sl.close_timeout_s <= 60,
            f"session_lifecycle.close_timeout_s: must be in (0, 60] (got {sl.close_timeout_s})",
        )
        _check(
            sl.wait_timeout_s >= 0,
            f"session_lifecycle.wait_timeout_s: must be >= 0 (got {sl.wait_timeout_s})",
        )
        _check(
            sl.idle_timeout_s is None or sl.idle_timeout_s > 0,
            f"session_lifecycle.idle_timeout_s: must be > 0 or null (got {sl.idle_timeout_s})",
        )
        _check(
            8 <= sl.id_max_length <= 1024,
            f"session_lifecycle.id_max_length: must be in [8, 1024] (got {sl.id_max_length})",
        )
        _check(
            sl.max_sessions >= 1,
            f"session_lifecycle.max_sessions: must be >= 1 (got {sl.max_sessions})",
        )
        _check(
            sl.closed_ttl_s >= 0,
            f"session_lifecycle.closed_ttl_s: must be >= 0 (got {sl.closed_ttl_s})",
        )
        _check(
            sl.max_streaming_sessions >= 1,
            "session_lifecycle.max_streaming_sessions: must be >= 1 "
            f"(got {sl.max_streaming_sessions})",
        )
        _check(
            0 < sl.streaming_max_pool_share <= 1,
            "session_lifecycle.streaming_max_pool_share: must be in (0, 1] "
            f"(got {sl.streaming_max_pool_share})",
        )
        _check(
            1 <= sl.speculative_prefill_max_in_flight <= 1024,
            "session_lifecycle.speculative_prefill_max_in_flight: must be in [1, 1024] "
            f"(got {sl.speculative_prefill_max_in_flight})",
        )
        for p in sl.strip_nvext_paths:
            _check(
                p in ("/generate", "/v1/chat/completions", "/v1/completions"),
                f"session_lifecycle.strip_nvext_paths: unknown path {p!r} (allowed: "
                "/generate, /v1/chat/completions, /v1/completions)",
            )
    if a.enabled:
        _check(0 < a.headroom <= 1, f"admission.headroom: must be in (0, 1] (got {a.headroom})")
        _check(
            0 < a.pressure_threshold <= 1,
            f"admission.pressure_threshold: must be in (0, 1] (got {a.pressure_threshold})",
        )
        _check(
            a.expected_decode_cap is None or a.expected_decode_cap > 0,
            f"admission.expected_decode_cap: must be > 0 (got {a.expected_decode_cap})",
        )
        _check(a.max_wait_s >= 0, f"admission.max_wait_s: must be >= 0 (got {a.max_wait_s})")
        _check(
            a.scope in ("train", "all"), f"admission.scope: must be train or all (got {a.scope!r})"
        )
        _check(
            a.default_completion_tokens > 0,
            f"admission.default_completion_tokens: must be > 0 (got {a.default_completion_tokens})",
        )
        _check(
            a.poll_interval_s > 0,
            f"admission.poll_interval_s: must be > 0 (got {a.poll_interval_s})",
        )
        _check(
            a.staleness_s is None or a.staleness_s >= a.poll_interval_s,
            f"admission.staleness_s: must be >= admission.poll_interval_s ({a.poll_interval_s}) (got {a.staleness_s})",
        )
        _check(
            a.metrics_timeout_s > 0,
            f"admission.metrics_timeout_s: must be > 0 (got {a.metrics_timeout_s})",
        )
        _check(a.lease_ttl_s > 0, f"admission.lease_ttl_s: must be > 0 (got {a.lease_ttl_s})")
        _check(a.max_queue >= 1, f"admission.max_queue: must be >= 1 (got {a.max_queue})")
        _check(
            a.chars_per_token > 0,
            f"admission.chars_per_token: must be > 0 (got {a.chars_per_token})",
        )
        _check(
            a.session_idle_s > 0,
            f"admission.session_idle_s: must be > 0 (got {a.session_idle_s})",
        )
        _validate_program(a)


def _validate_program(a: AdmissionConfig) -> None:
    _check(
        a.mode in ADMISSION_MODES,
        f"admission.mode: must be program or request (got {a.mode!r})",
    )
    _check(
        a.ledger in ("engine", "fleet"),
        f"admission.ledger: must be engine or fleet (got {a.ledger!r})",
    )
    for key in ("paused_max_wait_s", "new_session_max_wait_s", "idle_half_life_s"):
        value = getattr(a, key)
        _check(value >= 0, f"admission.{key}: must be >= 0 (got {value})")
    for key in ("tick_s", "idle_lease_s", "idle_ttl_s", "feedback_window_s"):
        value = getattr(a, key)
        _check(value > 0, f"admission.{key}: must be > 0 (got {value})")
    for key in (
        "pause_high",
        "pause_low",
        "target_start",
        "target_min",
        "target_max",
        "gate_off_below",
        "thrash_cached_fraction",
        "growth_target",
        "growth_quantile",
        "engage_cost",
        "engage_busy",
    ):
        value = getattr(a, key)
        _check(0 < value <= 1, f"admission.{key}: must be in (0, 1] (got {value})")
    _check(
        0 <= a.release_busy < 1,
        f"admission.release_busy: must be in [0, 1) (got {a.release_busy})",
    )
    _check(
        a.decode_token_weight > 0,
        f"admission.decode_token_weight: must be > 0 (got {a.decode_token_weight})",
    )
    for key in ("engage_windows", "release_windows"):
        value = getattr(a, key)
        _check(value >= 1, f"admission.{key}: must be >= 1 (got {value})")
    _check(
        a.cold_start_sessions >= 0,
        f"admission.cold_start_sessions: must be >= 0 (got {a.cold_start_sessions})",
    )
    _check(
        a.pause_low < a.pause_high,
        f"admission.pause_low: must be < pause_high ({a.pause_high}) (got {a.pause_low})",
    )
    _check(
        a.target_min <= a.target_start <= a.target_max,
        "admission.target_start: must be in [target_min, target_max] "
        f"([{a.target_min}, {a.target_max}]) (got {a.target_start})",
    )
    _check(
        0 <= a.priority_max <= 9,
        "admission.priority_max: must be in [0, 9] (SGLang preempts a running request at a "
        f"priority gap of 10) (got {a.priority_max})",
    )
    _check(
        a.priority_unit_tokens >= 1,
        f"admission.priority_unit_tokens: must be >= 1 (got {a.priority_unit_tokens})",
    )
    _check(
        a.session_buffer_tokens >= 0,
        f"admission.session_buffer_tokens: must be >= 0 (got {a.session_buffer_tokens})",
    )
    _check(a.max_sessions >= 1, f"admission.max_sessions: must be >= 1 (got {a.max_sessions})")
    _check(a.growth_window >= 1, f"admission.growth_window: must be >= 1 (got {a.growth_window})")
    _check(
        a.growth_min_closed >= 0,
        f"admission.growth_min_closed: must be >= 0 (got {a.growth_min_closed})",
    )
    _check(
        a.growth_horizon_turns >= 0,
        f"admission.growth_horizon_turns: must be >= 0 (got {a.growth_horizon_turns})",
    )


# CLI flag -> (section, key). Relax-compatible names first.
CLI_OVERRIDES: dict[str, tuple[str, str]] = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "router_url": ("router", "url"),
    "agentic_session_lifecycle": ("session_lifecycle", "enabled"),
    "agentic_program_admission": ("admission", "enabled"),
    "agentic_admission_headroom": ("admission", "headroom"),
    "agentic_admission_pressure_threshold": ("admission", "pressure_threshold"),
    "agentic_admission_expected_decode_cap": ("admission", "expected_decode_cap"),
    "agentic_admission_max_wait_s": ("admission", "max_wait_s"),
    "agentic_admission_scope": ("admission", "scope"),
    "admission_mode": ("admission", "mode"),
    "router_policy": ("router", "policy"),
    "time_scale": ("server", "time_scale"),
    "token_scale": ("server", "token_scale"),
}


def flag_name(override: str) -> str:
    """``"agentic_admission_max_wait_s"`` -> ``"--agentic-admission-max-wait-s"``."""
    return "--" + override.replace("_", "-")


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """Apply CLI overrides (None values are "not given") and re-validate.

    An error about a value a flag set names the flag (and the key it sets).
    """
    given: dict[str, str] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        section, key = CLI_OVERRIDES[name]
        given[f"{section}.{key}"] = name
        cfg = cfg.replace(section, **{key: value})
    try:
        validate(cfg)
    except ConfigError as exc:
        key, sep, rest = str(exc).partition(":")
        if sep and key in given:
            raise ConfigError(f"{flag_name(given[key])}:{rest} (sets {key})") from exc
        raise
    return cfg
