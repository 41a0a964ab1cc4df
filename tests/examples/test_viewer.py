"""Tier 2: ``areal view`` in a real browser (Debian's chromium + chromium-driver, selenium)
against the resume tests' real async GRPO run (6 steps, max_staleness=1, 2 x 4 samples a step).

The page loads with no console errors, the reward curve has the run's 6 points, a staleness
filter changes the table, and a sample's page colours its tokens by weight version. Screenshots
go to tmp_path, or to $AREAL_VIEWER_SCREENSHOTS (docs/images for docs/viewer.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WAIT = 30  # seconds for the page to fetch and draw


@pytest.fixture
def viewer_url(async_grpo_reference):
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal.cli", "view", str(async_grpo_reference), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # "areal view: http://127.0.0.1:<port>/ (Ctrl-C stops it)"
        assert "http://" in line, f"areal view printed {line!r}"
        yield line.split()[2]
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip(
            "chromium and chromedriver are not installed (make install installs them as root: "
            "apt-get install chromium chromium-driver)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    yield driver
    driver.quit()


def _wait(driver, css: str, at_least: int = 1):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, css)) >= at_least
    )
    return driver.find_elements(By.CSS_SELECTOR, css)


def test_viewer_shows_curves_filters_samples_and_colours_tokens(viewer_url, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shots = Path(os.environ.get("AREAL_VIEWER_SCREENSHOTS", tmp_path))
    browser.get(viewer_url)
    points = _wait(browser, 'circle.pt[data-key="reward/mean"]', at_least=6)
    assert sorted(int(p.get_attribute("data-step")) for p in points) == [1, 2, 3, 4, 5, 6]
    assert _wait(
        browser, 'circle.pt[data-key^="staleness/hist/"]'
    )  # the staleness histogram is drawn
    browser.save_screenshot(str(shots / "viewer-curves.png"))

    browser.get(viewer_url + "#samples")
    rows = _wait(browser, "#samples-table tbody tr", at_least=48)  # 6 steps x 2 groups x 4 samples
    assert len(rows) == 48
    browser.find_element(By.NAME, "staleness_min").send_keys("1")
    browser.find_element(By.ID, "apply").click()
    WebDriverWait(browser, WAIT).until(
        lambda d: d.find_element(By.ID, "matched").text != "48 samples match"
    )
    stale = browser.find_elements(By.CSS_SELECTOR, "#samples-table tbody tr")
    assert 0 < len(stale) < 48  # the run ran ahead (staleness 1 somewhere), not everywhere
    assert all(r.find_elements(By.TAG_NAME, "td")[6].text == "1" for r in stale)
    browser.save_screenshot(str(shots / "viewer-samples.png"))

    stale[0].click()
    tokens = _wait(browser, "#tokens span.tok")
    assert len(tokens) == 4  # gconfig.max_new_tokens
    assert all("background" in t.get_attribute("style") for t in tokens)
    assert {t.get_attribute("data-version") for t in tokens} <= {"0", "1", "2", "3", "4", "5", "-1"}
    assert "lag 1" in browser.find_element(By.ID, "legend").text
    browser.save_screenshot(str(shots / "viewer-sample.png"))

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
