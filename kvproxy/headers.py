"""Header hygiene for one hop: what crosses it and what is recomputed.

Shared by the proxy's forward (:mod:`kvproxy.proxy.handlers`) and Dynamo's relay of
translated turns (:mod:`kvproxy.dynamo.relay`).
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvproxy.credentials import COOKIE_NAME, bearer_matches

# RFC 9110 section 7.6.1 connection-specific fields, plus the non-standard Proxy-Connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Set by aiohttp for the new hop (host, length of the body actually sent).
_RECOMPUTED = frozenset({"host", "content-length"})


# What never crosses the hop, as lower-case names (the headers' own spelling is kept).
_DROPPED = HOP_BY_HOP | _RECOMPUTED


def _dropped(headers: Mapping[str, str]) -> frozenset[str]:
    """The names not forwarded: hop-by-hop, recomputed, and those ``Connection`` names."""
    value = headers.get("Connection")
    if not value:
        return _DROPPED
    return _DROPPED | {t.strip().lower() for t in value.split(",") if t.strip()}


def _without_dropped(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """A copy of ``headers`` (order and spelling kept) without the names not forwarded.

    Copied whole in C, then the dozen dropped names deleted where present: twice as
    fast as filtering every header in Python."""
    out = CIMultiDict(headers)
    for name in _dropped(headers):
        if name in out:
            del out[name]
    return out


_COOKIE_PREFIX = COOKIE_NAME + "="


def _strip_own_credentials(out: CIMultiDict[str], admin_token: str | None) -> None:
    """Remove kvproxy's own credentials: an ``Authorization: Bearer`` carrying
    ``server.admin_token``, and the dashboard cookie (other cookies are kept)."""
    if admin_token is not None and "Authorization" in out:
        kept = [v for v in out.popall("Authorization") if not bearer_matches(admin_token, v)]
        for value in kept:
            out.add("Authorization", value)
    cookies = out.getall("Cookie", ())
    if cookies and any(_COOKIE_PREFIX in c for c in cookies):
        del out["Cookie"]
        for header in cookies:
            parts = [p.strip() for p in header.split(";")]
            kept_parts = [p for p in parts if p and not p.startswith(_COOKIE_PREFIX)]
            if kept_parts:
                out.add("Cookie", "; ".join(kept_parts))


def forward_request_headers(
    request: web.Request,
    extra: Mapping[str, str] | None = None,
    admin_token: str | None = None,
) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop ones and kvproxy's own credentials (the admin
    bearer token ``admin_token``, the dashboard cookie), with X-Forwarded-For appended."""
    src = request.headers
    out = _without_dropped(src)
    if admin_token is not None or "Cookie" in src:
        _strip_own_credentials(out, admin_token)
    peer = request.remote or "unknown"
    prior = src.get("X-Forwarded-For")
    out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    if extra:
        out.update(extra)
    return out


def forward_response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Upstream response headers minus hop-by-hop ones and the body length."""
    return _without_dropped(headers)
