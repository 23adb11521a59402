"""Parse the router's worker listings into engine base URLs. Pure.

Shapes handled (see docs/operations.md for examples):

- smg >= 1.5 ``GET /workers``: ``{"workers": [{"url", "is_healthy", "labels": {...}}]}``;
- sglang-router 0.3.x ``GET /workers``: the same list with ``"metadata"`` instead of
  ``"labels"``. That router drops a top-level ``session_id`` on ``/generate`` and chat;
- sglang-router <= 0.2.1 ``GET /list_workers``: ``{"urls": [...]}`` (no health).

With ``--dp-aware`` the router lists one entry per DP rank as ``url@<rank>``; the
suffix is stripped and the engine listed once. An engine healthy on any rank counts
as healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvproxy.urls import base_url

__all__ = ["DiscoveryError", "RouterFlavor", "base_url"]


class RouterFlavor(StrEnum):
    SMG = "smg"  # /workers with "labels" (smg >= 1.5): passes top-level session_id
    LEGACY_WORKERS = "sglang-router-0.3"  # /workers with "metadata": drops session_id
    LEGACY_LIST = "sglang-router-0.2"  # /list_workers only
    STATIC = "static"  # router.engines configured; discovery not used
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class EngineList:
    healthy: tuple[str, ...] = ()
    unhealthy: tuple[str, ...] = ()
    flavor: RouterFlavor = RouterFlavor.UNKNOWN
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    # The worker URLs exactly as the router lists them (DP rank suffixes and all), in
    # its order, and the healthy ones: what smg's consistent-hashing ring is built from.
    ring_urls: tuple[str, ...] = ()
    ring_healthy: tuple[str, ...] = ()

    @property
    def all(self) -> tuple[str, ...]:
        return self.healthy + self.unhealthy

    @property
    def legacy(self) -> bool:
        return self.flavor in (RouterFlavor.LEGACY_WORKERS, RouterFlavor.LEGACY_LIST)


class DiscoveryError(ValueError):
    """The listing is not in any known shape."""


def _dedupe(urls: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(urls))


def parse_workers(doc: Any) -> EngineList:
    """Parse a ``GET /workers`` document."""
    if not isinstance(doc, dict) or not isinstance(doc.get("workers"), list):
        raise DiscoveryError("expected an object with a 'workers' list")
    healthy: list[str] = []
    unhealthy: list[str] = []
    labels: dict[str, dict[str, str]] = {}
    flavor = RouterFlavor.UNKNOWN
    ring_urls: list[str] = []
    ring_healthy: list[str] = []
    for entry in doc["workers"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            continue
        url = base_url(entry["url"])
        if not url:
            continue
        ring_urls.append(entry["url"])
        if entry.get("is_healthy", True) is not False:
            ring_healthy.append(entry["url"])
        if isinstance(entry.get("labels"), dict):
            flavor = RouterFlavor.SMG
            labels[url] = {str(k): str(v) for k, v in entry["labels"].items()}
        elif isinstance(entry.get("metadata"), dict) and flavor is RouterFlavor.UNKNOWN:
            flavor = RouterFlavor.LEGACY_WORKERS
            labels[url] = {str(k): str(v) for k, v in entry["metadata"].items()}
        (healthy if entry.get("is_healthy", True) is not False else unhealthy).append(url)
    healthy_set = set(healthy)
    return EngineList(
        healthy=_dedupe(healthy),
        unhealthy=_dedupe([u for u in unhealthy if u not in healthy_set]),
        flavor=flavor,
        labels=labels,
        ring_urls=_dedupe(ring_urls),
        ring_healthy=_dedupe(ring_healthy),
    )


def parse_list_workers(doc: Any) -> EngineList:
    """Parse a legacy ``GET /list_workers`` document (no health: all count as healthy)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("urls"), list):
        raise DiscoveryError("expected an object with a 'urls' list")
    raw = [u for u in doc["urls"] if isinstance(u, str) and u.strip()]
    urls = [base_url(u) for u in raw]
    return EngineList(
        healthy=_dedupe(urls),
        flavor=RouterFlavor.LEGACY_LIST,
        ring_urls=_dedupe(raw),
        ring_healthy=_dedupe(raw),
    )


def static_engines(urls: tuple[str, ...]) -> EngineList:
    """A configured list: the ring mirrors these strings as given (write them exactly as
    the router registered them)."""
    return EngineList(
        healthy=_dedupe([base_url(u) for u in urls]),
        flavor=RouterFlavor.STATIC,
        ring_urls=_dedupe(list(urls)),
        ring_healthy=_dedupe(list(urls)),
    )
