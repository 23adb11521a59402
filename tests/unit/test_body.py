import orjson
import pytest

from kvproxy.proxy.body import inject_fields, parse_object, unjoined


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"a":1}', {"a": 1}),
        (b"  {}  ", {}),
        (b"[1,2]", None),
        (b'"text"', None),
        (b"not json", None),
        (b"", None),
        (b'{"a":', None),
    ],
)
def test_parse_object(raw: bytes, expected: object) -> None:
    assert parse_object(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":8}}',
        b"{}",
        b"  \n{ }",
        b'{\n  "text": "hi"\n}',
        b'\t{"nested":{"session_id":"inner"}}',
    ],
)
def test_inject_adds_top_level_fields_and_keeps_the_rest(raw: bytes) -> None:
    fields = {"session_id": "sess-1", "rid": "0" * 32}
    out = inject_fields(raw, fields)
    doc = orjson.loads(out)
    original = orjson.loads(raw)
    assert doc == {**original, **fields}
    # the original bytes after the opening brace are carried over verbatim
    brace = raw.index(b"{")
    assert out.endswith(raw[brace + 1 :])


def test_inject_nothing_returns_the_same_object() -> None:
    raw = b'{"a": 1}'
    assert inject_fields(raw, {}) is raw


def test_inject_escapes_values() -> None:
    out = inject_fields(b'{"a":1}', {"session_id": 'we"ird\\id'})
    assert orjson.loads(out)["session_id"] == 'we"ird\\id'


def test_inject_rejects_non_objects() -> None:
    with pytest.raises(ValueError):
        inject_fields(b"[1]", {"a": 1})


def test_unjoined_is_the_body_as_a_one_byte_head_and_the_rest() -> None:
    raw = b'{"input_ids":[1,2,3]}'
    head, rest = unjoined(raw)
    assert bytes(head) == b"{" and bytes(head) + bytes(rest) == raw
    assert rest.obj is raw  # a view: nothing copied
