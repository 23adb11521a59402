"""The admission ledger: cluster KV capacity, pressure, leases, TTL, epoch, usage window.

Pure: no asyncio, no I/O. Time is passed in as a monotonic ``now``. One writer (the
coordinator) owns an instance. Mirrors the ``BudgetState`` of the Relax V2 design,
with per-engine freshness instead of one global timestamp.

Engines
    Each engine known to the fleet has a cached ``max_total_num_tokens`` (SGLang
    0.5.23 emits it once at startup, so the last value seen is kept) and a last
    *fresh* reading: a ``token_usage`` with the time it was observed. An engine is
    fresh while ``now - observed_at <= staleness_s`` and its capacity is known. Only
    fresh engines count: ``ceiling = int(sum(max_total of fresh engines) x headroom)``
    and ``pressure = max(token_usage of fresh engines)``. One engine whose scrapes
    fail drops out of both once its reading ages out; the rest keep admitting. The
    ledger is *degraded* (every decision fails open) only when no engine is fresh.

Epoch
    The sorted set of fresh engine URLs is the ledger's signature; the epoch goes up
    by one whenever it changes (so the first reading gives epoch 1, and an engine
    leaving, going stale, coming back or joining each bump it). Lease ids carry the
    epoch of their grant: ``f"{epoch}:{ticket_id}"``.

    Leases survive an epoch change, as in the Relax V2 design. A lease stands for an
    attempt that is running (or about to run) on some engine; dropping it would
    forget KV that is still in use on the surviving engines and over-admit exactly
    when capacity just shrank. Keeping it errs the other way: ``reserved`` may exceed
    the smaller ceiling for a while, so new requests wait until those attempts end
    (an attempt on a lost engine ends soon, with an upstream error, and releases its
    lease), and no request waits longer than ``max_wait_s`` anyway. The TTL reclaims
    any lease whose holder vanished.

Leases
    Idempotent per ticket: reserving a ticket that already holds a lease returns that
    lease with its original tokens, never a second charge. Releasing an unknown lease
    is a no-op, so a double release is safe; ``reserved`` never goes below zero.
    Leases are kept in creation order, so TTL expiry looks only at the oldest ones.

Decisions (``reserve``), in order: existing lease -> granted (same lease);
no fresh engine -> ``degraded``; tokens > ceiling -> ``oversized`` (it could never
fit; the coordinator bypasses it instead of letting it block the FIFO head);
pressure >= threshold -> ``pressure_guard``; committed + tokens > ceiling ->
``capacity_exhausted``; else granted (``capacity_available``). For a resident
session only the degraded and pressure checks apply.

Session residency (program-aware mode; docs/admission.md)
    A lease may carry a session id. When such a lease is released (the request
    ended), the session becomes (or stays) *resident*: ``resident[sid] =
    max(resident[sid], the lease's full tokens)`` and the session is idle since
    ``now``. ``committed = reserved + resident_total`` is what the capacity check of
    *new* work uses: ``committed + tokens > ceiling -> capacity_exhausted``. A request
    of a resident session is never held for capacity (its KV is already counted, and
    holding it could deadlock the sessions expected to free room): only ``degraded``
    and ``pressure_guard`` apply, and its lease charges only the growth
    ``max(0, tokens - resident[sid])``. Residency ends with :meth:`end_session` (the
    session closed), :meth:`expire_sessions` (idle for ``idle_s`` with no live lease),
    or the ``max_resident_sessions`` bound (least recently active idle session first).
    A lease reclaimed by the TTL does not add residency (its holder vanished).

Usage window
    Each :meth:`reconcile` (one per poll) with at least one fresh engine adds a
    sample: the mean and the max of the fresh engines' usage. ``kv_token_usage_mean``
    is the mean of the per-poll means over the window, ``kv_token_usage_max`` the peak
    per-poll max. Resetting the window restarts the mean and sets the peak to the
    current max (the current level, not zero).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from kvproxy.record import Record

CAPACITY_AVAILABLE = "capacity_available"
CAPACITY_EXHAUSTED = "capacity_exhausted"
PRESSURE_GUARD = "pressure_guard"
DEGRADED = "degraded"
OVERSIZED = "oversized"


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine's last fresh reading."""

    url: str
    max_total_num_tokens: int
    token_usage: float
    observed_at: float


