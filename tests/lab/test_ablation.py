"""The ablation set of program admission (kvlab.lab.ablation): every entry is a valid
admission override that changes the run, and the table reads as ratios to off."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.lab.ablation import ABLATIONS, format_ablation, run_ablation
from kvlab.lab.runner import run_lab
from kvproxy.config import from_mapping
from tests.lab.test_lab import SMALL, TINY_POOL


@pytest.mark.parametrize(("name", "overrides"), ABLATIONS, ids=[n for n, _ in ABLATIONS])
def test_every_ablation_is_a_valid_admission_config(name, overrides) -> None:  # type: ignore[no-untyped-def]
    cfg = from_mapping({"admission": {"enabled": True, **overrides}})
    for key, value in overrides.items():
        assert getattr(cfg.admission, key) == value


def test_the_defaults_row_is_a_plain_both_run_and_every_row_is_kept() -> None:
    cfg = dataclasses.replace(SMALL, engine_overrides=TINY_POOL)
    # The table's first row reads as "both at its documented defaults": the same run.
    out = run_ablation(cfg, [0], ABLATIONS[:1])
    both = run_lab(dataclasses.replace(cfg, policy="both", seed=0)).summary
    row = out[ABLATIONS[0][0]]["per_seed"][0]
    wall = {"wall_s", "speedup"}  # the host's time, not the run's
    assert {k: v for k, v in row.items() if k not in wall} == {
        k: v for k, v in both.items() if k not in wall
    }
    assert row["admission_counters"]  # admission ran
    # Rows are keyed by name: a repeated name would drop a row from the table.
    names = [name for name, _ in ABLATIONS]
    assert list(dict.fromkeys(names)) == names


def test_run_ablation_runs_off_and_both_with_each_override() -> None:
    cfg = dataclasses.replace(SMALL, engine_overrides=TINY_POOL)
    chosen = [("no pause", {"pause": False}), ("request mode (Relax)", {"mode": "request"})]
    out = run_ablation(cfg, [0], chosen)
    assert list(out) == ["off", "no pause", "request mode (Relax)"]
    for r in out.values():
        assert r["median"]["sessions_completed"] == SMALL.sessions
    # Request mode is a different admission: its counters differ from program mode's.
    counters = {n: r["median"].get("admission_counters") for n, r in out.items()}
    assert counters["no pause"] != counters["request mode (Relax)"]


def test_format_ablation_is_ratios_to_off() -> None:
    meds = {
        "off": {"sessions_per_min": 4.0, "recomputed_prefill_tokens": 1000, "makespan_s": 100.0},
        "x": {"sessions_per_min": 6.0, "recomputed_prefill_tokens": 250, "makespan_s": 50.0},
    }
    lines = format_ablation(meds).splitlines()
    assert lines[0].split()[:3] == ["x", "off", "sessions/min"]
    row = lines[2].split()
    assert row == ["x", "1.50x", "0.25x", "-", "0.50x"]
