"""A mirror of smg's consistent-hashing ring: which engine the router picks for a key. Pure.

kvproxy never chooses a worker. Under ``smg --policy consistent_hashing`` with an
``X-SMG-Routing-Key`` header the router's choice is a pure function of the key and the
registered worker URLs, so kvproxy can recompute it and know where each session lives.

The algorithm, as in smg's ``model_gateway/src/worker/hash_ring.rs`` and
``policies/consistent_hashing.rs`` (unchanged since v1.0.1):

- a position is the first 8 bytes of the blake3 digest, read as a little-endian u64;
- each worker URL has 150 virtual nodes at ``"{url}#{vnode}"``, sorted by position;
- the ring is built from every *registered* worker URL (healthy or not), exactly as the
  router lists it (``--dp-aware`` rank suffixes included);
- a key's owner is the first virtual node at or after the key's position (a bisect-left),
  walking clockwise past unavailable workers to the first available one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

import blake3

VIRTUAL_NODES = 150


def position(text: str) -> int:
    """The ring position of ``text``: blake3, first 8 bytes, little-endian."""
    return int.from_bytes(blake3.blake3(text.encode()).digest()[:8], "little")


class HashRing:
    """The ring of a fixed set of worker URLs; lookups skip unavailable workers."""

    __slots__ = ("_owners", "_positions", "urls")

    def __init__(self, urls: Iterable[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.urls: tuple[str, ...] = tuple(dict.fromkeys(urls))
        nodes = sorted(
            (position(f"{url}#{v}"), url) for url in self.urls for v in range(virtual_nodes)
        )
        self._positions = [p for p, _ in nodes]
        self._owners = [u for _, u in nodes]

    def __len__(self) -> int:
        return len(self.urls)

    def owner(self, key: str, available: Iterable[str] | None = None) -> str | None:
        """The worker the router sends ``key`` to; None when no worker is available.

        ``available`` (default: every URL of the ring) is the set the router would accept:
        a key whose first worker is unavailable moves clockwise to the next available one.
        """
        if not self._positions:
            return None
        ok = None if available is None else set(available)
        n = len(self._positions)
        start = bisect_left(self._positions, position(key))
        seen: set[str] = set()
        for step in range(n):
            url = self._owners[(start + step) % n]
            if url in seen:
                continue
            if ok is None or url in ok:
                return url
            seen.add(url)
            if len(seen) == len(self.urls):
                break
        return None
