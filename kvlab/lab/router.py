"""The router's placement in the lab: smg's ``consistent_hashing`` and ``round_robin``.

``consistent_hashing`` is :class:`kvproxy.fleet.ring.HashRing`, the exact mirror of
smg's ring (blake3, 150 virtual nodes per worker URL), keyed by the
``X-SMG-Routing-Key`` header. Without the header smg hashes other headers
(``authorization``, ``x-forwarded-for``, ``cookie``); the lab's clients send none of
them, so every key-less request lands on the owner of the empty key, as one shared
header value pins all traffic to one worker in smg. ``round_robin`` cycles through
the workers per request, whatever the request (smg's ``round_robin`` without sticky
sessions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvproxy.fleet.ring import HashRing

ROUTER_POLICIES = ("consistent_hashing", "round_robin")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class Placement:
    """Which worker URL the router sends a request to."""

    def __init__(self, policy: str, urls: Sequence[str]) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        if not urls:
            raise ValueError("the router needs at least one worker URL")
        self.policy = policy
        self.urls = tuple(urls)
        self._ring = HashRing(self.urls) if policy == "consistent_hashing" else None
        self._next = 0

    def pick(self, headers: Mapping[str, str]) -> str:
        if self._ring is not None:
            key = headers.get(ROUTING_KEY_HEADER) or ""
            owner = self._ring.owner(key)
            assert owner is not None  # every worker of the lab is available
            return owner
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        return url
