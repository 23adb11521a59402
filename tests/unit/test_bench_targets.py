"""The proxy benchmark's targets and checks (scripts/benchproxy): which kvproxy feature set
and build a target names, and how the hot path's targets are judged from a run's data."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench() -> Iterator[tuple[ModuleType, ModuleType]]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from benchproxy import common, report

        yield common, report
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.parametrize(
    ("target", "features", "compiled", "known"),
    [
        ("direct", None, False, True),
        ("naive", None, False, True),
        ("off", "off", False, True),
        ("both-ring", "both-ring", False, True),
        ("lifecycle:compiled", "lifecycle", True, True),
        ("admission-ring:compiled", "admission-ring", True, True),
        ("naive:compiled", None, False, False),  # a reference forwarder has no build
        ("lifecycle:fast", None, False, False),
    ],
)
def test_a_target_names_its_feature_set_and_build(
    bench: tuple[ModuleType, ModuleType],
    target: str,
    features: str | None,
    compiled: bool,
    known: bool,
) -> None:
    common, _ = bench
    assert common.feature_set(target) == features
    assert common.is_compiled(target) is compiled
    assert common.known_target(target) is known


def test_off_is_taken_from_the_same_build(bench: tuple[ModuleType, ModuleType]) -> None:
    common, _ = bench
    assert common.in_build_of("off", "lifecycle") == "off"
    assert common.in_build_of("off", "lifecycle:compiled") == "off:compiled"


def _sat(**rps_by_target: list[float]) -> dict[str, Any]:
    runs = {
        t.replace("_c", ":compiled"): [{"rps": r} for r in rs] for t, rs in rps_by_target.items()
    }
    return {"runs": runs, "targets": {t: {} for t in runs}}


def test_round_ratio_pairs_rounds_and_takes_the_median(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    _, report = bench
    # Round by round: 0.5, 0.9, 0.8 -> 0.8; the ratio of the medians would be 0.8/1.0.
    sat = _sat(off=[1000.0, 500.0, 600.0], lifecycle=[500.0, 450.0, 480.0])
    assert report.round_ratio(sat, "lifecycle", "off") == pytest.approx(0.8)
    assert report.round_ratio(sat, "lifecycle", "naive") is None  # not measured


def test_saturation_ratios_are_judged_against_off_of_the_same_build_and_naive(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    _, report = bench
    sat = _sat(
        naive=[100.0, 100.0, 100.0],
        off=[200.0, 200.0, 200.0],
        lifecycle=[160.0, 170.0, 180.0],  # 0.85x off (at the limit), 1.7x naive
        off_c=[100.0, 100.0, 100.0],
        lifecycle_c=[80.0, 80.0, 90.0],  # 0.80x off:compiled, 0.8x naive
    )
    checks = {
        (c[0], c[1].split("x ")[1].split("'")[0]): (c[2], c[3]) for c in report._ratio_checks(sat)
    }
    assert checks == {
        ("lifecycle", "off"): ("0.85x", True),
        ("lifecycle", "naive"): ("1.70x", True),
        ("lifecycle:compiled", "off:compiled"): ("0.80x", False),
        ("lifecycle:compiled", "naive"): ("0.80x", False),
    }


def test_one_at_a_time_latency_limits_differ_for_off_and_a_feature(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    _, report = bench

    def row(delta: float, errors: int = 0) -> dict[str, Any]:
        return {"delta_p50_ms": delta, "errors": {"timeout": errors} if errors else {}}

    results = {
        "bodies": {
            "4KB": {
                "targets": {
                    "direct": row(0.0),
                    "off": row(0.35),  # over 0.3
                    "lifecycle": row(0.35),  # within 0.4
                    "admission:compiled": row(0.1, errors=2),  # fast, but failed requests
                }
            }
        }
    }
    met = {c[0]: c[3] for c in report._one_at_a_time_checks(results)}
    assert met == {"off": False, "lifecycle": True, "admission:compiled": False}
