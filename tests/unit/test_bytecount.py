"""The vectorised byte count agrees with ``bytes.count`` on every span."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.proxy import bytecount
from kvproxy.proxy.bytecount import VECTOR_MIN_BYTES, count_byte


def test_the_test_environment_runs_the_vectorised_count() -> None:
    # numpy is in the test extra: without it these tests would only check bytes.count.
    assert bytecount.load() is True


@pytest.mark.parametrize(
    "n", [0, 1, VECTOR_MIN_BYTES - 1, VECTOR_MIN_BYTES, 3 * VECTOR_MIN_BYTES + 7]
)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_spans_around_the_vector_threshold(n: int, offset: int) -> None:
    rng = random.Random(n * 31 + offset)
    raw = bytes(rng.choice(b"0123456789, \n") for _ in range(n + 2 * offset))
    start, end = offset, offset + n
    assert count_byte(raw, 0x2C, start, end) == raw.count(b",", start, end)


@settings(max_examples=60, deadline=None)
@given(
    chunk=st.binary(min_size=1, max_size=64),
    reps=st.integers(min_value=1, max_value=1200),
    byte=st.integers(min_value=0, max_value=255),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_any_byte_any_span(chunk: bytes, reps: int, byte: int, cut: tuple[float, float]) -> None:
    raw = chunk * reps
    a, b = sorted(int(f * len(raw)) for f in cut)
    assert count_byte(raw, byte, a, b) == raw.count(bytes((byte,)), a, b)
