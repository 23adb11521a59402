"""Ledger (request) mode's decisions: two FIFOs in front of the fleet-wide ledger. Pure.

Time is injected (``now``); nothing here awaits. The controller
(:mod:`kvproxy.admission.coordinator`) owns one :class:`FleetAdmission` and keeps only
what a waiting request needs from the event loop: its future and the aging timer.

Decision order for a sized, in-scope, unprotected request (:meth:`FleetAdmission.offer`;
the caller first drains at ``now`` when anything waits):

1. nobody waits in its FIFO and the ledger grants -> ``admit`` with a lease;
2. the ledger refuses ``degraded`` or ``oversized`` -> ``bypass`` at once (fail open);
3. the FIFOs already hold ``max_queue`` waiters -> ``bypass``/``queue_full``;
4. otherwise it waits at the tail of its FIFO (``pressure_guard`` /
   ``capacity_exhausted``, or someone is ahead of it).

Session residency (docs/admission.md): a request of a resident session (*continuing*)
waits in the ``continuing`` FIFO, every other in ``new``. :meth:`FleetAdmission.drain`
grants the continuing FIFO's heads first, then the new FIFO's, each in strict arrival
order: draining a FIFO stops at the first head the ledger refuses, and a refused new
head never blocks a continuing request. A head refused at ``enqueued_at + max_wait_s``
leaves as ``bypass``/``aged``; :meth:`FleetAdmission.next_deadline` says when that
comes, for the caller's timer.

Storage (:class:`FleetQueues`) has the two-lane shape of program mode's per-engine
queues: the fleet is its one engine (:data:`FLEET`),
with lanes ``continuing`` and ``new``. A withdrawn entry is skipped lazily at a head
and a lane is compacted when dead entries dominate: every operation is O(1) amortised.

The decisions are counted as they are made (``agentic_kv/admission/*``, named in
:mod:`kvproxy.admission.catalogue`) and every wait that ends is observed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvproxy.admission.catalogue import (
    C_ADMIT,
    C_BYPASS,
    C_BYPASS_REASON,
    C_CANCELLED,
    C_LEASE_EXPIRED,
    C_RESIDENCY_EVICTED,
    C_RESIDENCY_EXPIRED,
    C_WAIT,
    C_WAIT_CONTINUING,
    C_WAIT_GRANTED,
    C_WAIT_NEW_SESSION,
    C_WAIT_SECONDS_SUM,
)
from kvproxy.admission.fleet.ledger import DEGRADED, OVERSIZED, Ledger
from kvproxy.admission.records import Action, Decision, Mode, Outcome
from kvproxy.admission.report import WaitHistogram
from kvproxy.observability import WindowedCounters

FLEET = "fleet"  # the engine every entry waits for: the fleet's pooled capacity
CONTINUING = "continuing"  # lane of requests of resident sessions (served first)
NEW = "new"  # lane of everything else
_COMPACT_MIN = 64  # a lane longer than this is compacted when most of it is dead


@dataclass(slots=True)
class FleetEntry:
    ticket: str
    tokens: int
    enqueued_at: float
    session: str | None = None  # passed to the ledger (None when residency is off)
    live: bool = True
    engine: str = FLEET


class FleetQueues:
    """The two FIFOs and an index of live entries by ticket."""

    __slots__ = ("continuing", "entries", "live_continuing", "new")

    def __init__(self) -> None:
        self.continuing: deque[FleetEntry] = deque()
        self.new: deque[FleetEntry] = deque()
        self.entries: dict[str, tuple[FleetEntry, str]] = {}  # ticket -> (entry, lane)
        self.live_continuing = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self.entries

    def _lane(self, which: str) -> deque[FleetEntry]:
        return self.continuing if which == CONTINUING else self.new

    def push(self, entry: FleetEntry, which: str) -> None:
        self._lane(which).append(entry)
        if which == CONTINUING:
            self.live_continuing += 1
        self.entries[entry.ticket] = (entry, which)

    def head(self, url: str, which: str) -> FleetEntry | None:
        """The live head of lane ``which`` (``url``: every entry waits for :data:`FLEET`)."""
        lane = self._lane(which)
        while lane and not lane[0].live:
            lane.popleft()
        return lane[0] if lane else None

    def pop(self, url: str, which: str) -> FleetEntry:
        e = self._lane(which).popleft()
        self._unlive(e, which)
        self.entries.pop(e.ticket, None)
        return e

    def _unlive(self, e: FleetEntry, which: str) -> None:
        if e.live:
            e.live = False
            if which == CONTINUING:
                self.live_continuing -= 1

    def remove(self, ticket: str) -> FleetEntry | None:
        found = self.entries.pop(ticket, None)
        if found is None:
            return None
        entry, which = found
        self._unlive(entry, which)
        lane = self._lane(which)
        live = self.live_continuing if which == CONTINUING else len(self) - self.live_continuing
        if len(lane) > _COMPACT_MIN and len(lane) > 2 * live:
            kept = deque(e for e in lane if e.live)
            if which == CONTINUING:
                self.continuing = kept
            else:
                self.new = kept
        return entry

    def waiting(self, url: str) -> tuple[int, int]:
        """(continuing, new) live entries."""
        return self.live_continuing, len(self.entries) - self.live_continuing

    def heads(self) -> Iterator[FleetEntry]:
        for which in (CONTINUING, NEW):
            h = self.head(FLEET, which)
            if h is not None:
                yield h

    def oldest(self) -> FleetEntry | None:
        """The earlier of the two heads (each lane is in arrival order)."""
        best: FleetEntry | None = None
        for h in self.heads():
            if best is None or h.enqueued_at < best.enqueued_at:
                best = h
        return best

    def live(self) -> Iterator[tuple[FleetEntry, str]]:
        yield from self.entries.values()


# What a drain resolves: an entry and its decision (None: it was abandoned, its waiter
# gone before a decision; counted ``cancelled``).
Resolved = tuple[FleetEntry, Decision | None]


class FleetAdmission:
    """Ledger mode over one fleet-wide :class:`~kvproxy.admission.fleet.ledger.Ledger`."""

    __slots__ = (
        "_evicted_seen",
        "counters",
        "ledger",
        "max_queue",
        "max_wait_s",
        "queues",
        "waits",
    )

    def __init__(
        self,
        ledger: Ledger,
        counters: WindowedCounters,
        waits: WaitHistogram,
        *,
        max_wait_s: float,
        max_queue: int,
    ) -> None:
        self.ledger = ledger
        self.counters = counters
        self.waits = waits
        self.queues = FleetQueues()
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._evicted_seen = 0  # ledger.residency_evicted already counted

    def configure(self, *, max_wait_s: float, max_queue: int) -> None:
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue

    def bypass(self, reason: Outcome, tokens: int, wait_s: float = 0.0) -> Decision:
        """Forwarded without a lease (counted ``bypass`` and ``bypass_<reason>``)."""
        c = self.counters
        c.inc(C_BYPASS)
        c.inc(C_BYPASS_REASON[reason])
        return Decision(Action.BYPASS, reason, None, tokens, wait_s)

    def offer(
        self, ticket: str, tokens: int, now: float, sid: str | None, continuing: bool
    ) -> Decision | FleetEntry:
        """Decide for a request of ``tokens`` at ``now`` (see the module docstring);
        the entry it waits as when it is not decided at once. ``continuing``: its
        session is resident (``sid``: the session, None when residency is off)."""
        ledger = self.ledger
        queues = self.queues
        if continuing:
            assert sid is not None
            ledger.touch(sid, now)  # active: not idle-expired while it waits
            queued = queues.live_continuing
        else:
            queued = len(queues.entries) - queues.live_continuing
        if not queued:  # fast path: nobody ahead of it in its FIFO
            grant = ledger.reserve(ticket, tokens, now, sid, continuing=continuing)
            if grant.granted:
                self.counters.inc(C_ADMIT)
                return _admitted(grant.lease_id, grant.tokens, 0.0)
            reason = grant.reason
        else:
            reason = ledger.check(tokens, now, sid, continuing=continuing)
        if reason == DEGRADED:
            return self.bypass(Outcome.DEGRADED, tokens)
        if reason == OVERSIZED:
            return self.bypass(Outcome.OVERSIZED, tokens)
        if len(queues.entries) >= self.max_queue:
            return self.bypass(Outcome.QUEUE_FULL, tokens)
        entry = FleetEntry(ticket, tokens, now, sid)
        c = self.counters
        c.inc(C_WAIT)
        if continuing:
            queues.push(entry, CONTINUING)
            c.inc(C_WAIT_CONTINUING)
        else:
            queues.push(entry, NEW)
            if sid is not None:
                c.inc(C_WAIT_NEW_SESSION)
        return entry

    def drain(self, now: float, abandoned: Callable[[str], bool]) -> list[Resolved]:
        """Resolve heads while the ledger admits them: the continuing FIFO first, then
        the new one. ``abandoned(ticket)``: its waiter is gone (cancelled, not yet
        withdrawn): it leaves uncounted but for ``cancelled``, without a lease."""
        out: list[Resolved] = []
        self._drain_lane(CONTINUING, now, abandoned, out)
        self._drain_lane(NEW, now, abandoned, out)
        return out

    def _drain_lane(
        self, which: str, now: float, abandoned: Callable[[str], bool], out: list[Resolved]
    ) -> None:
        queues = self.queues
        continuing = which == CONTINUING
        while (e := queues.head(FLEET, which)) is not None:
            if abandoned(e.ticket):
                queues.pop(FLEET, which)
                self._cancelled(e, now)
                out.append((e, None))
                continue
            decision = self._head_decision(e, now, continuing)
            if decision is None:
                return  # strict FIFO: nobody overtakes a refused head
            queues.pop(FLEET, which)
            self.waits.observe(decision.wait_s)
            out.append((e, decision))

    def _head_decision(self, e: FleetEntry, now: float, continuing: bool) -> Decision | None:
        """How a head leaves now, or None while it waits."""
        waited = max(0.0, now - e.enqueued_at)
        grant = self.ledger.reserve(e.ticket, e.tokens, now, e.session, continuing=continuing)
        if grant.granted:
            c = self.counters
            c.inc(C_ADMIT)
            c.inc(C_WAIT_GRANTED)
            c.inc(C_WAIT_SECONDS_SUM, waited)
            return _admitted(grant.lease_id, grant.tokens, waited)
        if grant.reason == DEGRADED:
            return self.bypass(Outcome.DEGRADED, e.tokens, waited)
        if grant.reason == OVERSIZED:
            return self.bypass(Outcome.OVERSIZED, e.tokens, waited)
        if now >= e.enqueued_at + self.max_wait_s:  # refused at its deadline: fail open
            # (the timer's own deadline sum: a timer firing at the deadline always ages
            # the head, never re-arms for ~0 s on a rounding difference)
            return self.bypass(Outcome.AGED, e.tokens, waited)
        return None

    def _cancelled(self, e: FleetEntry, now: float) -> None:
        self.counters.inc(C_CANCELLED)
        self.waits.observe(now - e.enqueued_at)

    def cancel(self, ticket: str, now: float) -> bool:
        """Withdraw a waiting ticket (counted ``cancelled``); whether it was at a head
        (then the caller drains: the next one may go)."""
        found = self.queues.entries.get(ticket)
        if found is None:
            return False
        entry, which = found
        was_head = self.queues.head(FLEET, which) is entry
        self.queues.remove(ticket)
        self._cancelled(entry, now)
        return was_head

    def release_all(self, reason: Outcome, now: float) -> list[Resolved]:
        """Every waiter leaves as ``bypass``/``reason`` (stop, or disabled by a reload)."""
        out: list[Resolved] = []
        queues = self.queues
        for which in (CONTINUING, NEW):
            while (e := queues.head(FLEET, which)) is not None:
                queues.pop(FLEET, which)
                decision = self.bypass(reason, e.tokens, now - e.enqueued_at)
                self.waits.observe(decision.wait_s)
                out.append((e, decision))
        return out

    def housekeep(self, now: float, idle_s: float) -> None:
        """A poll's upkeep of the ledger: reconcile it, reclaim leases past their TTL
        and end residencies idle past ``idle_s`` (counted)."""
        ledger = self.ledger
        ledger.reconcile(now)
        expired = ledger.expire(now)
        if expired:
            self.counters.inc(C_LEASE_EXPIRED, len(expired))
        idle = ledger.expire_sessions(now, idle_s)
        if idle:
            self.counters.inc(C_RESIDENCY_EXPIRED, len(idle))
        self.sync_evicted()

    def sync_evicted(self) -> None:
        """Count the residencies the ledger's table bound dropped since last time."""
        evicted = self.ledger.residency_evicted
        if evicted > self._evicted_seen:
            self.counters.inc(C_RESIDENCY_EVICTED, evicted - self._evicted_seen)
        self._evicted_seen = evicted

    def next_deadline(self) -> float | None:
        """When the earlier head ages (None: nothing waits)."""
        oldest = self.queues.oldest()
        return None if oldest is None else oldest.enqueued_at + self.max_wait_s


def _admitted(lease_id: str | None, tokens: int, wait_s: float) -> Decision:
    """Admitted holding a lease of the fleet-wide ledger."""
    outcome = Outcome.CAPACITY_AVAILABLE
    return Decision(outcome.action, outcome, lease_id, tokens, wait_s, mode=Mode.FLEET)
