"""The admin plane's Host and Origin checks, and the start-up exposure warning (pure)."""

from __future__ import annotations

import pytest

from kvproxy.plane import exposure_warning, host_allowed, host_name, origin_allowed, plane_problem


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8100", "127.0.0.1"),
        ("LocalHost:8100", "localhost"),
        ("[::1]:8100", "::1"),
        ("example.com", "example.com"),
    ],
)
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    ("header", "admin_hosts", "bound", "ok"),
    [
        ("127.0.0.1:8100", (), "127.0.0.1", True),
        ("localhost:8100", (), "127.0.0.1", True),
        ("[::1]:8100", (), "::1", True),
        ("evil.example:8100", (), "127.0.0.1", False),  # DNS rebinding
        ("10.0.0.5:8100", (), "127.0.0.1", False),
        ("anything:8100", (), "0.0.0.0", True),
        ("kv.internal:8100", ("kv.internal",), "0.0.0.0", True),
        ("other:8100", ("kv.internal",), "0.0.0.0", False),
        ("localhost:8100", ("kv.internal:8100",), "127.0.0.1", False),
    ],
)
def test_host_allowed(header: str, admin_hosts: tuple[str, ...], bound: str, ok: bool) -> None:
    assert host_allowed(header, admin_hosts, bound) is ok


@pytest.mark.parametrize(
    ("method", "origin", "extra", "ok"),
    [
        ("POST", None, (), True),  # not a browser
        ("POST", "http://127.0.0.1:8100", (), True),  # kvproxy's own page
        ("POST", "http://127.0.0.1:8100/", (), True),
        ("POST", "https://evil.example", (), False),
        ("POST", "null", (), False),
        ("GET", "https://evil.example", (), True),  # cannot read the answer
        ("POST", "https://ops.example", ("https://ops.example",), True),
    ],
)
def test_origin_allowed(method: str, origin: str | None, extra: tuple[str, ...], ok: bool) -> None:
    assert origin_allowed(method, origin, "http://127.0.0.1:8100", extra) is ok


def test_plane_problem_names_what_is_wrong() -> None:
    base = {
        "method": "POST",
        "scheme": "http",
        "bound_host": "127.0.0.1",
        "admin_hosts": (),
        "admin_origins": (),
    }
    assert plane_problem(host_header="127.0.0.1:1", origin=None, **base) is None
    assert "Host" in (plane_problem(host_header="evil:1", origin=None, **base) or "")
    bad_origin = plane_problem(host_header="127.0.0.1:1", origin="http://evil", **base)
    assert "cross-origin" in (bad_origin or "")


def test_exposure_warning() -> None:
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "t") is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "admin_token" in warning
