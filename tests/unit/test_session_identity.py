"""Session id sources, validation, path prefix and injection decisions."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from kvproxy.config import SessionLifecycleConfig
from kvproxy.sessions.identity import (
    NO_IDENTITY,
    RID_BATCH,
    RID_LENGTH,
    ROUTING_KEY_HEADER,
    SKIP_ALREADY_PRESENT,
    SKIP_DISABLED,
    SKIP_NO_SESSION,
    SKIP_NOT_JSON_OBJECT,
    SKIP_SESSION_PARAMS,
    InvalidSessionId,
    SessionIdentity,
    TooManyRids,
    injection_plan,
    new_rid,
    resolve_identity,
    split_session_path,
    validate_session_id,
)

ON = SessionLifecycleConfig(enabled=True)


def nvext(sid: Any = None, action: str | None = None) -> dict[str, Any]:
    control: dict[str, Any] = {}
    if sid is not None:
        control["session_id"] = sid
    if action is not None:
        control["action"] = action
    return {"nvext": {"session_control": control}}


# -- split_session_path --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/sessions/abc/v1/chat/completions", ("abc", "/v1/chat/completions")),
        ("/sessions/abc/generate", ("abc", "/generate")),
        ("/sessions/abc", ("abc", "/")),
        ("/sessions/abc/", ("abc", "/")),
        ("/sessions/traj%3A7/generate", ("traj:7", "/generate")),
        ("/sessions/a%40b/v1/completions", ("a@b", "/v1/completions")),
        ("/v1/chat/completions", (None, "/v1/chat/completions")),
        ("/sessions", (None, "/sessions")),
        ("/sessionsabc/generate", (None, "/sessionsabc/generate")),
        ("/x/sessions/abc/generate", (None, "/x/sessions/abc/generate")),
        # The rest of the path is returned unchanged (still encoded).
        ("/sessions/s1/v1/a%20b", ("s1", "/v1/a%20b")),
    ],
)
def test_split_session_path(path: str, expected: tuple[str | None, str]) -> None:
    assert split_session_path(path) == expected


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/sessions//generate", "empty"),
        ("/sessions/%zz/generate", "malformed"),
        ("/sessions/abc%4/generate", "malformed"),
        ("/sessions/%ff%fe/generate", "UTF-8"),
    ],
)
def test_split_session_path_rejects(path: str, fragment: str) -> None:
    with pytest.raises(InvalidSessionId, match=fragment) as info:
        split_session_path(path)
    assert info.value.source == "path"


def test_encoded_slash_in_path_id_is_rejected_by_validation() -> None:
    sid, rest = split_session_path("/sessions/a%2Fb/generate")
    assert (sid, rest) == ("a/b", "/generate")
    with pytest.raises(InvalidSessionId, match="characters"):
        resolve_identity(ON, path_session_id=sid, headers={}, body=None)


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "max_length", "fragment"),
    [
        ("", 128, "empty"),
        ("a" * 129, 128, "129 characters long"),
        ("has space", 128, "characters"),
        ("semi;colon", 128, "characters"),
        ("ünïcode", 128, "characters"),
        ("new\nline", 128, "characters"),
        (42, 128, "must be a string"),
        (["a"], 128, "must be a string"),
    ],
)
def test_validate_rejects(value: Any, max_length: int, fragment: str) -> None:
    with pytest.raises(InvalidSessionId, match=fragment):
        validate_session_id(value, max_length, source="header")


@pytest.mark.parametrize(
    "value", ["a", "traj-000123", "shard.session-ab12", "user@host:7", "A_b.c-d:e@f", "x" * 128]
)
def test_validate_accepts(value: str) -> None:
    assert validate_session_id(value, max_length=128, source="body") == value


def test_error_message_names_source_and_reason() -> None:
    with pytest.raises(InvalidSessionId) as info:
        resolve_identity(ON, path_session_id=None, headers={"X-Session-ID": "bad id"}, body={})
    msg = str(info.value)
    assert "session header" in msg and "characters" in msg


# -- resolve_identity ----------------------------------------------------------

BODY_AND_ALL = {"session_id": "from-body", **nvext("from-nvext")}
ALL_HEADERS = {"X-Session-ID": "from-header", ROUTING_KEY_HEADER: "from-key"}


@pytest.mark.parametrize(
    ("sources", "headers", "body", "path_id", "expected"),
    [
        # Default order: body, header, nvext, routing_key, path.
        (None, ALL_HEADERS, BODY_AND_ALL, "from-path", ("from-body", "body")),
        (None, ALL_HEADERS, nvext("from-nvext"), "from-path", ("from-header", "header")),
        (None, {ROUTING_KEY_HEADER: "k"}, nvext("from-nvext"), "p", ("from-nvext", "nvext")),
        (None, {ROUTING_KEY_HEADER: "from-key"}, {}, "from-path", ("from-key", "routing_key")),
        (None, {}, {}, "from-path", ("from-path", "path")),
        (None, {}, None, "from-path", ("from-path", "path")),
        # Header names are case-insensitive.
        (None, {"x-session-id": "lower"}, {}, None, ("lower", "header")),
        # JSON null counts as absent.
        (None, {"X-Session-ID": "h"}, {"session_id": None}, None, ("h", "header")),
        # A reordered list changes the winner.
        (("path", "body"), ALL_HEADERS, BODY_AND_ALL, "from-path", ("from-path", "path")),
        (("routing_key",), ALL_HEADERS, BODY_AND_ALL, "p", ("from-key", "routing_key")),
        # Sources not listed are not consulted.
        (("header",), {}, BODY_AND_ALL, "p", (None, None)),
        # Malformed nvext is ignored rather than rejected.
        (None, {}, {"nvext": "oops"}, None, (None, None)),
        (None, {}, {"nvext": {"session_control": 5}}, None, (None, None)),
    ],
)
def test_resolve_sources(
    sources: tuple[str, ...] | None,
    headers: dict[str, str],
    body: dict[str, Any] | None,
    path_id: str | None,
    expected: tuple[str | None, str | None],
) -> None:
    cfg = ON if sources is None else dataclasses.replace(ON, id_sources=sources)
    ident = resolve_identity(cfg, path_session_id=path_id, headers=headers, body=body)
    assert (ident.session_id, ident.source) == expected


def test_custom_header_name() -> None:
    cfg = dataclasses.replace(ON, id_header="X-Agent-Run")
    ident = resolve_identity(cfg, path_session_id=None, headers={"X-Agent-Run": "r1"}, body={})
    assert ident.session_id == "r1"
    ident = resolve_identity(cfg, path_session_id=None, headers={"X-Session-ID": "r1"}, body={})
    assert ident.session_id is None


def test_first_present_source_must_be_valid_no_fallthrough() -> None:
    with pytest.raises(InvalidSessionId) as info:
        resolve_identity(
            ON,
            path_session_id=None,
            headers={"X-Session-ID": "good"},
            body={"session_id": "bad id"},
        )
    assert info.value.source == "body"


def test_length_limit_from_config() -> None:
    cfg = dataclasses.replace(ON, id_max_length=8)
    assert resolve_identity(cfg, path_session_id="12345678", headers={}, body=None).present
    with pytest.raises(InvalidSessionId, match="at most 8"):
        resolve_identity(cfg, path_session_id="123456789", headers={}, body=None)


def test_disabled_reads_and_validates_nothing() -> None:
    off = SessionLifecycleConfig(enabled=False)
    ident = resolve_identity(
        off, path_session_id="bad id", headers={"X-Session-ID": "bad id"}, body={}
    )
    assert ident == NO_IDENTITY


@pytest.mark.parametrize(
    ("headers", "body", "close_after"),
    [
        ({}, {"session_id": "s"}, False),
        ({}, {"session_id": "s", **nvext(action="close")}, True),
        ({}, {"session_id": "s", **nvext(action="open")}, False),
        ({"X-Session-Final": "true"}, {"session_id": "s"}, True),
        ({"x-session-final": "1"}, {"session_id": "s"}, True),
        ({"X-Session-Final": " YES "}, {"session_id": "s"}, True),
        ({"X-Session-Final": "false"}, {"session_id": "s"}, False),
        ({"X-Session-Final": "0"}, {"session_id": "s"}, False),
        # No session id -> nothing to close.
        ({"X-Session-Final": "true"}, {}, False),
        ({}, nvext(action="close"), False),
    ],
)
def test_close_after(headers: dict[str, str], body: dict[str, Any], close_after: bool) -> None:
    ident = resolve_identity(ON, path_session_id=None, headers=headers, body=body)
    assert ident.close_after is close_after


def test_nvext_supplies_id_and_close_together() -> None:
    ident = resolve_identity(ON, path_session_id=None, headers={}, body=nvext("n1", "close"))
    assert ident == SessionIdentity("n1", "nvext", True)


# -- injection_plan ------------------------------------------------------------

SID = SessionIdentity("s1", "header", False)


def test_new_rid_is_fixed_length_hex_and_unique() -> None:
    n = 3 * RID_BATCH + 7  # across several draws from the kernel
    rids = {new_rid() for _ in range(n)}
    assert len(rids) == n
    assert all(len(r) == RID_LENGTH and int(r, 16) >= 0 for r in rids)


def test_a_forked_child_does_not_hand_out_the_parents_rids() -> None:
    new_rid()  # the pool holds drawn rids now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next rid, to the parent
        try:
            os.write(write, new_rid().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    parent = new_rid()
    assert len(child) == RID_LENGTH
    assert child != parent  # without the fork hook both pop the same drawn rid


@pytest.mark.parametrize(
    ("identity", "body", "fields", "skip"),
    [
        (SID, {"text": "hi", "rid": "r"}, {"session_id": "s1"}, None),
        (SID, {"text": "hi", "rid": "r", "session_id": "s1"}, {}, SKIP_ALREADY_PRESENT),
        (SID, {"rid": "r", "session_params": {"id": "legacy"}}, {}, SKIP_SESSION_PARAMS),
        # session_params: null is the same as absent.
        (SID, {"rid": "r", "session_params": None}, {"session_id": "s1"}, None),
        (NO_IDENTITY, {"rid": "r"}, {}, SKIP_NO_SESSION),
    ],
)
def test_session_id_injection(
    identity: SessionIdentity, body: dict[str, Any], fields: dict[str, Any], skip: str | None
) -> None:
    plan = injection_plan(ON, identity, body)
    assert dict(plan.fields) == fields
    assert plan.skip_reason == skip
    assert plan.counts_as_skipped is (skip == SKIP_SESSION_PARAMS)
    assert plan.rid == "r" and not plan.rid_generated


def test_different_existing_session_id_is_overwritten() -> None:
    # The proxy tracks and closes the resolved id, so the engine must see that one.
    plan = injection_plan(ON, SID, {"session_id": "other", "rid": "r"})
    assert dict(plan.fields) == {"session_id": "s1"}
    assert plan.overwrites == ("session_id",)


@pytest.mark.parametrize("body", [{"text": "hi"}, {"text": "hi", "rid": None}])
def test_rid_generated_when_missing(body: dict[str, Any]) -> None:
    plan = injection_plan(ON, SID, body)
    rid = plan.fields["rid"]
    assert isinstance(rid, str) and len(rid) == RID_LENGTH
    assert plan.rid == rid and plan.rid_generated
    assert plan.abort_rids == (rid,)
    assert plan.overwrites == (("rid",) if "rid" in body else ())


def test_rid_generated_without_session_too() -> None:
    plan = injection_plan(ON, NO_IDENTITY, {"text": "hi"})
    assert set(plan.fields) == {"rid"}
    assert plan.skip_reason == SKIP_NO_SESSION


def test_rid_generated_even_when_session_params_skip() -> None:
    plan = injection_plan(ON, SID, {"session_params": {"id": "x"}})
    assert set(plan.fields) == {"rid"}


LONG = "c" * 32  # as long as kvproxy's own rids: named in an abort


@pytest.mark.parametrize(
    ("body", "abort_rids"),
    [
        ({"rid": LONG, "sampling_params": {"n": 3}}, (LONG, f"{LONG}_0", f"{LONG}_1", f"{LONG}_2")),
        ({"rid": LONG, "n": 2}, (LONG, f"{LONG}_0", f"{LONG}_1")),
        ({"rid": LONG, "n": 1}, (LONG,)),
        ({"rid": LONG, "n": True}, (LONG,)),
        ({"rid": LONG, "n": 64}, (LONG,)),  # n + 1 over max_rids_per_request: not expanded
        ({"rid": [LONG, LONG + "b"]}, (LONG, LONG + "b")),
        # SGLang aborts by prefix: a short client rid ("0" aborts every "0...") never is.
        ({"rid": "r", "n": 3}, ()),
        ({"rid": "0"}, ()),
        ({"rid": ["a", LONG]}, (LONG,)),
        ({"rid": 7}, ()),
    ],
)
def test_abort_rids(body: dict[str, Any], abort_rids: tuple[str, ...]) -> None:
    plan = injection_plan(ON, SID, body)
    assert plan.abort_rids == abort_rids
    assert "rid" not in plan.fields


def test_a_rid_list_over_the_cap_is_refused() -> None:
    injection_plan(ON, SID, {"rid": [f"{i:032d}" for i in range(64)]})  # at the cap
    with pytest.raises(TooManyRids, match="max_rids_per_request"):
        injection_plan(ON, SID, {"rid": [f"{i:032d}" for i in range(65)]})
    short = dataclasses.replace(ON, abort_rid_min_length=1)
    assert injection_plan(short, SID, {"rid": "r", "n": 2}).abort_rids == ("r", "r_0", "r_1")


def test_sticky_routing_header() -> None:
    sticky = dataclasses.replace(ON, sticky_routing=True)
    assert injection_plan(ON, SID, {"rid": "r"}).headers == {}
    assert injection_plan(sticky, SID, {"rid": "r"}).headers == {ROUTING_KEY_HEADER: "s1"}
    # The client's own routing key is left alone; no session, no header.
    kept = injection_plan(sticky, SID, {"rid": "r"}, headers={"x-smg-routing-key": "mine"})
    assert kept.headers == {}
    assert injection_plan(sticky, NO_IDENTITY, {"rid": "r"}).headers == {}


def test_non_object_bodies_get_nothing() -> None:
    # The pipeline passes None for a body that is not a JSON object.
    plan = injection_plan(ON, SID, None)
    assert plan.empty and plan.skip_reason == SKIP_NOT_JSON_OBJECT


def test_disabled_plan_is_empty() -> None:
    plan = injection_plan(SessionLifecycleConfig(enabled=False), SID, {"text": "x"})
    assert plan.empty and plan.skip_reason == SKIP_DISABLED
