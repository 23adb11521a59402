"""Placement attribution: which engine serves each session's routing key. Pure.

Under ``smg --policy consistent_hashing`` the router sends a request carrying
``X-SMG-Routing-Key: K`` to ``HashRing(registered worker URLs).owner(K, available)``.
kvproxy builds the same ring from the worker URLs exactly as the router lists them
(``GET /workers``, DP rank suffixes included) and maps each ring URL to the engine
base URL it polls (suffix stripped), so every session is attributed to one engine.

With any other router policy placement is unknown: :attr:`Placement.mirrored` is
False and program admission falls back to fleet-wide accounting.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvproxy.config import ROUTER_POLICIES_MIRRORED
from kvproxy.fleet.ring import HashRing
from kvproxy.urls import base_url


class Placement:
    """The mirrored ring of one worker set plus its availability."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._ring = HashRing(())
        self._available: frozenset[str] = frozenset()
        self.generation = 0  # bumps on every worker-set or availability change

    @property
    def mirrored(self) -> bool:
        return self.policy in ROUTER_POLICIES_MIRRORED

    @property
    def workers(self) -> tuple[str, ...]:
        return self._ring.urls

    @property
    def available(self) -> frozenset[str]:
        return self._available

    def update(self, workers: Iterable[str], available: Iterable[str]) -> bool:
        """Set the registered worker URLs (as the router lists them) and the available
        ones; returns True when anything changed."""
        workers = tuple(dict.fromkeys(workers))
        avail = frozenset(available) & frozenset(workers)
        if workers == self._ring.urls and avail == self._available:
            return False
        if workers != self._ring.urls:
            self._ring = HashRing(workers)
        self._available = avail
        self.generation += 1
        return True

    def owner(self, key: str) -> str | None:
        """The engine base URL the router sends ``key`` to; None when unknown."""
        if not self.mirrored or not self._available:
            return None
        url = self._ring.owner(key, self._available)
        return None if url is None else base_url(url)


__all__ = ["Placement"]
