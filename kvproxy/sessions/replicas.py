"""The session manager's link to the state it shares with other replicas
(``state.backend: redis``): the :class:`~kvproxy.state.shared.SharedState` it owns, and
what that tells it back (a due session to close, another replica's close, the open
sessions to write back after an outage, the requests of a replica gone to abort)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvproxy.config import SessionLifecycleConfig, StateConfig
from kvproxy.observability import WindowedCounters
from kvproxy.sessions.lifecycle_core import open_snapshot
from kvproxy.sessions.lifecycle_metrics import CLOSED_IDLE
from kvproxy.sessions.table import SessionTable
from kvproxy.state.shared import SharedState, Store, replica_name


class Manager(Protocol):
    """What this module uses of :class:`~kvproxy.sessions.lifecycle.SessionManager`."""

    @property
    def _counters(self) -> WindowedCounters: ...

    @property
    def _closes(self) -> Mapping[str, Any]: ...

    @property
    def _table(self) -> SessionTable: ...

    @property
    def _clock(self) -> Callable[[], float]: ...

    @property
    def config(self) -> SessionLifecycleConfig: ...

    def _begin_close(self, session_id: str, reason: str, *, fan_out: bool = True) -> Any: ...

    def abort_orphans(self, rids: Sequence[str]) -> None: ...


def shared_state(manager: Manager, store: Store, cfg: StateConfig) -> SharedState:
    """``manager``'s shared state on ``store``, wired to its table and close sequence."""

    def close_due(session_id: str) -> None:
        # The shared sweep found the session idle, or owed by a replica that died: its
        # close is claimed, so one replica fans it out.
        if manager._begin_close(session_id, "idle") is not None:
            manager._counters.inc(CLOSED_IDLE)

    def remote_close(session_id: str) -> None:
        # Another replica closes the session: abort the requests of it held here, and
        # forget it (no fan-out here).
        if manager.config.enabled and session_id not in manager._closes:
            manager._begin_close(session_id, "remote", fan_out=False)

    def snapshot(now_wall: float) -> list[tuple[str, float, int]]:
        return open_snapshot(manager._table.live(), manager._clock(), now_wall)

    return SharedState(
        cfg,
        store,
        replica=replica_name(),
        closed_ttl_s=lambda: manager.config.closed_ttl_s,
        idle_timeout_s=lambda: manager.config.idle_timeout_s,
        closing=lambda: list(manager._closes),
        snapshot=snapshot,
        on_due=close_due,
        on_remote_close=remote_close,
        on_orphans=manager.abort_orphans,
    )
