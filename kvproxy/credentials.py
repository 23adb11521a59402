"""kvproxy's own credentials, and fingerprints of the data plane's. Pure.

kvproxy's credentials are the admin bearer token (``server.admin_token``) and the
dashboard cookie (:data:`COOKIE_NAME`); they are for kvproxy alone, and
:mod:`kvproxy.headers` removes them before a request is forwarded.

A data-plane credential is whatever the client authenticates to the router or the
engines with: ``Authorization`` or ``x-api-key``. kvproxy never checks it; with
``session_lifecycle.bind_credential`` it keeps a keyed hash of it
(:func:`fingerprint`) for each session, so that only the same credential (or the admin
token) can close that session. The key is random per process: a fingerprint is never
logged, and cannot be tested against guessed credentials outside the process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

COOKIE_NAME = "kvproxy_dashboard"
# The headers a data-plane credential is read from, in order.
CREDENTIAL_HEADERS = ("Authorization", "x-api-key")

_FINGERPRINT_KEY = os.urandom(32)


def token_matches(token: str, candidate: str) -> bool:
    """Constant-time comparison of a submitted token with the configured one."""
    return hmac.compare_digest(token.encode(), candidate.encode())


def bearer_matches(token: str, authorization: str | None) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <token>`` (constant time)."""
    if authorization is None:
        return False
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and token_matches(token, value.strip())


def fingerprint(headers: Mapping[str, str]) -> bytes | None:
    """A keyed 16-byte hash of the request's data-plane credential; None without one."""
    for name in CREDENTIAL_HEADERS:
        value = headers.get(name)
        if value:
            digest = hashlib.blake2b(
                f"{name.lower()}\0{value.strip()}".encode("utf-8", "surrogateescape"),
                key=_FINGERPRINT_KEY,
                digest_size=16,
            )
            return digest.digest()
    return None


__all__ = ["COOKIE_NAME", "CREDENTIAL_HEADERS", "bearer_matches", "fingerprint", "token_matches"]
