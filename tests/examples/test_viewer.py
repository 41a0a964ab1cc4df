"""Tier 2: ``areal view`` in a real browser (Debian's chromium + chromium-driver, selenium)
against two real runs: the resume tests' async GRPO run of the demo's config (6 steps,
max_staleness=1, 2 x 4 samples a step) and the recorded Core async PPO run (2 steps).

The page loads with no console errors, the reward curve has the run's 6 points, the two runs
stand side by side, a staleness filter changes the table (whose rows name their server and
rollout worker), a sample's page colours its tokens by weight version and by trainer - server
logprob, and the Core run's timeline shows its MFCs on its model worker. Screenshots go to
tmp_path, or to $AREAL_VIEWER_SCREENSHOTS.

Without the runs: hand-made run dirs (an SFT run's stats.jsonl; an RL run's stats and recorded
samples) show uPlot charts with round tick values, a smoothing control that changes the drawn
curves, the SFT run's loss chart without RL or Core cards, and a sample's prompt and reference
answer with its tokens in the staleness chart's lag colours.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from viewer_screenshots import chromium_paths, headless_chromium  # noqa: E402

pytestmark = pytest.mark.slow
WAIT = 30  # seconds for the page to fetch and draw
STALENESS = "staleness: trained tokens per version lag"
# the colours of the drawn (smoothed) series of the chart titled arguments[0], as CSS computes
# them (what a token's background-color reads)
LAG_COLOURS_JS = """
const box = [...document.querySelectorAll('#charts .chart')]
  .find(b => b.dataset.title === arguments[0]);
const u = box.uplot;
return u.series.flatMap((s, i) => i > 0 && i % 2 === 0 ? [s.stroke(u, i)] : []).map(c => {
  const e = document.createElement('i'); e.style.backgroundColor = c; document.body.append(e);
  const css = getComputedStyle(e).backgroundColor; e.remove(); return css;
});
"""


# each uPlot chart in `arguments[0]` titled `arguments[1]`: its series as [label, raw points,
# drawn (smoothed) points]; uPlot's columns are steps, then raw and smoothed per series
SERIES_JS = """
return [...document.querySelectorAll(arguments[0] + ' .chart')]
  .filter(b => b.dataset.title === arguments[1] && b.uplot).map(b => {
    const u = b.uplot;
    const pts = i => u.data[0].map((x, j) => [x, u.data[i][j]]).filter(p => p[1] != null);
    return u.series.flatMap((s, i) => i > 0 && i % 2 === 0 ? [[s.label, pts(i - 1), pts(i)]] : []);
  });
"""


@contextmanager
def _view(*runs: Path):
    """The URL of ``areal view RUNS`` on a free loopback port, while it runs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal.cli", "view", *map(str, runs), "--port", "0"],
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
def viewer_url(async_grpo_reference, core_async_recorded):
    with _view(async_grpo_reference, core_async_recorded) as url:  # run 0: Lite, run 1: Core
        yield url


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
    _wait(browser, "#charts .chart .uplot", at_least=3)
    (reward,) = browser.execute_script(SERIES_JS, "#charts", "mean reward (training rollouts)")
    lite, core = (raw for label, raw, _ in reward if label.endswith("reward/mean"))
    assert [x for x, _ in lite] == [1, 2, 3, 4, 5, 6] and [x for x, _ in core] == [1, 2]
    (lags,) = browser.execute_script(SERIES_JS, "#charts", STALENESS)  # the staleness histogram
    assert lags
    browser.save_screenshot(str(shots / "viewer-curves.png"))

    browser.get(viewer_url + "#compare")  # left: run 0 (Lite, 6 steps), right: run 1 (Core, 2)
    _wait(browser, '#compare-rows .pair[data-title="mean reward (training rollouts)"] .uplot', 2)
    left, right = browser.execute_script(
        SERIES_JS, "#compare-rows", "mean reward (training rollouts)"
    )
    assert [len(raw) for _, raw, _ in left + right] == [6, 2]
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
    legend = [s.text for s in browser.find_elements(By.CSS_SELECTOR, "#legend span")]
    assert legend == ["-1", "-0.01", "-0.0001", "+0.0001", "+0.01", "+1"]  # trainer - server

    browser.get(viewer_url + "#timeline")
    Select(browser.find_element(By.ID, "timeline-run")).select_by_value("1")
    bars = _wait(browser, 'rect.span[data-worker="0"]', at_least=2)
    assert {b.get_attribute("data-name") for b in bars} >= {"actor_adv", "actor_train"}
    assert "steps 1..2" in browser.find_element(By.ID, "timeline-note").text
    browser.save_screenshot(str(shots / "viewer-timeline.png"))

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def _round_ticks(labels: str) -> bool:
    """Whether axis tick labels are evenly spaced multiples of 1, 2, 2.5 or 5 x 10^k (not the
    data's min and max)."""
    values = [float(v) for v in labels.split()]
    if len(values) < 2:
        return False
    step = values[1] - values[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5)) and all(
        math.isclose(b - a, step, rel_tol=1e-6) and math.isclose(a / step, round(a / step))
        for a, b in zip(values, values[1:])
    )


