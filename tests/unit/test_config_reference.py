"""The written references state the code's defaults: every key of every section is in
``configs/kvproxy.yaml`` and in ``docs/configuration.md``'s tables, with the default the
dataclass has (kvproxy/config/). Adding a key without documenting it fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvproxy.admission.program.params import ProgramParams
from kvproxy.config import SECTIONS, AdmissionConfig, Config

REPO = Path(__file__).resolve().parents[2]
# Old keys still accepted (kvproxy.config.admission.resolve_session_residency): in the
# reference doc, not in the YAML (which shows only current keys).
OLD_KEYS = {("admission", "session_residency")}


def _defaults(section: str) -> dict[str, Any]:
    return dataclasses.asdict(getattr(Config(), section))


def _doc_value(cell: str) -> Any:
    """A default as docs/configuration.md writes it: ``64 MiB``, ``null (off)``, ``true``,
    ``0.90``, `` `cache_aware` ``, `` `[body, header]` ``."""
    text = re.sub(r"\s*\(.*\)$", "", cell.replace("`", "").strip())
    if m := re.fullmatch(r"(\d+) MiB", text):
        return int(m.group(1)) * 1024 * 1024
    return yaml.safe_load(text)


def _doc_tables() -> dict[str, dict[str, Any]]:
    """Section -> key -> its default, from the ``## `section` `` tables."""
    tables: dict[str, dict[str, Any]] = {}
    section = None
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        if m := re.fullmatch(r"## `(\w+)`", line):
            section = m.group(1)
            tables[section] = {}
            continue
        if line.startswith("## "):
            section = None
        if section is None or not line.startswith("| `"):
            continue
        key_cell, default_cell = (c.strip() for c in line.strip("|").split("|")[:2])
        keys = re.findall(r"`(\w+)`", key_cell)
        if len(keys) == 1:
            tables[section][keys[0]] = _doc_value(default_cell)
        else:  # `pause_high`, `pause_low` | 0.95, 0.85
            for key, value in zip(keys, default_cell.split(","), strict=True):
                tables[section][key] = _doc_value(value)
    return tables


def _same(written: Any, default: Any) -> bool:
    """Equal as YAML values: a list is a tuple, 10 is 10.0, but 1 is not true."""
    if isinstance(written, bool) or isinstance(default, bool):
        return written is default
    if isinstance(written, list | tuple) and isinstance(default, list | tuple):
        return list(written) == list(default)
    return bool(written == default)


def test_doc_value_reads_the_tables_spellings() -> None:
    cases = {
        "64 MiB": 64 * 1024 * 1024,
        "null (off)": None,
        "`[body, header, nvext]`": ["body", "header", "nvext"],
        "`cache_aware`": "cache_aware",
        "0.90": 0.9,
        "true": True,
        "`[]`": [],
    }
    for cell, value in cases.items():
        assert _doc_value(cell) == value, cell


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_yaml_reference_states_every_key_with_its_default(section: str) -> None:
    raw = yaml.safe_load((REPO / "configs" / "kvproxy.yaml").read_text())[section]
    defaults = _defaults(section)
    expected = {k for k in defaults if (section, k) not in OLD_KEYS}
    assert set(raw) == expected, (sorted(expected - set(raw)), sorted(set(raw) - expected))
    wrong = {k: (raw[k], defaults[k]) for k in raw if not _same(raw[k], defaults[k])}
    assert not wrong, wrong


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_reference_doc_states_every_key_with_its_default(section: str) -> None:
    table = _doc_tables()[section]
    defaults = _defaults(section)
    assert set(table) == set(defaults), (
        sorted(set(defaults) - set(table)),
        sorted(set(table) - set(defaults)),
    )
    wrong = {k: (table[k], defaults[k]) for k in table if not _same(table[k], defaults[k])}
    assert not wrong, wrong


def test_program_params_take_their_defaults_from_the_config() -> None:
    # The keys program admission shares with the config have the config's default; the
    # rest are the controller's own constants, listed here so a new one is a decision.
    own = {
        "target_cut",
        "target_step",
        "quiet_windows",
        "min_feedback_turns",
        "engage_min_turns",
        "growth_alpha",
        "cold_start_ratio",
        "min_inflight",
        "floor_room",
        "floor_room_host",
        "forecast_ratio",
    }
    derived = {
        "cut_interval_s": 2 * AdmissionConfig().feedback_window_s,
        "staleness_s": AdmissionConfig().effective_staleness_s,
    }
    cfg = dataclasses.asdict(AdmissionConfig())
    for f in dataclasses.fields(ProgramParams):
        if f.name in own:
            continue
        expected = derived[f.name] if f.name in derived else cfg[f.name]
        assert f.default == expected, f.name
