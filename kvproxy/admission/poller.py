"""What admission reads from the fleet, and the loops that read it (asyncio shell).

* :meth:`Poller.scrape`: every healthy engine's ``/metrics``, concurrently, each
  within ``metrics_timeout_s``; :meth:`Poller.observe` feeds the readings to both
  ledgers (a failed or unparsable scrape keeps the engine's last reading, which goes
  stale after ``effective_staleness_s``; counted ``scrape_failure``);
* :meth:`Poller.probe`: the ``/server_info`` of engines not read yet (eviction policy,
  context length), when priority steering or growth reservations need it;
* :meth:`Poller.check_diversion`: the requests smg's own counters show routed off
  the consistent-hashing ring since the last read (:func:`diverted_requests`; counted
  ``router_diverted``, and warned about);
* :func:`poll_loop` / :func:`tick_loop`: the background tasks, started and stopped
  together by :class:`Loops`; an exception never stops them (counted ``poll_error``).

The controller (:mod:`kvproxy.admission.coordinator`) decides what to do with what
is read; this module only reads.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Container, Sequence

import aiohttp

from kvproxy.admission.catalogue import C_DIVERTED, C_POLL_ERROR, C_SCRAPE_FAILURE
from kvproxy.admission.fleet.ledger import Ledger
from kvproxy.admission.program.ledger import EngineLedger
from kvproxy.fleet.client import EngineHttp
from kvproxy.fleet.engine_info import EngineSessionMode, probe
from kvproxy.fleet.engine_metrics import parse_engine_metrics
from kvproxy.observability import RateLimitedLog, WindowedCounters
from kvproxy.urls import base_url, join


class Poller:
    """Reads engines' ``/metrics`` and ``/server_info`` and smg's ``/metrics``."""

    __slots__ = ("_counters", "_diverted_seen", "_fetch", "_http", "_log", "_timeout_s")

    def __init__(
        self,
        http: EngineHttp | None,
        fetch_metrics: Callable[[str], Awaitable[str]] | None,
        timeout_s: Callable[[], float],
        counters: WindowedCounters,
        log: RateLimitedLog,
    ) -> None:
        """``fetch_metrics`` replaces the HTTP scrape (tests, the lab); ``timeout_s``
        reads ``metrics_timeout_s`` at each call (a reload may change it)."""
        if http is None and fetch_metrics is None:
            raise ValueError("AdmissionController needs http or fetch_metrics")
        self._http = http
        self._fetch = fetch_metrics or self._http_fetch
        self._timeout_s = timeout_s
        self._counters = counters
        self._log = log
        self._diverted_seen: float | None = None

    async def _http_fetch(self, url: str) -> str:
        assert self._http is not None
        timeout = aiohttp.ClientTimeout(total=self._timeout_s())
        async with self._http.get(join(url, "/metrics"), timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text(errors="replace")

    async def _scrape(self, url: str) -> str:
        return await asyncio.wait_for(self._fetch(url), self._timeout_s())

    async def scrape(self, urls: Sequence[str]) -> list[str | BaseException]:
        """Every engine's ``/metrics`` text, or what it raised, in ``urls`` order."""
        return await asyncio.gather(*(self._scrape(u) for u in urls), return_exceptions=True)

    def observe(
        self,
        urls: list[str],
        results: Sequence[str | BaseException],
        now: float,
        ledger: Ledger,
        engines: EngineLedger,
    ) -> None:
        """Feed a scrape's readings to the fleet ledger (which keeps only ``urls``) and
        to program admission's per-engine ledger."""
        counters = self._counters
        ledger.retain(urls)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                counters.inc(C_SCRAPE_FAILURE)
                self._log.warning(
                    "scrape:" + url, "admission: /metrics of %s failed: %r", url, result
                )
                continue
            m = parse_engine_metrics(result)
            fresh = ledger.observe(
                url,
                now=now,
                max_total_num_tokens=m.max_total_num_tokens,
                token_usage=m.token_usage,
                num_used_tokens=m.num_used_tokens,
            )
            if not fresh:
                counters.inc(C_SCRAPE_FAILURE)
                self._log.warning(
                    "usage:" + url, "admission: /metrics of %s has no KV usage gauges", url
                )
            engines.observe_engine(
                base_url(url),
                now,
                max_total_num_tokens=m.max_total_num_tokens,
                evicted_total=m.evicted_tokens_total,
                retracted_total=m.num_retracted_requests_total,
                streaming_held=m.streaming_session_held_tokens,
                streaming_sessions=m.num_streaming_sessions,
                host_tokens=m.hicache_host_total_tokens,
                token_usage=m.token_usage,
                queue_reqs=m.num_queue_reqs,
            )

    async def probe(self, urls: Sequence[str], known: Container[str]) -> list[EngineSessionMode]:
        """The ``/server_info`` of the engines whose base URL is not in ``known``."""
        if self._http is None:
            return []
        missing = [u for u in urls if base_url(u) not in known]
        if not missing:
            return []
        http = self._http
        results = await asyncio.gather(
            *(probe(http, u, self._timeout_s()) for u in missing), return_exceptions=True
        )
        return [r for r in results if isinstance(r, EngineSessionMode)]

    async def check_diversion(self, url: str) -> None:
        """Count the requests smg routed off the ring since the last read of its
        ``/metrics`` at ``url`` (none on the first read), and warn."""
        diverted = await self._diverted(url)
        if diverted > 0:
            self._counters.inc(C_DIVERTED, diverted)
            self._log.warning(
                "diverted",
                "admission: smg routed %d request(s) off the consistent-hashing ring "
                "(no healthy owner or random fallback): per-engine accounting is off for them",
                int(diverted),
            )

    async def _diverted(self, url: str) -> float:
        if self._http is None:
            return 0.0
        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout_s())
            async with self._http.get(url, timeout=timeout) as resp:
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._log.warning("smg-metrics", "admission: %s unreadable: %r", url, exc)
            return 0.0
        total = diverted_requests(text)
        if total is None:
            return 0.0
        seen, self._diverted_seen = self._diverted_seen, total
        return total - seen if seen is not None and total > seen else 0.0


