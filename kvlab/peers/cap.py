"""A fixed cap on live sessions per engine, as a pure core (time-free).

A session is *live* from its first admitted request to its close. Each session's
engine is the router's placement (the caller says which); a new session whose engine
already has ``cap`` live sessions waits in that engine's FIFO; a close admits the head
of its engine's FIFO. Requests of live sessions always pass. The bound of a schedule
that only limits how many sessions run at once on each engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class CapGate:
    cap: int
    live: dict[str, str] = field(default_factory=dict)  # session -> engine
    queues: dict[str, deque[str]] = field(default_factory=dict)  # engine -> FIFO
    max_queued: int = 1 << 20
    admitted_waiting: int = 0

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"cap must be >= 1, got {self.cap}")

    def count(self, engine: str) -> int:
        return sum(1 for e in self.live.values() if e == engine)

    def request(self, session: str, engine: str) -> bool:
        """True: the request passes now; False: the session waits in the FIFO."""
        if session in self.live:
            return True
        q = self.queues.setdefault(engine, deque())
        if not q and self.count(engine) < self.cap:
            self.live[session] = engine
            return True
        if session not in q:
            if len(q) >= self.max_queued:
                raise OverflowError(f"cap: more than {self.max_queued} sessions queued")
            q.append(session)
        return False

    def close(self, session: str) -> list[str]:
        """``session`` ended: the sessions its close admits (FIFO order)."""
        engine = self.live.pop(session, None)
        if engine is None:
            for q in self.queues.values():
                if session in q:
                    q.remove(session)
            return []
        admitted: list[str] = []
        q = self.queues.get(engine, deque())
        while q and self.count(engine) < self.cap:
            nxt = q.popleft()
            self.live[nxt] = engine
            admitted.append(nxt)
        self.admitted_waiting += len(admitted)
        return admitted
