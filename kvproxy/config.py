"""Configuration: typed, frozen dataclasses loaded from one YAML file.

Pure: no I/O except :func:`load_config`, which reads the file. Validation errors
name the offending key and its allowed range. A feature's constraints are only
checked when that feature is enabled, so a half-filled ``admission:`` block never
stops a proxy that runs with admission off.

Precedence: defaults < YAML < CLI overrides (``apply_overrides``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


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
    log_level: str = "WARNING"
    # Slow clients: a request head must arrive within header_read_timeout_s (else 408
    # and the connection is closed), a request body within body_read_timeout_s of the
    # head's end (else the connection is closed). 0 disables a bound.
    header_read_timeout_s: float = 15.0
    body_read_timeout_s: float = 60.0


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


@dataclass(frozen=True, slots=True)
class SessionLifecycleConfig:
    enabled: bool = False
    # Ordered sources of a request's session id.
    id_sources: tuple[str, ...] = SESSION_ID_SOURCES
    id_header: str = "X-Session-ID"
    # A request carrying this header with a true value ("1", "true", "yes") is the
    # session's last turn: the session closes once it completes.
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
    # Program-aware mode: count a session's KV between its turns (its residency) and
    # hold new sessions, never turns of sessions already resident. False: every
    # request is admitted on its own (the per-request behaviour).
    session_residency: bool = True
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


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "router": RouterConfig,
    "session_lifecycle": SessionLifecycleConfig,
    "admission": AdmissionConfig,
}


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Coerce a YAML scalar to the field's annotated type, or raise ConfigError."""
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: must be set (got null)")
    base = annotation.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: must be true or false (got {value!r})")
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: must be an integer (got {value!r})")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: must be a number (got {value!r})")
        return float(value)
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: must be a string (got {value!r})")
        return value
    if base.startswith("tuple"):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: must be a list (got {value!r})")
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: must be a list of strings (got {value!r})")
        return tuple(value)
    raise AssertionError(f"unhandled annotation {annotation} for {key}")


def _build_section(name: str, raw: Any, base: Any) -> Any:
    cls = _SECTIONS[name]
    if raw is None:
        return base
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}: must be a mapping (got {type(raw).__name__})")
    known = {f.name: f for f in fields(cls)}
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            allowed = ", ".join(sorted(known))
            raise ConfigError(f"{name}.{key}: unknown key (allowed: {allowed})")
        changes[key] = _coerce(f"{name}.{key}", value, str(known[key].type))
    return dataclasses.replace(base, **changes)


def from_mapping(raw: Mapping[str, Any] | None, source: str | None = None) -> Config:
    """Build and validate a Config from a parsed YAML document."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError("top level: must be a mapping of sections")
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{key}: unknown section (allowed: {', '.join(_SECTIONS)})")
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
        raw = yaml.safe_load(text)
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
    _check(
        s.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"},
        f"server.log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (got {s.log_level!r})",
    )
    for key in ("header_read_timeout_s", "body_read_timeout_s"):
        value = getattr(s, key)
        _check(value >= 0, f"server.{key}: must be >= 0 (0 = no bound) (got {value})")
    _check(bool(_URL_RE.match(r.url)), f"router.url: must be an http(s) URL (got {r.url!r})")
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
}


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """Apply CLI overrides (None values are "not given") and re-validate."""
    for name, value in overrides.items():
        if value is None:
            continue
        section, key = CLI_OVERRIDES[name]
        cfg = cfg.replace(section, **{key: value})
    validate(cfg)
    return cfg
