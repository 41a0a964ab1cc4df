"""The agent example end to end (tier 2): examples/agent_arithmetic.yaml through ``areal launch
local`` and the GRPO entry script with ``workflow.type=agent``, on the random tiny model: the
openai-client agent's episodes train, eval runs the agent, and the agent counters are logged."""

from __future__ import annotations

import pytest

from conftest import GRPO_SCRIPT, REPO
from launch_harness import assert_finite, train_steps

pytestmark = pytest.mark.slow
AGENT_YAML = REPO / "examples" / "agent_arithmetic.yaml"


def test_agent_example_trains_through_the_grpo_script(launcher, tiny_model_dir):
    run_dir = launcher.run("agent", GRPO_SCRIPT, AGENT_YAML, [
        f"actor.path={tiny_model_dir}", "total_train_steps=2", "train_dataset.batch_size=2",
        "gconfig.n_samples=2", "gconfig.max_new_tokens=8", "eval_gconfig.max_new_tokens=8",
        "rollout.max_concurrent_rollouts=4", "valid_dataset.arithmetic.n_test=4", "valid_dataset.batch_size=4",
        "evaluator.freq_steps=null",
    ])  # fmt: skip
    stats = train_steps(run_dir)
    assert sorted(stats) == [0, 1, 2], sorted(stats)
    assert stats[0]["eval/accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # the agent's own reward
    for step in (1, 2):
        assert_finite(stats[step], ["reward/mean", "agent/episodes", "agent/episodes_failed", "loss/pg_loss"])
        assert stats[step]["agent/calls_per_episode"] >= 1.0
    assert stats[2]["agent/episodes"] >= 8  # two steps of 2 groups x 2 episodes
