"""The pure parts of "forward only the data plane": path canonicalisation, the
allowlist, engine URL trust and kvproxy's own credentials removed before forwarding."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from kvproxy.credentials import fingerprint
from kvproxy.fleet.discovery import EngineList
from kvproxy.fleet.trust import trusted_engines
from kvproxy.headers import forward_request_headers
from kvproxy.paths import (
    DEFAULT_FORWARD_PATHS,
    compile_forward_paths,
    encoded_path,
    encoded_query,
    path_problem,
    pattern_problem,
)
from kvproxy.trust import EngineTrust, engine_url_problem, host_pattern_problem


@pytest.mark.parametrize(
    ("raw", "refused"),
    [
        ("/generate", False),
        ("/generate?x=1&y=%2F", False),  # the query may hold anything encoded
        ("/gen%65rate", False),  # an encoded letter decodes to the same path
        ("/v1/responses/resp_1/cancel", False),
        ("/.well-known/x", False),
        ("/generate%3Fa=1", True),
        ("/generate%3fa=1", True),
        ("/generate%23", True),
        ("/a%2Fb", True),
        ("/a%2fb", True),
        ("/./generate", True),
        ("/x/../generate", True),
        ("/%2e/generate", True),
        ("/x/%2E%2E/generate", True),
        ("/x/.%2e/generate", True),
        ("/generate/.", True),
        ("//generate", True),
        ("/generate#frag", True),
    ],
)
def test_path_problem(raw: str, refused: bool) -> None:
    assert (path_problem(raw) is not None) is refused


DEFAULT = compile_forward_paths(DEFAULT_FORWARD_PATHS)


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/generate", True),
        ("/v1/chat/completions", True),
        ("/v1/responses", True),
        ("/v1/responses/resp_1", True),
        ("/v1/responses/resp_1/input_items", True),
        ("/v1/messages", True),
        ("/v1/models", True),
        ("/health", True),
        ("/get_model_info", True),
        ("/workers", False),
        ("/workers/abc", False),
        ("/flush_cache", False),
        ("/wasm", False),
        ("/v1/tokenizers", False),
        ("/generate/x", False),  # an exact path has no sub-resources
        ("/v1/responsesx", False),
        ("/kvproxy/anything", False),
        ("/", False),
    ],
)
def test_default_forward_paths(path: str, allowed: bool) -> None:
    assert DEFAULT.allows(path) is allowed


def test_wildcard_and_own_prefix() -> None:
    everything = compile_forward_paths(["/*"])
    assert everything.allows("/workers") and everything.allows("/a/b/c")
    assert not everything.allows("/kvproxy/sessions/x/close")  # never forwarded
    assert not compile_forward_paths([]).allows("/generate")


@pytest.mark.parametrize(
    ("pattern", "ok"),
    [
        ("/generate", True),
        ("/v1/responses/*", True),
        ("/*", True),
        ("generate", False),
        ("/v1/*/x", False),
        ("/v1/responses*", False),
        ("/a?b", False),
        ("/a%2Fb", False),
        ("/x/../y", False),
        ("/kvproxy/health", False),
        ("/kvproxy/*", False),
        ("/caf\u00e9", False),
    ],
)
def test_pattern_problem(pattern: str, ok: bool) -> None:
    assert (pattern_problem(pattern) is None) is ok


@pytest.mark.parametrize(
    ("path", "encoded"),
    [
        ("/generate", "/generate"),
        ("/a b", "/a%20b"),
        ("/100%", "/100%25"),  # a decoded % is sent encoded: the router sees this path
        ("/%41", "/%2541"),
        ("/caf\u00e9", "/caf%C3%A9"),
    ],
)
def test_encoded_path(path: str, encoded: str) -> None:
    assert encoded_path(path) == encoded


def test_encoded_query() -> None:
    assert encoded_query("a=%20b&c=d") == "a=%20b&c=d"
    assert encoded_query("a=\u00e9") == "a=%C3%A9"


@pytest.mark.parametrize(
    ("url", "hosts", "ok"),
    [
        ("http://127.0.0.1:30001", (), True),
        ("https://engine-1.internal:443", (), True),
        ("http://10.0.0.5:30001@1", (), True),  # a data-parallel rank suffix
        ("ftp://127.0.0.1:30001", (), False),
        ("file:///etc/passwd", (), False),
        ("http://user:pw@127.0.0.1:1", (), False),
        ("http://127.0.0.1:1?x=1", (), False),
        ("http://:1", (), False),
        ("http://10.0.0.5:30001", ("10.0.0.0/8",), True),
        ("http://10.0.0.5:30001", ("192.168.0.0/16",), False),
        ("http://Engine-1.Internal:30001", ("engine-1.internal",), True),
        ("http://evil.example:30001", ("engine-1.internal", "10.0.0.0/8"), False),
        ("http://[::1]:30001", ("::1",), True),
    ],
)
def test_engine_url_problem(url: str, hosts: tuple[str, ...], ok: bool) -> None:
    assert (engine_url_problem(url, EngineTrust.of(hosts)) is None) is ok


def test_host_patterns() -> None:
    for good in ("10.0.0.0/8", "127.0.0.1", "::1", "engine-1.internal"):
        assert host_pattern_problem(good) is None
    for bad in ("http://x", "a b", "", "x/y/z"):
        assert host_pattern_problem(bad) is not None


def test_trusted_engines_drops_the_refused_everywhere() -> None:
    found = EngineList(
        healthy=("http://10.0.0.1:1", "http://6.6.6.6:1"),
        unhealthy=("gopher://10.0.0.2:1",),
        ring_urls=("http://10.0.0.1:1@0", "http://6.6.6.6:1"),
        ring_healthy=("http://10.0.0.1:1@0", "http://6.6.6.6:1"),
        labels={"http://6.6.6.6:1": {}, "http://10.0.0.1:1": {}},
    )
    cleaned, refused = trusted_engines(found, EngineTrust.of(["10.0.0.0/8"]))
    assert cleaned.healthy == ("http://10.0.0.1:1",) and cleaned.unhealthy == ()
    assert cleaned.ring_urls == cleaned.ring_healthy == ("http://10.0.0.1:1@0",)
    assert set(cleaned.labels) == {"http://10.0.0.1:1"}
    assert set(refused) == {"http://6.6.6.6:1", "gopher://10.0.0.2:1"}


def _headers(pairs: list[tuple[str, str]], token: str | None) -> CIMultiDict[str]:
    request = make_mocked_request("POST", "/generate", headers=CIMultiDict(pairs))
    return forward_request_headers(request, None, token)


def test_own_credentials_are_not_forwarded() -> None:
    out = _headers(
        [
            ("Authorization", "Bearer s3cret"),
            ("Cookie", "a=1; kvproxy_dashboard=abc; b=2"),
            ("X-Api-Key", "data-plane"),
        ],
        "s3cret",
    )
    assert "Authorization" not in out
    assert out["Cookie"] == "a=1; b=2"
    assert out["X-Api-Key"] == "data-plane"
    # A data-plane bearer (not kvproxy's token) is forwarded as it came.
    out = _headers([("Authorization", "Bearer sk-user"), ("Cookie", "kvproxy_dashboard=x")], "t")
    assert out["Authorization"] == "Bearer sk-user" and "Cookie" not in out
    out = _headers([("Authorization", "Bearer sk-user")], None)
    assert out["Authorization"] == "Bearer sk-user"


def test_fingerprint_of_the_data_plane_credential() -> None:
    a = fingerprint({"Authorization": "Bearer a"})
    assert a is not None and len(a) == 16
    assert a == fingerprint({"Authorization": " Bearer a "})
    assert a != fingerprint({"Authorization": "Bearer b"})
    assert fingerprint({"x-api-key": "k"}) not in (None, a)
    assert fingerprint({}) is None and fingerprint({"Authorization": ""}) is None
