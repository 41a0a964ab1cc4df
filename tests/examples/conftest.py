"""Fixtures for end-to-end runs through ``areal launch local``: a launcher factory that kills
everything it started at teardown, and the reference async GRPO run the resume tests compare to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launcher"))  # launch_harness

from launch_harness import REPO, Launch, start_launch  # noqa: E402

RUN_TIMEOUT = 180.0  # seconds; each run takes ~10-30 s on a quiet 2-core machine
CORE_RUN_TIMEOUT = 300.0  # seconds; a Core run starts Ray and its actors first (~20-60 s)
GRPO_SCRIPT = REPO / "examples" / "gsm8k_grpo.py"
GRPO_YAML = REPO / "examples" / "arithmetic_grpo.yaml"
# A few-second RL step on CPU: 2 prompts x 4 samples x 4 new tokens.
SMALL_RL = [  # the random tiny model always scores 0: no dynamic sampling (it would reject all)
    "actor.dynamic_sampling=false", "train_dataset.batch_size=2", "gconfig.n_samples=4",
    "gconfig.max_new_tokens=4", "eval_gconfig.max_new_tokens=4",
    "rollout.max_concurrent_rollouts=4",
    "valid_dataset.size=8",  # the held-out evaluations at step 0 and the end: 8 problems
]  # fmt: skip
# The random tiny model scores 0 on arithmetic: zero advantages, weights that never move. A reward
# that varies within a group gives an update something to train: tests/core/sync_rewards.py, on
# the run's PYTHONPATH (REWARDS_ENV) or copied beside a scratch-dir run.
SYNC_REWARDS = REPO / "tests" / "core" / "sync_rewards.py"
REWARDS_ENV = {"PYTHONPATH": str(SYNC_REWARDS.parent)}


def replay(
    run_dir: Path, env: dict[str, str], *knobs: str, to: int | None = None
) -> subprocess.CompletedProcess:
    """``areal replay --trust-run-dir [--to STEP] RUN_DIR [KEY=VALUE ...]`` (the run's own
    recorded script: the test recorded it) with ``env`` over the test's own."""
    args = ["--trust-run-dir", *(["--to", str(to)] if to is not None else []), str(run_dir)]
    return subprocess.run(
        [sys.executable, "-m", "areal.cli", "replay", *args, *knobs],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, **env},
    )


# The resume tests' run: async GRPO, a recover checkpoint every step, relaunch on failure.
RESUMABLE = [
    *SMALL_RL,
    "total_train_steps=6",
    "rollout.max_staleness=1",
    "valid_dataset=null",
    "recover.mode=auto",
    "recover.freq_steps=1",
    "recover.retries=2",
    "seed=7",
]


class Launcher:
    """Starts runs under one root; :meth:`cleanup` kills every process any of them left."""

    def __init__(self, root: Path, model_dir: str):
        self.root = root
        self.model_dir = model_dir
        self.runs: list[Launch] = []

    def start(
        self,
        name: str,
        script: Path,
        config: Path,
        overrides: list[str],
        env: dict[str, str] | None = None,
    ) -> tuple[Launch, Path]:
        """Run ``script`` with ``config`` as experiment ``name`` (trial t); returns RUN_DIR too."""
        fileroot = self.root / name
        run = start_launch(
            script, config, [f"experiment_name={name}", "trial_name=t", *overrides], fileroot, env
        )
        self.runs.append(run)
        return run, fileroot / name / "t"

    def run(
        self,
        name: str,
        script: Path,
        config: Path,
        overrides: list[str],
        env: dict[str, str] | None = None,
        timeout: float = RUN_TIMEOUT,
    ) -> Path:
        """Run to the end; assert exit 0 and that no process of the run is left."""
        run, run_dir = self.start(name, script, config, overrides, env)
        code = run.wait(timeout)
        assert code == 0, f"{name} exited with {code}:\n{run.output()}\n{_trainer_tail(run_dir)}"
        run.assert_no_survivors()
        return run_dir

    def cleanup(self) -> None:
        for run in self.runs:
            run.cleanup()


def _trainer_tail(run_dir: Path, n: int = 40) -> str:
    log = run_dir / "logs" / "trainer.log"
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


# A Core async PPO run of 2 steps on one model worker (Ray started by the master), recorded for
# areal replay: test_core_record replays it, test_viewer shows its MFC timeline beside the Lite run.
CORE_ASYNC_SCRIPT = REPO / "areal" / "core" / "async_ppo.py"
CORE_RECORDED = [  # 2 prompts x 4 samples x 4 tokens a step, a reward that varies
    *SMALL_RL, "valid_dataset=null", "reward_fn=sync_rewards:content_reward", "reward.timeout=300",
    "core.backend=ray", "core.n_workers=1", "core.n_rollout_workers=2", "actor.optimizer.lr=1e-2",
    "total_train_steps=2", "rollout.max_staleness=1", "seed=3",
    "stats_logger.replay.enabled=true", "stats_logger.replay.keep_weights=true",
]  # fmt: skip
CORE_ENV = {**REWARDS_ENV, "RAY_ADDRESS": ""}  # no RAY_ADDRESS: a local Ray instance


@pytest.fixture(scope="session")
def core_async_recorded(tmp_path_factory, tiny_model_dir) -> Path:
    """RUN_DIR of the recorded Core async PPO run above (shared by several tests)."""
    made = Launcher(tmp_path_factory.mktemp("core"), tiny_model_dir)
    try:
        yield made.run(
            "core", CORE_ASYNC_SCRIPT, GRPO_YAML, [f"actor.path={tiny_model_dir}", *CORE_RECORDED],
            CORE_ENV, timeout=CORE_RUN_TIMEOUT,
        )  # fmt: skip
    finally:
        made.cleanup()


@pytest.fixture
def launcher(tmp_path, tiny_model_dir):
    made = Launcher(tmp_path, tiny_model_dir)
    yield made
    made.cleanup()


@pytest.fixture(scope="session")
def async_grpo_reference(tmp_path_factory, tiny_model_dir) -> Path:
    """RUN_DIR of an uninterrupted resumable async GRPO run (shared by several tests)."""
    made = Launcher(tmp_path_factory.mktemp("reference"), tiny_model_dir)
    try:
        yield made.run("ref", GRPO_SCRIPT, GRPO_YAML, [f"actor.path={tiny_model_dir}", *RESUMABLE])
    finally:
        made.cleanup()
