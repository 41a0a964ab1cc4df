"""Tier 2: on-policy distillation end to end on the tiny model. The example config through
``areal launch local``: the launcher starts the student's server and the teacher's, the teacher
scores every training group, and the update's advantages carry its reverse KL; and Core's sync
PPO with the teacher as a node on the model worker (with the other sequences' baseline)."""

from __future__ import annotations

import pytest
from conftest import GRPO_SCRIPT, REPO, SMALL_RL

from launch_harness import assert_finite, train_steps

pytestmark = pytest.mark.slow
DISTILL_YAML = REPO / "examples" / "arithmetic_distill.yaml"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """Another tiny model of the same tokenizer (seed 1): it disagrees with the student."""
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("teacher"), size="tiny", seed=1))


def test_the_distillation_example_trains_on_the_teachers_reverse_kl(
    launcher, tiny_model_dir, teacher_dir
):
    run_dir = launcher.run("distill", GRPO_SCRIPT, DISTILL_YAML, [
        f"actor.path={tiny_model_dir}", f"distill.teacher_path={teacher_dir}", *SMALL_RL,
        "total_train_steps=2", "valid_dataset=null",
    ])  # fmt: skip
    stats = train_steps(run_dir)
    assert sorted(stats) == [1, 2]
    for step in (1, 2):
        assert_finite(stats[step], ["loss/distill_reverse_kl", "loss/pg_loss", "loss/grad_norm"])
        assert stats[step]["loss/distill_reverse_kl"] != 0.0  # two different random models
    assert (run_dir / "logs" / "teacher0.log").is_file()


def test_core_sync_ppo_distils_with_a_teacher_node(launcher, tiny_model_dir, teacher_dir):
    run_dir = launcher.run(
        "core-distill",
        REPO / "areal" / "core" / "sync_ppo.py",
        DISTILL_YAML,
        [
            f"actor.path={tiny_model_dir}",
            f"distill.teacher_path={teacher_dir}",
            "distill.n_servers=0",
            "distill.baseline=others",  # the Lite test above runs the raw log ratio
            *SMALL_RL,
            "total_train_steps=2",
            "valid_dataset=null",
            "rollout.max_staleness=0",
        ],
    )
    stats = train_steps(run_dir)
    assert sorted(stats) == [1, 2]
    for step in (1, 2):
        assert_finite(stats[step], ["loss/distill_reverse_kl", "mfc/teacher_logp/wall_time"])
