"""The Grafana dashboard (configs/grafana/kvproxy-dashboard.json): structure, and that the
committed file is exactly what scripts/make_grafana_dashboard.py generates."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "kvproxy-dashboard.json"
GENERATOR = ROOT / "scripts" / "make_grafana_dashboard.py"
INSTANCE_FILTER = 'instance=~"$instance"'


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_grafana_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _load_generator()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return orjson.loads(DASHBOARD.read_bytes())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included (and panels nested in collapsed rows)."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in _panels(dashboard) if p["type"] != "row"]


def test_committed_file_is_what_the_generator_produces(generator: ModuleType) -> None:
    assert DASHBOARD.read_bytes() == generator.render(), (
        "configs/grafana/kvproxy-dashboard.json is stale: run "
        "python scripts/make_grafana_dashboard.py"
    )
    assert generator.main(["--check"]) == 0


def test_check_fails_on_a_drifted_file(generator: ModuleType, tmp_path: Path) -> None:
    drifted = tmp_path / "dashboard.json"
    drifted.write_bytes(DASHBOARD.read_bytes().replace(b'"10s"', b'"5s"'))
    assert generator.main(["--check", "--output", str(drifted)]) == 1
    assert generator.main(["--check", "--output", str(tmp_path / "missing.json")]) == 1
    assert generator.main(["--output", str(drifted)]) == 0
    assert generator.main(["--check", "--output", str(drifted)]) == 0


def test_file_format() -> None:
    raw = DASHBOARD.read_text()
    assert raw.endswith("}\n")
    assert raw.startswith('{\n  "')  # 2-space indentation


def test_dashboard_metadata(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "kvproxy"
    assert dashboard["title"] == "kvproxy"
    assert dashboard["schemaVersion"] == 39
    assert dashboard["refresh"] == "10s"
    assert dashboard["time"] == {"from": "now-30m", "to": "now"}
    (ds_input,) = dashboard["__inputs"]
    assert ds_input["name"] == "DS_PROMETHEUS"
    assert ds_input["type"] == "datasource" and ds_input["pluginId"] == "prometheus"
    required = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    panel_types = {p["type"] for p in _query_panels(dashboard)}
    assert {("panel", t) for t in panel_types} <= required


def test_templating_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] == "${DS_PROMETHEUS}"  # filled in by the import
    inst = variables["instance"]
    assert inst["type"] == "query"
    assert inst["multi"] is True and inst["includeAll"] is True
    assert inst["definition"] == "label_values(kvproxy_requests_total, instance)"
    assert inst["query"]["query"] == inst["definition"]
    assert inst["datasource"]["uid"] == "${datasource}"


def test_panels_have_unique_ids_and_grid_positions(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"}, p["title"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0
        assert pos["x"] + pos["w"] <= 24, f"{p['title']} overflows the grid"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_every_query_uses_the_variables(dashboard: dict[str, Any]) -> None:
    panels = _query_panels(dashboard)
    assert panels
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            expr = t["expr"]
            assert isinstance(expr, str) and expr, p["title"]
            # Every selector, not just one of them, is filtered on the instance.
            selectors = expr.count("{")
            assert selectors >= 1 and expr.count(INSTANCE_FILTER) == selectors, (
                f"{p['title']}: {expr}"
            )


def test_rows_and_key_panels(dashboard: dict[str, Any]) -> None:
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Overview",
        "Admission queue",
        "Budget",
        "Per-engine",
        "Admission decisions",
        "Sessions",
        "Proxy",
        "Ledger signal health",
    ]
    by_title = {p["title"]: p for p in _query_panels(dashboard)}
    degraded = by_title["Ledger degraded"]
    assert degraded["type"] == "stat"
    steps = degraded["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert {"color": "red", "value": 1} in steps
    assert by_title["Reserved utilization"]["fieldConfig"]["defaults"]["unit"] == "percentunit"
    usage = by_title["KV token usage by engine"]
    assert usage["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
    exprs = " ".join(t["expr"] for p in by_title.values() for t in p["targets"])
    assert "histogram_quantile(0.99" in exprs
    assert "sum by (instance, status)" in exprs
    # Counters are graphed as rates, never raw.
    for p in by_title.values():
        for t in p["targets"]:
            if re.search(r"_(total|bucket|sum|count)\{", t["expr"]):
                assert "rate(" in t["expr"], t["expr"]
