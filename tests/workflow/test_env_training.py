"""The environment workflows train through ``areal launch local`` (tier 2, the random tiny model):
the GRPO launches of docs/environments.md's recipes, as written there plus a short budget and the
tiny model: reasoning-gym (here two tasks mixed), OpenEnv (examples/openenv_guess.py,
multi-turn) and verifiers (examples/verifiers_tasks.py: a single-turn taskset and a tool-using
one) each run 3 GRPO steps, and the trained samples that ``areal view`` reads carry each token's
weight version and each episode's reward."""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="the envs extra: pip install -e '.[envs]'")
pytest.importorskip("openenv", reason="the envs extra: pip install -e '.[envs]'")
pytest.importorskip("verifiers", reason="the envs extra: pip install -e '.[envs]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launcher"))  # launch_harness

from areal.utils.samples import SampleIndex  # noqa: E402
from launch_harness import REPO, assert_finite, start_launch, train_steps  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples"
# 3 steps of 2 items x 2 episodes, short answers; the random model rarely scores: no dynamic
# sampling (it would reject every all-zero group), no periodic eval (the run's first and last are
# enough), 4 held-out items.
SHORT = [
    "total_train_steps=3", "train_dataset.batch_size=2", "gconfig.n_samples=2",
    "rollout.max_concurrent_rollouts=4", "actor.dynamic_sampling=false",
    "evaluator.freq_steps=null", "valid_dataset.size=4", "valid_dataset.batch_size=4",
    "stats_logger.tensorboard=false",
]  # fmt: skip


def doc_launches() -> list[list[str]]:
    """The GRPO launch lines of docs/environments.md's recipes, as argv after ``areal launch
    local examples/gsm8k_grpo.py`` (``--config YAML`` and the overrides)."""
    text = (REPO / "docs" / "environments.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line)
            if argv[:4] == ["areal", "launch", "local", "examples/gsm8k_grpo.py"]:
                out.append(argv[4:])
    return out


def _train(tmp_path: Path, model: str, name: str, doc_index: int, *extra: str) -> Path:
    """Run the ``doc_index``-th GRPO launch of the docs with the tiny model, SHORT and ``extra``."""
    config, yaml, *doc_overrides = doc_launches()[doc_index]
    assert config == "--config", doc_launches()[doc_index]
    kept = [o for o in doc_overrides if not o.startswith("actor.path=")]  # the tiny model instead
    fileroot = tmp_path / name
    run = start_launch(
        EXAMPLES / "gsm8k_grpo.py",
        REPO / yaml,
        [f"experiment_name={name}", "trial_name=t", f"actor.path={model}", *kept, *SHORT, *extra],
        fileroot,
    )
    try:
        code = run.wait(300)
        assert code == 0, f"{name} exited with {code}:\n{run.output()}"
        run.assert_no_survivors()
    finally:
        run.cleanup()
    return fileroot / name / "t"


def test_the_docs_hold_one_grpo_launch_per_recipe():
    configs = [argv[1] for argv in doc_launches()]
    assert (
        configs
        == [f"examples/{y}_grpo.yaml" for y in ("reasoning_gym", "openenv")]
        + ["examples/verifiers_grpo.yaml"] * 2
    )


def _check_trained(run_dir: Path) -> list[dict]:
    """3 steps logged with finite losses and the env counters; every recorded sample has per-token
    versions of the weights that made it and a finite reward. Returns the samples."""
    stats = train_steps(run_dir)
    assert sorted(stats)[-3:] == [1, 2, 3], sorted(stats)
    for step in (1, 2, 3):
        assert_finite(stats[step], ["reward/mean", "loss/pg_loss", "agent/episodes"])
        assert stats[step]["agent/env_errors"] == 0 and stats[step]["agent/env_timeouts"] == 0
    index = SampleIndex(run_dir)
    rows = index.rows()
    assert {r["step"] for r in rows} == {1, 2, 3}
    samples = [index.sample(r["step"], r["rank"], r["index"]) for r in rows]
    for s in samples:
        sampled = [v for v in s["versions"] if v >= 0]
        assert sampled and max(sampled) <= s["trainer_version"], s["versions"]
        assert len(s["versions"]) == len(s["completion_ids"]) == len(s["behav_logp"])
        assert math.isfinite(s["reward"]) and 0.0 <= s["reward"] <= 1.0
    return samples


def test_reasoning_gym_two_tasks_train_three_grpo_steps(tmp_path, tiny_model_dir):
    mix = "reasoning_gym:chain_sum(max_terms=3),leg_counting"
    run_dir = _train(tmp_path, tiny_model_dir, "rg", 0,
                     f"train_dataset.path={mix}", f"valid_dataset.path={mix}",
                     "gconfig.max_new_tokens=6", "eval_gconfig.max_new_tokens=6")  # fmt: skip
    samples = _check_trained(run_dir)
    assert {s["sample_id"].split("/")[0] for s in samples} == {"chain_sum", "leg_counting"}


def test_openenv_multi_turn_episodes_train_three_grpo_steps(tmp_path, tiny_model_dir):
    run_dir = _train(tmp_path, tiny_model_dir, "oe", 1,
                     "gconfig.max_new_tokens=4", "eval_gconfig.max_new_tokens=4")  # fmt: skip
    samples = _check_trained(run_dir)
    # the random model rarely names the digit: most episodes take all three turns
    assert max(len(s["turn_starts"]) for s in samples) == 3
    assert any(v == -1 for s in samples for v in s["versions"])  # the observations between turns


def test_verifiers_single_turn_taskset_trains_three_grpo_steps(tmp_path, tiny_model_dir):
    run_dir = _train(tmp_path, tiny_model_dir, "vf", 2,
                     "gconfig.max_new_tokens=4", "eval_gconfig.max_new_tokens=4")  # fmt: skip
    samples = _check_trained(run_dir)
    assert {len(s["turn_starts"]) for s in samples} == {1}


def test_verifiers_tool_taskset_trains_three_grpo_steps(tmp_path, tiny_model_dir):
    run_dir = _train(tmp_path, tiny_model_dir, "vf-tools", 3,
                     "gconfig.max_new_tokens=8", "eval_gconfig.max_new_tokens=8")  # fmt: skip
    samples = _check_trained(run_dir)
    assert {s["sample_id"].split("/")[1][:4] for s in samples} == {"calc"}
    # the toolset's method is offered in every prompt (the random model's 8 tokens never make a
    # whole call: the tool round trip is tests/workflow/test_env_workflows.py's)
    assert all("multiply(" in s["prompt_text"] for s in samples)  # the tiny template's tools line
