"""Tier 2: short runs of every entry script through ``areal launch local`` on CPU.

Each run must exit 0, log the expected steps with finite key metrics, and leave an HF
checkpoint that transformers loads and runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import GRPO_SCRIPT, GRPO_YAML, REPO, SMALL_RL

from launch_harness import assert_finite, effective_ids, train_steps

pytestmark = pytest.mark.slow
PPO_YAML = REPO / "examples" / "arithmetic_ppo.yaml"
RL_LOSSES = ["loss/pg_loss", "loss/loss", "loss/entropy", "loss/grad_norm", "loss/approx_kl"]


def _reloads(ckpt: Path, head: str = "lm") -> None:
    """The HF dir loads with transformers and gives finite outputs on a short prompt."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    auto = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
    model = auto.from_pretrained(ckpt)
    ids = AutoTokenizer.from_pretrained(ckpt)("1+2=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids).logits
    assert torch.isfinite(out).all()
    if head != "lm":
        assert out.shape[-1] == 1  # one score per token: the value head survived the export


def _changed(ckpt: Path, start: str) -> bool:
    """Whether any weight differs from the starting model's."""
    from safetensors.torch import load_file

    new, old = load_file(ckpt / "model.safetensors"), load_file(Path(start) / "model.safetensors")
    return any(not torch.equal(new[k], old[k]) for k in old if k in new)


def _check_rl_run(
    run_dir: Path, n_steps: int, max_staleness: int, extra: list[str]
) -> dict[int, dict]:
    stats = train_steps(run_dir)
    assert sorted(stats) == [0, *range(1, n_steps + 1)], sorted(stats)
    for step in (0, n_steps):
        assert_finite(stats[step], ["eval/accuracy"])
    for step in range(1, n_steps + 1):
        assert_finite(stats[step], ["reward/mean", "staleness/max", *RL_LOSSES, *extra])
        assert stats[step]["staleness/max"] <= max_staleness
    ids = effective_ids(run_dir)
    assert sorted(ids) == list(range(1, n_steps + 1))
    assert all(len(v) == 2 for v in ids.values())  # train_dataset.batch_size groups per step
    _reloads(run_dir / "checkpoints" / "actor" / f"step{n_steps}")
    return stats


def test_sync_grpo_runs_end_to_end(launcher, tiny_model_dir):
    run_dir = launcher.run("grpo", GRPO_SCRIPT, GRPO_YAML, [
        f"actor.path={tiny_model_dir}", *SMALL_RL, "total_train_steps=2", "rollout.max_staleness=0",
        "evaluator.freq_steps=null",
    ])  # fmt: skip
    stats = _check_rl_run(run_dir, 2, 0, [])
    # Synchronous: every token comes from the weights being trained.
    assert all(stats[s]["staleness/max"] == 0 for s in (1, 2))


def test_async_grpo_runs_end_to_end_ahead_of_training_within_the_bound(async_grpo_reference):
    # The resume tests' reference run (6 steps, max_staleness=1, no evaluation).
    stats = train_steps(async_grpo_reference)
    assert sorted(stats) == list(range(1, 7)), sorted(stats)
    for step in range(1, 7):
        assert_finite(stats[step], ["reward/mean", "staleness/max", *RL_LOSSES])
        assert stats[step]["staleness/max"] <= 1
    assert any(stats[s]["staleness/max"] == 1 for s in stats)  # rollouts really ran ahead
    ids = effective_ids(async_grpo_reference)
    assert sorted(ids) == list(range(1, 7)) and all(len(v) == 2 for v in ids.values())
    _reloads(async_grpo_reference / "checkpoints" / "actor" / "step6")


def test_ppo_with_critic_runs_end_to_end(launcher, tiny_model_dir):
    paths = [f"{k}.path={tiny_model_dir}" for k in ("actor", "critic", "ref")]
    run_dir = launcher.run("ppo", GRPO_SCRIPT, PPO_YAML, [
        *paths, *SMALL_RL, "total_train_steps=2", "evaluator.freq_steps=null",
    ])  # fmt: skip
    _check_rl_run(run_dir, 2, 1, ["loss/critic/loss"])
    # GAE over a KL-penalised reward gives non-zero advantages even when every answer is wrong.
    assert _changed(run_dir / "checkpoints" / "actor" / "step2", tiny_model_dir)


def test_sft_runs_end_to_end(launcher, tiny_model_dir):
    run_dir = launcher.run(
        "sft",
        REPO / "examples" / "sft.py",
        REPO / "examples" / "sft_arithmetic.yaml",
        [
            f"model.path={tiny_model_dir}",
            "total_train_steps=2",
            "train_dataset.batch_size=8",
            "evaluator.freq_steps=null",
        ],
    )
    stats = train_steps(run_dir)
    assert sorted(stats) == [1, 2], sorted(stats)
    for step in (1, 2):
        assert_finite(stats[step], ["loss/loss"])
    assert_finite(stats[2], ["eval/loss"])
    assert stats[2]["loss/loss"] < stats[1]["loss/loss"]  # lr 1e-3 on a tiny model: it learns
    ckpt = run_dir / "checkpoints" / "model" / "step2"
    _reloads(ckpt)
    assert _changed(ckpt, tiny_model_dir)


def test_reward_model_runs_end_to_end(launcher, tiny_model_dir):
    run_dir = launcher.run("rm", REPO / "examples" / "rm.py", REPO / "examples" / "rm.yaml", [
        f"model.path={tiny_model_dir}", "total_train_steps=2", "train_dataset.batch_size=8",
        "evaluator.freq_steps=null",
    ])  # fmt: skip
    stats = train_steps(run_dir)
    assert sorted(stats) == [1, 2], sorted(stats)
    for step in (1, 2):
        assert_finite(stats[step], ["loss/loss", "loss/pair_acc"])
    assert_finite(stats[2], ["eval/loss", "eval/pair_acc"])
    _reloads(run_dir / "checkpoints" / "reward_model" / "step2", head="value")
