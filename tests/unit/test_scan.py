"""The byte scanner agrees with the full parse (orjson) on real-shaped and odd bodies."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvproxy.admission.classify import request_priority
from kvproxy.admission.reservation import (
    _batch_size,
    completion_tokens,
    exact_prompt_tokens,
    prompt_chars,
)
from kvproxy.config import SessionLifecycleConfig
from kvproxy.dynamo.nvext import InvalidNvext, parse_nvext
from kvproxy.proxy import scan as scan_module
from kvproxy.proxy.body import parse_object
from kvproxy.proxy.scan import (
    METHOD_FULL,
    METHOD_SCAN,
    MIN_EXCISE_BYTES,
    BodyScan,
    batch_size,
    count_elements,
    count_flat_ids,
    find_key,
    locate_flat_array,
    prompt_token_count,
    scan_object,
    validated,
)
from kvproxy.sessions.identity import InvalidSessionId, injection_plan, resolve_identity

LIFECYCLE = SessionLifecycleConfig(enabled=True)


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 152_000) for _ in range(n)]


def _identity(body: Any) -> Any:
    try:
        return resolve_identity(LIFECYCLE, path_session_id=None, headers={}, body=body)
    except InvalidSessionId as exc:
        return ("invalid", str(exc))


def parse_nvext_or_error(body: Any) -> Any:
    try:
        return parse_nvext(body)
    except InvalidNvext as exc:
        return ("invalid", str(exc))


def documented_exception(scan: BodyScan) -> bool:
    """An excised array of digits, commas and whitespace that orjson rejects (``[1,,2]``):
    the one body :meth:`BodyScan.validate` passes where the full parse refuses it."""
    for start, end in scan._spans.values():
        if count_flat_ids(scan._raw, start, end) is not None:
            try:
                orjson.loads(scan._raw[start:end])
            except orjson.JSONDecodeError:
                return True
    return False


def assert_deferred_agrees(raw: bytes, full: dict[str, Any] | None) -> None:
    """``count=False``: the arrays are only located; reading a count gives the eager
    scan's answer, and validate() the full parse's verdict (for both scans)."""
    lazy = scan_object(raw, count=False)
    eager = scan_object(raw)
    if full is None:
        # Not an object: refused at once, or by validate(), or the documented exception.
        for scan in (lazy, eager):
            assert scan is None or not scan.validate() or documented_exception(scan), raw[:200]
        return
    assert lazy is not None and eager is not None, raw[:200]
    assert set(lazy.deferred) == set(lazy.excised)  # (a nested one may force a full parse)
    assert set(eager.deferred) == set(eager.excised)  # counted, not checked
    assert lazy.session_id == full.get("session_id") and lazy.rid == full.get("rid")
    assert lazy._materialised == {} and lazy._counts == {}  # nothing counted or built
    assert lazy.prompt_token_count == eager.prompt_token_count
    assert lazy.batch_size == eager.batch_size
    assert lazy.validate() and lazy.deferred == ()
    assert eager.validate() and eager.deferred == ()
    assert lazy.to_dict() == full


def assert_agrees(raw: bytes) -> BodyScan | None:
    """The scan and the full parse give the same answer to every reader of the body."""
    full = parse_object(raw)
    scan = scan_object(raw)
    assert_deferred_agrees(raw, full)
    if full is None:
        assert scan is None or not scan.validate() or documented_exception(scan), raw[:200]
        return None
    assert scan is not None, raw[:200]
    # The scan's facts first (before anything materialises an excised array).
    assert scan.prompt_token_count == exact_prompt_tokens(full)
    assert scan.batch_size == _batch_size(full)
    assert prompt_token_count(scan) == prompt_token_count(full) == exact_prompt_tokens(full)
    assert batch_size(scan) == batch_size(full) == _batch_size(full)
    assert scan._materialised == {}
    assert scan.input_ids_count == (
        exact_prompt_tokens({"input_ids": full["input_ids"]}) if "input_ids" in full else None
    )
    # The readers of the pipeline, given the scan instead of the dict.
    assert request_priority(scan) == request_priority(full)
    for path in ("/generate", "/v1/chat/completions"):
        try:
            expected = completion_tokens(path, full, default=4096, cap=4096)
        except Exception as exc:  # a malformed sampling_params list: same error type
            with pytest.raises(type(exc)):
                completion_tokens(path, scan, default=4096, cap=4096)
        else:
            assert completion_tokens(path, scan, default=4096, cap=4096) == expected
            # The sizer and the planners read the small fields from the plain members.
            assert completion_tokens(path, scan.members, default=4096, cap=4096) == expected
    assert _identity(scan) == _identity(full) == _identity(scan.members)
    assert parse_nvext_or_error(scan.members) == parse_nvext_or_error(full)
    ident = _identity(full)
    if not isinstance(ident, tuple):
        a = injection_plan(LIFECYCLE, ident, scan.members)
        b = injection_plan(LIFECYCLE, ident, full)
        assert (a.skip_reason, a.overwrites, a.rid_generated) == (
            b.skip_reason,
            b.overwrites,
            b.rid_generated,
        )
        assert set(a.fields) == set(b.fields)
        if not a.rid_generated:
            assert a.rid == b.rid and a.abort_rids == b.abort_rids
    # And the whole mapping, materialised.
    assert list(scan) == list(full)
    assert len(scan) == len(full)
    assert scan.to_dict() == full
    assert dict(scan.items()) == full
    assert prompt_chars(scan) == prompt_chars(full)
    only_ids = scan_object(raw, ("input_ids",))
    assert only_ids is not None and only_ids.to_dict() == full
    assert only_ids.input_ids_count == scan.input_ids_count
    return scan


# ----------------------------------------------------------------------------- tables
GEN = {"sampling_params": {"max_new_tokens": 512, "n": 1, "temperature": 1.0}, "stream": False}


@pytest.mark.parametrize(
    ("raw", "method", "count"),
    [
        (orjson.dumps({"input_ids": _ids(2000), **GEN}), METHOD_SCAN, 2000),
        # Python's json.dumps spacing, input_ids last.
        (json.dumps({**GEN, "rid": "r1", "input_ids": _ids(500)}).encode(), METHOD_SCAN, 500),
        # Newlines and tabs around every token.
        (
            b'{\n\t"input_ids" :\n [ '
            + b" ,\n\t".join(str(i).encode() for i in _ids(300))
            + b' ]\r\n, "session_id":"s"}',
            METHOD_SCAN,
            300,
        ),
        # Too short to be worth excising: parsed.
        (b'{"input_ids":[1,2,3]}', METHOD_FULL, 3),
        # A token-id prompt on /v1/completions.
        (orjson.dumps({"model": "m", "prompt": _ids(400)}), METHOD_SCAN, 400),
        # Chat: nothing to excise.
        (orjson.dumps({"messages": [{"role": "user", "content": "hi" * 500}]}), METHOD_FULL, None),
        # Both counted keys (input_ids wins, as in exact_prompt_tokens).
        (orjson.dumps({"prompt": _ids(300, 1), "input_ids": _ids(600)}), METHOD_SCAN, 600),
        # Negative ids: not a digit array, parsed normally.
        (orjson.dumps({"input_ids": [-1, *_ids(400)]}), METHOD_FULL, 401),
        # Floats: parsed, and not token ids (first element not an int).
        (orjson.dumps({"input_ids": [1.5, *_ids(400)]}), METHOD_FULL, None),
        # 20 digits: orjson reads a float.
        (b'{"input_ids":[' + b"9" * 20 + b"," + b",".join([b"7"] * 300) + b"]}", METHOD_FULL, None),
        # A batch (list of lists): parsed, summed.
        (orjson.dumps({"input_ids": [_ids(200), _ids(300, 2)]}), METHOD_FULL, 500),
        # Empty arrays.
        (b'{"input_ids":[]}', METHOD_FULL, 0),
        (b'{"input_ids":[' + b" " * 300 + b"]}", METHOD_SCAN, 0),
    ],
)
def test_scan_table(raw: bytes, method: str, count: int | None) -> None:
    scan = assert_agrees(raw)
    assert scan is not None
    assert scan.method == method
    assert scan.prompt_token_count == count


@pytest.mark.parametrize(
    "raw",
    [
        # input_ids nested first (in nvext), the top-level one after it: full parse.
        orjson.dumps({"nvext": {"input_ids": _ids(400)}, "input_ids": _ids(500, 3)}),
        # inside a chat message
        orjson.dumps({"messages": [{"role": "user", "input_ids": _ids(400)}], "input_ids": [1]}),
        # Duplicate top-level keys: orjson keeps the last value (in the first's position).
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"rid":"a","input_ids":[5,6]}',
        b'{"input_ids":[5,6],"rid":"a","input_ids":' + orjson.dumps(_ids(400)) + b"}",
        b'{"session_id":"a","input_ids":' + orjson.dumps(_ids(300)) + b',"session_id":"b"}',
        # The key spelled with an escape: the same key for the parser.
        b'{"input\\u005fids":' + orjson.dumps(_ids(400)) + b"}",
        # A key that merely ends in "input_ids" (the quote before it is escaped).
        b'{"a\\"input_ids":' + orjson.dumps(_ids(400)) + b',"input_ids":[1,2]}',
        # The same bytes inside a string value.
        b'{"text":"\\"input_ids\\":[1,2]","input_ids":' + orjson.dumps(_ids(300)) + b"}",
        # Unicode and escapes everywhere else.
        orjson.dumps(
            {
                "session_id": "traj-é",
                "text": '日本語 \n\t"quoted" \\ \u2028 😀',
                "input_ids": _ids(300),
                "nvext": {"agent_hints": {"priority": 5, "osl": 64}},
            }
        ),
        json.dumps({"text": "日本語 😀", "input_ids": _ids(300)}, ensure_ascii=True).encode(),
        # Numbers in every JSON form around the array.
        b'{"priority":-0,"n":2E0,"max_tokens":1.5e2,"x":-12.5e-3,"input_ids":'
        + orjson.dumps(_ids(300))
        + b',"max_completion_tokens":1e1}',
        # Real shapes: /generate, chat with input_ids (0.5.23), nvext session control.
        orjson.dumps(
            {
                "input_ids": _ids(5000),
                "rid": "8f1c2a0e5b6d4c1e9a7b3d2f1e0c9b8a",
                "session_id": "traj-000123",
                "sampling_params": {"max_new_tokens": 512, "stop_token_ids": [151645], "n": 4},
                "return_logprob": True,
                "logprob_start_len": -1,
                "stream": True,
            }
        ),
        orjson.dumps(
            {
                "model": "m",
                "messages": [{"role": "system", "content": "x"}],
                "input_ids": _ids(700),
                "max_completion_tokens": 100,
                "n": 2,
                "nvext": {"session_control": {"session_id": "s-1", "action": "close"}},
            }
        ),
    ],
)
def test_scan_agrees_on_tricky_bodies(raw: bytes) -> None:
    assert assert_agrees(raw) is not None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"null",
        b"[1,2]",
        b'"text"',
        b"\xef\xbb\xbf{}",  # BOM: orjson refuses it
        b'{"input_ids":' + orjson.dumps(_ids(400)),  # truncated
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b"}}",  # trailing garbage
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b"]",
        b'{"input_ids":' + orjson.dumps(_ids(400))[:-1] + b"}",  # array not closed
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"a":}',
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"t":"\x01"}',  # control char
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"t":"\xff"}',  # invalid UTF-8
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"t":"\\ud800"}',  # lone surrogate
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b",}",  # trailing comma
        b'{"input_ids":[01,' + orjson.dumps(_ids(400))[1:] + b"}",  # leading zero first
        b'["input_ids":' + orjson.dumps(_ids(400)) + b"]",
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"x":NaN}',
        b'{"input_ids":' + orjson.dumps(_ids(400)) + b',"x":' + b"[" * 1100 + b"]" * 1100 + b"}",
    ],
)
def test_scan_rejects_what_the_parser_rejects(raw: bytes) -> None:
    assert parse_object(raw) is None
    assert scan_object(raw) is None


@pytest.mark.parametrize(
    "inner",
    [b"1,,2", b"1 2", b"1,02"],
)
def test_documented_difference_inside_a_digit_array(inner: bytes) -> None:
    """Inside an excised digit array only the character set is checked: the body is
    counted where orjson rejects it (the engine then answers 400, as without kvproxy)."""
    raw = b'{"input_ids":[' + inner + b"," + b",".join([b"7"] * 200) + b"]}"
    assert parse_object(raw) is None
    scan = scan_object(raw)
    assert scan is not None and scan.method == METHOD_SCAN
    assert scan.prompt_token_count == inner.count(b",") + 1 + 200
    with pytest.raises(orjson.JSONDecodeError):
        scan["input_ids"]  # materialising it meets the parser's verdict


@pytest.mark.parametrize(
    ("inner", "valid", "count", "eager_scans"),
    [
        (b"1,2", True, 202, True),
        (b"-1,2", True, 202, True),  # valid JSON, a sign first: parsed when counted
        (b"1,-2", True, 202, True),  # counted by its commas, parsed by validate()
        (b"1.5,2", True, None, True),  # not token ids
        (b"true,1", True, None, True),
        (b"1 2", True, 201, True),  # the documented exception: validate() passes it
        (b"1,,2", True, 203, True),
        (b"1,abc", False, 202, True),  # counted on trust, refused by validate()
        (b"abc", False, None, False),  # not JSON: validate() says what the full parse says
        (b"01,2", False, None, False),
        (b"NaN,1", False, None, False),
    ],
)
def test_arrays_are_checked_only_when_asked(
    inner: bytes, valid: bool, count: int | None, eager_scans: bool
) -> None:
    """Both scans take a flat array on trust past its first element (the eager one counts
    it at once, ``count=False`` on the first read) until validate(), which answers as the
    full parse does (but for the documented exception)."""
    raw = b'{"session_id":"s","input_ids":[' + inner + b"," + b",".join([b"7"] * 200) + b"]}"
    eager = scan_object(raw)
    assert (eager is not None) == eager_scans
    lazy = scan_object(raw, count=False)
    assert lazy is not None and lazy.deferred == ("input_ids",) and lazy.session_id == "s"
    assert lazy.validate() == valid
    assert lazy.prompt_token_count == count == (eager.prompt_token_count if eager else None)
    if valid:
        assert lazy.deferred == ()
    if eager is not None:
        assert eager.validate() == valid


def test_validated_checks_an_eager_scan_and_is_true_for_a_dict() -> None:
    raw = orjson.dumps({"input_ids": _ids(400)})
    scan = scan_object(raw)
    assert scan is not None and scan.prompt_token_count == 400
    assert scan.deferred == ("input_ids",)  # counted, its interior not yet checked
    assert validated(scan) and scan.deferred == () and scan._materialised == {}
    assert validated({"input_ids": "anything"})


@pytest.mark.parametrize(
    ("inner", "count"),
    [
        (b"", 0),
        (b"  ", 0),
        (b"7", 1),
        (b" 7 , 8 ", 2),
        (b"1,,2", 3),
        (b"1,abc", 2),
        (b"0", 1),
        (b"9" * 19, 1),
        (b"9" * 20, None),  # a float for orjson
        (b"07,1", None),
        (b"-1,2", None),
        (b"1.5", None),
        (b"1,", None),
        (b"1 ,\n", None),
        (b",1", None),
        (b"x", None),
    ],
)
def test_count_elements(inner: bytes, count: int | None) -> None:
    raw = b'{"input_ids":[' + inner + b"]}"
    start = raw.index(b"[")
    assert count_elements(raw, start, len(raw) - 1) == count


def test_scan_does_not_materialise_until_asked() -> None:
    ids = _ids(1000)
    raw = orjson.dumps({"input_ids": ids, "rid": "r", **GEN})
    scan = scan_object(raw)
    assert scan is not None and scan.excised == ("input_ids",)
    assert scan._materialised == {}
    assert scan.rid == "r" and scan.max_new_tokens == 512 and scan.n == 1 and not scan.stream
    assert scan._materialised == {}
    assert scan["input_ids"] == ids
    assert scan.get("input_ids") is scan["input_ids"]  # cached


def test_small_field_accessors() -> None:
    raw = orjson.dumps(
        {
            "input_ids": _ids(300),
            "session_id": "s",
            "session_params": {"id": "x"},
            "rid": "r",
            "priority": 3,
            "stream": True,
            "max_tokens": 7.0,
            "max_completion_tokens": 9,
            "n": 3,
            "text": "t",
            "messages": [],
            "nvext": {"agent_hints": {"osl": 5}, "session_control": {"action": "close"}},
        }
    )
    s = scan_object(raw)
    assert s is not None
    assert (s.session_id, s.session_params, s.rid, s.priority, s.stream) == (
        "s",
        {"id": "x"},
        "r",
        3,
        True,
    )
    assert (s.max_tokens, s.max_completion_tokens, s.n, s.max_new_tokens) == (7, 9, 3, None)
    assert s.agent_hints == {"osl": 5} and s.session_control == {"action": "close"}
    assert s.has_text and s.has_messages
    bare = scan_object(b'{"nvext": 3, "sampling_params": {"n": 2, "max_new_tokens": 4}}')
    assert bare is not None
    assert bare.nvext is None and bare.agent_hints is None and bare.session_control is None
    assert bare.n == 2 and bare.max_new_tokens == 4 and not bare.has_text


def test_locate_flat_array() -> None:
    raw = b'{"a":1, "input_ids" : [ 1, 2 ,3 ] }'
    start, end, count = locate_flat_array(raw, "input_ids") or (0, 0, 0)
    assert raw[start:end] == b"[ 1, 2 ,3 ]" and count == 3
    assert locate_flat_array(b'{"input_ids":"x"}', "input_ids") is None
    assert locate_flat_array(b'{"input_ids":[[1]]}', "input_ids") is None
    assert locate_flat_array(b'{"input_ids":[1,true]}', "input_ids") is None
    assert locate_flat_array(b'{"input_ids":[1,]}', "input_ids") is None
    assert locate_flat_array(b'{"input_ids":[,]}', "input_ids") is None
    assert locate_flat_array(b'{"input_ids":[1', "input_ids") is None


# -------------------------------------------------------------------------- properties
_WS_CHOICES = ["", "", "", " ", "  ", "\n", "\t", "\r\n", " \n  "]
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "/": "\\/"}


@st.composite
def ws(draw: st.DrawFn) -> str:
    return draw(st.sampled_from(_WS_CHOICES))


@st.composite
def json_string(draw: st.DrawFn, value: str | None = None) -> str:
    """``value`` (drawn when None) as a JSON string, each character literal or escaped.

    A given ``value`` (a key) is escaped in one draw out of eight, a drawn one always may be."""
    if value is None:
        value = draw(st.text(max_size=12))
    elif draw(st.integers(0, 7)):
        return json.dumps(value, ensure_ascii=False)
    out = ['"']
    for ch in value:
        code = ord(ch)
        mode = draw(st.integers(0, 5))
        if code > 0xFFFF:
            if mode == 0:  # surrogate pair escape
                c = code - 0x10000
                out.append(f"\\u{0xD800 + (c >> 10):04x}\\u{0xDC00 + (c & 0x3FF):04X}")
            else:
                out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            out.append("?")  # lone surrogates cannot be encoded in UTF-8
        elif ch in _SHORT_ESCAPES and (mode < 3 or ch in '"\\\n\t\r'):
            out.append(_SHORT_ESCAPES[ch])
        elif code < 0x20 or mode == 0:
            out.append(f"\\u{code:04x}" if mode % 2 else f"\\u{code:04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


@st.composite
def json_number(draw: st.DrawFn) -> str:
    sign = draw(st.sampled_from(["", "", "-"]))
    digits = draw(st.sampled_from(["0", "7", "42", "151645", "18446744073709551615", "1" * 22]))
    frac = draw(st.sampled_from(["", "", "", ".0", ".5", ".000125"]))
    exp = draw(st.sampled_from(["", "", "", "e0", "E+2", "e-3", "E10"]))
    return sign + digits + frac + exp


@st.composite
def json_value(draw: st.DrawFn, depth: int = 0) -> str:
    kinds = ["str", "num", "lit"] + (["arr", "obj"] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "str":
        return draw(json_string())
    if kind == "num":
        return draw(json_number())
    if kind == "lit":
        return draw(st.sampled_from(["true", "false", "null"]))
    n = draw(st.integers(0, 3))
    if kind == "arr":
        items = [draw(ws()) + draw(json_value(depth + 1)) + draw(ws()) for _ in range(n)]
        return "[" + ",".join(items) + "]" if items else "[" + draw(ws()) + "]"
    members = [
        draw(ws()) + draw(json_string(draw(_KEYS))) + draw(ws()) + ":" + draw(ws())
        + draw(json_value(depth + 1)) + draw(ws())
        for _ in range(n)
    ]  # fmt: skip
    return "{" + ",".join(members) + "}" if members else "{" + draw(ws()) + "}"


_KEYS = st.sampled_from(
    ["input_ids", "prompt", "session_id", "rid", "n", "text", "x", "é", "a b", "😀", ""]
)


@st.composite
def token_array(draw: st.DrawFn) -> str:
    n = draw(st.one_of(st.integers(0, 5), st.integers(50, 400)))
    rng = random.Random(draw(st.integers(0, 2**32)))
    ids = [str(rng.randrange(0, 200_000)) for _ in range(n)]
    if ids and not draw(st.integers(0, 3)):
        variant = draw(st.sampled_from(["neg", "float", "big", "zero", "true"]))
        pos = rng.randrange(len(ids))
        ids[pos] = {"neg": "-5", "float": "2.5", "big": "9" * 21, "zero": "0", "true": "true"}[
            variant
        ]
    sep = draw(st.sampled_from([",", ", ", " , ", ",\n", "\t,"]))
    return "[" + draw(ws()) + sep.join(ids) + draw(ws()) + "]"


_BODY_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "session_id": st.one_of(st.text(alphabet="ab-_:.@9", max_size=10), st.none(), st.integers()),
    "rid": st.one_of(st.text(alphabet="0123456789abcdef", max_size=8), st.none()),
    "priority": st.one_of(st.integers(-5, 5), st.floats(-5, 5), st.none(), st.booleans()),
    "stream": st.booleans(),
    "n": st.one_of(st.integers(0, 4), st.none()),
    "max_tokens": st.one_of(st.integers(0, 10_000), st.floats(0, 1e4), st.none()),
    "max_completion_tokens": st.one_of(st.integers(0, 10_000), st.none()),
    "sampling_params": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "max_new_tokens": st.integers(0, 10_000),
                "n": st.integers(0, 4),
                "temperature": st.floats(0, 2),
                "stop": st.lists(st.text(max_size=4), max_size=2),
            },
        ),
        st.lists(st.fixed_dictionaries({"max_new_tokens": st.integers(0, 99)}), max_size=2),
    ),
    "nvext": st.fixed_dictionaries(
        {},
        optional={
            "agent_hints": st.fixed_dictionaries(
                {}, optional={"priority": st.integers(-3, 3), "osl": st.integers(0, 999)}
            ),
            "session_control": st.fixed_dictionaries(
                {},
                optional={
                    "session_id": st.text(alphabet="abc-1", min_size=1, max_size=6),
                    "action": st.sampled_from(["bind", "open", "close"]),
                },
            ),
        },
    ),
    "session_params": st.one_of(st.none(), st.fixed_dictionaries({"id": st.text(max_size=3)})),
    "text": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=5), max_size=3)),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}
        ),
        max_size=3,
    ),
}


@st.composite
def body(draw: st.DrawFn) -> bytes:
    """A request body as bytes: real fields, token arrays, junk, duplicates, odd spacing."""
    members: list[str] = []
    keys = draw(st.lists(st.sampled_from(sorted(_BODY_VALUES)), max_size=6))
    for key in keys:
        value = draw(_BODY_VALUES[key])
        # Re-encode small values with odd spacing and escapes via json_string for keys.
        members.append(draw(json_string(key)) + draw(ws()) + ":" + draw(ws()) + json.dumps(value))
    for _ in range(draw(st.integers(0, 2))):
        members.append(draw(json_string(draw(_KEYS))) + ":" + draw(json_value()))
    counted = st.sampled_from(["input_ids", "input_ids", "prompt"])
    for key in draw(st.lists(counted, min_size=draw(st.sampled_from([0, 1, 1, 1])), max_size=2)):
        members.append(draw(json_string(key)) + draw(ws()) + ":" + draw(ws()) + draw(token_array()))
    if not draw(st.integers(0, 3)):  # a token array nested somewhere too
        members.append('"nvext":{"input_ids":' + draw(token_array()) + "}")
    members = draw(st.permutations(members))
    text = draw(ws()) + "{" + ",".join(draw(ws()) + m + draw(ws()) for m in members) + "}"
    return (text + draw(ws())).encode()


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(body())
@example(b'{"input_ids":[' + b",".join([b"1"] * 300) + b"]}")
def test_property_scan_agrees_with_full_parse(raw: bytes) -> None:
    assert_agrees(raw)


@PROPERTY
@given(body(), st.data())
def test_property_corrupted_bodies(raw: bytes, data: st.DataObject) -> None:
    """One byte inserted, deleted or replaced anywhere: same verdict, except the
    documented case of a corruption inside an excised digit array."""
    pos = data.draw(st.integers(0, len(raw)))
    op = data.draw(st.sampled_from(["insert", "delete", "replace"]))
    byte = bytes([data.draw(st.sampled_from(list(b'{}[]",: 0123456789-.e\\\x00\xff')))])
    if op == "insert":
        bad = raw[:pos] + byte + raw[pos:]
    elif op == "delete":
        bad = raw[:pos] + raw[pos + 1 :]
    else:
        bad = raw[:pos] + byte + raw[pos + 1 :]
    full = parse_object(bad)
    scan = scan_object(bad)
    assert_deferred_agrees(bad, full)
    if full is None and scan is not None:
        # An excised array's interior is taken on trust until validate().
        assert any(start < pos < end for start, end in scan._spans.values()), bad[:300]
        assert not scan.validate() or documented_exception(scan), bad[:300]
        return
    assert_agrees(bad)


HEAD = scan_module._KEY_HEAD


@st.composite
def quoted_haystack(draw: st.DrawFn) -> bytes:
    """Bytes of quotes, key fragments and long quote-free runs, across the key head."""
    pieces = st.one_of(
        st.sampled_from([b'"', b'"input_ids"', b'"input_i', b'"prompt"', b'\\"', b":[", b"x"]),
        st.integers(1, 3000).map(lambda n: b"1," * n),
    )
    return b"".join(draw(st.lists(pieces, max_size=120)))


@PROPERTY
@given(quoted_haystack(), st.sampled_from([b'"input_ids"', b'"prompt"']))
def test_property_find_key_is_bytes_find(raw: bytes, needle: bytes) -> None:
    assert find_key(raw, needle) == raw.find(needle)


@pytest.mark.parametrize("at", [0, HEAD - 20, HEAD - 11, HEAD - 1, HEAD, HEAD + 5000, 150_000])
@pytest.mark.parametrize("quotes_before", [0, 10, 200])
def test_find_key_at_the_head_boundary_and_past_the_quote_walk(at: int, quotes_before: int) -> None:
    pad = b'"a",' * quotes_before
    raw = pad + b"7," * ((at - len(pad)) // 2 if at > len(pad) else 0)
    raw = raw + b'"input_ids":[1]' + b"8," * 100_000
    assert find_key(raw, b'"input_ids"') == raw.find(b'"input_ids"')
    assert find_key(raw, b'"prompt"') == -1


def test_min_excise_threshold_is_what_the_tables_assume() -> None:
    assert len(orjson.dumps(_ids(300))) > MIN_EXCISE_BYTES > len(b"[1,2,3]")


def test_counted_keys_per_path() -> None:
    from kvproxy.proxy.scan import counted_keys_for

    assert counted_keys_for("/generate") == ("input_ids",)
    assert counted_keys_for("/v1/completions") == ("input_ids", "prompt")
    assert counted_keys_for("/v1/chat/completions") == ()
    chat = orjson.dumps({"messages": [], "input_ids": _ids(400)})
    scan = scan_object(chat, counted_keys_for("/v1/chat/completions"))
    assert scan is not None and scan.method == METHOD_FULL and scan.input_ids_count == 400
