"""Who may use the operator surface, for every access level and credential."""

from __future__ import annotations

import pytest

from kvproxy.admin.auth import Access, allowed, cookie_value

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


def test_the_cookie_is_not_the_token_and_changes_with_it() -> None:
    assert GOOD_COOKIE != TOKEN and TOKEN not in GOOD_COOKIE
    assert cookie_value("a") != cookie_value("b")
    assert cookie_value(TOKEN) == GOOD_COOKIE  # stable across restarts
