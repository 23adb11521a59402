"""The one rate-limited logger (kvproxy.observability.RateLimitedLog)."""

from __future__ import annotations

import logging

import pytest

from kvproxy.observability import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_logs_once_per_interval_and_keys_are_independent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t.rl"), 30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.rl"):
        assert rl.warning("a", "first %s", 1)
        clock.now = 29.9
        assert not rl.warning("a", "again")
        assert rl.warning("b", "other key")
        clock.now = 30.0
        assert rl.warning("a", "after the interval")
    assert [r.getMessage() for r in caplog.records] == [
        "first 1",
        "other key",
        "after the interval",
    ]


def test_the_key_table_is_bounded() -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t.rl2"), 30.0, max_keys=2, clock=clock)
    assert rl.warning("a", "x") and rl.warning("b", "x")
    assert rl.warning("c", "x")  # table full: forgotten, so "a" may log again
    assert rl.warning("a", "x")
    assert len(rl._last) <= 2
