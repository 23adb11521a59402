"""Sliding inactivity timeouts of bound sessions (``session_control.action: bind``). Pure.

A bound session is closed ``timeout`` seconds after the end of its last response,
unless another request of it starts first. Time is injected (``now``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Timer:
    timeout_s: float
    last_end: float
    running: int = 0


class BindTimers:
    """Bounded table of bound sessions; the oldest is dropped (not closed) past the cap."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._t: OrderedDict[str, _Timer] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._t)

    def started(self, sid: str, timeout_s: float, now: float) -> None:
        """A request of ``sid`` starts (its timeout is the latest one the client sent)."""
        t = self._t.get(sid)
        if t is None:
            t = self._t[sid] = _Timer(timeout_s, now)
        t.timeout_s = timeout_s
        t.running += 1
        self._t.move_to_end(sid)
        while len(self._t) > self.max_sessions:
            self._t.popitem(last=False)
            self.dropped += 1

    def ended(self, sid: str, now: float) -> None:
        """A request of ``sid`` has finished its response: the clock restarts."""
        t = self._t.get(sid)
        if t is not None:
            t.running = max(0, t.running - 1)
            t.last_end = now

    def forget(self, sid: str) -> None:
        self._t.pop(sid, None)

    def expired(self, now: float) -> list[str]:
        """Sessions idle (nothing running) for their timeout; removed from the table."""
        out = [
            sid for sid, t in self._t.items() if t.running == 0 and now - t.last_end >= t.timeout_s
        ]
        for sid in out:
            del self._t[sid]
        return out

    def timeout_of(self, sid: str) -> float | None:
        t = self._t.get(sid)
        return None if t is None else t.timeout_s

    def deadline(self, sid: str) -> float | None:
        t = self._t.get(sid)
        return None if t is None or t.running else t.last_end + t.timeout_s


__all__ = ["BindTimers"]
