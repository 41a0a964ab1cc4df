"""Tier 2: ``areal view`` in a real browser (Debian's chromium + chromium-driver, selenium)
against two real runs: the resume tests' async GRPO run of the demo's config (6 steps,
max_staleness=1, 2 x 4 samples a step) and the recorded Core async PPO run (2 steps).

The page loads with no console errors, the reward curve has the run's 6 points, the two runs
stand side by side, a staleness filter changes the table (whose rows name their server and
rollout worker), a sample's page colours its tokens by weight version and by trainer - server
logprob, and the Core run's timeline shows its MFCs on its model worker. Screenshots go to
tmp_path, or to $AREAL_VIEWER_SCREENSHOTS.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from viewer_screenshots import chromium_paths, headless_chromium  # noqa: E402

pytestmark = pytest.mark.slow
WAIT = 30  # seconds for the page to fetch and draw


@pytest.fixture
def viewer_url(async_grpo_reference, core_async_recorded):
    runs = [str(async_grpo_reference), str(core_async_recorded)]  # run 0: Lite, run 1: Core
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal.cli", "view", *runs, "--port", "0"],
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
    if not all(chromium_paths()):
        pytest.skip(
            "chromium and chromedriver are not installed (make install installs them as root: "
            "apt-get install chromium chromium-driver)"
        )
    pytest.importorskip("selenium.webdriver")
    driver = headless_chromium(console_logs=True)  # the docs' screenshots use it too
    yield driver
    driver.quit()


def _wait(driver, css: str, at_least: int = 1):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, css)) >= at_least
    )
    return driver.find_elements(By.CSS_SELECTOR, css)


def test_viewer_shows_curves_runs_side_by_side_samples_tokens_and_the_core_timeline(
    viewer_url, browser, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    shots = Path(os.environ.get("AREAL_VIEWER_SCREENSHOTS", tmp_path))
    browser.get(viewer_url)
    points = _wait(browser, 'circle.pt[data-run="0"][data-key="reward/mean"]', at_least=6)
    assert sorted(int(p.get_attribute("data-step")) for p in points) == [1, 2, 3, 4, 5, 6]
    assert _wait(browser, 'circle.pt[data-key^="staleness/hist/"]')  # the staleness histogram
    browser.save_screenshot(str(shots / "viewer-curves.png"))

    browser.get(viewer_url + "#compare")  # left: run 0 (Lite, 6 steps), right: run 1 (Core, 2)
    _wait(browser, '#compare-rows circle.pt[data-run="1"][data-key="reward/mean"]', at_least=2)
    pairs = browser.find_elements(By.CSS_SELECTOR, "#compare-rows .pair")
    reward = next(p for p in pairs if "mean reward" in p.text)
    left, right = reward.find_elements(By.CSS_SELECTOR, ".chart")
    assert len(left.find_elements(By.CSS_SELECTOR, 'circle.pt[data-run="0"]')) == 6
    assert len(right.find_elements(By.CSS_SELECTOR, 'circle.pt[data-run="1"]')) == 2
    browser.save_screenshot(str(shots / "viewer-compare.png"))

    browser.get(viewer_url + "#samples")
    rows = _wait(browser, "#samples-table tbody tr", at_least=48)  # 6 steps x 2 groups x 4 samples
    assert len(rows) == 48
    server, worker = (c.text for c in rows[0].find_elements(By.TAG_NAME, "td")[9:11])
    assert re.fullmatch(r"[\w.-]+:\d+", server) and worker == "rank0"
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
    browser.find_element(By.CSS_SELECTOR, 'input[name="colour"][value="logp"]').click()
    assert browser.find_element(By.ID, "legend").text.startswith("red: trainer logprob")

    browser.get(viewer_url + "#timeline")
    Select(browser.find_element(By.ID, "timeline-run")).select_by_value("1")
    bars = _wait(browser, 'rect.span[data-worker="0"]', at_least=2)
    assert {b.get_attribute("data-name") for b in bars} >= {"actor_adv", "actor_train"}
    assert "steps 1..2" in browser.find_element(By.ID, "timeline-note").text
    browser.save_screenshot(str(shots / "viewer-timeline.png"))

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
