"""Tier 2: ``areal view`` in a real browser (Debian's chromium + chromium-driver, selenium) on a
run whose recorded files are broken the ways a killed or diverged run leaves them (issue 56): an
empty sample file, a half-written stats line, a NaN reward and a -inf logprob. The reward curve
is drawn, the table lists the NaN sample and its page shows its tokens, with no console error.
A few seconds: the recorder writes the run in the test, nothing trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from viewer_screenshots import chromium_paths, headless_chromium  # noqa: E402

pytestmark = pytest.mark.slow
WAIT = 30  # seconds for the page to fetch and draw
REWARD_CHART_DRAWN = """
const box = [...document.querySelectorAll("#charts .chart")]
  .find(b => b.textContent.startsWith("mean reward"));
return !!box && !!box.querySelector("svg, canvas") && !box.textContent.includes("not logged");
"""


@pytest.fixture
def broken_run(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.utils.test_viewer_api import _record

    for step in (1, 2, 3):
        _record(tmp_path, step, [[0, 0], [0]], version=0)
    step1 = tmp_path / "samples" / "step-000001-rank0.parquet"
    rows = pq.read_table(step1).to_pylist()
    rows[0]["reward"], rows[0]["behav_logp"] = float("nan"), [float("-inf"), -1.0]
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(step1)), step1)
    (tmp_path / "samples" / "step-000002-rank0.parquet").write_bytes(b"")  # a killed write
    stats = [{"step": s, "reward/mean": 0.5 * s} for s in (1, 2, 3)]
    (tmp_path / "stats.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in stats) + '{"step": 4, "reward/mean": NaN}\n{"st'
    )
    return tmp_path


def test_a_broken_run_still_shows_its_curves_and_its_nan_sample(broken_run):
    if not all(chromium_paths()):
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium "
                    "chromium-driver)")  # fmt: skip
    pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    proc = subprocess.Popen(
        [sys.executable, "-m", "areal.cli", "view", str(broken_run), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    browser = headless_chromium(console_logs=True)
    try:
        url = proc.stdout.readline().split()[2]  # "areal view: http://127.0.0.1:<port>/ ..."

        def wait(css: str, at_least: int = 1):
            WebDriverWait(browser, WAIT).until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, css)) >= at_least
            )
            return browser.find_elements(By.CSS_SELECTOR, css)

        browser.get(url)  # the reward chart is drawn (its NaN line left out), not "not logged"
        WebDriverWait(browser, WAIT).until(lambda d: d.execute_script(REWARD_CHART_DRAWN))
        browser.get(url + "#samples")
        rows = wait("#samples-table tbody tr", at_least=4)  # steps 1 and 3; step 2 file is empty
        assert len(rows) == 4
        cells = [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        assert cells[0][:5] == ["1", "0", "0", "g", "NaN"], cells[0]
        rows[0].click()
        tokens = wait("#tokens span.tok", at_least=2)
        assert "behaviour logp -Infinity" in tokens[0].get_attribute("title")
        assert "reward NaN" in browser.find_element(By.ID, "sample-meta").text
        browser.find_element(By.CSS_SELECTOR, 'input[name="colour"][value="logp"]').click()
        assert len(browser.find_elements(By.CSS_SELECTOR, "#tokens span.tok")) == 2
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()
        proc.terminate()
        proc.wait(10)
