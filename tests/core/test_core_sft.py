"""Tier 2: ``areal core sft`` (SFT through the master) against Lite's examples/sft.py on the same
config: the same loss at every step, the same held-out NLL and a checkpoint, with one in-process
worker and with 2 Ray workers (a real local Ray head). All runs are plain processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CORE_SFT = [sys.executable, "-m", "areal.cli", "core", "sft"]


def run(
    cmd: list[str], fileroot: Path, name: str, model_dir: str, extra: tuple[str, ...] = ()
) -> dict[int, dict]:
    """Three steps of SFT (constant LR, so a shorter run's steps are a longer one's first steps)."""
    overrides = [
        f"fileroot={fileroot}",
        f"experiment_name={name}",
        "trial_name=t",
        f"model.path={model_dir}",
        "total_train_steps=3",
        "train_dataset.batch_size=8",
        "evaluator.freq_steps=null",
        "valid_dataset.batch_size=50",
        "seed=5",
        "model.optimizer.warmup_steps_proportion=0",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [*cmd, "--config", str(REPO / "examples" / "sft_arithmetic.yaml"), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if cmd is CORE_SFT:  # the last line says where the run went (issue 34)
        last = out.stdout.strip().splitlines()[-1]
        assert last.startswith(f"run finished; logs and outputs in {fileroot / name / 't'}"), (
            out.stdout[-2000:]
        )
    lines = (fileroot / name / "t" / "stats.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def lite(tmp_path_factory, tiny_model_dir) -> dict[int, dict]:
    return run(
        [sys.executable, "examples/sft.py"], tmp_path_factory.mktemp("lite"), "lite", tiny_model_dir
    )


def check_same(core: dict[int, dict], lite: dict[int, dict], run_dir: Path) -> None:
    assert sorted(core) == sorted(lite) == [1, 2, 3]
    for step in (1, 2, 3):
        assert core[step]["loss/loss"] == pytest.approx(lite[step]["loss/loss"], rel=1e-5)
        assert core[step]["mfc/sft_train/n_tokens"] == lite[step]["perf/n_tokens"]
    assert core[3]["eval/loss"] == pytest.approx(lite[3]["eval/loss"], rel=1e-5)
    assert (run_dir / "checkpoints" / "model" / "step3" / "model.safetensors").is_file()


def test_core_sft_in_process_reaches_the_same_loss_as_lite_sft(tmp_path, tiny_model_dir, lite):
    check_same(run(CORE_SFT, tmp_path, "core", tiny_model_dir), lite, tmp_path / "core" / "t")


def test_core_sft_on_two_ray_workers_reaches_lite_sfts_loss_and_resumes_losslessly(
    tmp_path, tiny_model_dir, lite, ray_head
):
    # 2 steps with a recover checkpoint each step, then the same trial to 3 steps: it resumes
    # after step 2 (weights, optimizer, data position) and its step 3 is the uninterrupted one's;
    # every step's loss, the held-out NLL and the checkpoint are Lite's (one Ray run does both)
    extra = (
        "core.backend=ray",
        "core.n_workers=2",
        f"core.ray_address={ray_head.address}",
        "recover.mode=resume",
        "recover.freq_steps=1",
    )
    first = run(CORE_SFT, tmp_path, "core", tiny_model_dir, (*extra, "total_train_steps=2"))
    assert sorted(first) == [1, 2]
    resumed = run(CORE_SFT, tmp_path, "core", tiny_model_dir, extra)
    assert sorted(resumed) == [1, 2, 3]
    assert resumed[1] == first[1] and resumed[2] == first[2]  # kept (timings too): not redone
    log = (tmp_path / "core" / "t" / "logs").glob("*.log")
    assert any("at step 2" in p.read_text() and "resumed from" in p.read_text() for p in log)
    check_same(resumed, lite, tmp_path / "core" / "t")
