"""The pure request pipeline, as a playbook: rows of (request in) -> (plan or refusal out).

No sockets, no app: each row is one intercepted request given to
:func:`kvproxy.proxy.pipeline.plan_request` and the plan it must produce (only the
fields a row names are compared). The rows are named by the rule they check.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from kvproxy.config import Config, from_mapping
from kvproxy.proxy.errors import ErrorType
from kvproxy.proxy.pipeline import (
    PASS_THROUGH,
    Plan,
    Refusal,
    final_fields,
    plan_request,
    read_body,
    render_body,
    with_turn_headers,
)
from kvproxy.proxy.scan import counted_keys_for, scan_object

OFF: dict[str, Any] = {}
LIFECYCLE = {"session_lifecycle": {"enabled": True}}
STICKY = {"session_lifecycle": {"enabled": True, "sticky_routing": True}}
ADMISSION = {"admission": {"enabled": True, "mode": "program"}}
BOTH = {"session_lifecycle": {"enabled": True}, "admission": {"enabled": True, "mode": "program"}}
STRIP = {"session_lifecycle": {"enabled": True, "strip_nvext_paths": ["/v1/chat/completions"]}}
STRIP_GENERATE = {"session_lifecycle": {"enabled": True, "strip_nvext_paths": ["/generate"]}}

# A token array whose interior is not JSON: the lifecycle alone does not look inside it.
BAD_IDS = b'"input_ids":[abc,' + b",".join([b"7"] * 200) + b"]"
GOOD_IDS = b'"input_ids":[' + b",".join([b"7"] * 200) + b"]"

ROUTING = "X-SMG-Routing-Key"

# (rule, config, path, path session id, headers, body) -> expected plan fields / refusal
ROWS: list[tuple[str, dict[str, Any], str, str | None, dict[str, str], bytes, Any]] = [
    (
        "features_off_forward_as_received",
        OFF,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b'{"text":"x"}',
        PASS_THROUGH,
    ),
    (
        "not_a_json_object_forward_as_received",
        LIFECYCLE,
        "/generate",
        None,
        {},
        b"[1,2]",
        PASS_THROUGH,
    ),
    ("invalid_json_forward_as_received", BOTH, "/generate", None, {}, b"{nope", PASS_THROUGH),
    (
        "header_session_injected_and_tracked",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s1"},
        b'{"input_ids":[1,2,3],"rid":"r1"}',
        {
            "fields": {"session_id": "s1"},
            "session_id": "s1",
            "ticket": "r1",
            "track": True,
            "turn": True,
            "admit": False,
            "abort_rids": (),  # a short client rid: never named in an abort
        },
    ),
    (
        "path_session_wins_no_body_change_needed",
        LIFECYCLE,
        "/generate",
        "p1",
        {},
        b'{"text":"x","rid":"r2"}',
        {"fields": {"session_id": "p1"}, "session_id": "p1", "ticket": "r2"},
    ),
    (
        "body_session_kept_rid_generated",
        LIFECYCLE,
        "/generate",
        None,
        {},
        b'{"session_id":"s2","text":"hi"}',
        {"session_id": "s2", "track": True, "fields_keys": {"rid"}},
    ),
    (
        "sticky_routing_adds_routing_key_header",
        STICKY,
        "/generate",
        None,
        {"X-Session-ID": "s1"},
        b'{"text":"x","rid":"r"}',
        {"headers": {ROUTING: "s1"}},
    ),
    (
        "final_header_on_closes_after",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s1", "X-Session-Final": "on"},
        b'{"text":"x","rid":"r"}',
        {"close_after": True},
    ),
    (
        "final_header_no_does_not_close",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s1", "X-Session-Final": "no"},
        b'{"text":"x","rid":"r"}',
        {"close_after": False},
    ),
    (
        "no_session_nothing_tracked",
        LIFECYCLE,
        "/generate",
        None,
        {},
        b'{"text":"x","rid":"r"}',
        {"session_id": None, "track": False, "turn": False},
    ),
    (
        "bad_session_header_refused_400",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "bad id!"},
        b'{"text":"x"}',
        Refusal(ErrorType.INVALID_SESSION_ID, ""),
    ),
    (
        "bad_nvext_refused_400",
        LIFECYCLE,
        "/generate",
        None,
        {},
        b'{"text":"x","nvext":{"agent_hints":{"priority":"x"}}}',
        Refusal(ErrorType.INVALID_REQUEST, ""),
    ),
    (
        "admission_alone_reads_session_injects_nothing",
        ADMISSION,
        "/generate",
        None,
        {"X-Session-ID": "s1"},
        b'{"input_ids":[1,2,3],"rid":"r1"}',
        {
            "fields": {},
            "session_id": "s1",
            "admit": True,
            "track": False,
            "routing_key": "s1",
            "headers": {ROUTING: "s1"},
        },
    ),
    (
        "admission_alone_bad_session_not_refused",
        ADMISSION,
        "/generate",
        None,
        {"X-Session-ID": "bad id!"},
        b'{"text":"x","rid":"r"}',
        {"session_id": None, "admit": True, "routing_key": None, "headers": {}},
    ),
    (
        "admission_client_routing_key_kept",
        ADMISSION,
        "/generate",
        None,
        {"X-Session-ID": "s1", ROUTING: "k9"},
        b'{"text":"x","rid":"r"}',
        {"routing_key": "k9", "headers": {}},
    ),
    (
        "both_routing_key_waits_for_turn",
        BOTH,
        "/generate",
        None,
        {"X-Session-ID": "s1"},
        b'{"text":"x","rid":"r"}',
        {"admit": True, "turn": True, "routing_key": None},
    ),
    (
        "hint_priority_read_when_agent_hints_on",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s1"},
        b'{"text":"x","rid":"r","nvext":{"agent_hints":{"priority":3}}}',
        {"priority_hint": 3},
    ),
    (
        "strip_nvext_on_configured_path",
        STRIP,
        "/v1/chat/completions",
        None,
        {},
        b'{"messages":[],"rid":"r","nvext":{}}',
        {"strip_nvext": True},
    ),
    (
        "deferred_token_array_is_not_looked_inside_by_the_lifecycle",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b"{" + BAD_IDS + b"}",  # tracked; the engine answers 400, as without kvproxy
        {"track": True, "session_id": "s", "fields_keys": {"session_id", "rid"}},
    ),
    (
        "deferred_token_array_checked_before_a_reserialising_overwrite",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b'{"rid":null,' + BAD_IDS + b"}",
        PASS_THROUGH,
    ),
    (
        "deferred_token_array_checked_before_nvext_is_stripped",
        STRIP_GENERATE,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b'{"nvext":{},' + BAD_IDS + b"}",
        PASS_THROUGH,
    ),
    (
        # A null nvext is no nvext for the hints, but the member is still stripped.
        "deferred_token_array_checked_before_a_null_nvext_is_stripped",
        STRIP_GENERATE,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b'{"nvext":null,' + BAD_IDS + b"}",
        PASS_THROUGH,
    ),
    (
        "deferred_token_array_checked_before_a_speculative_prefill",
        LIFECYCLE,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b'{"nvext":{"agent_hints":{"speculative_prefill":true}},' + BAD_IDS + b"}",
        PASS_THROUGH,
    ),
    (
        "valid_token_array_stripped_as_usual",
        STRIP_GENERATE,
        "/generate",
        None,
        {"X-Session-ID": "s"},
        b'{"nvext":{},' + GOOD_IDS + b"}",
        {"strip_nvext": True, "track": True},
    ),
    (
        "strip_nvext_not_on_other_paths",
        STRIP,
        "/generate",
        None,
        {},
        b'{"text":"x","rid":"r","nvext":{}}',
        {"strip_nvext": False},
    ),
]


def _plan(cfg: dict[str, Any], path: str, sid: str | None, headers: dict[str, str], raw: bytes):
    config: Config = from_mapping(cfg)
    body = read_body(config, path, raw)  # as the handler reads it
    return config, plan_request(config, path, sid, CIMultiDict(headers), body)


@pytest.mark.parametrize(
    ("rule", "cfg", "path", "sid", "headers", "raw", "expected"), ROWS, ids=[r[0] for r in ROWS]
)
def test_playbook(rule, cfg, path, sid, headers, raw, expected) -> None:
    _, plan = _plan(cfg, path, sid, headers, raw)
    if isinstance(expected, Refusal):
        assert isinstance(plan, Refusal)
        assert plan.kind == expected.kind and plan.message
        assert plan.status == 400
        return
    assert isinstance(plan, Plan)
    if expected is PASS_THROUGH:
        assert plan.passthrough
        return
    for name, want in expected.items():
        if name == "fields_keys":
            assert set(plan.fields) == want
        elif name in ("fields", "headers"):
            assert dict(getattr(plan, name)) == want, name
        else:
            assert getattr(plan, name) == want, name


def test_turn_headers_then_routing_key_rule() -> None:
    """A turn's routing header is added unless the client set one; program admission then
    attributes the session to that key."""
    config, plan = _plan(BOTH, "/generate", None, {"X-Session-ID": "s1"}, b'{"text":"x"}')
    assert isinstance(plan, Plan)
    bound = with_turn_headers(plan, config, CIMultiDict({"X-Session-ID": "s1"}), {ROUTING: "t"})
    assert bound.routing_key == "t" and bound.headers[ROUTING] == "t"
    client = CIMultiDict({"X-Session-ID": "s1", ROUTING: "c"})
    kept = with_turn_headers(plan, config, client, {ROUTING: "t"})
    assert kept.routing_key == "c" and ROUTING not in kept.headers


@pytest.mark.parametrize(
    ("top_level", "hint", "steering", "want_priority", "want_source"),
    [
        (None, None, None, None, None),
        (None, None, 4, 4, "steering"),
        (None, 20, 4, 20, "hint"),
        (7, 20, 4, None, None),  # the body's own priority wins, nothing added
    ],
)
def test_final_fields_priority_rule(top_level, hint, steering, want_priority, want_source) -> None:
    doc: dict[str, Any] = {"text": "x", "rid": "r"}
    if top_level is not None:
        doc["priority"] = top_level
    if hint is not None:
        doc["nvext"] = {"agent_hints": {"priority": hint}}
    _, plan = _plan(LIFECYCLE, "/generate", None, {"X-Session-ID": "s"}, orjson.dumps(doc))
    assert isinstance(plan, Plan)
    fields, source = final_fields(plan, steering)
    assert fields.get("priority") == want_priority
    assert source == want_source
    assert fields["session_id"] == "s"


def test_render_splices_without_reencoding_token_ids() -> None:
    raw = b'{ "input_ids" : [1, 2,  3], "rid":"r"}'
    _, plan = _plan(LIFECYCLE, "/generate", None, {"X-Session-ID": "s"}, raw)
    assert isinstance(plan, Plan)
    out = render_body(raw, plan, plan.fields)
    assert out.endswith(raw[1:])  # the client's bytes, untouched after the splice
    assert orjson.loads(out) == {"session_id": "s", "input_ids": [1, 2, 3], "rid": "r"}


def test_render_overwrite_and_strip_reserialise() -> None:
    raw = b'{"messages":[],"rid":"r","nvext":{"x":1}}'
    _, plan = _plan(STRIP, "/v1/chat/completions", None, {"X-Session-ID": "s"}, raw)
    assert isinstance(plan, Plan)
    out = orjson.loads(render_body(raw, plan, {"session_id": "s"}))
    assert out == {"messages": [], "rid": "r", "session_id": "s"}
    assert render_body(raw, PASS_THROUGH, {"session_id": "s"}) == raw


def test_token_ids_counted_never_built_on_the_decision_path() -> None:
    """The scan's counted input_ids stay unparsed through planning and admission sizing."""
    from kvproxy.admission.reservation import _batch_size, exact_prompt_tokens

    raw = orjson.dumps({"input_ids": list(range(5000)), "rid": "r", "sampling_params": {"n": 1}})
    body = scan_object(raw, counted_keys_for("/generate"))
    assert body is not None and body.excised == ("input_ids",)
    config = from_mapping(BOTH)
    plan = plan_request(config, "/generate", None, CIMultiDict({"X-Session-ID": "s"}), body)
    assert isinstance(plan, Plan)
    final_fields(plan, 3)
    assert exact_prompt_tokens(body) == 5000
    assert _batch_size(body) == 1
    assert body._materialised == {}  # nothing built the 5,000-int list


