"""Tier 2: the trainer's server-loss policy end to end. In the quickstart GRPO shape (one
server), ``kill -9`` of the server: the launcher restarts it and the trainer waits for it
(``rollout.server_restart_timeout``) instead of stopping with ``AllServersDeadError``."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import GRPO_SCRIPT, GRPO_YAML, RUN_TIMEOUT, SMALL_RL

from launch_harness import marked_processes, server_ports, train_steps

pytestmark = pytest.mark.slow


def test_a_one_server_run_whose_server_is_killed_mid_run_finishes(launcher, tiny_model_dir):
    run, run_dir = launcher.start("server_loss", GRPO_SCRIPT, GRPO_YAML, [
        f"actor.path={tiny_model_dir}", *SMALL_RL, "total_train_steps=4", "rollout.max_staleness=0",
        "evaluator.freq_steps=null", "cluster.n_servers=1", "rollout.server_restart_timeout=120",
    ])  # fmt: skip
    assert run.wait(RUN_TIMEOUT, until=lambda: 1 in train_steps(run_dir)) is None, run.output()
    [port] = set(server_ports(run_dir))
    [server] = [pid for pid, cmd in marked_processes(f"--port {port}").items() if " serve " in cmd]
    os.kill(server, signal.SIGKILL)
    code = run.wait(RUN_TIMEOUT)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    assert code == 0, (
        f"{run.output()}\n{trainer_log[-3000:]}"
    )  # was: AllServersDeadError 3 s after the kill
    assert sorted(train_steps(run_dir))[-4:] == [1, 2, 3, 4]
    assert (
        "server0 exited with code -9; restarting it on port"
        in (run_dir / "logs" / "launcher.log").read_text()
    )
    run.assert_no_survivors()
