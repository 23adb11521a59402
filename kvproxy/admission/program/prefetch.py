"""Program admission's prefetch: when to make an idle session's prefix resident again
before its tool returns, and the prompts it resends. Pure: no I/O, time injected.

On an engine with a host KV tier (SGLang's HiCache) an idle session's prefix may have
left the device for host memory; its next turn then waits for the load back. A
prefetch is the session's last prompt sent again as one output token
(:func:`kvproxy.warm.warm_body`), through the router with the session's routing key,
``lead`` seconds before its tool is expected to return, so the load happens while the
tool runs. (SGLang has no call that loads a prefix from host to device ahead of a
request: HiCache's prefetch, ``HiRadixCache.prefetch_from_storage`` in sgl-project/sglang
``mem_cache/hiradix_cache.py``, brings the storage tier into host memory and is started by
a request's own match. So the mechanism is a request: its match loads what the host
holds.) Who and when (docs/admission.md#prefetch-before-the-tool-returns):

* the expected tool call is the shortest of the session's last :data:`TOOL_SAMPLES`
  (request after an answer: a late prefetch is wasted, an early one only loads sooner);
  a tool shorter than twice the lead is not planned for (its prefix has hardly left);
* a client that knows better says so (``POST /kvproxy/sessions/{id}/prefetch``);
* when it is due it is sent only to an engine with a host tier (without one a prefetch
  is a recompute moved earlier: measured to lose, docs/benchmarks.md), heard from
  lately, queueing nothing, under its pressure threshold, running fewer than
  ``min_inflight`` turns, with fewer than its bound of prefetches in flight and its
  sessions within pool + host, for a session still idle and not paused.

:class:`Prefetches` applies these rules over the ledger, :class:`PrefetchPlan` holds
who is due when, :class:`Prompts` the prompts to resend, bounded in bytes.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson

from kvproxy.admission.program.events import Event
from kvproxy.admission.program.ledger import EngineLedger, Session, SessionState
from kvproxy.admission.program.params import ProgramParams
from kvproxy.warm import body_bytes

# Tool calls remembered per session (the expected one is the shortest of them).
TOOL_SAMPLES = 4


def expected_tool_s(tool_s: tuple[float, ...]) -> float | None:
    """The tool call to plan for: the shortest of the last ones (None: none seen)."""
    return min(tool_s) if tool_s else None


def with_tool_call(tool_s: tuple[float, ...], seconds: float) -> tuple[float, ...]:
    """``tool_s`` with one more tool call, the oldest dropped past :data:`TOOL_SAMPLES`."""
    return (*tool_s[-(TOOL_SAMPLES - 1) :], seconds)


def tool_end_in_s(raw: bytes) -> float:
    """The body of ``POST /kvproxy/sessions/{id}/prefetch``: empty (the tool returns
    now) or ``{"in_s": seconds}`` (it returns in that many seconds); ValueError saying
    what is wrong otherwise."""
    if not raw.strip():
        return 0.0
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ValueError("body must be empty or a JSON object") from None
    if not isinstance(doc, dict):
        raise ValueError("body must be empty or a JSON object")
    unknown = sorted(set(doc) - {"in_s"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}: the only field is in_s")
    in_s = doc.get("in_s", 0.0)
    if isinstance(in_s, bool) or not isinstance(in_s, int | float) or not 0 <= in_s < 86_400:
        raise ValueError(f"in_s: must be a number of seconds in [0, 86400) (got {in_s!r})")
    return float(in_s)


class PrefetchPlan:
    """Who is due for a prefetch, when: one time per session, in a heap with lazy
    deletion (rebuilt once it holds more than twice the live entries). At most
    ``max_sessions`` sessions are planned for; past that a plan is refused."""

    __slots__ = ("_due", "_heap", "max_sessions")

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, sid: object) -> bool:
        return sid in self._due

    def plan(self, sid: str, at: float) -> bool:
        """Due at ``at`` (replacing any earlier plan); False when the table is full."""
        if sid not in self._due and len(self._due) >= self.max_sessions:
            return False
        self._due[sid] = at
        heapq.heappush(self._heap, (at, sid))
        if len(self._heap) > 2 * len(self._due) + 64:
            self._heap = [(t, s) for s, t in self._due.items()]
            heapq.heapify(self._heap)
        return True

    def cancel(self, sid: str) -> bool:
        """No prefetch for ``sid`` (its turn came, it ended); True if one was planned."""
        return self._due.pop(sid, None) is not None

    def pop_due(self, now: float) -> list[str]:
        """The sessions due at ``now``, earliest first; they leave the plan."""
        out: list[str] = []
        heap, due = self._heap, self._due
        while heap and heap[0][0] <= now:
            at, sid = heapq.heappop(heap)
            if due.get(sid) == at:
                del due[sid]
                out.append(sid)
        return out

    def clear(self) -> None:
        self._due.clear()
        self._heap.clear()


class Prefetches:
    """The prefetch's rules over program admission's ledger (the module docstring),
    counting into the core's ``events``. :class:`~kvproxy.admission.program.core.ProgramCore`
    calls it at a turn's arrival and answer, and asks it who is due at each tick."""

    __slots__ = ("events", "p", "plan")

    def __init__(self, params: ProgramParams, events: Counter[str]) -> None:
        self.p = params
        self.events = events
        self.plan = PrefetchPlan(params.max_sessions)

    def configure(self, params: ProgramParams) -> None:
        self.p = params
        self.plan.max_sessions = params.max_sessions

    def __len__(self) -> int:
        return len(self.plan)

    def __contains__(self, sid: object) -> bool:
        return sid in self.plan

    def tool_returned(self, s: Session, now: float) -> None:
        """An idle session's next turn arrived: its tool call's length is learned, and a
        prefetch still planned for it came too late."""
        if self.plan.cancel(s.sid):
            self.events[Event.PREFETCH_LATE] += 1
        if now > s.since:
            s.tool_s = with_tool_call(s.tool_s, now - s.since)

    def answered(self, s: Session, now: float) -> None:
        """The session's turn was answered: plan its prefetch ``prefetch_lead_s`` before
        the expected end of the tool call that follows (none for a tool under twice the
        lead)."""
        tool = expected_tool_s(s.tool_s)
        lead = self.p.prefetch_lead_s
        if tool is not None and tool >= 2 * lead and self.plan.plan(s.sid, now + tool - lead):
            self.events[Event.PREFETCH_PLANNED] += 1

    def expect(self, s: Session | None, in_s: float, now: float) -> bool:
        """A client says the session's tool returns in ``in_s`` seconds: its prefetch is
        due ``prefetch_lead_s`` before (none for a tool under twice the lead: its prefix
        has hardly left). False when the session is unknown, has no answer yet, or has a
        turn in flight."""
        if s is None or s.running or not s.turns:
            return False
        lead = self.p.prefetch_lead_s
        if in_s < 2 * lead:
            self.plan.cancel(s.sid)
            return True
        if not self.plan.plan(s.sid, now + in_s - lead):
            return False
        self.events[Event.PREFETCH_PLANNED] += 1
        return True

    def due(self, ledger: EngineLedger, now: float) -> list[tuple[str, str]]:
        """The prefetches to send now, as (session, engine): each counts in flight on
        its engine until :meth:`done`."""
        out: list[tuple[str, str]] = []
        for sid in self.plan.pop_due(now):
            s = ledger.get(sid)
            if s is None or s.running:
                continue
            skip = self._skip(ledger, s, now)
            if skip is not None:
                self.events[skip] += 1
                continue
            ledger.engines[s.engine].prefetching += 1
            self.events[Event.PREFETCH_SENT] += 1
            out.append((sid, s.engine))
        return out

    def _skip(self, ledger: EngineLedger, s: Session, now: float) -> Event | None:
        """Why a due prefetch is not sent (None: it is). Never to an engine that queues
        work, is under pressure, runs ``min_inflight`` turns of kvproxy's or more, or
        already loads its bound: it must not delay decodes. Nor where the engine's
        sessions overflow pool + host (``tier_room``): the prefix may be lost there, and
        the prefetch would recompute it (measured against sending on every idle engine:
        docs/benchmarks.md, "Prefetch before the tool returns")."""
        if s.state is not SessionState.ACTIVE or s.pause_pending:
            return Event.PREFETCH_SKIPPED_PAUSED
        eng = ledger.engines.get(s.engine)
        if eng is None or eng.host_tokens <= 0:
            return Event.PREFETCH_SKIPPED_NO_HOST_TIER
        usage = eng.token_usage
        if eng.observed_at is None or now - eng.observed_at > self.p.staleness_s or usage is None:
            return Event.PREFETCH_SKIPPED_STALE
        p = self.p
        if (
            eng.queue_reqs
            or usage >= p.pressure_threshold
            or eng.load.inflight >= p.min_inflight
            or eng.prefetching >= p.prefetch_max_in_flight
        ):
            return Event.PREFETCH_SKIPPED_BUSY
        if ledger.undecayed(s.engine) > ledger.tier_room(s.engine):
            return Event.PREFETCH_SKIPPED_OVERFLOW
        return None

    @staticmethod
    def done(ledger: EngineLedger, url: str) -> None:
        """A prefetch to ``url`` finished (any outcome)."""
        eng = ledger.engines.get(url)
        if eng is not None and eng.prefetching > 0:
            eng.prefetching -= 1

    def cancel(self, sid: str) -> None:
        self.plan.cancel(sid)

    def clear(self) -> None:
        self.plan.clear()


class Prompt(NamedTuple):
    """A session's last request, as it came: what its prefetch resends."""

    path: str
    body: Mapping[str, Any]
    routing_key: str | None
    authorization: str | None
    size: int


class Prompts:
    """The last request of each session with prefetch on, at most ``max_bytes`` in all
    (:func:`~kvproxy.warm.body_bytes`), the least recently kept out first. A body is
    kept by reference: it is the one the turn forwarded."""

    __slots__ = ("_items", "bytes", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Prompt] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def keep(
        self,
        sid: str,
        path: str,
        body: Mapping[str, Any],
        routing_key: str | None,
        authorization: str | None,
    ) -> None:
        self.forget(sid)
        size = body_bytes(body)
        if size > self.max_bytes:
            return
        self._items[sid] = Prompt(path, body, routing_key, authorization, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, sid: str) -> Prompt | None:
        return self._items.get(sid)

    def forget(self, sid: str) -> None:
        old = self._items.pop(sid, None)
        if old is not None:
            self.bytes -= old.size

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


__all__ = [
    "TOOL_SAMPLES",
    "PrefetchPlan",
    "Prefetches",
    "Prompt",
    "Prompts",
    "expected_tool_s",
    "tool_end_in_s",
    "with_tool_call",
]
