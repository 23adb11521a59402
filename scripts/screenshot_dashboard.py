#!/usr/bin/env python3
"""The dashboard's screenshot (docs/img/dashboard.png) from a live KV-bound run.

Starts ``kvproxy demo --only both`` (simulated engines, the real router ``smg`` and
kvproxy with both features on, W1 through the HTTP driver) as a subprocess, finds the
proxy's port in the configuration the demo writes, opens ``/kvproxy/dashboard`` in
headless Chromium (Playwright; the Chromium of ``scripts/ensure_chromium.sh``) and saves a
full-page screenshot every ``--every-s`` seconds while the proxy answers, for at most
``--after-s`` seconds: the last one is kept. The demo is then
stopped by its PID (it stops its own processes on SIGTERM).

    python scripts/screenshot_dashboard.py --png docs/img/dashboard.png   # the demo's W1, 48 per engine
    python scripts/screenshot_dashboard.py --quick                          # the quick demo's W1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from playwright.async_api import async_playwright

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]


def chromium() -> str:
    path = os.environ.get("KVPROXY_CHROMIUM") or shutil.which("chromium")
    if not path:
        out = subprocess.run(
            [str(ROOT / "scripts" / "ensure_chromium.sh")], capture_output=True, text=True
        )
        path = out.stdout.strip()
    if not path:
        sys.exit("no Chromium: run scripts/ensure_chromium.sh")
    return path


def proxy_url(out_dir: Path, demo: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The proxy's URL, once the demo has written its config and the proxy answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if demo.poll() is not None:
            sys.exit(f"the demo exited early ({demo.returncode}); see {out_dir}")
        for cfg in out_dir.glob("kvproxy-both-*.yaml"):
            port = yaml.safe_load(cfg.read_text())["server"]["port"]
            url = f"http://127.0.0.1:{port}"
            try:
                with urllib.request.urlopen(url + "/kvproxy/health", timeout=1.0):
                    return url
            except OSError:
                pass
        time.sleep(0.5)
    sys.exit("the proxy did not come up in time")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/kvproxy/health", timeout=2.0):
            return True
    except OSError:
        return False


async def shoot(url: str, png: Path, args: argparse.Namespace) -> bool:
    """Open the dashboard at once and screenshot it every ``--every-s`` seconds while the
    proxy answers, until ``--after-s``: the last screenshot taken is kept."""
    taken = False
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": args.width, "height": args.height})
            await page.goto(url + "/kvproxy/dashboard")
            tmp = png.with_suffix(".tmp.png")
            png.parent.mkdir(parents=True, exist_ok=True)
            deadline = time.monotonic() + args.after_s
            while True:
                await asyncio.sleep(args.every_s)
                if not healthy(url):
                    break
                await page.screenshot(path=str(tmp), full_page=True)
                tmp.replace(png)
                taken = True
                if time.monotonic() >= deadline:
                    break
        finally:
            await browser.close()
    return taken


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--png", type=Path, default=ROOT / "results" / "dashboard.png")
    ap.add_argument("--quick", action="store_true", help="the quick demo's W1 (runs ~40 s)")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--after-s", type=float, default=90.0, help="the last screenshot at most")
    ap.add_argument("--every-s", type=float, default=5.0, help="seconds between screenshots")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1000)
    args = ap.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="kvproxy-dashboard-"))
    argv = [sys.executable, "-m", "kvproxy", "demo", "--only", "both", "--seeds", args.seed]
    argv += ["--out", str(out_dir), "--json-only", *(["--quick"] if args.quick else [])]
    demo = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = proxy_url(out_dir, demo, timeout_s=120.0)
        print(f"proxy at {url}; screenshots for up to {args.after_s:g} s", flush=True)
        if not asyncio.run(shoot(url, args.png, args)):
            sys.exit("no screenshot: the proxy stopped answering first")
        print(f"wrote {args.png}")
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)
            try:
                demo.wait(timeout=30)
            except subprocess.TimeoutExpired:
                demo.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