@dataclass(frozen=True, slots=True)
class EngineView:
    """An engine as the ledger sees it at some ``now`` (for health reports)."""

    url: str
    fresh: bool
    max_total_num_tokens: int | None
    token_usage: float | None
    age_s: float | None


class Lease(Record):
    __slots__ = (
        "created_at",
        "epoch",
        "full_tokens",
        "lease_id",
        "session_id",
        "ticket_id",
        "tokens",
    )

    def __init__(
        self,
        lease_id: str,
        ticket_id: str,
        tokens: int,
        epoch: int,
        created_at: float,
        session_id: str | None = None,
        full_tokens: int = 0,
    ) -> None:
        self.lease_id: Final = lease_id
        self.ticket_id: Final = ticket_id
        # Charged to ``reserved`` (for a resident session: the growth only).
        self.tokens: Final = tokens
        self.epoch: Final = epoch
        self.created_at: Final = created_at
        self.session_id: Final = session_id
        # The request's whole reservation (prefix + completion budget); equals
        # ``tokens`` unless the session was resident when the lease was granted.
        self.full_tokens: Final = full_tokens


class Grant(Record):
    __slots__ = ("charged", "epoch", "granted", "lease_id", "reason", "tokens")

    def __init__(
        self,
        granted: bool,
        reason: str,
        lease_id: str | None,
        tokens: int,
        epoch: int,
        charged: int = 0,
    ) -> None:
        self.granted: Final = granted
        self.reason: Final = reason
        self.lease_id: Final = lease_id
        self.tokens: Final = tokens  # the request's reservation (a lease's ``full_tokens``)
        self.epoch: Final = epoch
        # Tokens charged to ``reserved`` (smaller than ``tokens`` for a resident session).
        self.charged: Final = charged


class _Resident:
    __slots__ = ("last_active", "tokens")

    def __init__(self, tokens: int, last_active: float) -> None:
        self.tokens = tokens
        self.last_active = last_active


