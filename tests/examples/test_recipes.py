"""The reward and workflow recipes of docs/recipes.md run verbatim from a scratch directory outside
the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, RUN_TIMEOUT, SMALL_RL, SYNC_REWARDS

from launch_harness import read_jsonl

pytestmark = pytest.mark.slow


RECIPES = REPO / "docs" / "recipes.md"


def _recipe_block(lang: str, first_line: str) -> str:
    """The ``lang`` code block of docs/recipes.md that starts with ``first_line``."""
    for block in re.findall(rf"```{lang}\n(.*?)```", RECIPES.read_text(), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"docs/recipes.md has no ```{lang} block starting with {first_line!r}")


def test_reward_recipe_runs_verbatim_from_a_scratch_dir(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    (home / "my_task").mkdir(parents=True)
    log = tmp_path / "reward_calls.txt"
    (home / "my_task" / "my_rewards.py").write_text(
        _recipe_block("python", "# my_rewards.py")
        + f"""

import os as _os
_recipe_reward = last_line_reward


def last_line_reward(completion, reference, prompt):  # the test's wrapper: records each call
    with open({str(log)!r}, "a") as f:
        f.write(repr(prompt[-30:]) + "\\n")
    return _recipe_reward(completion, reference, prompt)
"""
    )
    export, cp, launch = _recipe_block("bash", "export SFT_MODEL=").strip().splitlines()
    assert export.endswith(
        "/runs/quickstart/sft/run/checkpoints/model/step300"
    )  # what `make demo` writes
    subprocess.run(
        cp, shell=True, cwd=REPO, env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True
    )
    # the recipe's launch line, verbatim, plus a tiny model and a two-step budget
    areal = (
        str(REPO / ".venv" / "bin" / "areal")
        if (REPO / ".venv" / "bin" / "areal").exists()
        else "areal"
    )
    cmd = launch.replace("areal launch", f"{areal} launch", 1).replace("$SFT_MODEL", tiny_model_dir)
    extra = [
        f"actor.path={tiny_model_dir}",
        f"fileroot={tmp_path / 'runs'}",
        "experiment_name=e",
        "trial_name=t",
        *SMALL_RL,
        "total_train_steps=2",
        "launcher.echo=false",
        "launcher.server_threads=1",
        "eval_gconfig.max_new_tokens=1",
        "valid_dataset.size=4",
    ]
    out = subprocess.run(
        f"{cmd} {' '.join(extra)}",
        shell=True,
        cwd=home / "my_task",
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env={**os.environ, "HOME": str(home)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stats = {r["step"]: r for r in read_jsonl(tmp_path / "runs" / "e" / "t" / "stats.jsonl")}
    assert {1, 2} <= set(stats), sorted(stats)
    assert sum(stats[s]["reward/n_calls"] for s in (1, 2)) > 0, stats  # rollouts may run ahead
    assert all(stats[s]["reward/n_failed"] == 0 for s in (1, 2)), stats
    calls = log.read_text().splitlines()  # our function ran, with the prompt's text
    assert len(calls) >= 16 and all(c not in ("''", '""') for c in calls), calls[:5]


def test_a_reward_fn_that_does_not_import_fails_before_anything_starts(tmp_path, tiny_model_dir):
    shutil.copy(REPO / "examples" / "gsm8k_grpo.py", tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "launch",
            "local",
            str(tmp_path / "gsm8k_grpo.py"),
            f"actor.path={tiny_model_dir}",
            "actor.use_critic=false",
            "cluster.n_servers=1",
            f"fileroot={tmp_path / 'runs'}",
            "reward_fn=my_rewardz:last_line_reward",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "reward_fn: cannot import 'my_rewardz'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()  # nothing was written or started


def test_workflow_recipe_runs_verbatim_from_a_scratch_dir(tmp_path, tiny_model_dir):
    task = tmp_path / "my_task"
    task.mkdir()
    (task / "my_workflows.py").write_text(_recipe_block("python", "# my_workflows.py"))
    # The recipe's workflow rejects groups with equal rewards: a varying reward lets it train.
    shutil.copy(SYNC_REWARDS, task)
    for name in ("gsm8k_grpo.py", "arithmetic_grpo.yaml"):
        shutil.copy(REPO / "examples" / name, task)
    launch = _recipe_block(
        "bash", "areal launch local gsm8k_grpo.py --config arithmetic_grpo.yaml workflow"
    )
    areal = (
        str(REPO / ".venv" / "bin" / "areal")
        if (REPO / ".venv" / "bin" / "areal").exists()
        else "areal"
    )
    extra = [
        f"actor.path={tiny_model_dir}",
        f"fileroot={tmp_path / 'runs'}",
        "experiment_name=e",
        "trial_name=t",
        *SMALL_RL,
        "gconfig.max_new_tokens=6",
        "total_train_steps=2",
        "launcher.echo=false",
        "launcher.server_threads=1",
        "valid_dataset=null",
        "reward_fn=sync_rewards:content_reward",
    ]
    launch = (
        launch.strip()
        .replace("areal launch", f"{areal} launch", 1)
        .replace("$SFT_MODEL", tiny_model_dir)
    )
    cmd = f"{launch} {' '.join(extra)}"
    out = subprocess.run(
        cmd, shell=True, cwd=task, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stats = {r["step"]: r for r in read_jsonl(tmp_path / "runs" / "e" / "t" / "stats.jsonl")}
    assert {1, 2} <= set(stats), sorted(stats)
    assert all(0 < stats[s]["reward/mean"] < 1 for s in (1, 2))  # only groups with a signal trained
