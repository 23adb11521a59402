"""The lab's signal faults: when a scrape fails and how late it answers (pure)."""

from __future__ import annotations

import random

import pytest

from kvlab.lab.faults import FAULTS, signal_fault


@pytest.mark.parametrize(
    ("name", "t", "failing"),
    [
        ("none", 125.0, False),
        ("windows", 119.9, False),
        ("windows", 120.0, True),
        ("windows", 127.9, True),
        ("windows", 128.0, False),
        ("windows", 304.0, True),
        ("windows", 424.0, False),  # twice, not periodic
        ("periodic", 51.9, False),
        ("periodic", 52.0, True),
        ("periodic", 172.0, True),  # every minute
        ("periodic", 180.0, False),
        ("quarter", 14.9, False),
        ("quarter", 15.0, True),
        ("quarter", 95.0, True),
        ("lag", 120.0, False),
    ],
)
def test_failing_windows(name: str, t: float, failing: bool) -> None:
    assert signal_fault(name).failing(t) is failing


def test_quarter_fails_a_quarter_of_the_time() -> None:
    f = FAULTS["quarter"]
    samples = [f.failing(i / 10) for i in range(2000)]
    assert sum(samples) / len(samples) == pytest.approx(0.25, abs=0.01)


def test_lag_is_seeded_bounded_and_only_for_lag() -> None:
    lag = FAULTS["lag"]
    a = [lag.delay_s(random.Random(3)) for _ in range(5)]
    assert a == [lag.delay_s(random.Random(3)) for _ in range(5)]
    rng = random.Random(0)
    delays = [lag.delay_s(rng) for _ in range(5000)]
    assert max(delays) <= 12.0 and min(delays) >= 0.0
    assert 1.5 < sum(delays) / len(delays) < 2.5
    assert FAULTS["windows"].delay_s(random.Random(0)) == 0.0


def test_an_unknown_fault_names_the_choices() -> None:
    with pytest.raises(ValueError, match="none, windows, periodic, quarter, lag"):
        signal_fault("sometimes")
