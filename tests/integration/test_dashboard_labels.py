"""The dashboard's small gaps, in a real browser: every chart names its unit (rates
per second), no two labels in a chart overlap, no table cell or tile is blank, and the
chart grid leaves no empty cell."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.async_api import Page

from .conftest import MakeProxy
from .test_dashboard_browser import ADMISSION, browser, open_dashboard

pytestmark = pytest.mark.usefixtures("router")

RATE_CHARTS = ("decisions", "closes", "traffic")
DASH = "\u2013"  # what the page shows for a missing number


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


async def _check_page(page: Page) -> None:
    figures = await page.query_selector_all("figure.chart")
    assert figures
    for fig in figures:
        chart = await fig.get_attribute("data-chart")
        unit = await fig.query_selector("figcaption .unit")
        assert unit is not None and (await unit.text_content() or "").strip(), chart
        ticks = [
            await t.text_content() or "" for t in await fig.query_selector_all("svg text.tick")
        ]
        if chart in RATE_CHARTS:
            assert "/ s" in (await unit.text_content() or ""), chart
            # The y axis' ticks carry the unit too (0/s, .../s); the x axis' do not.
            assert sum(t.endswith("/s") for t in ticks) == 3, (chart, ticks)
        boxes: list[tuple[str, dict[str, Any]]] = []
        for text in await fig.query_selector_all("svg text"):
            box = await text.bounding_box()
            if box is not None:
                boxes.append((await text.text_content() or "", box))
        for i, (ta, a) in enumerate(boxes):
            for tb, b in boxes[i + 1 :]:
                assert not _overlap(a, b), f"{chart}: {ta!r} overlaps {tb!r}"
    for cell in await page.query_selector_all("#engines tbody td"):
        assert (await cell.text_content() or "").strip() not in ("", DASH)
    tiles = await page.query_selector_all(".tiles .tile")
    assert len(await page.query_selector_all(".tiles .tile .sub")) == len(tiles)
    for part in await page.query_selector_all(".tiles .tile .value, .tiles .tile .sub"):
        assert (await part.text_content() or "").strip() not in ("", DASH)
    # The grid's last row is filled: the last chart ends where the widest row ends.
    edges = []
    for f in figures:
        box = await f.bounding_box()
        assert box is not None
        edges.append(box["x"] + box["width"])
    assert abs(edges[-1] - max(edges)) < 2, edges


async def test_features_off_labels_units_and_cells(make_proxy: MakeProxy) -> None:
    proxy = await make_proxy()
    async with browser() as b:
        await open_dashboard(b, proxy)
        await _check_page(b.page)
        assert await b.page.text_content('#tiles [data-tile="waiting"] .sub') == "admission is off"
        assert await b.page.text_content('#tiles [data-tile="sessions"] .value') == "off"
        modes = [
            await c.text_content()
            for c in await b.page.query_selector_all("#engines tbody td:last-child")
        ]
        assert modes and set(modes) == {"lifecycle off"}
        await b.screenshot("dashboard-features-off.png")
    assert b.errors == []


async def test_features_on_labels_units_and_cells(make_proxy: MakeProxy) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True}, admission=ADMISSION)
    async with browser() as b:
        await b.page.set_viewport_size({"width": 1000, "height": 1000})  # two columns
        await open_dashboard(b, proxy)
        await _check_page(b.page)
    assert b.errors == []
