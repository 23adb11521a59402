"""Program admission's ledger shared between replicas: the asyncio shell that sends this
replica's records and folds the others' in (:mod:`kvproxy.replication.ledger` is the
pure part; docs/design.md, "Shared admission state").

- The request path only marks sessions changed (:class:`SyncedLedger` calls back; no
  await, no I/O). One writer task turns what changed since its last pass into records
  (sessions, this replica's waiting first turns, its engagement) and sends them as one
  ``PUBLISH`` on ``<key_prefix>admission``: one round trip per batch, not per request.
- One listener task folds the other replicas' records into the ledger and, when a
  waiting turn may now go, drains the program gate.
- A beat task says this replica is alive every ``state.sweep_interval_s`` and forgets
  replicas not heard for ``state.replica_ttl_s`` (their running turns, waiters and
  engagement stop counting; an engine one held engaged alone is engaged here).
- Every store call is bounded by ``state.op_timeout_s``. On a timeout or an error the
  replica falls back: one WARNING (then at most one per 30 s), counters, nothing the
  others claimed counts any more, and its own ledger decides alone. Every
  ``state.retry_interval_s`` (and at each beat, as a failed send leaves the channel
  open) it tries again; when the store answers it says hello (the others send it their
  sessions) and sends its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import Metric

from kvproxy.admission.program.ledger import EngineLedger
from kvproxy.admission.program.queues import Queues
from kvproxy.config import StateConfig
from kvproxy.observability import WindowedCounters, counter_families, gauge_families
from kvproxy.replication.ledger import (
    SEP,
    Engaged,
    Hello,
    Left,
    Rec,
    SyncedLedger,
    Waiting,
    decode_batch,
    encode_batch,
    to_wall,
)
from kvproxy.state.link import StoreLink
from kvproxy.state.redis_store import StoreUnavailable

log = logging.getLogger(__name__)

_P = "agentic_kv/state/admission_"
UP = _P + "up"
PEERS = _P + "peers"
SENT = _P + "records_sent"
APPLIED = _P + "records_applied"
BATCHES = _P + "batches"
ERRORS = _P + "errors"
FALLBACKS = _P + "fallbacks"
REJOINS = _P + "rejoins"
DRAINS = _P + "drains"
GONE = _P + "replicas_gone"
TAKEN_OVER = _P + "engagements_taken_over"

COUNTER_HELP: dict[str, str] = {
    SENT: "Admission ledger records this replica sent to the others.",
    APPLIED: "Admission ledger records of other replicas folded into this one's.",
    BATCHES: "Publishes of admission ledger records (one round trip each).",
    ERRORS: "Admission ledger store calls that failed or timed out.",
    FALLBACKS: "Times this replica's admission fell back to its own ledger alone.",
    REJOINS: "Times this replica's admission rejoined the shared ledger.",
    DRAINS: "Waiting turns looked at again after another replica's records.",
    GONE: "Replicas forgotten by admission (not heard for state.replica_ttl_s).",
    TAKEN_OVER: "Engines a forgotten replica held engaged that this replica engaged.",
}
GAUGE_HELP: dict[str, str] = {
    UP: "1 while the admission ledger is shared (0: this replica admits alone).",
    PEERS: "Other replicas this replica's admission heard within state.replica_ttl_s.",
}

# Most records in one message (a full view is sent in several).
MAX_RECORDS = 500


class Channel(Protocol):
    """What the shell needs of a backend (:class:`~kvproxy.state.redis_store.RedisStore`)."""

    async def publish(self, message: str, channel: str | None = None) -> None: ...

    def messages(self, channel: str | None = None) -> AsyncIterator[str]: ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class Program(Protocol):
    """What the shell uses of :class:`~kvproxy.admission.program.core.ProgramCore`."""

    ledger: EngineLedger
    queues: Queues


class AdmissionSync:
    """One replica's link to the other replicas' admission ledgers."""

    def __init__(
        self,
        cfg: StateConfig,
        store: Channel,
        program: Program,
        *,
        replica: str,
        drain: Callable[[], None],
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.replica = replica
        self.channel = f"{cfg.key_prefix}admission"
        # A batch's lines each start "<kind><SEP><replica><SEP>" (one-letter kinds), and a
        # batch holds its sender's records only: this prefix at offset 2 marks our own.
        self._own = f"{replica}{SEP}"
        self._store = store
        self._program = program
        self._drain = drain
        self._clock = clock
        self._wall = wall
        self._dirty: dict[str, float] = {}  # session -> wall time of its last change
        self._waiting: dict[str, str] = {}  # ticket -> engine, as sent
        self._engaged: dict[str, tuple[bool, int]] = {}  # engine -> as sent
        self._hello = False  # say hello (and send the whole view) on the next pass
        self._full = False  # send the whole view on the next pass
        self._wake = asyncio.Event()
        self._counters = WindowedCounters(COUNTER_HELP)
        self._link = StoreLink(
            cfg,
            store,
            self._counters,
            log=log,
            errors=ERRORS,
            fallbacks=FALLBACKS,
            warning="shared admission: the store at %s is unavailable (%s); this replica "
            "admits from its own ledger until it answers again",
            on_fall_back=self._alone,
        )
        self.ledger = self._install()

    @property
    def up(self) -> bool:
        return self._link.up

    # -- the ledger --------------------------------------------------------------

    def _install(self) -> SyncedLedger:
        """The program's ledger as a :class:`SyncedLedger` calling back here (again
        after the program replaced it: a clear)."""
        led = self._program.ledger
        if not isinstance(led, SyncedLedger):
            mirror = getattr(self, "ledger", None)
            led = SyncedLedger.adopt(led, self.replica, None if mirror is None else mirror.mirror)
            self._program.ledger = led
        led.on_change = self._changed
        self.ledger = led
        return led

    def _changed(self, sid: str) -> None:
        # Stamped now: a record of another replica's older change no longer applies here.
        at = self._dirty[sid] = self._wall()
        self.ledger.mirror.versions[sid] = (at, self.replica)
        if len(self._dirty) == 1:
            self._wake.set()

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Start the writer, listener and beat tasks (the listener joins: a store that
        does not answer leaves this replica alone, retrying)."""
        self._link.up = True  # (a store down from the start warns once, as a later fall)
        self._link.start(
            [
                (self._write_loop(), "writer"),
                (self._listen_loop(), "listener"),
                (self._beat_loop(), "beat"),
            ],
            "kvproxy-admission",
        )

    async def stop(self) -> None:
        await self._link.stop()
        self.ledger.on_change = None

    # -- sending -----------------------------------------------------------------

    def pending(self) -> list[Rec]:
        """The records to send now: changed sessions, waiting first turns that came or
        went, engagement that changed (everything, after a hello)."""
        self._install()
        now, wall = self._clock(), self._wall()
        led, me = self.ledger, self.replica
        recs: list[Rec] = []
        if self._hello:
            recs.append(Hello(me, wall))
        full = self._hello or self._full
        self._hello = self._full = False
        if full:
            self._waiting.clear()
            self._engaged.clear()
            # The sessions whose latest record is this replica's, stamped as they were.
            for sid in led.sessions:
                at, by = led.mirror.versions.get(sid, (wall, me))
                if by == me:
                    self._dirty.setdefault(sid, at)
        dirty, self._dirty = self._dirty, {}
        recs.extend(led.record(sid, now, wall, at) for sid, at in dirty.items())
        recs.extend(self._waiter_records(now, wall))
        for url, eng in list(led.engines.items()):
            sent = (led.locally_engaged(url), eng.shared_prefix)
            if self._engaged.get(url) != sent:
                self._engaged[url] = sent
                recs.append(Engaged(me, wall, url, *sent))
        return recs

    def _waiter_records(self, now: float, wall: float) -> Iterator[Rec]:
        me, sent = self.replica, self._waiting
        current = {t: e for t, (e, which) in self._program.queues.entries.items() if which == "new"}
        for ticket in [t for t in sent if t not in current]:
            del sent[ticket]
            yield Left(me, wall, ticket)
        for ticket, e in current.items():
            if ticket in sent:
                continue
            sent[ticket] = e.engine
            # It has surely left by twice its bound (the core's aging), plus a beat.
            bound = e.deadline + (e.deadline - e.enqueued_at) + self.cfg.replica_ttl_s
            yield Waiting(
                me, wall, ticket, e.engine, to_wall(e.enqueued_at, now, wall),
                to_wall(bound, now, wall),
            )  # fmt: skip

    async def flush(self) -> bool:
        """Send what is pending (bounded); False when the store failed."""
        if not self.up:
            self._dirty.clear()
            return False
        recs = self.pending()
        for i in range(0, len(recs), MAX_RECORDS):
            chunk = recs[i : i + MAX_RECORDS]
            try:
                await asyncio.wait_for(
                    self._store.publish(encode_batch(chunk), self.channel), self.cfg.op_timeout_s
                )
            except (StoreUnavailable, TimeoutError) as exc:
                self._fall_back(exc)
                return False
            self._counters.inc(SENT, len(chunk))
            self._counters.inc(BATCHES)
        return True

    async def _write_loop(self) -> None:
        while not self._link.stopping:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("shared admission: sending failed")

    # -- receiving ---------------------------------------------------------------

    def receive(self, message: str) -> int:
        """Fold one message of another replica in; drains when a waiting turn may go.
        Returns the records applied."""
        self._install()
        if not message:  # (the store's mark: subscribed; say hello now)
            self._hello = True
            self._wake.set()
            return 0
        if message.startswith(self._own, 2):
            # This replica's own batch, back from the channel (every subscriber gets every
            # message): one sender per batch, so none of it applies here. Not decoded:
            # with N replicas that is 1/N of all that arrives.
            return 0
        now, wall = self._clock(), self._wall()
        applied, drain = 0, False
        for rec in decode_batch(message):
            if rec.replica == self.replica:
                continue
            applied += 1
            if isinstance(rec, Hello) and not rec.beat:
                self._full = True
                self._wake.set()
            drain = self.ledger.apply(rec, now, wall) or drain
        self._counters.inc(APPLIED, applied)
        if drain:
            self._counters.inc(DRAINS)
            self._drain()
        return applied

    async def _listen_loop(self) -> None:
        async def failed() -> None:
            self._fall_back(RuntimeError("listener failed"))

        await self._link.listen(
            lambda: self._store.messages(self.channel),
            self.receive,
            while_down=self._try_rejoin,
            on_error=failed,
            what="shared admission: the channel",
        )

    async def _try_rejoin(self) -> None:
        exc = await self._link.ping()
        if exc is not None:
            self._counters.inc(ERRORS)
            log.debug("shared admission: the store is still unavailable (%s)", exc)
            return
        if self.up:  # (the listener and the beat both try: the first one rejoined)
            return
        self._link.up = True
        self._hello = True  # the others send their whole view, and this replica its own
        self._wake.set()
        self._counters.inc(REJOINS)
        log.info("shared admission: the store answers again; this replica rejoined it")

    # -- liveness ----------------------------------------------------------------

    async def _beat_loop(self) -> None:
        while not self._link.stopping:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            try:
                await self.beat()
            except Exception:
                log.exception("shared admission: the beat failed")

    async def beat(self) -> list[str]:
        """Say this replica is alive; forget the replicas gone quiet. Returns them.
        Fallen back after a send failed (a publish past ``op_timeout_s``) while the
        channel stayed open, it first tries to rejoin: the listener, still receiving,
        would never notice."""
        self._install()
        if not self.up:
            await self._try_rejoin()
        gone = self.ledger.expire_replicas(self._clock(), self.cfg.replica_ttl_s)
        if gone:
            self._counters.inc(GONE, len(gone))
            if self.ledger.taken_over:
                self._counters.inc(TAKEN_OVER, len(self.ledger.taken_over))
                self._wake.set()  # (its engagement record goes out)
            self._drain()
        if self.up:
            try:
                message = encode_batch([Hello(self.replica, self._wall(), beat=True)])
                await asyncio.wait_for(
                    self._store.publish(message, self.channel), self.cfg.op_timeout_s
                )
            except (StoreUnavailable, TimeoutError) as exc:
                self._fall_back(exc)
        return gone

    def _fall_back(self, exc: BaseException) -> None:
        self._link.fall_back(exc)

    def _alone(self) -> None:
        # Nothing another replica claims counts any more; what was to be sent is not.
        self._dirty.clear()
        self._waiting.clear()
        self._engaged.clear()
        self.ledger.forget_others(self._clock())
        self._drain()

    # -- metrics -----------------------------------------------------------------

    def totals(self) -> dict[str, float]:
        return dict(self._counters.total_items())

    def gauges(self) -> dict[str, float]:
        now, ttl = self._clock(), self.cfg.replica_ttl_s
        peers = sum(1 for at in self.ledger.mirror.heard.values() if now - at <= ttl)
        return {UP: 1.0 if self.up else 0.0, PEERS: float(peers)}

    def collect(self) -> Iterator[Metric]:
        yield from counter_families(self._counters, COUNTER_HELP)
        yield from gauge_families(self.gauges(), GAUGE_HELP)

    def health(self) -> dict[str, Any]:
        return {"replica": self.replica, "up": self.up, **self.gauges()}


@contextlib.asynccontextmanager
async def running(sync: AdmissionSync) -> AsyncIterator[AdmissionSync]:
    await sync.start()
    try:
        yield sync
    finally:
        await sync.stop()
