"""The dashboard in a real headless browser (Debian's chromium driven by Playwright)
against a live kvproxy in front of the real router and the simulator engines.

Screenshots land in ``test-artifacts/`` (or ``$KVPROXY_TEST_ARTIFACTS``). Every test
fails if the page logged a console error or threw.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import Page, async_playwright

from kvproxy import keys

from .conftest import MakeProxy, Proxy, set_faults, wait_until

pytestmark = pytest.mark.usefixtures("router")

ARTIFACTS = Path(
    os.environ.get("KVPROXY_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")
)
# Flags for a root, network-less CI machine: no sandbox, no GPU, no background calls.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
RENDER_TIMEOUT_MS = 15_000
ADMISSION = {"enabled": True, "poll_interval_s": 0.2, "staleness_s": 0.6}


def chromium_path() -> str:
    path = os.environ.get("KVPROXY_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail(
            "the dashboard tests need Chromium: apt-get install chromium "
            "(or set KVPROXY_CHROMIUM to a Chromium binary)"
        )
    return path


@dataclass
class Browser:
    page: Page
    errors: list[str] = field(default_factory=list)

    async def screenshot(self, name: str) -> Path:
        path = artifact_path(name)
        await self.page.screenshot(path=str(path), full_page=True)
        return path


def artifact_path(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


@contextlib.asynccontextmanager
async def browser() -> AsyncIterator[Browser]:
    """A fresh headless Chromium page that records console errors and page errors."""
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = await chromium.new_page(viewport={"width": 1400, "height": 1000})
            b = Browser(page)
            page.on(
                "console",
                lambda m: (
                    b.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None
                ),
            )
            page.on("pageerror", lambda e: b.errors.append(f"page error: {e}"))
            yield b
        finally:
            await chromium.close()


# The page's CSP forbids eval, so Playwright's wait_for_function cannot run there:
# conditions are polled from here (bounded in time) through DOM attribute reads.
async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    await wait_until(check, timeout_s=RENDER_TIMEOUT_MS / 1000, what=what)


async def last_seq(page: Page) -> int:
    return int(await page.get_attribute("body", "data-last-seq") or 0)


async def open_dashboard(b: Browser, proxy: Proxy) -> None:
    await b.page.goto(proxy.url + "/kvproxy/dashboard")

    async def rendered_twice() -> bool:
        return await last_seq(b.page) >= 2

    await until(rendered_twice, "two samples rendered")


async def legend_value(page: Page, chart: str, series: str) -> float | None:
    raw = await page.get_attribute(
        f'figure[data-chart="{chart}"] .legend [data-series="{series}"]', "data-value"
    )
    return float(raw) if raw else None


async def wait_legend(
    page: Page, chart: str, series: str, condition: Callable[[float], bool], what: str
) -> None:
    """Wait until the chart's latest value for ``series`` satisfies ``condition``."""

    async def check() -> bool:
        v = await legend_value(page, chart, series)
        return v is not None and condition(v)

    await until(check, f"{chart}/{series}: {what}")


async def line_paths(page: Page, chart: str) -> dict[str, str]:
    paths = await page.query_selector_all(f'figure[data-chart="{chart}"] svg path.line')
    return {
        (await p.get_attribute("data-series")) or "": (await p.get_attribute("d")) or ""
        for p in paths
    }


async def run_sessions(
    http: aiohttp.ClientSession, proxy: Proxy, sids: list[str], stop: asyncio.Event
) -> int:
    """Turns for each session until ``stop`` (bounded); the sessions stay open."""
    sent = 0

    async def one(sid: str, i: int) -> None:
        nonlocal sent
        for turn in range(200):
            if stop.is_set():
                return
            body = {
                "input_ids": list(range(100 + i, 400 + i + turn * 20)),
                "sampling_params": {"max_new_tokens": 16},
            }
            async with http.post(
                proxy.url + "/generate", json=body, headers={"X-Session-ID": sid}
            ) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            sent += 1

    await asyncio.gather(*(one(sid, i) for i, sid in enumerate(sids)))
    return sent


async def test_dashboard_renders_live_charts_that_move_with_traffic(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True}, admission=ADMISSION)
    async with browser() as b:
        page = b.page
        await open_dashboard(b, proxy)

        # Every chart has data; the engine chart has a line per engine.
        for chart in await page.query_selector_all("figure[data-chart]"):
            assert int(await chart.get_attribute("data-points") or 0) >= 2
        engine_lines = page.locator('figure[data-chart="engines"] path.line')

        async def two_engine_lines() -> bool:
            return await engine_lines.count() == 2

        await until(two_engine_lines, "a line per engine")
        assert await page.text_content("#status") == "ok"
        assert await page.locator("#engines tbody tr").count() == 2
        before = await line_paths(page, "traffic")
        assert await legend_value(page, "sessions", "gauges.sessions_open") == 0

        sids = [f"dash-live-{i}" for i in range(4)]
        stop = asyncio.Event()
        traffic = asyncio.create_task(run_sessions(http, proxy, sids, stop))
        try:
            await wait_legend(page, "traffic", "rates.requests", lambda v: v > 0, "> 0")
            await wait_legend(page, "sessions", "gauges.sessions_open", lambda v: v == 4, "4")
            await wait_legend(page, "decisions", "rates.admit", lambda v: v > 0, "> 0")
            await b.screenshot("dashboard-live.png")
        finally:
            stop.set()
            sent = await asyncio.wait_for(traffic, 30)
        assert sent > 0

        for sid in sids:
            async with http.post(proxy.url + "/close_session", json={"session_id": sid}) as resp:
                assert resp.status == 200
        await wait_legend(page, "sessions", "gauges.sessions_open", lambda v: v == 0, "0")
        after = await line_paths(page, "traffic")
        assert after["rates.requests"] != before["rates.requests"]
        # The closes were counted: the close series rose above zero at some sample.
        closes = await page.get_attribute(
            'figure[data-chart="closes"] path.line[data-series="rates.sessions_closed"]', "d"
        )
        assert closes is not None and _max_height(closes) > 0
        await b.screenshot("dashboard-after-close.png")
    assert b.errors == []


