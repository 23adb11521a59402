"""Who may use the operator surface, for every access level and credential."""

from __future__ import annotations

import pytest

from kvproxy.admin.auth import Access, SignInLimiter, allowed, cookie_valid, cookie_value

TOKEN = "s3cret"
GOOD_COOKIE = cookie_value(TOKEN)


@pytest.mark.parametrize(
    ("access", "token", "public_stats", "authorization", "cookie", "expected"),
    [
        # No token configured: everything is open.
        (Access.ADMIN, None, False, None, None, True),
        (Access.VIEW, None, False, None, None, True),
        (Access.STATS, None, False, None, None, True),
        # ADMIN: the bearer header only.
        (Access.ADMIN, TOKEN, True, f"Bearer {TOKEN}", None, True),
        (Access.ADMIN, TOKEN, True, f"bearer {TOKEN}", None, True),
        (Access.ADMIN, TOKEN, True, "Bearer wrong", None, False),
        (Access.ADMIN, TOKEN, True, f"Basic {TOKEN}", None, False),
        (Access.ADMIN, TOKEN, True, None, GOOD_COOKIE, False),
        (Access.ADMIN, TOKEN, True, None, None, False),
        # VIEW: the header or the dashboard cookie.
        (Access.VIEW, TOKEN, True, f"Bearer {TOKEN}", None, True),
        (Access.VIEW, TOKEN, True, None, GOOD_COOKIE, True),
        (Access.VIEW, TOKEN, True, None, TOKEN, False),  # the raw token is not a cookie
        (Access.VIEW, TOKEN, True, None, cookie_value("other"), False),
        (Access.VIEW, TOKEN, True, None, None, False),
        # STATS: open while public_stats, else as VIEW.
        (Access.STATS, TOKEN, True, None, None, True),
        (Access.STATS, TOKEN, False, None, None, False),
        (Access.STATS, TOKEN, False, f"Bearer {TOKEN}", None, True),
        (Access.STATS, TOKEN, False, None, GOOD_COOKIE, True),
    ],
)
def test_allowed(
    access: Access,
    token: str | None,
    public_stats: bool,
    authorization: str | None,
    cookie: str | None,
    expected: bool,
) -> None:
    got = allowed(
        access, token=token, public_stats=public_stats, authorization=authorization, cookie=cookie
    )
    assert got is expected


def test_the_cookie_is_not_the_token_and_differs_per_sign_in() -> None:
    assert GOOD_COOKIE != TOKEN and TOKEN not in GOOD_COOKIE
    assert cookie_value("a") != cookie_value("b")
    assert cookie_value(TOKEN) != GOOD_COOKIE  # a fresh nonce each time
    # Stable across restarts: the same issue time and nonce sign the same.
    assert cookie_value(TOKEN, issued=1, nonce="n") == cookie_value(TOKEN, issued=1, nonce="n")


@pytest.mark.parametrize(
    ("cookie", "now", "valid"),
    [
        (cookie_value(TOKEN, issued=1000, nonce="ab"), 1000, True),
        (cookie_value(TOKEN, issued=1000, nonce="ab"), 1000 + 3600, True),
        (cookie_value(TOKEN, issued=1000, nonce="ab"), 1000 + 3601, False),  # expired
        (cookie_value(TOKEN, issued=1000, nonce="ab"), 1000 - 61, False),  # from the future
        (cookie_value("other", issued=1000, nonce="ab"), 1000, False),
        (cookie_value(TOKEN, issued=1000, nonce="ab").replace(".ab.", ".ac."), 1000, False),
        ("1000.ab", 1000, False),
        ("x.ab.cd", 1000, False),
        ("", 1000, False),
        ("\u00e9t\u00e9", 1000, False),  # not ASCII: refused, never a TypeError
    ],
)
def test_cookie_valid(cookie: str, now: float, valid: bool) -> None:
    assert cookie_valid(TOKEN, cookie, now=now, max_age_s=3600) is valid


def test_allowed_reads_the_cookie_age() -> None:
    cookie = cookie_value(TOKEN, issued=1000, nonce="n")
    args = {"token": TOKEN, "public_stats": True, "authorization": None, "cookie": cookie}
    assert allowed(Access.VIEW, now=1100, cookie_max_age_s=200, **args)
    assert not allowed(Access.VIEW, now=1300, cookie_max_age_s=200, **args)


def test_sign_in_limiter_counts_failures_per_client_for_a_minute() -> None:
    limiter = SignInLimiter(max_clients=2)
    for i in range(3):
        assert not limiter.blocked("a", 10.0 + i, 3)
        limiter.failed("a", 10.0 + i)
    assert limiter.blocked("a", 13.0, 3) and not limiter.blocked("b", 13.0, 3)
    assert not limiter.blocked("a", 70.0, 3)  # the first failure left the window
    assert limiter.unlogged == 3
    assert limiter.log_due(13.0) and not limiter.log_due(72.0) and limiter.log_due(73.0)
    limiter.failed("b", 71.0)
    limiter.failed("c", 71.0)  # bounded: the stalest client ("a") is forgotten
    limiter.failed("a", 71.0)
    assert not limiter.blocked("a", 71.0, 2)
