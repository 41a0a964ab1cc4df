"""Tier 2: the one-GPU layout on CPU. ``CUDA_VISIBLE_DEVICES=0`` makes the launcher see one GPU
for a trainer rank and a server (refused before colocation existed); it puts both on it, and the
trainer has the server give back its KV cache for every train step. Everything still computes on
the CPU, so this checks the layout and the sleep/wake protocol, not GPU memory (tier 3 does)."""

from __future__ import annotations

import pytest
from conftest import GRPO_SCRIPT, GRPO_YAML, SMALL_RL

from launch_harness import assert_finite, train_steps

pytestmark = pytest.mark.slow


def test_one_gpu_colocates_trainer_and_server_and_the_server_sleeps_each_step(
    launcher, tiny_model_dir, tmp_path
):
    shm = tmp_path / "shm"  # stands in for /dev/shm: the weight updates' own dir, outside RUN_DIR
    run_dir = launcher.run("coloc", GRPO_SCRIPT, GRPO_YAML, [
        f"actor.path={tiny_model_dir}", *SMALL_RL, "total_train_steps=2", "rollout.max_staleness=1",
        "valid_dataset=null", "cluster.n_servers=1", f"weight_update_dir={shm}",
    ], env={"CUDA_VISIBLE_DEVICES": "0"})  # fmt: skip
    # the updates went there, and the run deleted them when it ended (the export holds them)
    assert (shm / "coloc" / "t").is_dir() and not list((shm / "coloc" / "t").glob("v*"))
    assert not (run_dir / "weights").exists()
    out = (launcher.root / "coloc" / "launcher.out").read_text(errors="replace")
    assert "1 GPU(s) for 1 trainer ranks + 1 servers: each server shares a trainer's GPU" in out, (
        out
    )
    stats = train_steps(run_dir)
    assert sorted(stats) == [1, 2]
    for step in (1, 2):
        assert_finite(stats[step], ["reward/mean", "loss/loss"])
        assert stats[step]["staleness/max"] <= 1  # the bound holds across the sleeps
    server_log = (run_dir / "logs" / "server0.log").read_text(errors="replace")
    assert server_log.count("released the KV cache") == 2, server_log[-2000:]