def _max_height(d: str) -> float:
    """How far above its lowest point an SVG path (``M x,y L x,y ...``) rises."""
    ys = [float(p.split(",")[1]) for p in d.replace("M", " ").replace("L", " ").split()]
    return max(ys) - min(ys)


async def test_dashboard_shows_the_degraded_banner_when_engine_metrics_fail(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(admission=ADMISSION)
    async with browser() as b:
        page = b.page
        await open_dashboard(b, proxy)
        assert await page.locator('[data-banner-id="ledger-degraded"]').count() == 0

        await set_faults(http, engine_urls, metrics="error")
        banner = page.locator('[data-banner-id="ledger-degraded"]')
        await banner.wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
        assert "fail open" in (await banner.text_content() or "")
        assert await page.text_content("#status") == "degraded"
        stale = page.locator("#engines .flag", has_text="stale")

        async def both_stale() -> bool:
            return await stale.count() == 2

        await until(both_stale, "both engines flagged stale")
        await b.screenshot("dashboard-degraded.png")

        await set_faults(http, engine_urls, metrics="ok")
        await banner.wait_for(state="detached", timeout=RENDER_TIMEOUT_MS)
        assert await page.text_content("#status") == "ok"
    assert b.errors == []


async def test_dashboard_with_an_admin_token_asks_for_it_once(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": "s3cret-token"}, admission=ADMISSION)
    async with browser() as b:
        page = b.page
        response = await page.goto(proxy.url + "/kvproxy/dashboard")
        assert response is not None and response.status == 401
        await page.fill("input[name=token]", "not-the-token")
        await page.click("button[type=submit]")
        assert "Wrong token" in (await page.text_content("form") or "")

        await page.fill("input[name=token]", "s3cret-token")
        await page.click("button[type=submit]")

        async def rendered() -> bool:
            return await last_seq(page) >= 1

        await until(rendered, "the dashboard after signing in")
        cookies = await page.context.cookies()
        assert [c["httpOnly"] for c in cookies if c["name"] == "kvproxy_dashboard"] == [True]
        # The token itself never appears in the page (the config view redacts it).
        assert "s3cret-token" not in await page.content()
        await page.click("details summary")
        assert await page.is_visible("text=(set)")
    # The sign-in page itself is answered 401, which Chromium reports as a failed load.
    assert [e for e in b.errors if "401" not in e] == []


async def test_with_both_features_off_the_charts_say_so_and_hover_reads_a_moment(
    make_proxy: MakeProxy,
) -> None:
    proxy = await make_proxy()
    async with browser() as b:
        page = b.page
        await open_dashboard(b, proxy)
        notes = {
            chart: await page.text_content(f'figure[data-chart="{chart}"] .note')
            for chart in ("queue", "engines", "sessions", "traffic")
        }
        assert notes == {
            "queue": "(admission is off)",
            "engines": "(admission is off)",
            "sessions": "(session lifecycle is off)",
            "traffic": "",
        }
        assert [await f.text_content() for f in await page.query_selector_all(".feature")] == [
            "session lifecycle: off",
            "admission: off",
        ]

        chart = page.locator('figure[data-chart="traffic"]')
        box = await chart.locator("svg").bounding_box()
        assert box is not None
        await page.mouse.move(box["x"] + box["width"] * 0.95, box["y"] + box["height"] / 2)
        assert await chart.locator("line.cursor").count() == 1
        assert (await chart.locator(".at").text_content() or "").startswith("at ")
        await page.mouse.move(1, 1)  # leave: back to the latest values
        assert await chart.locator("line.cursor").count() == 0
        assert await chart.locator(".at").text_content() == ""
    assert b.errors == []


async def test_dashboard_shows_program_admission_per_engine_and_the_fallback(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(admission=ADMISSION, router={"policy": "round_robin"})
    async with browser() as b:
        page = b.page
        await open_dashboard(b, proxy)
        banner = page.locator('[data-banner-id="admission-fallback"]')
        await banner.wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
        assert "round_robin" in (await banner.text_content() or "")
        # Told the policy is mirrorable (the lab's injection point), the table fills in.
        proxy.app[keys.ADMISSION].set_router_policy("consistent_hashing")
        await proxy.app[keys.ADMISSION].poll_once()
        body = {"input_ids": [5] * 50, "sampling_params": {"max_new_tokens": 2}}
        async with http.post(
            f"{proxy.url}/generate", json=body, headers={"X-Session-ID": "dash-program-1"}
        ) as resp:
            assert resp.status == 200
        await banner.wait_for(state="detached", timeout=RENDER_TIMEOUT_MS)
        rows = page.locator("#program tbody tr")

        async def filled() -> bool:
            return await rows.count() >= 1

        await until(filled, "program admission rows")
        text = await page.text_content("#program") or ""
        assert "Footprint / capacity" in text and "http://" in text
    assert b.errors == []
