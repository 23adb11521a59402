"""Every metric the Grafana dashboard queries exists on a live kvproxy's /metrics.

kvproxy runs in front of the real router and simulated engines, with session lifecycle
and admission on (the dashboard covers both).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvproxy.keys import ADMISSION

from .conftest import MakeProxy, wait_until

pytestmark = pytest.mark.usefixtures("router")

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvproxy-dashboard.json"
METRIC_NAME = re.compile(r"\b(?:kvproxy|agentic_kv)_[A-Za-z0-9_]*")
# Sample names a family of each type exposes (the parser strips a counter's _total).
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "untyped": ("",),
}


def dashboard_metric_names() -> set[str]:
    """Metric names in every panel query and in the template variables' queries."""
    doc = orjson.loads(DASHBOARD.read_bytes())
    exprs: list[str] = []
    for panel in doc["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            exprs.extend(t["expr"] for t in p.get("targets", []))
    exprs.extend(v.get("definition", "") for v in doc["templating"]["list"])
    names = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert names, "no metric names found in the dashboard"
    return names


def exposed_sample_names(text: str) -> set[str]:
    """Sample names of a /metrics page. A labelled family without a child yet (e.g.
    upstream errors before the first error) has no samples: its sample names are the
    ones its declared type implies."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        if not family.samples:
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def test_exposed_sample_names_of_an_empty_labelled_counter() -> None:
    text = (
        "# HELP a_total x\n# TYPE a_total counter\n"
        "# HELP b x\n# TYPE b counter\nb_total 1.0\n"
        "# HELP h x\n# TYPE h histogram\n"
    )
    assert exposed_sample_names(text) == {"a_total", "b_total", "h_bucket", "h_sum", "h_count"}


async def test_every_dashboard_metric_is_exposed(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(
        session_lifecycle={"enabled": True}, admission={"enabled": True, "poll_interval_s": 0.1}
    )
    # One request so the labelled request counter has a child, and engine readings.
    async with http.post(
        proxy.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
        headers={"X-Session-ID": f"grafana-{uuid.uuid4().hex}"},
    ) as resp:
        assert resp.status == 200
        await resp.read()

    async def engines_fresh() -> bool:
        return proxy.app[ADMISSION].stats()["agentic_kv/budget/engines_fresh"] >= 1

    await wait_until(engines_fresh, timeout_s=10, what="a fresh engine reading")

    async with http.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        exposed = exposed_sample_names(await resp.text())

    assert "kvproxy_requests_total" in exposed
    missing = sorted(dashboard_metric_names() - exposed)
    assert not missing, f"dashboard queries metrics kvproxy does not expose: {missing}"
