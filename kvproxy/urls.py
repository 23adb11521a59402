"""The one URL normaliser: how kvproxy compares and joins engine and router URLs.

Pure. An engine appears in smg's listings as ``http://host:port`` or, per data-parallel
rank, ``http://host:port@rank``; configs and users add trailing slashes. kvproxy keys
every per-engine table by :func:`base_url` and joins paths onto it with :func:`join`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_DP_SUFFIX = re.compile(r"@\d+$")


def base_url(url: str) -> str:
    """``http://h:1@2`` -> ``http://h:1``; surrounding space and trailing slashes removed."""
    return _DP_SUFFIX.sub("", url.strip()).rstrip("/")


def unique_base_urls(urls: Iterable[str]) -> list[str]:
    """The distinct non-empty :func:`base_url` of ``urls``, in first-seen order."""
    out: dict[str, None] = {}
    for url in urls:
        base = base_url(url)
        if base:
            out.setdefault(base, None)
    return list(out)


def join(url: str, path: str) -> str:
    """``base_url(url)`` followed by ``path`` (which starts with ``/``)."""
    return base_url(url) + path
