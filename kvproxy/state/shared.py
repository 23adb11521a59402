"""The shared state's asyncio shell: one per replica, between the session lifecycle
(:mod:`kvproxy.sessions.lifecycle`) and the store.

- The request path only *submits* operations (:meth:`SharedState.submit`: no await, no
  I/O); one writer task sends what has queued up as one pipelined round trip.
- A close *claims* the session (:meth:`SharedState.claim_close`, one bounded round
  trip) so that exactly one replica fans ``/close_session`` out, then tells the others
  on the events channel (they abort the requests of the session they hold).
- A heartbeat task renews the replica's heartbeat and its claims, and, under a lease
  that one replica holds at a time, sweeps the sessions whose close is due (idle ones,
  and those whose final turn ran on a replica that died) and takes the requests a dead
  replica had in flight (their rids ride on the begin and end writes), to be aborted
  on every engine: a replica gone without closing its connections (a host lost, a
  process hung) leaves no request computing for nobody past ``replica_ttl_s`` +
  ``orphan_abort_after_s``.
- Every store call is bounded by ``state.op_timeout_s``. On a timeout or an error the
  replica *falls back*: one WARNING (then at most one per 30 s), what it would have
  written is dropped and counted, and its local session table goes on deciding alone
  (idle closes included). Every ``state.retry_interval_s`` it tries the store again;
  when it answers, the replica *rejoins*: it writes back its open sessions (their last
  activity and requests in flight) and is shared again.

Admission state is not here: program admission's ledger is shared on the same store by
:mod:`kvproxy.replication.sync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import Metric

from kvproxy.config import StateConfig
from kvproxy.observability import WindowedCounters, counter_families, gauge_families
from kvproxy.state.core import (
    Begin,
    Claim,
    Due,
    End,
    Finish,
    Heartbeat,
    Lease,
    Op,
    Orphans,
    Restore,
)
from kvproxy.state.link import StoreLink
from kvproxy.state.redis_store import StoreUnavailable, redacted_url

log = logging.getLogger(__name__)

_P = "agentic_kv/state/"
STORE_UP = _P + "store_up"
QUEUED_OPS = _P + "queued_ops"
OPS = _P + "ops"
BATCHES = _P + "batches"
DROPPED = _P + "ops_dropped"
ERRORS = _P + "store_errors"
FALLBACKS = _P + "fallbacks"
REJOINS = _P + "rejoins"
CLAIMS_LOST = _P + "close_claims_lost"
CLAIMS_UNCHECKED = _P + "close_claims_unchecked"
REMOTE_CLOSES = _P + "remote_closes"
SWEEPS = _P + "sweeps"
DUE = _P + "due_closes"
RESTORED = _P + "restored_sessions"
ORPHAN_ABORTS = _P + "orphan_aborts"

COUNTER_HELP: dict[str, str] = {
    OPS: "State operations written to the shared store.",
    BATCHES: "Pipelined round trips to the shared store.",
    DROPPED: "State operations dropped (store unavailable or queue full).",
    ERRORS: "Shared store calls that failed or timed out.",
    FALLBACKS: "Times this replica fell back to its local state.",
    REJOINS: "Times this replica rejoined the shared store.",
    CLAIMS_LOST: "Closes not fanned out here: another replica claimed the session.",
    CLAIMS_UNCHECKED: "Closes fanned out without a claim (the store was unavailable).",
    REMOTE_CLOSES: "Closes started by another replica applied here (its requests aborted).",
    SWEEPS: "Shared idle sweeps this replica ran (under the sweep lease).",
    DUE: "Sessions the shared sweep found due (idle, or owed by a dead replica).",
    RESTORED: "Open sessions written back to the store on rejoining.",
    ORPHAN_ABORTS: "Requests of replicas gone that this replica aborted on every engine.",
}
GAUGE_HELP: dict[str, str] = {
    STORE_UP: "1 while the shared store answers (0: this replica decides alone).",
    QUEUED_OPS: "State operations waiting for the writer.",
}

# Most operations queued for the writer, and in one pipelined round trip.
MAX_QUEUED = 20_000
MAX_BATCH = 512
# Most open sessions written back on rejoining.
MAX_RESTORE = 10_000
# Most rids of one request recorded as in flight.
MAX_REQUEST_RIDS = 16


class Store(Protocol):
    """What the shell needs of a backend (:class:`~kvproxy.state.redis_store.RedisStore`)."""

    async def execute(self, ops: Sequence[Op]) -> list[Any]: ...

    async def publish(self, message: str) -> None: ...

    def messages(self) -> AsyncIterator[str]: ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


def replica_name() -> str:
    """This process's name in the store: host, pid and a random part (unique per start)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SharedState:
    """One replica's link to the shared session state."""

    def __init__(
        self,
        cfg: StateConfig,
        store: Store,
        *,
        replica: str,
        closed_ttl_s: Callable[[], float],
        idle_timeout_s: Callable[[], float | None],
        closing: Callable[[], Iterable[str]],
        snapshot: Callable[[float], Iterable[tuple[str, float, int]]],
        on_due: Callable[[str], None],
        on_remote_close: Callable[[str], None],
        on_orphans: Callable[[list[str]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.replica = replica
        self._store = store
        self._closed_ttl_s = closed_ttl_s
        self._idle_timeout_s = idle_timeout_s
        self._closing = closing
        self._snapshot = snapshot
        self._on_due = on_due
        self._on_remote_close = on_remote_close
        self._on_orphans = on_orphans
        self._clock = clock
        self._queue: deque[Op] = deque()
        self._wake = asyncio.Event()
        self._counters = WindowedCounters(COUNTER_HELP)
        self._link = StoreLink(
            cfg,
            store,
            self._counters,
            log=log,
            errors=ERRORS,
            fallbacks=FALLBACKS,
            warning="shared state: the store at %s is unavailable (%s); this replica "
            "decides alone until it answers again",
            on_fall_back=self._drop_queued,
            warn_keys=4,
        )

    @property
    def up(self) -> bool:
        """The store answered last time: the shared state decides (not the local one)."""
        return self._link.up

    @property
    def started(self) -> bool:
        return self._link.started

    def now(self) -> float:
        return self._clock()

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Join (bounded: a store that does not answer leaves the replica in fallback,
        retrying), then start the writer, heartbeat and events tasks."""
        await self._try_rejoin(first=True)
        self._link.start(
            [
                (self._write_loop(), "writer"),
                (self._beat_loop(), "heartbeat"),
                (self._events_loop(), "events"),
            ],
            "kvproxy-state",
        )

    async def stop(self) -> None:
        """Flush what is queued (bounded), stop the tasks (bounded), close the client."""
        if self.up and self._queue:
            await self._flush()
        await self._link.stop()

    # -- the request path ------------------------------------------------------

    def submit(self, op: Op) -> None:
        """Queue ``op`` for the writer (no I/O). Dropped and counted while the store is
        unavailable (the rejoin writes the open sessions back) or the queue is full."""
        if not self.up or len(self._queue) >= MAX_QUEUED:
            self._counters.inc(DROPPED)
            return
        self._queue.append(op)
        if len(self._queue) == 1:
            self._wake.set()

    def begin(self, session_id: str, final: bool, rids: Sequence[str] = ()) -> None:
        """A request of ``session_id`` entered this replica (``final``: its last turn;
        ``rids``: what an abort of it names, in flight here until :meth:`end`)."""
        ttl = self.cfg.session_ttl_s
        rids = tuple(rids[:MAX_REQUEST_RIDS])
        self.submit(Begin(session_id, self.replica, self._clock(), ttl, final, rids))

    def end(self, session_id: str, rids: Sequence[str] = ()) -> None:
        """A request of ``session_id`` left this replica."""
        ttl = self.cfg.session_ttl_s
        rids = tuple(rids[:MAX_REQUEST_RIDS])
        self.submit(End(session_id, self.replica, self._clock(), ttl, rids))

    # -- closes ----------------------------------------------------------------

    async def claim_close(self, session_id: str) -> bool | None:
        """Claim the close of ``session_id`` (one bounded round trip, after what is
        queued). True: this replica fans it out (the others are told); False: another
        replica does or did; None: the store is unavailable, the caller closes anyway."""
        if not self.up:
            self._counters.inc(CLAIMS_UNCHECKED)
            return None
        now = self._clock()
        claim = Claim(session_id, self.replica, now, self.cfg.replica_ttl_s)
        # After what is queued (this replica's last writes of the session), in one trip.
        answers = await self.call([*self._take(), claim])
        if answers is None:
            self._counters.inc(CLAIMS_UNCHECKED)
            return None
        if not answers[-1]:
            self._counters.inc(CLAIMS_LOST)
            return False
        await self._publish(f"close\t{self.replica}\t{session_id}")
        return True

    def finish_close(self, session_id: str) -> None:
        """The close this replica claimed (or made without a claim) is done."""
        ttl = max(self._closed_ttl_s(), self.cfg.replica_ttl_s)
        self.submit(Finish(session_id, self.replica, self._clock(), ttl))

    async def _publish(self, message: str) -> None:
        try:
            await asyncio.wait_for(self._store.publish(message), self.cfg.op_timeout_s)
        except (StoreUnavailable, TimeoutError) as exc:
            self._fall_back(exc)

    # -- store calls -----------------------------------------------------------

    async def call(self, ops: Sequence[Op]) -> list[Any] | None:
        """Run ``ops`` in one round trip, bounded by ``op_timeout_s``; None (and a
        fallback) on a timeout or an error."""
        if not ops:
            return []
        try:
            answers = await asyncio.wait_for(self._store.execute(ops), self.cfg.op_timeout_s)
        except (StoreUnavailable, TimeoutError) as exc:
            self._counters.inc(DROPPED, len(ops))
            self._fall_back(exc)
            return None
        self._counters.inc(OPS, len(ops))
        self._counters.inc(BATCHES)
        return answers

    def _take(self, limit: int = MAX_BATCH) -> list[Op]:
        batch: list[Op] = []
        queue = self._queue
        while queue and len(batch) < limit:
            batch.append(queue.popleft())
        return batch

    async def _flush(self) -> None:
        for _ in range(MAX_QUEUED // MAX_BATCH + 1):
            batch = self._take()
            if not batch or await self.call(batch) is None:
                return

    def _fall_back(self, exc: BaseException) -> None:
        self._link.fall_back(exc)

    def _drop_queued(self) -> None:
        # (what it would have written: the rejoin writes the open sessions back)
        self._counters.inc(DROPPED, len(self._queue))
        self._queue.clear()

    async def _try_rejoin(self, *, first: bool = False) -> None:
        exc = await self._link.ping()
        if exc is not None:
            if first:
                self._link.up = True  # a fallback from the start: it warns once too
            self._fall_back(exc)
            return
        self._link.up = True
        restore = self._restore_ops()
        beat = self._beat_ops()
        if await self.call([*beat, *restore]) is None:
            return
        self._counters.inc(RESTORED, len(restore))
        if not first:
            self._counters.inc(REJOINS)
            log.info("shared state: the store answers again; this replica rejoined it")

    def _restore_ops(self) -> list[Op]:
        now = self._clock()
        ttl = self.cfg.session_ttl_s
        ops: list[Op] = []
        for sid, last, in_flight in self._snapshot(now):
            if len(ops) >= MAX_RESTORE:
                break
            ops.append(Restore(sid, self.replica, last, in_flight, now, ttl))
        return ops

    # -- background tasks ------------------------------------------------------

    async def _write_loop(self) -> None:
        while not self._link.stopping:
            await self._wake.wait()
            self._wake.clear()
            for _ in range(MAX_QUEUED // MAX_BATCH + 1):
                batch = self._take()
                if not batch:
                    break
                await self.call(batch)

    def _beat_ops(self) -> list[Op]:
        now, cfg = self._clock(), self.cfg
        closing = tuple(self._closing())[:MAX_BATCH]
        return [
            Heartbeat(self.replica, now, cfg.replica_ttl_s, closing),
            Lease("sweep", self.replica, now, cfg.replica_ttl_s),
        ]

    async def _beat_loop(self) -> None:
        while not self._link.stopping:
            if not self.up:
                await asyncio.sleep(self.cfg.retry_interval_s)
                await self._try_rejoin()
                continue
            await asyncio.sleep(self.cfg.sweep_interval_s)
            try:
                await self.beat()
            except Exception:
                log.exception("shared state: heartbeat failed")

    async def beat(self) -> list[str]:
        """Renew the heartbeat and claims; with the sweep lease, close what is due and
        abort what the replicas gone had in flight (one more round trip for both).
        Returns the sessions found due."""
        answers = await self.call(self._beat_ops())
        if answers is None or not answers[1]:
            return []
        self._counters.inc(SWEEPS)
        now = self._clock()
        # A replica not heard for replica_ttl_s is marked gone; orphan_abort_after_s
        # later (time to beat again, e.g. rejoining after the store came back, and for
        # its requests to end) those still recorded in flight are taken, each by one
        # sweep only.
        sweep: list[Op] = [Due(now, self._idle_timeout_s())]
        grace = self.cfg.orphan_abort_after_s
        if self._on_orphans is not None and grace is not None:
            sweep.append(Orphans(now, grace))
        found = await self.call(sweep)
        if not found:
            return []
        orphans: list[str] = found[1] if len(found) > 1 else []
        if orphans and self._on_orphans is not None:
            self._counters.inc(ORPHAN_ABORTS, len(orphans))
            self._on_orphans(orphans)
        due: list[str] = found[0]
        self._counters.inc(DUE, len(due))
        for sid in due:
            self._on_due(sid)
        return due

    async def _events_loop(self) -> None:
        async def pause() -> None:
            await asyncio.sleep(self.cfg.retry_interval_s)

        # (while down, the heartbeat task tries to rejoin)
        await self._link.listen(
            self._store.messages,
            self._on_message,
            while_down=None,
            on_error=pause,
            what="shared state: the events channel",
        )

    def _on_message(self, message: str) -> None:
        kind, _, rest = message.partition("\t")
        replica, _, session_id = rest.partition("\t")
        if kind == "close" and session_id and replica != self.replica:
            self._counters.inc(REMOTE_CLOSES)
            self._on_remote_close(session_id)

    # -- metrics ---------------------------------------------------------------

    def totals(self) -> dict[str, float]:
        return dict(self._counters.total_items())

    def gauges(self) -> dict[str, float]:
        return {STORE_UP: 1.0 if self.up else 0.0, QUEUED_OPS: float(len(self._queue))}

    def collect(self) -> Iterator[Metric]:
        yield from counter_families(self._counters, COUNTER_HELP)
        yield from gauge_families(self.gauges(), GAUGE_HELP)

    def health(self) -> dict[str, Any]:
        return {
            "backend": self.cfg.backend,
            "url": redacted_url(self.cfg.redis_url),
            "replica": self.replica,
            "store_up": self.up,
            "queued_ops": len(self._queue),
        }


@contextlib.asynccontextmanager
async def running(shared: SharedState) -> AsyncIterator[SharedState]:
    await shared.start()
    try:
        yield shared
    finally:
        await shared.stop()
