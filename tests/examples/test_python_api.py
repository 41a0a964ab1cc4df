"""Tier 2: ``examples/python_api.py`` (configs built in Python, SFT then GRPO through
``launch_local``) runs end to end on the tiny model in a short smoke configuration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow
DEADLINE_S = 540


def test_the_python_api_example_runs_sft_then_grpo(tmp_path, tiny_model_dir):
    from areal.api.config import GRPOConfig, load_config
    from areal.utils.plot import read_stats

    cmd = [
        sys.executable,
        str(REPO / "examples" / "python_api.py"),
        "--out",
        str(tmp_path),
        "--model",
        tiny_model_dir,
        "--sft-steps",
        "2",
        "--grpo-steps",
        "1",
        "--small",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:  # past the deadline: the launcher and everything it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-4000:]
    assert (tmp_path / "sft" / "run" / "checkpoints" / "model" / "step2" / "config.json").is_file()
    cfg = load_config(
        GRPOConfig, ["--config", str(tmp_path / "grpo.yaml")]
    )  # the saved config reloads
    assert (
        cfg.actor.path.endswith("step2")
        and cfg.train_dataset.batch_size == 2
        and cfg.gconfig.n_samples == 4
    )
    rows = read_stats(tmp_path / "grpo" / "run")
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1]
    assert "held-out accuracy" in out.splitlines()[-1]
