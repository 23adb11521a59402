"""Who may use the operator surface when ``server.admin_token`` is set.

:func:`allowed` decides from the token and the request's credentials alone (pure, no
aiohttp); :func:`kvproxy.admin.guard.guarded` wraps an aiohttp handler with it. With no token configured
everything is open (kvproxy listens on loopback by default). With one:

- ``ADMIN`` (config reload, session close, stats reset): ``Authorization: Bearer``
  only. These change state, so a browser's ambient cookie is never enough.
- ``VIEW`` (the dashboard and its data): the bearer header, or the dashboard
  cookie a browser gets by entering the token once on the dashboard's sign-in page.
- ``STATS`` (``GET /kvproxy/stats``, ``GET /metrics``): open while
  ``server.public_stats`` is true (the default), else as ``VIEW``.

The cookie holds an HMAC of the token, not the token: it cannot be replayed as a
bearer header, and changing the token (a config reload) invalidates every cookie.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

from kvproxy.credentials import COOKIE_NAME, bearer_matches, token_matches

NEEDS_TOKEN = "admin endpoint: send Authorization: Bearer <server.admin_token>"
_COOKIE_CONTEXT = b"kvproxy dashboard session v1"


class Access(enum.Enum):
    ADMIN = "admin"
    VIEW = "view"
    STATS = "stats"


def cookie_value(token: str) -> str:
    """The dashboard cookie's value for ``token``."""
    return hmac.new(token.encode(), _COOKIE_CONTEXT, hashlib.sha256).hexdigest()


def allowed(
    access: Access,
    *,
    token: str | None,
    public_stats: bool,
    authorization: str | None,
    cookie: str | None,
) -> bool:
    """Whether a request with these credentials may use an endpoint of ``access``."""
    if token is None:
        return True
    if access is Access.STATS and public_stats:
        return True
    if bearer_matches(token, authorization):
        return True
    if access is Access.ADMIN:
        return False
    return cookie is not None and hmac.compare_digest(cookie, cookie_value(token))


__all__ = [
    "COOKIE_NAME",
    "NEEDS_TOKEN",
    "Access",
    "allowed",
    "bearer_matches",
    "cookie_value",
    "token_matches",
]
