"""The raw hop's framing (scripts/benchproxy/rawhop.py), the benchmark's reference for what a
Python HTTP hop costs without a framework: where a request and a response end, whatever
pieces their bytes arrive in."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def rawhop() -> Iterator[ModuleType]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from benchproxy import rawhop

        yield rawhop
    finally:
        sys.path.remove(str(SCRIPTS))


REQUEST = b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{"a": 12}'
LENGTH_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello"
)
CHUNKED_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"6\r\ndata: \r\n"
    b"a;ext=1\r\n0123456789\r\n"
    b"0\r\nX-Trailer: 1\r\n\r\n"
)
EMPTY_RESPONSE = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (REQUEST, len(REQUEST)),
        (REQUEST + b"GET / HTTP/1.1\r\n", len(REQUEST)),  # the next request's start
        (REQUEST[:20], None),  # the head is incomplete
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET", 33),  # no body
        (b"POST / HTTP/1.1\r\ncontent-length:  3\r\n\r\nabc" + b"GET", 42),  # case, spacing
    ],
)
def test_request_length(rawhop: ModuleType, buf: bytes, expected: int | None) -> None:
    assert rawhop.request_length(bytearray(buf)) == expected


def _ends(rawhop: ModuleType, stream: bytes, step: int) -> list[int]:
    """The offsets in ``stream`` where ResponseEnd saw a response end, fed ``step``
    bytes at a time."""
    end = rawhop.ResponseEnd()
    found: list[int] = []
    for start in range(0, len(stream), step):
        piece = stream[start : start + step]
        offset = 0
        while piece:
            used = end.feed(piece)
            if used is None:
                break
            offset += used
            found.append(start + offset)
            piece = piece[used:]
    return found


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, 10_000])
def test_response_ends_in_any_pieces(rawhop: ModuleType, step: int) -> None:
    """Back-to-back responses of each framing are told apart however their bytes are cut,
    chunk extensions and trailers included."""
    stream = LENGTH_RESPONSE + CHUNKED_RESPONSE + EMPTY_RESPONSE + LENGTH_RESPONSE
    boundaries = [
        len(LENGTH_RESPONSE),
        len(LENGTH_RESPONSE + CHUNKED_RESPONSE),
        len(LENGTH_RESPONSE + CHUNKED_RESPONSE + EMPTY_RESPONSE),
        len(stream),
    ]
    assert _ends(rawhop, stream, step) == boundaries


def test_a_response_cut_short_does_not_end(rawhop: ModuleType) -> None:
    assert _ends(rawhop, CHUNKED_RESPONSE[:-2], 5) == []
    assert _ends(rawhop, LENGTH_RESPONSE[:-1], 5) == []
