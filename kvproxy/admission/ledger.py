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
pressure >= threshold -> ``pressure_guard``; reserved + tokens > ceiling ->
``capacity_exhausted``; else granted (``capacity_available``).

Usage window
    Each :meth:`reconcile` (one per poll) with at least one fresh engine adds a
    sample: the mean and the max of the fresh engines' usage. ``kv_token_usage_mean``
    is the mean of the per-poll means over the window, ``kv_token_usage_max`` the peak
    per-poll max. Resetting the window restarts the mean and sets the peak to the
    current max (the current level, not zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    ticket_id: str
    tokens: int
    epoch: int
    created_at: float


@dataclass(frozen=True, slots=True)
class Grant:
    granted: bool
    reason: str
    lease_id: str | None
    tokens: int
    epoch: int


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
    ) -> None:
        self.headroom = headroom
        self.pressure_threshold = pressure_threshold
        self.lease_ttl_s = lease_ttl_s
        self.staleness_s = staleness_s

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
    ) -> None:
        """Apply new thresholds; they take effect at the next decision."""
        self.headroom = headroom
        self.pressure_threshold = pressure_threshold
        self.lease_ttl_s = lease_ttl_s
        self.staleness_s = staleness_s
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

    def check(self, tokens: int, now: float) -> str:
        """The reason ``reserve`` would give for a new ticket of ``tokens`` (no side effects)."""
        if self.is_degraded(now):
            return DEGRADED
        if tokens > self.ceiling:
            return OVERSIZED
        if self.pressure >= self.pressure_threshold:
            return PRESSURE_GUARD
        if self.reserved + tokens > self.ceiling:
            return CAPACITY_EXHAUSTED
        return CAPACITY_AVAILABLE

    def reserve(self, ticket_id: str, tokens: int, now: float) -> Grant:
        existing = self.lease_for_ticket(ticket_id)
        if existing is not None:
            return Grant(
                True, CAPACITY_AVAILABLE, existing.lease_id, existing.tokens, existing.epoch
            )
        tokens = max(0, int(tokens))
        reason = self.check(tokens, now)
        if reason != CAPACITY_AVAILABLE:
            return Grant(False, reason, None, tokens, self.epoch)
        lease_id = f"{self.epoch}:{ticket_id}"
        self._leases[lease_id] = Lease(lease_id, ticket_id, tokens, self.epoch, now)
        self._lease_by_ticket[ticket_id] = lease_id
        self.reserved += tokens
        return Grant(True, CAPACITY_AVAILABLE, lease_id, tokens, self.epoch)

    def release(self, lease_id: str) -> Lease | None:
        """Release a lease; unknown ids (already released or expired) are a no-op."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        if self._lease_by_ticket.get(lease.ticket_id) == lease_id:
            del self._lease_by_ticket[lease.ticket_id]
        self.reserved = max(0, self.reserved - lease.tokens)
        return lease

    def release_ticket(self, ticket_id: str) -> Lease | None:
        lease_id = self._lease_by_ticket.get(ticket_id)
        return None if lease_id is None else self.release(lease_id)

    def expire(self, now: float) -> tuple[Lease, ...]:
        """Release every lease older than ``lease_ttl_s``; returns them."""
        expired: list[Lease] = []
        for lease in self._leases.values():
            if now - lease.created_at <= self.lease_ttl_s:
                break  # creation order: the rest are younger
            expired.append(lease)
        for lease in expired:
            self.release(lease.lease_id)
        return tuple(expired)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    # -- metrics -----------------------------------------------------------------------

    def snapshot(self, now: float, *, reset_usage_window: bool = False) -> dict[str, float]:
        """Budget metrics (``agentic_kv/budget/*`` keys).

        ``reserved_utilization`` is present only when the ceiling is positive.
        """
        degraded = self.is_degraded(now)
        stale = sum(1 for e in self._engines.values() if not self._is_fresh(e, now))
        out: dict[str, float] = {
            "agentic_kv/budget/ceiling": float(self.ceiling),
            "agentic_kv/budget/reserved": float(self.reserved),
            "agentic_kv/budget/available_tokens": float(max(0, self.ceiling - self.reserved)),
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
            out["agentic_kv/budget/reserved_utilization"] = self.reserved / self.ceiling
        if reset_usage_window:
            self.reset_usage_window()
        return out

    def reset_usage_window(self) -> None:
        self._peak_usage = self.pressure
        self._usage_sum = 0.0
        self._usage_count = 0
