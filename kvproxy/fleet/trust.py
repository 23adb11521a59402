"""The engine list without the URLs kvproxy must not talk to (:mod:`kvproxy.trust`). Pure."""

from __future__ import annotations

import dataclasses

from kvproxy.fleet.discovery import EngineList
from kvproxy.trust import EngineTrust, engine_url_problem


def trusted_engines(found: EngineList, trust: EngineTrust) -> tuple[EngineList, dict[str, str]]:
    """``found`` without the URLs :func:`engine_url_problem` refuses, and the refused
    ones (URL -> why)."""
    refused: dict[str, str] = {}

    def keep(urls: tuple[str, ...]) -> tuple[str, ...]:
        kept = []
        for url in urls:
            problem = engine_url_problem(url, trust)
            if problem is None:
                kept.append(url)
            else:
                refused[url] = problem
        return tuple(kept)

    cleaned = dataclasses.replace(
        found,
        healthy=keep(found.healthy),
        unhealthy=keep(found.unhealthy),
        ring_urls=keep(found.ring_urls),
        ring_healthy=keep(found.ring_healthy),
        labels={u: v for u, v in found.labels.items() if engine_url_problem(u, trust) is None},
    )
    return cleaned, refused


__all__ = ["trusted_engines"]
