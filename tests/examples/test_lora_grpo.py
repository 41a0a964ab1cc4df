"""Tier 2: LoRA GRPO end to end through the launcher, killed mid-training and resumed.

A LoRA actor (KL against its own frozen base, no ``ref`` section) whose trainer worker is
SIGKILLed after step 2 must resume from its recover checkpoint (adapters + optimizer only) and
train exactly the sample ids of the uninterrupted run, step by step. Which samples a step trains
depends on the data loader and the rollout executor, not on the weights, so the reference is the
shared uninterrupted (full fine-tuning) run of test_resume.py. The final export holds the merged
model and the adapter in peft's layout.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import GRPO_SCRIPT, GRPO_YAML, RESUMABLE, RUN_TIMEOUT
from test_resume import N_STEPS, _victim

from launch_harness import assert_finite, effective_ids, train_steps

pytestmark = pytest.mark.slow
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optimizer.lr=1e-2", "actor.kl_ctl=0.05"]
KILL_AFTER_STEP = 2


def test_lora_grpo_resumes_sample_exact_with_small_checkpoints(
    launcher, tiny_model_dir, async_grpo_reference
):
    run, run_dir = launcher.start(
        "lora", GRPO_SCRIPT, GRPO_YAML, [f"actor.path={tiny_model_dir}", *RESUMABLE, *LORA]
    )
    passed = lambda: KILL_AFTER_STEP in train_steps(run_dir)  # noqa: E731
    assert run.wait(RUN_TIMEOUT, until=passed) is None, (
        f"run ended before step {KILL_AFTER_STEP}:\n{run.output()}"
    )
    os.kill(_victim(run, "trainer"), signal.SIGKILL)
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, f"the LoRA run did not recover (exit {code}):\n{run.output()}"
    assert "relaunching" in run.output()
    run.assert_no_survivors()

    assert effective_ids(run_dir) == effective_ids(async_grpo_reference), (
        "resumed LoRA run trained other samples"
    )
    stats = train_steps(run_dir)
    assert sorted(stats) == list(range(1, N_STEPS + 1))
    for rec in stats.values():
        assert_finite(rec, ["reward/mean", "loss/loss", "loss/grad_norm"])
    # recover checkpoints: adapters + optimizer, a small fraction of the full run's
    ckpts = sorted((run_dir / "recover").glob("ckpt-*/actor"))
    ref_ckpts = sorted((async_grpo_reference / "recover").glob("ckpt-*/actor"))
    assert ckpts and ref_ckpts
    size = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())  # noqa: E731
    assert size(ckpts[-1]) * 5 < size(ref_ckpts[-1])
    export = run_dir / "checkpoints" / "actor" / f"step{N_STEPS}"
    assert (export / "model.safetensors").is_file()
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    assert (export / "adapter" / "adapter_config.json").is_file()