async def poll_loop(
    interval_s: Callable[[], float],
    poll: Callable[[], Awaitable[None]],
    counters: WindowedCounters,
    log: RateLimitedLog,
) -> None:
    """``poll()`` every ``interval_s()`` seconds (read each time: a reload may change it)."""
    loop = asyncio.get_running_loop()
    next_at = loop.time() + interval_s()
    while True:
        try:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = loop.time() + interval_s()
            await poll()
        except asyncio.CancelledError:
            raise
        except Exception:  # poll never raises; belt and braces
            counters.inc(C_POLL_ERROR)
            log.warning("loop", "admission: poll loop error", exc_info=True)


async def tick_loop(
    period_s: Callable[[], float],
    tick: Callable[[], None],
    counters: WindowedCounters,
    log: RateLimitedLog,
) -> None:
    """``tick()`` every ``period_s()`` seconds."""
    while True:
        try:
            await asyncio.sleep(period_s())
            tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            counters.inc(C_POLL_ERROR)
            log.warning("tick", "admission: tick failed", exc_info=True)


class Loops:
    """The poll and tick tasks of one controller, started and stopped together."""

    __slots__ = ("_counters", "_log", "_tasks")

    def __init__(self, counters: WindowedCounters, log: RateLimitedLog) -> None:
        self._counters = counters
        self._log = log
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    def start(
        self,
        interval_s: Callable[[], float],
        poll: Callable[[], Awaitable[None]],
        period_s: Callable[[], float],
        tick: Callable[[], None],
    ) -> None:
        c, lg = self._counters, self._log
        self._tasks = [
            asyncio.create_task(poll_loop(interval_s, poll, c, lg), name="kvproxy-admission-poll"),
            asyncio.create_task(tick_loop(period_s, tick, c, lg), name="kvproxy-admission-tick"),
        ]

    async def stop(self) -> None:
        """Cancel both and wait for them (a cancellation of the caller propagates)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise


_BRANCH_RE = re.compile(
    r'^smg_consistent_hashing_policy_branch_total\{[^}]*branch="([a-z_]+)"[^}]*\}\s+(\S+)', re.M
)
# Branches of smg's consistent_hashing policy that send a request somewhere other than
# its ring owner (policies/consistent_hashing.rs). Overload protection filters workers
# before the policy runs, so those diversions show as routing_key_hit: no smg counter
# tells them apart (hence --disable-worker-overload-protection in the contract).
_OFF_RING = frozenset({"random_fallback", "no_healthy_workers", "target_worker_miss"})


def diverted_requests(text: str) -> float | None:
    """Sum of smg's off-ring branch counters in its /metrics text; None when absent."""
    found = False
    total = 0.0
    for branch, value in _BRANCH_RE.findall(text):
        found = True
        if branch in _OFF_RING:
            try:
                total += float(value)
            except ValueError:
                continue
    return total if found else None
