"""Tier 2: lossless automatic resume through the launcher (recover.mode=auto).

A run whose trainer worker is SIGKILLed mid-training, and one whose only generation server is
SIGKILLed with server restarts off, must be relaunched, resume from the last recover checkpoint,
and train exactly the sample ids of the uninterrupted run, step by step (async GRPO,
max_staleness=1), with no step's ids twice, no token staler than the bound, and the servers back
on the checkpoint's version.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import GRPO_SCRIPT, GRPO_YAML, RESUMABLE, RUN_TIMEOUT, Launcher

from launch_harness import Launch, assert_finite, effective_ids, read_jsonl, train_steps

pytestmark = pytest.mark.slow
N_STEPS = 6
KILL_AFTER_STEP = 2  # stats of step 2 are committed after its recover checkpoint is published


def _victim(run: Launch, which: str) -> int:
    """pid of the live trainer worker (torchrun's child running the script) or of server0."""
    run.snapshot()
    for pid, (_, cmd) in run.seen.items():
        is_worker = str(GRPO_SCRIPT) in cmd and "torch.distributed.run" not in cmd
        is_server = " serve " in cmd and "server0.yaml" in cmd
        if (is_worker if which == "trainer" else is_server) and Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError(f"no live {which} process among {run.seen}")


def _run_killing(launcher: Launcher, model: str, which: str, *extra: str) -> Path:
    run, run_dir = launcher.start(
        f"kill-{which}", GRPO_SCRIPT, GRPO_YAML, [f"actor.path={model}", *RESUMABLE, *extra]
    )
    passed = lambda: KILL_AFTER_STEP in train_steps(run_dir)  # noqa: E731
    assert run.wait(RUN_TIMEOUT, until=passed) is None, (
        f"run ended before step {KILL_AFTER_STEP}:\n{run.output()}"
    )
    os.kill(_victim(run, which), signal.SIGKILL)
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, f"the run did not recover (exit {code}):\n{run.output()}"
    assert "relaunching" in run.output()
    run.assert_no_survivors()
    return run_dir


def _check_same_training(run_dir: Path, reference: Path) -> None:
    records = read_jsonl(run_dir / "trained_samples-rank0.jsonl")
    assert {r["attempt"] for r in records} == {0, 1}, "expected exactly one relaunch"
    resumed_at = min(r["step"] for r in records if r["attempt"] == 1)
    assert KILL_AFTER_STEP < resumed_at <= KILL_AFTER_STEP + 2, resumed_at  # from the checkpoint
    ids = effective_ids(run_dir)
    assert ids == effective_ids(reference), (
        "the resumed run trained other samples than the reference"
    )
    flat = [i for step in sorted(ids) for i in ids[step]]
    assert len(flat) == len(set(flat)), "a sample was trained twice"
    stats = train_steps(run_dir)
    assert sorted(stats) == list(range(1, N_STEPS + 1))
    for step, rec in stats.items():
        assert_finite(rec, ["reward/mean", "loss/loss", "staleness/max"])
        # Tokens of the first resumed steps were generated after the relaunch (or restored from the
        # checkpoint): a server left at version 0 would make them resumed_at - 1 versions stale.
        assert rec["staleness/max"] <= 1, (
            f"step {step} trained tokens {rec['staleness/max']} versions old"
        )
    versions = [
        int(k.rsplit("/", 1)[1])
        for k in stats[resumed_at]
        if k.startswith("staleness/version_share/")
    ]
    assert min(versions) >= resumed_at - 2, (
        f"step {resumed_at} trained tokens of versions {versions}"
    )


def test_trainer_sigkilled_mid_training_resumes_and_trains_the_same_samples(
    launcher, tiny_model_dir, async_grpo_reference
):
    run_dir = _run_killing(launcher, tiny_model_dir, "trainer")
    _check_same_training(run_dir, async_grpo_reference)


def test_server_sigkilled_mid_training_without_restarts_stops_the_trainer_then_resumes_losslessly(
    launcher, tiny_model_dir, async_grpo_reference
):
    # With server restarts the trainer waits for the restarted server (tests/examples/
    # test_server_loss.py); without them it stops naming the server, and the relaunch resumes.
    run_dir = _run_killing(launcher, tiny_model_dir, "server", "launcher.server_restarts=0")
    trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    assert (
        "generation servers are dead (127.0.0.1:" in trainer_log
    )  # a clear error naming the server
    _check_same_training(run_dir, async_grpo_reference)
