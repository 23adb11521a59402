#!/usr/bin/env python3
"""Generate the Grafana dashboard for kvproxy's Prometheus metrics.

The dashboard is written to ``configs/grafana/kvproxy-dashboard.json``; import it in
Grafana 10/11 (Dashboards -> Import) and pick a Prometheus data source. Every query
filters on the ``$instance`` variable.

    .venv/bin/python scripts/make_grafana_dashboard.py          # regenerate the file
    .venv/bin/python scripts/make_grafana_dashboard.py --check  # exit 1 if it drifted
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

OUTPUT = Path(__file__).resolve().parent.parent / "configs" / "grafana" / "kvproxy-dashboard.json"

Panel = dict[str, Any]
# (expr, legend)
Query = tuple[str, str]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
INSTANCE = 'instance=~"$instance"'
RATE_WINDOW = "1m"
GRID_WIDTH = 24
# Default of admission.pressure_threshold (kvproxy/config/admission.py).
PRESSURE_THRESHOLD = 0.92

A = "agentic_kv_admission_"
B = "agentic_kv_budget_"
S = "agentic_kv_session_"


# ----------------------------------------------------------------- PromQL helpers
def sel(metric: str) -> str:
    """``metric{instance=~"$instance"}``."""
    return f"{metric}{{{INSTANCE}}}"


def rate(metric: str) -> str:
    return f"rate({sel(metric)}[{RATE_WINDOW}])"


def quantile(q: float, histogram: str, by: str = "instance") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) ({rate(histogram + '_bucket')}))"


def gauges(prefix: str, names: Sequence[str]) -> list[Query]:
    return [(sel(prefix + n), f"{n} {{{{instance}}}}") for n in names]


def rates(prefix: str, names: Sequence[str]) -> list[Query]:
    """Per-second rates of counters (exposed with a ``_total`` suffix)."""
    return [(rate(f"{prefix}{n}_total"), f"{n} {{{{instance}}}}") for n in names]


# ----------------------------------------------------------------- panel helpers
def _targets(queries: Sequence[Query]) -> list[dict[str, Any]]:
    return [
        {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
        for i, (expr, legend) in enumerate(queries)
    ]


def _thresholds(steps: Sequence[tuple[float | None, str]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def timeseries(
    title: str,
    queries: Sequence[Query],
    unit: str = "short",
    *,
    description: str = "",
    minimum: float | None = 0,
    maximum: float | None = None,
    threshold_line: float | None = None,
    dashed: Sequence[str] = (),
    step: bool = False,
) -> Panel:
    """A time series panel. ``dashed``: legends of series drawn as dashed lines."""
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "fillOpacity": 10,
        "lineInterpolation": "stepAfter" if step else "linear",
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
        "thresholdsStyle": {"mode": "dashed" if threshold_line is not None else "off"},
    }
    steps: list[tuple[float | None, str]] = [(None, "green")]
    if threshold_line is not None:
        steps.append((threshold_line, "red"))
    defaults: dict[str, Any] = {
        "custom": custom,
        "thresholds": _thresholds(steps),
        "unit": unit,
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    overrides = [
        {
            "matcher": {"id": "byRegexp", "options": f"^{legend}.*"},
            "properties": [
                {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                {"id": "custom.fillOpacity", "value": 0},
            ],
        }
        for legend in dashed
    ]
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets(queries),
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": {
            "legend": {
                "calcs": [],
                "displayMode": "list",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    query: Query,
    unit: str = "short",
    *,
    description: str = "",
    steps: Sequence[tuple[float | None, str]] = ((None, "green"),),
    mappings: dict[str, str] | None = None,
) -> Panel:
    """A stat panel showing the last value. ``mappings``: value -> text (e.g. 1 -> "on")."""
    value_mappings = []
    if mappings:
        value_mappings.append(
            {
                "type": "value",
                "options": {
                    value: {"index": i, "text": text}
                    for i, (value, text) in enumerate(mappings.items())
                },
            }
        )
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets([query]),
        "fieldConfig": {
            "defaults": {
                "mappings": value_mappings,
                "thresholds": _thresholds(steps),
                "unit": unit,
            },
            "overrides": [],
        },
        "options": {
            "colorMode": "background",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
    }


class Layout:
    """Places panels left to right on Grafana's 24-column grid, in titled rows,
    and numbers them."""

    def __init__(self) -> None:
        self.panels: list[Panel] = []
        self._x = 0
        self._y = 0
        self._row_height = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def _newline(self) -> None:
        self._y += self._row_height
        self._x = 0
        self._row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self._next_id(),
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self._y},
                "panels": [],
            }
        )
        self._y += 1

    def add(self, panel: Panel, w: int, h: int = 8) -> None:
        if self._x + w > GRID_WIDTH:
            self._newline()
        panel["id"] = self._next_id()
        panel["gridPos"] = {"h": h, "w": w, "x": self._x, "y": self._y}
        self.panels.append(panel)
        self._x += w
        self._row_height = max(self._row_height, h)


# ----------------------------------------------------------------- the dashboard
ON_OFF = {"0": "off", "1": "on"}


def overview(g: Layout) -> None:
    g.row("Overview")
    g.add(
        stat("Admission", (sel(A + "enabled"), "{{instance}}"), mappings=ON_OFF),
        w=4,
        h=4,
    )
    g.add(
        stat("Session lifecycle", (sel(S + "lifecycle_enabled"), "{{instance}}"), mappings=ON_OFF),
        w=4,
        h=4,
    )
    g.add(
        stat(
            "Ledger degraded",
            (sel(B + "degraded"), "{{instance}}"),
            description="1 when no engine has a fresh reading: every request bypasses admission.",
            steps=[(None, "green"), (1, "red")],
            mappings={"0": "no", "1": "DEGRADED"},
        ),
        w=4,
        h=4,
    )
    g.add(stat("Engines fresh", (sel(B + "engines_fresh"), "{{instance}}")), w=4, h=4)
    g.add(
        stat(
            "Engines stale",
            (sel(B + "engines_stale"), "{{instance}}"),
            steps=[(None, "green"), (1, "orange")],
        ),
        w=4,
        h=4,
    )
    g.add(
        stat(
            "Requests/s",
            (f"sum by (instance) ({rate('kvproxy_requests_total')})", "{{instance}}"),
            unit="reqps",
        ),
        w=4,
        h=4,
    )


def admission(g: Layout) -> None:
    g.row("Admission queue")
    g.add(
        timeseries(
            "Waiting requests",
            gauges(A, ["waiting", "waiting_new", "waiting_continuing"]),
            description="Requests in the admission FIFOs now: new sessions and resident "
            "(continuing) sessions held by the pressure guard.",
        ),
        w=12,
    )
    hist = A + "wait_seconds"
    g.add(
        timeseries(
            "Admission wait",
            [
                (quantile(0.5, hist), "p50 {{instance}}"),
                (quantile(0.99, hist), "p99 {{instance}}"),
                (f"{rate(hist + '_sum')} / {rate(hist + '_count')}", "mean {{instance}}"),
            ],
            unit="s",
            description="Seconds each request spent in the admission FIFO (any outcome).",
        ),
        w=12,
    )


def budget(g: Layout) -> None:
    g.row("Budget")
    g.add(
        timeseries(
            "Tokens committed vs ceiling",
            gauges(B, ["committed", "reserved", "resident", "ceiling"]),
            description="committed = reserved (live leases) + resident (sessions between "
            "turns); ceiling = fresh engines' KV pool x headroom.",
            dashed=["ceiling"],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Reserved utilization",
            gauges(B, ["reserved_utilization"]),
            unit="percentunit",
            description="committed / ceiling.",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Engine KV token usage (fleet)",
            gauges(B, ["kv_token_usage_mean", "kv_token_usage_max"]),
            unit="percentunit",
            description="Mean and max sglang:token_usage over fresh engines; the max is the "
            "pressure signal.",
            maximum=1,
            threshold_line=PRESSURE_THRESHOLD,
        ),
        w=8,
    )


def engines(g: Layout) -> None:
    g.row("Per-engine")
    g.add(
        timeseries(
            "KV token usage by engine",
            [(sel(B + "engine_token_usage"), "{{engine}}")],
            unit="percentunit",
            description="Each engine's last sglang:token_usage as the ledger read it. The "
            f"dashed line is the default admission.pressure_threshold ({PRESSURE_THRESHOLD}).",
            maximum=1,
            threshold_line=PRESSURE_THRESHOLD,
        ),
        w=10,
    )
    g.add(
        timeseries(
            "Engine fresh",
            [(sel(B + "engine_fresh"), "{{engine}}")],
            description="1 while the engine's metrics snapshot is fresh enough to count.",
            maximum=1,
            step=True,
        ),
        w=7,
    )
    g.add(
        timeseries(
            "KV pool size by engine",
            [(sel(B + "engine_max_total_num_tokens"), "{{engine}}")],
            description="max_total_num_tokens of each engine.",
            step=True,
        ),
        w=7,
    )


def decisions(g: Layout) -> None:
    g.row("Admission decisions")
    g.add(
        timeseries(
            "Decisions /s",
            rates(
                A,
                ["admit", "wait", "bypass", "cancelled", "wait_new_session", "wait_continuing"],
            ),
            unit="ops",
        ),
        w=12,
    )
    reasons = ["protected", "degraded", "aged", "oversized", "queue_full", "disabled"]
    g.add(
        timeseries("Bypasses by reason /s", rates(A, [f"bypass_{r}" for r in reasons]), unit="ops"),
        w=12,
    )


def sessions(g: Layout) -> None:
    g.row("Sessions")
    g.add(
        timeseries(
            "Sessions and their requests",
            gauges(S, ["open", "closing", "queued_requests", "forwarded_requests"]),
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Session lifecycle /s",
            rates(S, ["started", "close", "close_failure", "closed_idle", "closed_final"]),
            unit="ops",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Aborts and rejections /s",
            rates(
                S,
                [
                    "aborted_requests",
                    "abort_failure",
                    "disconnect_aborts",
                    "rejected_queued",
                    "rejected_closing",
                ],
            ),
            unit="ops",
        ),
        w=8,
    )


def proxy(g: Layout) -> None:
    g.row("Proxy")
    g.add(
        timeseries(
            "Requests /s by status",
            [
                (
                    f"sum by (instance, status) ({rate('kvproxy_requests_total')})",
                    "{{status}} {{instance}}",
                )
            ],
            unit="reqps",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Upstream errors /s by type",
            [
                (
                    f"sum by (instance, type) ({rate('kvproxy_upstream_errors_total')})",
                    "{{type}} {{instance}}",
                )
            ],
            unit="ops",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Added latency",
            [
                (quantile(0.5, "kvproxy_added_latency_seconds"), "p50 {{instance}}"),
                (quantile(0.99, "kvproxy_added_latency_seconds"), "p99 {{instance}}"),
            ],
            unit="s",
            description="Time spent in kvproxy before the response starts, excluding "
            "upstream time and admission waits.",
        ),
        w=8,
    )


def ledger_health(g: Layout) -> None:
    g.row("Ledger signal health")
    g.add(
        timeseries(
            "Engine scrapes and polling /s",
            rates(B, ["scrape_failure", "poll_error"]),
            unit="ops",
            description="Engine /metrics scrapes that failed or carried no usage; poll "
            "iterations that raised.",
        ),
        w=12,
    )
    g.add(
        timeseries(
            "Leases and residency /s",
            rates(
                B,
                ["lease_expired", "residency_expired", "residency_evicted", "session_ended"],
            ),
            unit="ops",
        ),
        w=12,
    )


def templating() -> dict[str, Any]:
    instances = "label_values(kvproxy_requests_total, instance)"
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                # Import replaces ${DS_PROMETHEUS} with the data source chosen there.
                "current": {
                    "selected": False,
                    "text": "${DS_PROMETHEUS}",
                    "value": "${DS_PROMETHEUS}",
                },
                "hide": 0,
                "includeAll": False,
                "multi": False,
                "options": [],
                "refresh": 1,
                "regex": "",
                "skipUrlSync": False,
            },
            {
                "name": "instance",
                "label": "Instance",
                "type": "query",
                "datasource": DATASOURCE,
                "definition": instances,
                "query": {
                    "qryType": 1,
                    "query": instances,
                    "refId": "PrometheusVariableQueryEditor",
                },
                "current": {},
                "hide": 0,
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "options": [],
                "refresh": 2,
                "regex": "",
                "skipUrlSync": False,
                "sort": 1,
            },
        ]
    }


def build() -> dict[str, Any]:
    g = Layout()
    for section in (
        overview,
        admission,
        budget,
        engines,
        decisions,
        sessions,
        proxy,
        ledger_health,
    ):
        section(g)
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes kvproxy's /metrics.",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "kvproxy: admission, KV budget, sessions and proxy health.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": g.panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["kvproxy", "llm"],
        "templating": templating(),
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "kvproxy",
        "uid": "kvproxy",
        "version": 1,
        "weekStart": "",
    }


def render() -> bytes:
    return orjson.dumps(build(), option=orjson.OPT_INDENT_2) + b"\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 if {OUTPUT.name} differs from the generated one",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write (or check)")
    args = parser.parse_args(argv)
    content = render()
    if args.check:
        if not args.output.is_file() or args.output.read_bytes() != content:
            print(
                f"{args.output} is out of date: run python scripts/make_grafana_dashboard.py",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(content)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
