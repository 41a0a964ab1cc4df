"""Tier 2: ``areal core sft`` (SFT through the master) against Lite's examples/sft.py on the same
config: the same loss at every step and a loadable checkpoint. Both run as plain processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str], fileroot: Path, name: str, model_dir: str) -> dict[int, dict]:
    overrides = [f"fileroot={fileroot}", f"experiment_name={name}", "trial_name=t", f"model.path={model_dir}",
                 "total_train_steps=3", "train_dataset.batch_size=8", "evaluator.freq_steps=null",
                 "valid_dataset.batch_size=50", "seed=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*cmd, "--config", str(REPO / "examples" / "sft_arithmetic.yaml"), *overrides],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (fileroot / name / "t" / "stats.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_core_sft_reaches_the_same_loss_as_lite_sft(tmp_path, tiny_model_dir):
    lite = run([sys.executable, "examples/sft.py"], tmp_path, "lite", tiny_model_dir)
    core = run([sys.executable, "-m", "areal.cli", "core", "sft"], tmp_path, "core", tiny_model_dir)
    assert sorted(core) == sorted(lite) == [1, 2, 3]
    for step in (1, 2, 3):
        assert core[step]["loss/loss"] == pytest.approx(lite[step]["loss/loss"], rel=1e-5)
        assert core[step]["mfc/sft_train/n_tokens"] == lite[step]["perf/n_tokens"]
    assert core[3]["eval/loss"] == pytest.approx(lite[3]["eval/loss"], rel=1e-5)
    assert (tmp_path / "core" / "t" / "checkpoints" / "model" / "step3" / "model.safetensors").is_file()
