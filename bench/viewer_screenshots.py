"""Screenshots of every ``areal view`` page, in headless Chromium (the PNGs of docs/viewer.md).

Run: ``python bench/viewer_screenshots.py RUN_DIR [RUN_DIR ...] [--out docs/images]``.

Serves the run dirs with ``areal view`` on a free loopback port and saves, under ``--out``:
``viewer-curves.png`` (every run), ``viewer-compare.png`` (the first two runs side by side;
needs two), ``viewer-samples.png`` (the first run's table, filtered to stale samples when it has
some), ``viewer-sample.png`` (the first listed sample, tokens by version) and
``viewer-timeline.png`` (the last step of the first run that has an MFC timeline: a Core run).
Needs Debian's ``chromium`` and ``chromium-driver`` and ``selenium`` (``make install``). Each
PNG is reduced to a 64-colour palette to keep the docs small.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAIT = 60  # seconds for a page to fetch and draw


def chromium_paths() -> tuple[str | None, str | None]:
    """Where Debian's ``chromium`` and ``chromedriver`` are on PATH (None where absent)."""
    return shutil.which("chromium"), shutil.which("chromedriver")


def headless_chromium(console_logs: bool = False):
    """A headless Debian Chromium driven by selenium at the viewer's window size (also the
    browser of tests/examples/test_viewer.py); ``console_logs`` keeps the page's console."""
    from selenium import webdriver

    chromium, chromedriver = chromium_paths()
    if not (chromium and chromedriver):
        raise SystemExit(
            "chromium and chromedriver are not on PATH: apt-get install chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,860",
    ):
        options.add_argument(flag)
    if console_logs:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(chromedriver))


def _shoot(driver, url: str, css: str, path: Path, before=None) -> None:
    """Open ``url``, run ``before(driver)`` if given, wait for ``css``, save a small PNG."""
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    if before is not None:
        before(driver)
    WebDriverWait(driver, WAIT).until(lambda d: d.find_elements(By.CSS_SELECTOR, css))
    driver.save_screenshot(str(path))
    Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)
    print(f"[screenshots] {path} ({path.stat().st_size // 1024} KiB)")


def _filter_stale(driver) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT).until(lambda d: d.find_element(By.ID, "matched").text)
    before = driver.find_element(By.ID, "matched").text
    driver.find_element(By.NAME, "staleness_min").send_keys("1")
    driver.find_element(By.ID, "apply").click()
    WebDriverWait(driver, WAIT).until(lambda d: d.find_element(By.ID, "matched").text != before)


def _pick_timeline(index: int):
    def pick(driver) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select

        Select(driver.find_element(By.ID, "timeline-run")).select_by_value(str(index))

    return pick


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    view = subprocess.Popen(
        [sys.executable, "-m", "areal.cli", "view", *map(str, args.run_dirs), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    driver = None
    try:
        url = view.stdout.readline().split()[2]  # "areal view: http://127.0.0.1:<port>/ ..."
        driver = headless_chromium()
        _shoot(
            driver,
            url + "#curves",
            "#charts .chart .uplot",  # uPlot has drawn a chart (RL: reward; SFT: loss)
            args.out / "viewer-curves.png",
        )
        if len(args.run_dirs) > 1:
            _shoot(
                driver,
                url + "#compare",
                "#compare-rows .chart .uplot",
                args.out / "viewer-compare.png",
            )
        stale = _has_stale(args.run_dirs[0])
        _shoot(driver, url + "#samples", "#samples-table tbody tr", args.out / "viewer-samples.png",
               _filter_stale if stale else None)  # fmt: skip
        from selenium.webdriver.common.by import By

        driver.find_elements(By.CSS_SELECTOR, "#samples-table tbody tr")[0].click()
        _shoot(driver, driver.current_url, "#tokens span.tok", args.out / "viewer-sample.png")
        core = [i for i, d in enumerate(args.run_dirs) if (d / "timeline.jsonl").is_file()]
        if core:
            _shoot(driver, url + "#timeline", "rect.span", args.out / "viewer-timeline.png",
                   _pick_timeline(core[0]))  # fmt: skip
    finally:
        if driver is not None:
            driver.quit()
        view.terminate()
        view.wait(10)
    return 0


def _has_stale(run_dir: Path) -> bool:
    """Whether the run trained a sample at staleness > 0."""
    from areal.utils.samples import SampleIndex

    return any(r["staleness"] > 0 for r in SampleIndex(run_dir).rows())


if __name__ == "__main__":
    sys.exit(main())
