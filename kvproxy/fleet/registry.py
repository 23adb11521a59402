"""The fleet: which engines sit behind the router, refreshed on an interval.

The asyncio shell around :mod:`kvproxy.fleet.discovery`. Both features read it:
admission polls the healthy engines' ``/metrics``; session close fans out to all of
them (healthy and unhealthy). A static ``router.engines`` list overrides discovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvproxy.config import RouterConfig
from kvproxy.fleet.discovery import (
    DiscoveryError,
    EngineList,
    RouterFlavor,
    parse_list_workers,
    parse_workers,
    static_engines,
)
from kvproxy.fleet.trust import trusted_engines
from kvproxy.trust import EngineTrust
from kvproxy.urls import join

log = logging.getLogger(__name__)

# Refused engine URLs remembered (each logged once); past this, refusals are counted only.
_REFUSED_LOGGED_MAX = 256

LEGACY_ROUTER_WARNING = (
    "the router is sglang-router <= 0.3 ({flavor}), which drops a top-level session_id on "
    "/generate and /v1/chat/completions: session lifecycle cannot tag those requests. "
    "Use smg >= 1.5."
)


@dataclass(frozen=True, slots=True)
class FleetHealth:
    """The fleet at one moment, as ``GET /kvproxy/health`` shows it (``fleet``)."""

    router_url: str
    router_reachable: bool | None  # None until the first refresh
    router_flavor: str
    engines_known: int
    healthy: tuple[str, ...]
    unhealthy: tuple[str, ...]
    last_refresh_age_s: float | None
    last_error: str | None
    # Engine URLs the router listed that kvproxy refused (kvproxy.fleet.trust), so far.
    engines_refused: int = 0

    @property
    def engines_healthy(self) -> int:
        return len(self.healthy)

    def to_json(self) -> dict[str, Any]:
        return {
            "router_url": self.router_url,
            "router_reachable": self.router_reachable,
            "router_flavor": self.router_flavor,
            "engines_known": self.engines_known,
            "engines_healthy": self.engines_healthy,
            "engines": {"healthy": list(self.healthy), "unhealthy": list(self.unhealthy)},
            "last_refresh_age_s": self.last_refresh_age_s,
            "last_error": self.last_error,
            "engines_refused": self.engines_refused,
        }


class Fleet:
    """Engine list discovered through the router (or configured statically)."""

    def __init__(
        self,
        cfg: RouterConfig,
        http: aiohttp.ClientSession,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._http = http
        self._clock = clock
        self._engines = static_engines(cfg.engines) if cfg.engines else EngineList()
        self._router_reachable: bool | None = None
        self._last_refresh: float | None = None
        self._last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._trust = EngineTrust.of(cfg.engine_hosts)
        # Refused engine URLs, each logged once (bounded), and how many refusals so far.
        self._refused_logged: set[str] = set()
        self.engines_refused = 0

    # -- read side -------------------------------------------------------------
    @property
    def engines(self) -> EngineList:
        return self._engines

    def healthy_engines(self) -> tuple[str, ...]:
        return self._engines.healthy

    def ring_workers(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(worker URLs as the router registered them, the healthy ones): the ring."""
        return self._engines.ring_urls, self._engines.ring_healthy

    def all_engines(self) -> tuple[str, ...]:
        """Every engine base URL known: healthy, unhealthy and the static list."""
        return self._engines.all

    @property
    def router_reachable(self) -> bool | None:
        return self._router_reachable

    def health(self) -> FleetHealth:
        age = None if self._last_refresh is None else round(self._clock() - self._last_refresh, 3)
        return FleetHealth(
            router_url=self._cfg.url,
            router_reachable=self._router_reachable,
            router_flavor=self._engines.flavor.value,
            engines_known=len(self._engines.all),
            healthy=self._engines.healthy,
            unhealthy=self._engines.unhealthy,
            last_refresh_age_s=age,
            last_error=self._last_error,
            engines_refused=self.engines_refused,
        )

    # -- refresh ---------------------------------------------------------------
    async def refresh(self) -> EngineList:
        """Re-read the engine list once. Never raises; keeps the last list on failure."""
        if self._cfg.engines:
            self._set_reachable(await self._probe_router())
            self._last_refresh = self._clock()
            return self._engines
        try:
            found = await self._discover()
        except (aiohttp.ClientError, TimeoutError, DiscoveryError, orjson.JSONDecodeError) as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._set_reachable(not isinstance(exc, aiohttp.ClientConnectionError | TimeoutError))
            log.debug("engine discovery failed: %s", self._last_error)
            return self._engines
        self._set_reachable(True)
        self._last_error = None
        self._last_refresh = self._clock()
        if found.all != self._engines.all or found.healthy != self._engines.healthy:
            log.info(
                "engines: %d healthy %s, %d unhealthy %s",
                len(found.healthy),
                list(found.healthy),
                len(found.unhealthy),
                list(found.unhealthy),
            )
        self._engines = found
        return found

    def _set_reachable(self, reachable: bool) -> None:
        """Log each change of the router's reachability once: a WARNING naming the URL
        when it cannot be reached (at start or later), an INFO line when it can again."""
        previous, self._router_reachable = self._router_reachable, reachable
        message = reachability_message(self._cfg.url, previous, reachable, self._last_error)
        if message is not None:
            log.log(logging.INFO if reachable else logging.WARNING, "%s", message)

    async def _get_json(self, path: str) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=self._cfg.connect_timeout_s)
        async with self._http.get(join(self._cfg.url, path), timeout=timeout) as resp:
            if resp.status != 200:
                return resp.status, None
            return resp.status, orjson.loads(await resp.read())

    async def _discover(self) -> EngineList:
        status, doc = await self._get_json("/workers")
        if status == 200:
            return self._trusted(parse_workers(doc))
        status, doc = await self._get_json("/list_workers")
        if status == 200:
            return self._trusted(parse_list_workers(doc))
        raise DiscoveryError(f"router answered {status} on /workers and /list_workers")

    def _trusted(self, found: EngineList) -> EngineList:
        """``found`` without the engine URLs kvproxy must not talk to (counted; each
        logged once, the first :data:`_REFUSED_LOGGED_MAX` of them)."""
        cleaned, refused = trusted_engines(found, self._trust)
        for url, why in refused.items():
            if url in self._refused_logged:
                continue
            self.engines_refused += 1
            if len(self._refused_logged) < _REFUSED_LOGGED_MAX:
                self._refused_logged.add(url)
                log.warning("engine URL from the router refused (%s): %r", why, _redacted(url))
        return cleaned

    async def _probe_router(self) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self._cfg.connect_timeout_s)
            async with self._http.get(join(self._cfg.url, "/health"), timeout=timeout):
                return True
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.discovery_interval_s)
            try:
                await self.refresh()
            except Exception:  # never let the refresh loop die
                log.exception("engine discovery crashed; will retry")

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="kvproxy-fleet-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def reconfigure(self, cfg: RouterConfig) -> None:
        """Apply a reloaded router section (interval, timeouts, static list)."""
        self._cfg = cfg
        self._trust = EngineTrust.of(cfg.engine_hosts)
        if cfg.engines:
            self._engines = static_engines(cfg.engines)


def _redacted(url: str) -> str:
    """``url`` (at most 200 characters) with any user info hidden."""
    scheme, sep, rest = url[:200].partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def reachability_message(
    url: str, previous: bool | None, reachable: bool, error: str | None
) -> str | None:
    """The log line for a change of the router's reachability (None: no change)."""
    if not reachable and previous is not False:
        why = f" ({error})" if error else ""
        return (
            f"router {url} is not reachable{why}: requests get 502 router_unreachable "
            "until it is; start the router or fix router.url / --router-url"
        )
    if reachable and previous is False:
        return f"router {url} is reachable now"
    return None


def legacy_warning(fleet: Fleet, lifecycle_enabled: bool) -> str | None:
    if lifecycle_enabled and fleet.engines.legacy:
        return LEGACY_ROUTER_WARNING.format(flavor=fleet.engines.flavor.value)
    return None


__all__ = ["Fleet", "RouterFlavor", "legacy_warning"]
