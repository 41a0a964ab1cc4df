"""Tier 2: short DPO runs of examples/dpo.py through ``areal launch local`` on CPU, with the
reference logprobs precomputed once and computed every step: both train on the same pairs and
must log the same losses."""

from __future__ import annotations

import pytest
from conftest import REPO
from test_end_to_end import _changed, _reloads

from launch_harness import assert_finite, train_steps

pytestmark = pytest.mark.slow
SCRIPT, YAML = REPO / "examples" / "dpo.py", REPO / "examples" / "dpo_arithmetic.yaml"
# The reward-model demo's built-in pairs (right answer over a near miss): no sampling needed.
ARITH = [
    "path=arithmetic",
    "arithmetic.max_digits=1",
    "arithmetic.operators=+",
    "arithmetic.n_train=40",
    "arithmetic.n_test=8",
    "arithmetic.test_percent=20",
]
SMALL = [
    "total_train_steps=2",
    "train_dataset.batch_size=8",
    "evaluator.freq_steps=null",
    "valid_dataset.split=test",
    "valid_dataset.batch_size=8",
    "optimizer.lr=1e-3",
    *[f"train_dataset.{a}" for a in ARITH],
    *[f"valid_dataset.{a}" for a in ARITH],
]
LOSSES = [
    "loss/loss",
    "loss/reward_acc",
    "loss/margin",
    "loss/chosen_reward",
    "loss/rejected_reward",
]


def test_dpo_runs_end_to_end_and_precomputed_reference_equals_online(launcher, tiny_model_dir):
    runs = {}
    for mode in ("precompute", "online"):
        runs[mode] = launcher.run(f"dpo-{mode}", SCRIPT, YAML, [
            f"model.path={tiny_model_dir}", f"dpo.ref_logp={mode}",
            *[o if not o.startswith("optimizer") else f"model.{o}" for o in SMALL],
        ])  # fmt: skip
    stats = {mode: train_steps(run_dir) for mode, run_dir in runs.items()}
    for mode, rows in stats.items():
        assert sorted(rows) == [1, 2], (mode, sorted(rows))
        for step in (1, 2):
            assert_finite(rows[step], LOSSES)
        assert_finite(rows[2], ["eval/loss", "eval/reward_acc", "eval/margin"])
    pre, online = stats["precompute"], stats["online"]
    assert "timing/ref_logp_precompute" in pre[1] and "timing/ref_logp" in online[1]
    for step in (1, 2):  # same seed, same pairs, same reference: the same losses
        assert online[step]["loss/loss"] == pytest.approx(pre[step]["loss/loss"], abs=1e-5)
    assert pre[2]["eval/loss"] == pytest.approx(online[2]["eval/loss"], abs=1e-5)
    ckpt = runs["precompute"] / "checkpoints" / "model" / "step2"
    _reloads(ckpt)
    assert _changed(ckpt, tiny_model_dir)
