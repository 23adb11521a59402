"""Request bodies of the intercepted endpoints: parse once, inject without re-serialising.

Pure functions. Injection splices ``"key":value,`` right after the opening brace of
the client's JSON object, so the rest of the bytes (a 200 KB ``input_ids`` list, say)
are forwarded untouched and never re-encoded. Keys are only ever *added* when absent,
so the result never has duplicate keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

_WHITESPACE = b" \t\r\n"


def parse_object(raw: bytes) -> dict[str, Any] | None:
    """The body as a dict, or None when it is not a JSON object (forwarded unchanged)."""
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def inject_fields(raw: bytes, fields: Mapping[str, Any]) -> bytes:
    """Return ``raw`` with ``fields`` added as top-level members of its JSON object.

    ``raw`` must be a JSON object (checked by :func:`parse_object`) that does not
    already contain any of ``fields``' keys.
    """
    if not fields:
        return raw
    return b"".join(splice_parts(raw, fields))


# A body as consecutive parts (sent in order, they are its bytes).
BodyParts = tuple[memoryview, bytes, memoryview]


def splice_parts(raw: bytes, fields: Mapping[str, Any]) -> BodyParts:
    """:func:`inject_fields`' result as its three parts, not joined: a view of ``raw`` up
    to its opening brace, the fields' members, a view of the rest (``fields`` not
    empty). A big body can be sent as these without ever being copied whole."""
    start = 0
    n = len(raw)
    while start < n and raw[start] in _WHITESPACE:
        start += 1
    if start >= n or raw[start] != 0x7B:  # "{"
        raise ValueError("body is not a JSON object")
    # One encoding of the fields as an object, its braces dropped: ``"k":v,...``.
    members = orjson.dumps(fields if type(fields) is dict else dict(fields))[1:-1]
    nxt = start + 1
    while nxt < n and raw[nxt] in _WHITESPACE:
        nxt += 1
    if nxt < n and raw[nxt] != 0x7D:  # not "}": the object has members of its own
        members += b","
    # Views, not slices: joined, the join is then the only copy of a big body.
    view = memoryview(raw)
    return view[: start + 1], members, view[start + 1 :]


def unjoined(raw: bytes) -> tuple[memoryview, memoryview]:
    """``raw`` as two views, its first byte and the rest, to be sent as parts: aiohttp
    writes the request head together with the first body write, joining them into one
    new buffer on Python before 3.12.9; with the first write one byte long, the body is
    never copied for it."""
    view = memoryview(raw)
    return view[:1], view[1:]
