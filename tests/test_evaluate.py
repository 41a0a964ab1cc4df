"""``areal eval``: a checkpoint's held-out accuracy through a real server, no training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("reward_fn,accuracy", [("math", 0.0), ("always_right:score", 1.0)])
def test_areal_eval_scores_every_held_out_item_with_the_configured_reward(
    tmp_path, tiny_model_dir, reward_fn, accuracy
):
    # The random tiny model never answers arithmetic right (math: 0.0); a reward of the user's
    # that always says right gives 1.0: the number is the configured reward's mean.
    (tmp_path / "always_right.py").write_text("def score(completion, reference):\n    return 1.0\n")
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "areal.cli",
        "eval",
        "--model",
        tiny_model_dir,
        "--config",
        str(REPO / "examples" / "arithmetic_grpo.yaml"),
        "--out",
        str(out),
        "valid_dataset.size=6",
        "eval_gconfig.max_new_tokens=2",
        f"reward_fn={reward_fn}",
        "launcher.server_threads=1",
    ]
    run = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary == json.loads(run.stdout[run.stdout.index("{") :])
    assert summary["n_items"] == summary["n_samples"] == 6 and summary["greedy"] is True
    assert summary["reward_failures"] == 0 and summary["accuracy"] == accuracy


def test_areal_eval_without_held_out_data_says_so(tiny_model_dir):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "eval",
            "--model",
            tiny_model_dir,
            "valid_dataset=null",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        run.returncode == 2 and "valid_dataset: null; areal eval needs held-out data" in run.stderr
    )


def test_areal_eval_names_its_own_flag_for_a_missing_model(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "areal.cli", "eval", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and f"--model: '{tmp_path / 'nope'}' does not exist" in run.stderr
    assert "actor.path" not in run.stderr