class _Engine:
    __slots__ = ("max_total", "snapshot", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.max_total: int | None = None
        self.snapshot: EngineSnapshot | None = None


class Ledger:
    """Capacity, pressure and leases for one fleet of engines."""

    def __init__(
        self,
        *,
        headroom: float = 0.90,
        pressure_threshold: float = 0.92,
        lease_ttl_s: float = 600.0,
        staleness_s: float = 6.0,
        session_residency: bool = True,
        max_resident_sessions: int = 100_000,
    ) -> None:
        self.headroom = headroom
        self.pressure_threshold = pressure_threshold
        self.lease_ttl_s = lease_ttl_s
        self.staleness_s = staleness_s
        self.session_residency = session_residency
        self.max_resident_sessions = max_resident_sessions

        self._engines: dict[str, _Engine] = {}
        self._signature: tuple[str, ...] = ()
        self._dirty = True
        # Earliest time at which a fresh engine goes stale (recompute needed then).
        self._next_expiry = math.inf

        self.epoch = 0
        self.ceiling = 0
        self.reserved = 0
        self.pressure = 0.0  # max usage over fresh engines
        self.mean_usage = 0.0  # mean usage over fresh engines
        self.fresh_count = 0

        self._leases: dict[str, Lease] = {}  # insertion (= creation) order
        self._lease_by_ticket: dict[str, str] = {}

        # Residency: session -> resident tokens and last activity. ``_idle`` holds the
        # resident sessions with no live lease, least recently active first (the
        # order idle expiry and the table bound consume). ``_live`` counts the live
        # leases of each session; ``_ended`` marks sessions ended while a lease was
        # live (its release must not make them resident again).
        self._resident: dict[str, _Resident] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._live: dict[str, int] = {}
        self._ended: set[str] = set()
        self.resident_total = 0
        self.residency_expired = 0  # cumulative: idle expiry
        self.residency_evicted = 0  # cumulative: max_resident_sessions bound
        self._now = -math.inf  # latest time seen (release without an explicit now)

        self._usage_sum = 0.0
        self._usage_count = 0
        self._peak_usage = 0.0

    # -- configuration ---------------------------------------------------------------

    def configure(
        self,
        *,
        headroom: float,
        pressure_threshold: float,
        lease_ttl_s: float,
        staleness_s: float,
        session_residency: bool | None = None,
        max_resident_sessions: int | None = None,
    ) -> None:
        """Apply new thresholds; they take effect at the next decision.

        Turning ``session_residency`` off forgets every resident session.
        """
        self.headroom = headroom
        self.pressure_threshold = pressure_threshold
        self.lease_ttl_s = lease_ttl_s
        self.staleness_s = staleness_s
        if session_residency is not None:
            if self.session_residency and not session_residency:
                self.clear_residency()
            self.session_residency = session_residency
        if max_resident_sessions is not None:
            self.max_resident_sessions = max_resident_sessions
        self._dirty = True

    # -- engine readings ---------------------------------------------------------------

    def observe(
        self,
        url: str,
        *,
        now: float,
        max_total_num_tokens: int | None = None,
        token_usage: float | None = None,
        num_used_tokens: int | None = None,
    ) -> bool:
        """Record one successful scrape of ``url``. Returns whether it was fresh.

        ``max_total_num_tokens`` is cached when given. The reading is fresh when it
        has a usage: ``token_usage`` itself, or ``num_used_tokens`` over the cached
        capacity. A scrape without either leaves the previous reading to age out.
        """
        eng = self._engines.get(url)
        if eng is None:
            eng = self._engines[url] = _Engine(url)
        if max_total_num_tokens is not None and max_total_num_tokens > 0:
            eng.max_total = int(max_total_num_tokens)
        if eng.max_total is None:
            return False
        usage = token_usage
        if usage is None and num_used_tokens is not None:
            usage = num_used_tokens / eng.max_total
        if usage is None or math.isnan(usage):
            return False
        usage = min(1.0, max(0.0, float(usage)))
        eng.snapshot = EngineSnapshot(url, eng.max_total, usage, now)
        self._dirty = True
        return True

    def retain(self, urls: tuple[str, ...] | list[str]) -> None:
        """Forget every engine not in ``urls`` (it left the fleet)."""
        keep = set(urls)
        gone = [u for u in self._engines if u not in keep]
        for u in gone:
            del self._engines[u]
        if gone:
            self._dirty = True

    def clear_engines(self) -> None:
        """Forget every engine: the ledger becomes degraded."""
        self._engines.clear()
        self._dirty = True

    def usage_of(self, url: str, now: float) -> float | None:
        """The engine's fresh ``token_usage``; None when unknown or stale."""
        eng = self._engines.get(url)
        if eng is None or eng.snapshot is None or not self._is_fresh(eng, now):
            return None
        return eng.snapshot.token_usage

    def _is_fresh(self, eng: _Engine, now: float) -> bool:
        s = eng.snapshot
        return (
            s is not None and now - s.observed_at <= self.staleness_s and s.max_total_num_tokens > 0
        )

    def _recompute(self, now: float) -> None:
        snaps: list[EngineSnapshot] = []
        for eng in self._engines.values():
            if eng.snapshot is not None and self._is_fresh(eng, now):
                snaps.append(eng.snapshot)
        signature = tuple(sorted(s.url for s in snaps))
        if signature != self._signature:
            self.epoch += 1
            self._signature = signature
        self.fresh_count = len(snaps)
        if snaps:
            usages = [s.token_usage for s in snaps]
            self.pressure = max(usages)
            self.mean_usage = sum(usages) / len(usages)
            self.ceiling = int(sum(s.max_total_num_tokens for s in snaps) * self.headroom)
            self._next_expiry = min(s.observed_at for s in snaps) + self.staleness_s
        else:
            self.pressure = 0.0
            self.mean_usage = 0.0
            self.ceiling = 0
            self._next_expiry = math.inf
        self._dirty = False

    def refresh(self, now: float) -> None:
        """Recompute the fresh set if a reading changed or one aged out. O(1) otherwise."""
        if self._dirty or now > self._next_expiry:
            self._recompute(now)

    def reconcile(self, now: float) -> None:
        """Recompute after a poll and add one sample to the usage window."""
        self._recompute(now)
        if self.fresh_count:
            self._usage_sum += self.mean_usage
            self._usage_count += 1
            self._peak_usage = max(self._peak_usage, self.pressure)

    def is_degraded(self, now: float) -> bool:
        self.refresh(now)
        return self.fresh_count == 0 or self.ceiling <= 0

    def engines(self, now: float) -> list[EngineView]:
        views = []
        for eng in self._engines.values():
            s = eng.snapshot
            views.append(
                EngineView(
                    url=eng.url,
                    fresh=self._is_fresh(eng, now),
                    max_total_num_tokens=eng.max_total,
                    token_usage=None if s is None else s.token_usage,
                    age_s=None if s is None else now - s.observed_at,
                )
            )
        return views

    # -- leases ------------------------------------------------------------------------

    def lease_for_ticket(self, ticket_id: str) -> Lease | None:
        lease_id = self._lease_by_ticket.get(ticket_id)
        return None if lease_id is None else self._leases.get(lease_id)

    @property
    def committed(self) -> int:
        """Tokens counted against the ceiling: live leases plus resident sessions."""
        return self.reserved + self.resident_total

    def check(
        self,
        tokens: int,
        now: float,
        session_id: str | None = None,
        *,
        continuing: bool = False,
    ) -> str:
        """The reason ``reserve`` would give for a new ticket of ``tokens`` (no side effects)."""
        if self.is_degraded(now):
            return DEGRADED
        if self._treat_as_resident(session_id, continuing):
            if self.pressure >= self.pressure_threshold:
                return PRESSURE_GUARD
            return CAPACITY_AVAILABLE
        if tokens > self.ceiling:
            return OVERSIZED
        if self.pressure >= self.pressure_threshold:
            return PRESSURE_GUARD
        if self.reserved + self.resident_total + tokens > self.ceiling:
            return CAPACITY_EXHAUSTED
        return CAPACITY_AVAILABLE

    def _treat_as_resident(self, session_id: str | None, continuing: bool) -> bool:
        if session_id is None or not self.session_residency:
            return False
        return continuing or session_id in self._resident

    def reserve(
        self,
        ticket_id: str,
        tokens: int,
        now: float,
        session_id: str | None = None,
        *,
        continuing: bool = False,
    ) -> Grant:
        """Grant a lease for ``ticket_id`` or say why not.

        ``session_id`` (ignored when ``session_residency`` is off) ties the lease to a
        session. A resident session, or any session when ``continuing`` is true (the
        coordinator classified the request as continuing on arrival, and its
        residency ended while it waited), is held only by ``degraded`` /
        ``pressure_guard``, and its lease charges ``max(0, tokens - resident)``.
        """
        existing = self.lease_for_ticket(ticket_id)
        if existing is not None:
            return Grant(
                True,
                CAPACITY_AVAILABLE,
                existing.lease_id,
                existing.full_tokens,
                existing.epoch,
                existing.tokens,
            )
        if now > self._now:
            self._now = now
        tokens = max(0, int(tokens))
        sid = session_id if self.session_residency else None
        reason = self.check(tokens, now, sid, continuing=continuing)
        if reason != CAPACITY_AVAILABLE:
            return Grant(False, reason, None, tokens, self.epoch)
        charge = tokens
        if sid is not None:
            res = self._resident.get(sid)
            if res is not None:
                charge = max(0, tokens - res.tokens)
                self._idle.pop(sid, None)  # busy: not idle while a lease is live
            self._live[sid] = self._live.get(sid, 0) + 1
            self._ended.discard(sid)
        lease_id = f"{self.epoch}:{ticket_id}"
        self._leases[lease_id] = Lease(lease_id, ticket_id, charge, self.epoch, now, sid, tokens)
        self._lease_by_ticket[ticket_id] = lease_id
        self.reserved += charge
        return Grant(True, CAPACITY_AVAILABLE, lease_id, tokens, self.epoch, charge)

    def release(self, lease_id: str, now: float | None = None, *, ran: bool = True) -> Lease | None:
        """Release a lease; unknown ids (already released or expired) are a no-op.

        A lease of a session makes the session resident with its full tokens, idle
        since ``now`` (default: the latest time the ledger has seen). ``ran=False``
        (the request was never forwarded) marks the session active but adds no
        tokens.
        """
        lease = self._drop_lease(lease_id)
        if lease is not None and lease.session_id is not None:
            t = self._now if now is None else now
            if t > self._now:
                self._now = t
            self._settle(lease, t, grow=ran)
        return lease

    def release_ticket(
        self, ticket_id: str, now: float | None = None, *, ran: bool = True
    ) -> Lease | None:
        lease_id = self._lease_by_ticket.get(ticket_id)
        return None if lease_id is None else self.release(lease_id, now, ran=ran)

    def _drop_lease(self, lease_id: str) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        if self._lease_by_ticket.get(lease.ticket_id) == lease_id:
            del self._lease_by_ticket[lease.ticket_id]
        self.reserved = max(0, self.reserved - lease.tokens)
        return lease

    def _unlive(self, sid: str) -> tuple[int, bool]:
        """One live lease of ``sid`` ended: (live leases left, whether it was ended)."""
        left = self._live.get(sid, 1) - 1
        ended = sid in self._ended
        if left <= 0:
            self._live.pop(sid, None)
            self._ended.discard(sid)
            left = 0
        else:
            self._live[sid] = left
        return left, ended

    def _settle(self, lease: Lease, now: float, *, grow: bool) -> None:
        sid = lease.session_id
        assert sid is not None
        left, ended = self._unlive(sid)
        if ended or not self.session_residency:
            return
        res = self._resident.get(sid)
        if res is None:
            if not grow:
                return
            res = self._resident[sid] = _Resident(lease.full_tokens, now)
            self.resident_total += lease.full_tokens
        else:
            if grow and lease.full_tokens > res.tokens:
                self.resident_total += lease.full_tokens - res.tokens
                res.tokens = lease.full_tokens
            res.last_active = now
        if left == 0:
            self._idle[sid] = None
            self._idle.move_to_end(sid)
            self._enforce_bound()

    def _enforce_bound(self) -> None:
        idle = self._idle
        while len(self._resident) > self.max_resident_sessions and idle:
            self._drop_residency(next(iter(idle)))
            self.residency_evicted += 1

    def _drop_residency(self, sid: str) -> bool:
        res = self._resident.pop(sid, None)
        if res is None:
            return False
        self._idle.pop(sid, None)
        self.resident_total = max(0, self.resident_total - res.tokens)
        return True

    def note_unleased_turn(self, session_id: str, tokens: int, now: float) -> None:
        """A turn of the session ran without a lease (it aged out of the FIFO).

        Its KV is in the engines all the same, so the session becomes (or stays)
        resident with ``max(resident, tokens)``, exactly as a released lease would
        make it; otherwise each of its later turns would be new work and wait again.
        """
        if not self.session_residency:
            return
        tokens = max(0, int(tokens))
        res = self._resident.get(session_id)
        if res is None:
            res = self._resident[session_id] = _Resident(tokens, now)
            self.resident_total += tokens
        else:
            if tokens > res.tokens:
                self.resident_total += tokens - res.tokens
                res.tokens = tokens
            res.last_active = max(res.last_active, now)
        if session_id not in self._live:
            self._idle[session_id] = None
            self._idle.move_to_end(session_id)
            self._enforce_bound()

    def is_resident(self, session_id: str | None) -> bool:
        return session_id is not None and session_id in self._resident

    def resident_tokens(self, session_id: str) -> int:
        res = self._resident.get(session_id)
        return 0 if res is None else res.tokens

    def touch(self, session_id: str, now: float) -> None:
        """A request of a resident session arrived: it is active now (not idle-expired)."""
        res = self._resident.get(session_id)
        if res is None:
            return
        res.last_active = max(res.last_active, now)
        if session_id in self._idle:
            self._idle.move_to_end(session_id)

    def end_session(self, session_id: str) -> bool:
        """Drop the session's residency (it closed). Idempotent; returns whether it was resident.

        A lease of the session still live is released normally but adds no residency.
        """
        if session_id in self._live:
            self._ended.add(session_id)
        return self._drop_residency(session_id)

    def expire_sessions(self, now: float, idle_s: float) -> tuple[str, ...]:
        """Drop the residency of sessions with no live lease idle for more than ``idle_s``."""
        idle = self._idle
        resident = self._resident
        out: list[str] = []
        while idle:
            sid = next(iter(idle))
            if now - resident[sid].last_active <= idle_s:
                break  # least recently active first: the rest are younger
            self._drop_residency(sid)
            out.append(sid)
        self.residency_expired += len(out)
        return tuple(out)

    def clear_residency(self) -> None:
        """Forget every resident session; live leases of sessions add none when released."""
        self._ended.update(self._live)
        self._resident.clear()
        self._idle.clear()
        self.resident_total = 0

    @property
    def resident_sessions(self) -> int:
        return len(self._resident)

    def expire(self, now: float) -> tuple[Lease, ...]:
        """Release every lease older than ``lease_ttl_s``; returns them.

        The holder vanished: a session's residency is not raised, and it stays idle
        since its last real activity (placed first in line for idle expiry).
        """
        expired: list[Lease] = []
        for lease in self._leases.values():
            if now - lease.created_at <= self.lease_ttl_s:
                break  # creation order: the rest are younger
            expired.append(lease)
        for lease in expired:
            self._drop_lease(lease.lease_id)
            sid = lease.session_id
            if sid is None:
                continue
            left, _ = self._unlive(sid)
            if left == 0 and sid in self._resident:
                self._idle[sid] = None
                self._idle.move_to_end(sid, last=False)
        return tuple(expired)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    # -- metrics -----------------------------------------------------------------------

    def snapshot(self, now: float, *, reset_usage_window: bool = False) -> dict[str, float]:
        """Budget metrics (``agentic_kv/budget/*`` keys).

        ``reserved`` is live leases, ``resident`` the resident sessions' tokens,
        ``committed`` their sum; ``available_tokens = max(0, ceiling - committed)`` and
        ``reserved_utilization = committed / ceiling`` (present only when the ceiling
        is positive).
        """
        degraded = self.is_degraded(now)
        stale = sum(1 for e in self._engines.values() if not self._is_fresh(e, now))
        committed = self.reserved + self.resident_total
        out: dict[str, float] = {
            "agentic_kv/budget/ceiling": float(self.ceiling),
            "agentic_kv/budget/reserved": float(self.reserved),
            "agentic_kv/budget/resident": float(self.resident_total),
            "agentic_kv/budget/resident_sessions": float(len(self._resident)),
            "agentic_kv/budget/committed": float(committed),
            "agentic_kv/budget/available_tokens": float(max(0, self.ceiling - committed)),
            "agentic_kv/budget/lease_count": float(len(self._leases)),
            "agentic_kv/budget/kv_token_usage_mean": (
                self._usage_sum / self._usage_count if self._usage_count else self.mean_usage
            ),
            "agentic_kv/budget/kv_token_usage_max": (
                self._peak_usage if self._usage_count else self.pressure
            ),
            "agentic_kv/budget/epoch": float(self.epoch),
            "agentic_kv/budget/degraded": 1.0 if degraded else 0.0,
            "agentic_kv/budget/engines_fresh": float(self.fresh_count),
            "agentic_kv/budget/engines_stale": float(stale),
        }
        if self.ceiling > 0:
            out["agentic_kv/budget/reserved_utilization"] = committed / self.ceiling
        if reset_usage_window:
            self.reset_usage_window()
        return out

    def reset_usage_window(self) -> None:
        self._peak_usage = self.pressure
        self._usage_sum = 0.0
        self._usage_count = 0
