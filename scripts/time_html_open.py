#!/usr/bin/env python3
"""Open an HTML page written by `attention_dump --html` in headless Chromium and report how long
it takes until the page says it has rendered (`<body data-render="ok">`), for each view.

    pip install playwright          # uses the system's chromium; no browser download
    python3 scripts/time_html_open.py page.html [--runs 3] [--chromium /usr/bin/chromium]

Prints one line per view and run: the time from navigation to `data-render="ok"` (the page's
own scripts done: data decoded, the view drawn) and the next painted frame, and the JS heap in
use then.
"""
import argparse
import shutil
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("page")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    ap.add_argument("--views", default="head,model,explain")
    args = ap.parse_args()
    url = Path(args.page).resolve().as_uri()
    size = Path(args.page).stat().st_size / 1e6
    print(f"{args.page}: {size:.1f} MB")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        for view in args.views.split(","):
            for run in range(args.runs):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                t0 = time.perf_counter()
                page.goto(f"{url}#view={view}", wait_until="commit", timeout=120_000)
                page.wait_for_selector("body[data-render]", timeout=120_000)
                # ... and the frame that shows it painted.
                page.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                dt = time.perf_counter() - t0
                state = page.get_attribute("body", "data-render")
                heap = page.evaluate("performance.memory ? performance.memory.usedJSHeapSize : 0") / 1e6
                print(f"view={view} run {run + 1}: {dt:.2f} s to data-render={state}, JS heap {heap:.0f} MB")
                page.close()
        browser.close()


if __name__ == "__main__":
    sys.exit(main())
