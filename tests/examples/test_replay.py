"""Tier 2: ``areal replay`` on a real 2-step async GRPO run (``rollout.max_staleness=1``) recorded
with ``stats_logger.replay.enabled``: the replay's weights equal the run's bit for bit at every
step; a replay with another learning rate reports step 1 as the first differing step (and exits
0: a changed knob is information); a tampered record is a mismatch (exit 1) naming the step."""

from __future__ import annotations

import json

import pytest
from conftest import GRPO_SCRIPT, GRPO_YAML, REWARDS_ENV, SMALL_RL, replay

pytestmark = pytest.mark.slow
RECORDED = [
    *SMALL_RL,
    "total_train_steps=2",
    "rollout.max_staleness=1",
    "valid_dataset=null",
    "stats_logger.replay.enabled=true",
    "stats_logger.replay.keep_weights=true",
    "seed=3",
    "reward_fn=sync_rewards:content_reward",
]


def test_replay_matches_every_step_and_a_changed_lr_diverges_at_step_1(launcher, tiny_model_dir):
    env = REWARDS_ENV
    run_dir = launcher.run(
        "rec", GRPO_SCRIPT, GRPO_YAML, [f"actor.path={tiny_model_dir}", *RECORDED], env
    )
    root = run_dir / "replay"
    assert sorted(p.name for p in root.glob("step-*.pt")) == [
        "step-000001-rank0.pt",
        "step-000002-rank0.pt",
    ]
    hashes = [
        json.loads(line)["tensors"] for line in (root / "hashes.jsonl").read_text().splitlines()
    ]
    assert [h == hashes[0] for h in hashes] == [True, False, False]  # every step moved the weights

    same = replay(run_dir, env)
    assert same.returncode == 0, same.stdout + same.stderr
    for step in (0, 1, 2):
        assert f"step {step}: weights bit-identical" in same.stdout
    assert "matches the record bit for bit at every step (0..2)" in same.stdout

    other_lr = replay(run_dir, env, "actor.optimizer.lr=0.05", to=1)
    assert other_lr.returncode == 0, other_lr.stdout + other_lr.stderr
    assert "first differ at step 1" in other_lr.stdout
    assert "step 1: " in other_lr.stdout and "max |diff| " in other_lr.stdout
    assert "step 2" not in other_lr.stdout  # --to 1

    lines = (root / "hashes.jsonl").read_text().splitlines()
    rec = json.loads(lines[2])  # step 2
    name = next(iter(rec["tensors"]))
    rec["tensors"][name] = "0" * 32
    lines[2] = json.dumps(rec)
    (root / "hashes.jsonl").write_text("\n".join(lines) + "\n")
    tampered = replay(run_dir, env)
    assert tampered.returncode == 1, tampered.stdout + tampered.stderr
    assert (
        f"MISMATCH: the replay first differs from the record at step 2, tensor {name!r}"
        in tampered.stdout
    )
