"""The session lifecycle's pure parts: what a close and the health check answer, and
the bookkeeping its shell (:mod:`kvproxy.sessions.lifecycle`) keeps. Pure.

No I/O and no clock: the shell passes ``now`` and what it read from the engines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvproxy.config import SessionLifecycleConfig
from kvproxy.sessions.table import SessionEntry, SessionState
from kvproxy.urls import base_url


class SessionClosed(Exception):
    """The request's session is closing or closed; it is not forwarded (HTTP 409)."""

    error_type: ClassVar[str] = "session_closed"

    def __init__(self, session_id: str, message: str | None = None) -> None:
        self.session_id = session_id
        super().__init__(
            message or f"session {session_id!r} is closing; the request was not forwarded"
        )

    def to_json(self) -> dict[str, Any]:
        return {"error": {"type": self.error_type, "message": str(self)}}


class SessionForbidden(Exception):
    """The session is bound to another data-plane credential
    (``session_lifecycle.bind_credential``): the request is refused (HTTP 403)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(
            f"session {session_id!r} was opened with another credential: "
            "only that credential (or the admin token) may use or close it"
        )


@dataclass(slots=True)
class CloseResult:
    session_id: str
    engines_told: int = 0  # engines that answered /close_session with 2xx
    engines_failed: int = 0  # engines that did not (error, non-2xx, timeout)
    aborted: int = 0  # forwarded requests aborted on the engines
    awaited: int = 0  # forwarded requests that finished on their own (on_close=wait)
    rejected_queued: int = 0  # requests queued in the proxy answered session_closed
    already_closed: bool = False  # closed earlier: nothing was sent
    reason: str = ""
    failures: dict[str, str] = field(default_factory=dict)  # engine url -> error
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "engines_told": self.engines_told,
            "engines_failed": self.engines_failed,
            "aborted": self.aborted,
            "awaited": self.awaited,
            "rejected_queued": self.rejected_queued,
            "already_closed": self.already_closed,
            "reason": self.reason,
        }
        if self.failures:
            out["failures"] = dict(self.failures)
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True, slots=True)
class SessionsHealth:
    """The session lifecycle at one moment, as ``GET /kvproxy/health`` shows it
    (``sessions``); with the feature off only ``enabled`` is shown."""

    enabled: bool
    on_close: str = ""
    sticky_routing: bool = False
    idle_timeout_s: float | None = None
    engine_check: str = ""
    # Engine base URL -> its session mode document (or the error reading it).
    engines: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    open: int = 0
    closing: int = 0

    def to_json(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        return {
            "enabled": True,
            "on_close": self.on_close,
            "sticky_routing": self.sticky_routing,
            "idle_timeout_s": self.idle_timeout_s,
            "engine_check": self.engine_check,
            "engines": dict(self.engines),
            "warnings": list(self.warnings),
            "open": self.open,
            "closing": self.closing,
        }


def base_urls(urls: Sequence[str]) -> list[str]:
    """The engines' base URLs, each once, in first-seen order (empty ones dropped)."""
    out: dict[str, None] = {}
    for url in urls:
        base = base_url(url)
        if base:
            out.setdefault(base, None)
    return list(out)


