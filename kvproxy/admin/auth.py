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

The cookie holds its issue time, a random nonce and an HMAC of both under the token,
not the token: it cannot be replayed as a bearer header, each sign-in gets its own,
it expires after ``server.cookie_max_age_s``, and changing the token (a config reload)
invalidates every cookie. Failed sign-ins are bounded per client address
(:class:`SignInLimiter`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict, deque

from kvproxy.credentials import COOKIE_NAME, bearer_matches, token_matches

NEEDS_TOKEN = "admin endpoint: send Authorization: Bearer <server.admin_token>"
_COOKIE_CONTEXT = b"kvproxy dashboard session v2\0"
# A cookie issued a little in the future (clock steps) is still accepted.
_CLOCK_SLACK_S = 60


class Access(enum.Enum):
    ADMIN = "admin"
    VIEW = "view"
    STATS = "stats"


def _signature(token: str, payload: str) -> str:
    return hmac.new(token.encode(), _COOKIE_CONTEXT + payload.encode(), hashlib.sha256).hexdigest()


def cookie_value(token: str, *, issued: int | None = None, nonce: str | None = None) -> str:
    """A new dashboard cookie for ``token``: ``issued.nonce.signature``."""
    payload = f"{int(time.time()) if issued is None else issued}.{nonce or secrets.token_hex(8)}"
    return f"{payload}.{_signature(token, payload)}"


def cookie_valid(token: str, cookie: str, *, now: float, max_age_s: float) -> bool:
    """Whether ``cookie`` was issued for ``token`` less than ``max_age_s`` ago."""
    if not cookie.isascii():
        return False
    issued, _, rest = cookie.partition(".")
    nonce, _, signature = rest.partition(".")
    if not (issued.isdigit() and nonce and signature):
        return False
    if not -_CLOCK_SLACK_S <= now - int(issued) <= max_age_s:
        return False
    return hmac.compare_digest(signature, _signature(token, f"{issued}.{nonce}"))


def allowed(
    access: Access,
    *,
    token: str | None,
    public_stats: bool,
    authorization: str | None,
    cookie: str | None,
    now: float | None = None,
    cookie_max_age_s: float = 43_200,
) -> bool:
    """Whether a request with these credentials may use an endpoint of ``access``
    (``now``: the wall clock, for the cookie's age; the current time when None)."""
    if token is None:
        return True
    if access is Access.STATS and public_stats:
        return True
    if bearer_matches(token, authorization):
        return True
    if access is Access.ADMIN:
        return False
    if cookie is None:
        return False
    when = time.time() if now is None else now
    return cookie_valid(token, cookie, now=when, max_age_s=cookie_max_age_s)


class SignInLimiter:
    """Failed dashboard sign-ins per client address over the last minute (bounded:
    at most ``max_clients`` addresses remembered, the stalest forgotten first)."""

    WINDOW_S = 60.0

    def __init__(self, max_clients: int = 1024) -> None:
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._max_clients = max_clients
        self.unlogged = 0  # failures since the last log line (kvproxy.admin.dashboard)
        self._logged_at = -math.inf

    def log_due(self, now: float) -> bool:
        """Whether a log line about the failures is due (one per window at most)."""
        if now - self._logged_at < self.WINDOW_S:
            return False
        self._logged_at = now
        return True

    def _recent(self, client: str, now: float) -> deque[float] | None:
        times = self._failures.get(client)
        if times is None:
            return None
        while times and now - times[0] >= self.WINDOW_S:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        return times

    def blocked(self, client: str, now: float, per_minute: int) -> bool:
        """Whether ``client`` has used up its failed attempts for the minute."""
        times = self._recent(client, now)
        return times is not None and len(times) >= per_minute

    def failed(self, client: str, now: float) -> None:
        times = self._recent(client, now)
        if times is None:
            times = self._failures[client] = deque(maxlen=10_000)
            while len(self._failures) > self._max_clients:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(client)
        times.append(now)
        self.unlogged += 1


__all__ = [
    "COOKIE_NAME",
    "NEEDS_TOKEN",
    "Access",
    "SignInLimiter",
    "allowed",
    "bearer_matches",
    "cookie_valid",
    "cookie_value",
    "token_matches",
]