def _rgb(css: str) -> tuple[int, ...]:
    """(r, g, b) of a CSS colour as the browser reports it: rgb(...) or rgba(..., 1)."""
    return tuple(int(v) for v in re.findall(r"\d+", css)[:3])


def _fake_runs(root: Path) -> tuple[Path, Path]:
    """An SFT run (stats only) and an RL run from step 23 (stats and one step's samples: lag 0
    and lag 1 tokens, with prompt and reference)."""
    from areal.api.config.base import SamplesConfig
    from areal.api.io import RolloutStatus, Trajectory
    from areal.rollout.trajectory import groups_to_batch
    from areal.runtime.samples import SampleRecorder

    sft, rl = root / "exp" / "sft", root / "exp" / "rl"
    for run in (sft, rl):
        run.mkdir(parents=True)
    rows = [{"step": s, "loss/loss": 2 / s, "timing/train_step": 0.5} for s in range(1, 41)]
    rows[9]["eval/loss"] = 0.3
    (sft / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [
        {
            "step": s,
            "reward/mean": 0.5 + (-0.1) ** s,
            "staleness/hist/0": 9.0,
            "staleness/hist/1": 3.0,
        }
        for s in range(23, 29)
    ]
    (rl / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    logp, versions = (
        [-0.01, -0.01, -3.0, -0.5],
        [4, 4, 5, 5],
    )  # trained on version 5: lags 1, 1, 0, 0
    group = [
        Trajectory([1], [5, 5, 5, 6], logp, versions, [1] * 4, 1.0, RolloutStatus.COMPLETED,
                   prompt_text="What is 3 + 4?", reference="7")
    ]  # fmt: skip
    batch = groups_to_batch([group])
    SampleRecorder(SamplesConfig(), rl, 0, Tok(), fresh=False).record(
        28, [group], batch.with_fields(tokens={"advantages": batch["loss_mask"].float()}), 5
    )
    return sft, rl


def test_an_sft_runs_page_shows_its_loss_on_round_axes_without_rl_or_core_cards(browser, tmp_path):
    from selenium.webdriver.common.by import By

    sft, _ = _fake_runs(tmp_path)
    with _view(sft) as url:
        browser.get(url)
        _wait(browser, "#charts .chart .uplot")
        titles = [c.get_attribute("data-title") for c in _wait(browser, "#charts .chart")]
        assert titles == ["loss (train, held-out)", "seconds per stage"]
        (loss,) = browser.execute_script(SERIES_JS, "#charts", "loss (train, held-out)")
        assert [(label, len(raw)) for label, raw, _ in loss] == [
            ("loss/loss", 40),
            ("eval/loss", 1),
        ]
        box = browser.find_element(By.CSS_SELECTOR, '#charts .chart[data-title^="loss"]')
        assert _round_ticks(box.get_attribute("data-y-ticks"))  # 0 0.5 1 1.5 2, not 0.05 .. 2
        assert _round_ticks(box.get_attribute("data-x-ticks"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_rl_curves_smooth_and_a_samples_tokens_share_the_staleness_charts_colours(
    browser, tmp_path
):
    from selenium.webdriver.common.by import By

    _, rl = _fake_runs(tmp_path)
    title = "mean reward (training rollouts)"
    with _view(rl) as url:
        browser.get(url)
        _wait(browser, "#charts .chart .uplot", at_least=2)
        box = browser.find_element(By.CSS_SELECTOR, f'#charts .chart[data-title="{title}"]')
        assert box.get_attribute("data-x-ticks").split()[0] == "23"
        assert _round_ticks(box.get_attribute("data-y-ticks"))
        ((_, raw, drawn),) = browser.execute_script(SERIES_JS, "#charts", title)[0]
        assert drawn != raw  # smoothed by default
        browser.execute_script(
            "const s = document.getElementById('smoothing'); s.value = 0;"
            "s.dispatchEvent(new Event('input'));"
        )
        ((_, raw, drawn),) = browser.execute_script(SERIES_JS, "#charts", title)[0]
        assert drawn == raw  # smoothing 0: the raw values
        (lags,) = browser.execute_script(SERIES_JS, "#charts", STALENESS)
        assert [label for label, _, _ in lags] == ["lag 0", "lag 1"]
        lag_colours = browser.execute_script(LAG_COLOURS_JS, STALENESS)

        browser.get(url + "#sample/0/28/0/0")
        tokens = _wait(browser, "#tokens span.tok", at_least=4)
        assert browser.find_element(By.ID, "sample-prompt").text == "What is 3 + 4?"
        assert browser.find_element(By.ID, "sample-reference").text == "7"
        background = [_rgb(t.value_of_css_property("background-color")) for t in tokens]
        assert background == [_rgb(lag_colours[i]) for i in (1, 1, 0, 0)]  # versions 4, 4, 5, 5
        assert "alt" in tokens[1].get_attribute("class").split()  # same colour, edges differ
        browser.find_element(By.CSS_SELECTOR, 'input[name="colour"][value="prob"]').click()
        tokens = browser.find_elements(By.CSS_SELECTOR, "#tokens span.tok")  # drawn again
        probs = [t.value_of_css_property("background-color") for t in tokens]
        assert len({probs[0], probs[2], probs[3]}) == 3  # p 0.99, 0.05, 0.61: three colours
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
