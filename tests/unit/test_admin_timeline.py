"""The dashboard's timeline: rates and ratios from cumulative counters, bounded."""

from __future__ import annotations

import pytest

from kvproxy.admin.timeline import Reading, Timeline


def reading(counters: dict[str, float], **gauges: float) -> Reading:
    return Reading(counters=counters, gauges=gauges, engines={"http://e1": 0.5})


def timeline(capacity: int = 10) -> Timeline:
    return Timeline(capacity, rates={"admit": "c/admit"}, ratios={"wait_mean_s": ("c/sum", "c/n")})


@pytest.mark.parametrize(
    ("steps", "expected_rates"),
    [
        # (monotonic now, counters) per step -> the last sample's rates
        ([(0.0, {"c/admit": 5})], {"admit": None, "wait_mean_s": None}),
        ([(0.0, {"c/admit": 5}), (2.0, {"c/admit": 9})], {"admit": 2.0, "wait_mean_s": None}),
        (
            [(0.0, {"c/sum": 1.0, "c/n": 1}), (1.0, {"c/sum": 4.0, "c/n": 3})],
            {"admit": 0.0, "wait_mean_s": 1.5},
        ),
        # The clock did not advance: nothing to difference against.
        ([(1.0, {"c/admit": 1}), (1.0, {"c/admit": 3})], {"admit": None, "wait_mean_s": None}),
        # A counter that appears to go backwards counts as no increase.
        ([(0.0, {"c/admit": 9}), (1.0, {"c/admit": 2})], {"admit": 0.0, "wait_mean_s": None}),
        # A counter absent before counts from zero.
        ([(0.0, {}), (0.5, {"c/admit": 1})], {"admit": 2.0, "wait_mean_s": None}),
    ],
)
def test_rates_and_ratios(
    steps: list[tuple[float, dict[str, float]]], expected_rates: dict[str, float | None]
) -> None:
    t = timeline()
    for now, counters in steps:
        sample = t.record(now, 1_700_000_000 + now, reading(counters, waiting=3.0))
    assert sample["rates"] == pytest.approx(expected_rates)
    assert sample["gauges"] == {"waiting": 3.0}
    assert sample["engines"] == {"http://e1": 0.5}
    assert sample["t"] == 1_700_000_000 + steps[-1][0]


def test_capacity_bounds_the_history_and_since_skips_what_the_client_has() -> None:
    t = timeline(capacity=3)
    for i in range(5):
        t.record(float(i), float(i), reading({"c/admit": float(i)}))
    assert len(t) == 3 and t.last_seq == 5
    assert [s["seq"] for s in t.since(0)] == [3, 4, 5]
    assert [s["seq"] for s in t.since(3)] == [4, 5]
    assert [s["seq"] for s in t.since(1)] == [3, 4, 5]  # older ones are gone
    assert t.since(5) == [] and t.since(99) == []


def test_an_empty_timeline() -> None:
    t = timeline()
    assert t.last_seq == 0 and t.since(0) == [] and len(t) == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Timeline(0, rates={})