@pytest.mark.parametrize(("cfg", "counted"), [(LIFECYCLE, False), (ADMISSION, True), (BOTH, True)])
def test_token_arrays_counted_only_for_admission(cfg: dict[str, Any], counted: bool) -> None:
    """The lifecycle alone only locates the array (four byte searches); admission's sizer
    needs the count, so with admission on it is counted (one comma count) while the body
    is read. Either way its interior is checked only when validated."""
    body = read_body(from_mapping(cfg), "/generate", b"{" + GOOD_IDS + b"}")
    assert body is not None and body.excised == ("input_ids",)
    assert bool(body._counts) == counted and body.deferred == ("input_ids",)
    assert body.prompt_token_count == 200 and body.deferred == ("input_ids",)
    assert body.validate() and body.deferred == ()


def test_render_overwrite_of_a_deferred_array_keeps_its_tokens() -> None:
    raw = b'{"rid":null,' + GOOD_IDS + b"}"
    _, plan = _plan(LIFECYCLE, "/generate", None, {"X-Session-ID": "s"}, raw)
    assert isinstance(plan, Plan) and plan.overwrite
    out = orjson.loads(render_body(raw, plan, plan.fields))
    assert out["input_ids"] == [7] * 200 and out["session_id"] == "s" and out["rid"]
