"""Tier 2: Core async PPO end to end (``areal core async-ppo``'s script under the real local
launcher: a real generation server, a local Ray instance with 2 model workers, 2 rollout workers
and the generation manager, the tiny model).

- Versions go up by one every step; every consumed sample's lag (trained version minus the
  oldest version of its tokens) is <= ``rollout.max_staleness`` (the script checks each sample
  and stops otherwise; the tests read the logged histogram) for bounds 0 (on-policy), 1 (the
  rollout-worker fault run) and 2 (the model-worker fault runs); no prompt is trained twice in
  an epoch; per-MFC, manager and per-worker stats are logged.
- Faults: a SIGKILLed rollout worker is restarted by Ray, its slots reclaimed and its work redone,
  and the run completes (counted in stats and ``areal core status``); a SIGKILLed model worker
  stops the attempt, the launcher relaunches it, and the resumed run trains the same sample
  sequence as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_sync_ppo's helpers

from test_sync_ppo import ENV, HERE, RUN_TIMEOUT, YAML, Runs, runs  # noqa: E402,F401  (runs: the fixture)

from launch_harness import REPO, effective_ids, start_launch, train_steps  # noqa: E402  (on the path now)

pytestmark = pytest.mark.slow

SCRIPT = REPO / "areal" / "core" / "async_ppo.py"
ASYNC = [  # 2 prompts x 4 samples x 4 tokens a step, a reward that varies
    "actor.dynamic_sampling=false", "train_dataset.batch_size=2", "gconfig.n_samples=4",
    "gconfig.max_new_tokens=4", "eval_gconfig.max_new_tokens=4", "rollout.max_concurrent_rollouts=4",
    "valid_dataset=null", "reward_fn=sync_rewards:length_reward", "reward.timeout=300",
    "core.backend=ray", "core.n_workers=2", "core.n_rollout_workers=2", "actor.optimizer.lr=1e-2",
]  # fmt: skip
assert HERE  # sync_rewards lives beside test_sync_ppo


def trained(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_samples-rank0.jsonl").read_text().splitlines()]


def check_lags(run_dir: Path, staleness: int, n_steps: int) -> dict[int, dict]:
    """Every step: one weight update, every sample's lag checked and within the bound."""
    steps = train_steps(run_dir)
    assert sorted(steps) == list(range(1, n_steps + 1))
    for step, s in steps.items():
        assert s["manager/version"] == step  # one weight update per step
        assert s["core/lag/max"] <= staleness
        assert sum(v for k, v in s.items() if k.startswith("core/lag/hist/")) == 8  # every sample checked
        assert s["mfc/actor_train/n_tokens"] > 0
    assert any(s["loss/grad_norm"] > 0 for s in steps.values())
    if staleness:
        assert any(s["core/lag/max"] > 0 for s in steps.values()), "no rollout overlapped training"
    return steps


def test_core_async_ppo_on_policy(runs, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = runs.run("async0", SCRIPT, [f"actor.path={tiny_model_dir}", *ASYNC, "total_train_steps=4",
                                      "rollout.max_staleness=0"])
    steps = check_lags(run, 0, 4)
    assert all(s["rollout_worker/0/episodes"] + s["rollout_worker/1/episodes"] >= 2 * n for n, s in steps.items())
    ids = [i for r in trained(run) for i in r["ids"]]
    assert len(ids) == 8 and len(set(ids)) == 8  # 4 steps x 2 prompts, each once


def status(run_dir: Path) -> dict | None:
    path = run_dir / "core_status.json"
    return json.loads(path.read_text()) if path.is_file() else None


def start(runs: Runs, name: str, overrides: list[str]):
    launch = start_launch(SCRIPT, YAML, [f"experiment_name={name}", "trial_name=t", *overrides], runs.root, env=ENV)
    runs.launches.append(launch)
    return launch, runs.root / name / "t"


def finish(launch, run_dir: Path) -> None:
    code = launch.wait(RUN_TIMEOUT)
    log = run_dir / "logs" / "trainer.log"
    assert code == 0, f"exit {code}:\n{launch.output()}\n{log.read_text(errors='replace')[-3000:]}"
    launch.assert_no_survivors()


def wait_for_step(launch, run_dir: Path, step: int) -> dict:
    launch.wait(RUN_TIMEOUT, until=lambda: (status(run_dir) or {}).get("step", 0) >= step)
    assert launch.proc.poll() is None, f"the run ended before step {step}:\n{launch.output()}"
    return status(run_dir)


def test_a_killed_rollout_worker_is_restarted_and_the_run_goes_on(runs, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    launch, run_dir = start(runs, "rwkill", [f"actor.path={tiny_model_dir}", *ASYNC, "total_train_steps=10",
                                             "rollout.max_staleness=1"])
    victim = wait_for_step(launch, run_dir, 2)["workers"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    finish(launch, run_dir)
    steps = check_lags(run_dir, 1, 10)
    assert steps[10]["rollout_worker/1/restarts"] == 1 and steps[10]["rollout_worker/0/restarts"] == 0
    assert status(run_dir)["workers"][1]["pid"] != victim
    ids = [i for r in effective_ids(run_dir).values() for i in r]
    assert len(ids) == 20 and len(set(ids)) == 20  # redone work is trained once
    out = subprocess.run([sys.executable, "-m", "areal.cli", "core", "status", str(run_dir)],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    row = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["1"]][0]
    assert row[-1] == "1" and "step 10/10" in out.stdout  # worker 1 restarted once


def test_a_killed_model_worker_resumes_with_the_uninterrupted_sample_sequence(runs, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    common = [f"actor.path={tiny_model_dir}", *ASYNC, "total_train_steps=6", "rollout.max_staleness=2",
              "recover.mode=auto", "recover.freq_steps=1", "recover.retries=2"]
    plain = runs.run("plain", SCRIPT, common)
    check_lags(plain, 2, 6)
    launch, run_dir = start(runs, "mwkill", common)
    victim = wait_for_step(launch, run_dir, 3)["model_worker_pids"][1]
    os.kill(victim, signal.SIGKILL)
    finish(launch, run_dir)
    attempts = {json.loads(line)["attempt"] for line in (run_dir / "trained_samples-rank0.jsonl").open()}
    assert attempts == {0, 1}, "the kill did not cost an attempt"
    assert effective_ids(run_dir) == effective_ids(plain)
    check_lags(run_dir, 2, 6)