def sessions_health(
    cfg: SessionLifecycleConfig,
    *,
    mode_docs: Mapping[str, Mapping[str, Any]],
    mode_warnings: Sequence[str],
    probe_errors: Mapping[str, str],
    engines: Sequence[str],
    check_state: str,
    open_count: int,
    closing_count: int,
) -> SessionsHealth:
    """The health view from what the engine check found.

    ``mode_docs``: engine -> its session mode document, for the engines read;
    ``mode_warnings``: what those modes warrant; ``probe_errors``: engine -> why it
    could not be read; ``engines``: the engines known now (listed as ``unchecked``
    until read, when ``check_engines``); ``check_state``: the check's progress
    (``not_started``, ``pending``, ``done``, ``incomplete``, ``stopped``).
    """
    if not cfg.enabled:
        return SessionsHealth(enabled=False)
    docs: dict[str, Any] = dict(mode_docs)
    for url, error in probe_errors.items():
        if url not in docs:
            docs[url] = {"mode": "unknown", "error": error}
    if cfg.check_engines:
        for url in engines:
            docs.setdefault(url, {"mode": "unchecked"})
    warnings = list(mode_warnings)
    if check_state in ("done", "incomplete") and not mode_docs:
        warnings.append("no engine answered /server_info: session modes unknown")
    elif probe_errors:
        warnings.append(
            f"{len(probe_errors)} engine(s) did not answer /server_info: "
            "their session mode is unknown"
        )
    return SessionsHealth(
        enabled=True,
        on_close=cfg.on_close,
        sticky_routing=cfg.sticky_routing,
        idle_timeout_s=cfg.idle_timeout_s,
        engine_check=check_state,
        engines=docs,
        warnings=tuple(warnings),
        open=open_count,
        closing=closing_count,
    )


def open_snapshot(
    entries: Iterable[SessionEntry], now: float, now_wall: float
) -> list[tuple[str, float, int]]:
    """The open sessions as the shared store takes them back after an outage: (id, last
    activity on the wall clock, requests in flight). ``now``: the table's clock."""
    return [
        (e.session_id, now_wall - (now - e.last_active), e.in_flight)
        for e in entries
        if e.state is SessionState.OPEN
    ]


# -- background tasks -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskPlan:
    """What a reconfiguration does to the background tasks: which to stop first, and
    which to (re)start after (each only if the new config wants it)."""

    stop_reaper: bool
    stop_checker: bool
    start_reaper: bool
    start_checker: bool


def reconfigure_plan(old: SessionLifecycleConfig, new: SessionLifecycleConfig) -> TaskPlan:
    """The idle reaper restarts when enabled or idle_timeout_s changes; the engine check
    stops when turned off and starts when turned on (not when it was on already)."""
    restart_reaper = (old.enabled, old.idle_timeout_s) != (new.enabled, new.idle_timeout_s)
    return TaskPlan(
        stop_reaper=restart_reaper,
        stop_checker=not new.enabled or not new.check_engines,
        start_reaper=restart_reaper,
        start_checker=new.enabled and new.check_engines and not (old.enabled and old.check_engines),
    )


def wants_reaper(cfg: SessionLifecycleConfig) -> bool:
    return cfg.enabled and cfg.idle_timeout_s is not None


def wants_checker(cfg: SessionLifecycleConfig) -> bool:
    return cfg.enabled and cfg.check_engines


def reap_interval_s(idle_timeout_s: float) -> float:
    """How often the reaper sweeps: a quarter of the idle timeout, in [0.01, 5] s."""
    return max(0.01, min(idle_timeout_s / 4.0, 5.0))


def check_delays(rounds: int, first_s: float, max_s: float) -> tuple[float, ...]:
    """The waits after each unfinished round of the engine check: doubling from
    ``first_s``, capped at ``max_s``."""
    delays: list[float] = []
    delay = first_s
    for _ in range(rounds):
        delays.append(delay)
        delay = min(delay * 2, max_s)
    return tuple(delays)


# -- rate-limited warnings ------------------------------------------------------


class WarnThrottle:
    """At most one warning per key in ``interval_s``; the ones held back are counted and
    told with the next one. Keys are bounded (past ``max_keys`` the table restarts)."""

    __slots__ = ("_at", "interval_s", "max_keys")

    def __init__(self, interval_s: float, max_keys: int) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        # key -> (when the last warning was let through, how many held back since)
        self._at: dict[tuple[str, str], tuple[float, int]] = {}

    def admit(self, key: tuple[str, str], now: float) -> int | None:
        """None: hold this warning back (counted). Else let it through: the number held
        back since the last one."""
        last = self._at.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._at[key] = (last[0], last[1] + 1)
            return None
        suppressed = last[1] if last is not None else 0
        if len(self._at) >= self.max_keys and key not in self._at:
            self._at.clear()
        self._at[key] = (now, 0)
        return suppressed

    def __len__(self) -> int:
        return len(self._at)
