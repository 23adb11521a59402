"""The request vocabulary: one header lookup, one truthy set, nvext, n, rid."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from kvproxy import vocab
from kvproxy.admission.classify import is_protected
from kvproxy.config import AdmissionConfig, SessionLifecycleConfig
from kvproxy.sessions.identity import resolve_identity

BOOL_HEADER_VALUES = [
    ("1", True),
    ("true", True),
    ("TRUE", True),
    (" yes ", True),
    ("on", True),
    ("On", True),
    ("0", False),
    ("false", False),
    ("off", False),
    ("", False),
    ("y", False),
]


@pytest.mark.parametrize(("value", "expected"), BOOL_HEADER_VALUES)
def test_final_and_protected_headers_accept_the_same_values(value: str, expected: bool) -> None:
    final = resolve_identity(
        SessionLifecycleConfig(enabled=True),
        path_session_id=None,
        headers={"X-Session-ID": "s1", "X-Session-Final": value},
        body={},
    )
    protected = is_protected(
        AdmissionConfig(trust_client_headers=True), {"X-KVProxy-Protected": value}, {}
    )
    assert final.close_after is expected
    assert protected is expected


def test_header_lookup_is_case_insensitive_for_dicts_and_multidicts() -> None:
    assert vocab.header({"x-session-id": "a"}, "X-Session-ID") == "a"
    assert vocab.header(CIMultiDict({"x-session-id": "b"}), "X-Session-ID") == "b"
    assert vocab.header({"Other": "c"}, "X-Session-ID") is None
    assert vocab.header(CIMultiDict(), "X-Session-ID") is None


@pytest.mark.parametrize(
    ("body", "section"),
    [
        ({"nvext": {"agent_hints": {"osl": 3}}}, {"osl": 3}),
        ({"nvext": {"agent_hints": "x"}}, None),
        ({"nvext": []}, None),
        ({"nvext": {"agent_hints": None}}, None),
        ({}, None),
        (None, None),
    ],
)
def test_nvext_section_only_walks_json_objects(body: Any, section: Any) -> None:
    assert vocab.nvext_section(body, "agent_hints") == section


@pytest.mark.parametrize(
    ("body", "n"),
    [
        ({}, 1),
        ({"n": 3}, 3),
        ({"n": 3.0}, 3),
        ({"n": 0}, 1),
        ({"n": True}, 1),
        ({"n": "2"}, 1),
        ({"sampling_params": {"n": 4}, "n": 2}, 4),
        ({"sampling_params": {}, "n": 2}, 2),
    ],
)
def test_sample_count(body: dict[str, Any], n: int) -> None:
    assert vocab.sample_count(body) == n


def test_body_rid_is_returned_as_sent() -> None:
    assert vocab.body_rid({"rid": ["a", "b"]}) == ["a", "b"]
    assert vocab.body_rid({}) is None
