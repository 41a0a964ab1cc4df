"""Tier 2: ``areal launch ray`` on a real local Ray cluster (``ray start --head`` started by the
test, 6 CPUs): a short async GRPO run with 1 server + 2 trainer ranks, a killed server that is
restarted, a placement that cannot fit, a SIGKILLed launcher that leaves nothing behind, and the
launch plan's other roles (the agent proxy, distillation teacher servers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch_harness import REPO, assert_finite, read_jsonl, start_launch, train_steps

pytestmark = pytest.mark.slow
GRPO = [REPO / "examples" / "gsm8k_grpo.py", REPO / "examples" / "arithmetic_grpo.yaml"]
DISTILL = [REPO / "examples" / "gsm8k_grpo.py", REPO / "examples" / "arithmetic_distill.yaml"]
SMALL_RL = [
    "actor.dynamic_sampling=false",
    "train_dataset.batch_size=2",
    "gconfig.n_samples=4",
    "gconfig.max_new_tokens=4",
    "eval_gconfig.max_new_tokens=4",
    "rollout.max_concurrent_rollouts=4",
    "launcher.server_threads=1",
    "launcher.trainer_threads=1",
    "launcher.stop_timeout=5",
    "valid_dataset.size=8",  # the held-out evaluations at step 0 and the end: 8 problems
]
RUN_TIMEOUT = 240.0


@pytest.fixture
def ray_launch(ray_head, tmp_path, tiny_model_dir):
    """``ray_launch(script, config, *overrides, env=None)`` -> (Launch, RUN_DIR); killed at
    teardown."""
    made = []

    def start(script, config, *overrides, env=None):
        common = [
            f"actor.path={tiny_model_dir}",
            "actor.use_critic=false",
            "experiment_name=e",
            "trial_name=t",
            f"launcher.ray.address={ray_head.address}",
            "launcher.echo=false",
        ]
        run = start_launch(
            script, config, [*common, *overrides], tmp_path / "root", env, mode="ray"
        )
        made.append(run)
        return run, tmp_path / "root" / "e" / "t"

    yield start
    for run in made:
        run.cleanup()


def test_async_grpo_through_ray_passes_the_local_launchers_end_to_end_checks(ray_launch):
    run, run_dir = ray_launch(
        *GRPO,
        *SMALL_RL,
        "cluster.n_servers=1",
        "cluster.trainer_nprocs=2",
        "total_train_steps=3",
        "rollout.max_staleness=1",
        "evaluator.freq_steps=null",
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    stats = train_steps(run_dir)
    assert sorted(stats) == [0, 1, 2, 3], sorted(stats)  # step 0: the evaluation before training
    for step in (1, 2, 3):
        assert_finite(
            stats[step], ["reward/mean", "loss/pg_loss", "loss/grad_norm", "staleness/max"]
        )
        assert stats[step]["staleness/max"] <= 1
    # Two ranks trained: each took one of the step's 2 groups, none twice.
    per_rank = [
        {r["step"]: r["ids"] for r in read_jsonl(run_dir / f"trained_samples-rank{k}.jsonl")}
        for k in (0, 1)
    ]
    assert all(
        sorted(ids) == [1, 2, 3] and all(len(v) == 1 for v in ids.values()) for ids in per_rank
    )
    assert all(per_rank[0][s] != per_rank[1][s] for s in (1, 2, 3)), per_rank
    logs = {p.name for p in (run_dir / "logs").glob("*.log")}
    assert logs >= {
        "server0.log",
        "server0-task.log",
        "trainer0.log",
        "trainer1.log",
        "launcher.log",
    }, logs
    assert (run_dir / "config.yaml").is_file() and (
        run_dir / "checkpoints" / "actor" / "step3"
    ).is_dir()
    out = subprocess.run(
        [sys.executable, "-m", "areal.cli", "plot", str(run_dir)], capture_output=True, text=True
    )
    assert out.returncode == 0 and (run_dir / "plot.png").is_file(), out.stderr
    run.assert_no_survivors()


def test_a_killed_server_is_restarted_and_the_run_goes_on(ray_launch):
    run, run_dir = ray_launch(
        Path(__file__).parent / "restart_entry.py",
        None,
        "cluster.n_servers=1",
        "launcher.server_threads=1",
        "launcher.stop_timeout=5",
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    log = (run_dir / "logs" / "server0-task.log").read_text(errors="replace")
    assert "restarting it on port" in log and "with weights version 3 (1 of 2)" in log, log[-2000:]
    run.assert_no_survivors()


def test_a_placement_that_cannot_fit_fails_fast_with_the_numbers(ray_launch):
    run, run_dir = ray_launch(
        *GRPO,
        *SMALL_RL,
        "cluster.n_servers=1",
        "cluster.trainer_nprocs=64",
        "train_dataset.batch_size=64",
    )
    assert run.wait(60) == 2, run.output()
    [failure] = read_jsonl(run_dir / "logs" / "failures.jsonl")
    assert (
        "1 server(s) + 64 trainer rank(s)" in failure["cause"]
        and "CPU 6 (wanted 65)" in failure["cause"]
    )
    assert not run.seen or run.survivors() == {}


def test_a_sigkilled_ray_launcher_leaves_no_process_behind(ray_launch):
    from launch_harness import marked_processes

    script = Path(__file__).parent / "entry_script.py"
    run, run_dir = ray_launch(
        script,
        None,
        "cluster.n_servers=1",
        "launcher.server_threads=1",
        "launcher.ray.forward_env=[AREAL_TEST_*]",
        env={"AREAL_TEST_BEHAVIOUR": "sleep"},
    )
    assert (
        run.wait(RUN_TIMEOUT, until=lambda: len(read_jsonl(run_dir / "entry.jsonl")) >= 1) is None
    ), run.output()
    started = marked_processes(run.marker)
    assert any("server_task" in cmd for cmd in started.values()), started  # Ray actors' processes
    assert any("entry_script" in cmd for cmd in started.values()), started
    run.proc.kill()
    run.proc.wait(10)
    run.assert_no_survivors(
        timeout=60
    )  # Ray kills the dead driver's actors; their processes follow


def test_without_ray_installed_the_launcher_says_how_to_install_it():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from areal.launcher.ray import main\n"
        "sys.exit(main(['x.py']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "pip install -e '.[ray]'" in out.stderr, out.stderr


def test_an_agent_cmd_run_gets_the_agent_proxy_role_on_a_cpu_bundle(ray_launch):
    script = Path(__file__).parent / "entry_script.py"
    run, run_dir = ray_launch(
        script,
        None,
        "cluster.n_servers=1",
        "launcher.server_threads=1",
        "workflow.type=agent_cmd",
        "workflow.agent.command=python agent.py",
        "launcher.ray.forward_env=[AREAL_TEST_*]",
        env={"AREAL_TEST_BEHAVIOUR": "agent_proxy"},
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    answer = json.loads((run_dir / "agent_proxy.json").read_text())
    assert answer["tokens"] >= 1 and answer["address"].startswith("127.0.0.1:")
    assert "agent proxy serves on" in (run_dir / "logs" / "agent_proxy.log").read_text()
    run.assert_no_survivors()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """Another tiny model of the same tokenizer (seed 1): it disagrees with the student."""
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("teacher"), size="tiny", seed=1))


def test_a_distillation_run_gets_its_teacher_server_role_on_a_bundle_of_its_own(
    ray_launch, teacher_dir
):
    run, run_dir = ray_launch(
        *DISTILL,
        *SMALL_RL,
        f"distill.teacher_path={teacher_dir}",
        "cluster.n_servers=1",
        "distill.n_servers=1",
        "total_train_steps=2",
        "valid_dataset=null",
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    stats = train_steps(run_dir)
    assert sorted(stats) == [1, 2], sorted(stats)
    for step in (1, 2):
        assert_finite(stats[step], ["loss/distill_reverse_kl", "loss/pg_loss"])
        assert stats[step]["loss/distill_reverse_kl"] != 0.0  # the teacher scored: two models
    task_log = (run_dir / "logs" / "teacher0-task.log").read_text()
    assert (
        "teacher0 serves on 127.0.0.1:" in task_log
        and (run_dir / "logs" / "teacher0.log").is_file()
    )
    run.assert_no_survivors()


def test_auto_recover_relaunches_on_ray_as_the_local_launcher_does(ray_launch):
    script = Path(__file__).parent / "entry_script.py"
    run, run_dir = ray_launch(
        script,
        None,
        "cluster.n_servers=1",
        "launcher.server_threads=1",
        "recover.mode=auto",
        "recover.retries=2",
        "launcher.ray.forward_env=[AREAL_TEST_*]",
        env={"AREAL_TEST_BEHAVIOUR": "fail_first"},
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    assert [e["attempt"] for e in read_jsonl(run_dir / "entry.jsonl")] == [0, 1]
    run.assert_no_survivors()


def test_a_killed_server_actor_stops_the_run_with_the_named_cause(ray_launch):
    from launch_harness import marked_processes

    run, run_dir = ray_launch(
        *GRPO,
        *SMALL_RL,
        "cluster.n_servers=1",
        "total_train_steps=200",
        "evaluator.freq_steps=null",
        "launcher.server_restarts=0",
    )
    assert run.wait(RUN_TIMEOUT, until=lambda: 1 in train_steps(run_dir)) is None, run.output()
    [task] = [pid for pid, cmd in marked_processes(run.marker).items() if "server_task" in cmd]
    actor = int(Path(f"/proc/{task}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
    os.kill(actor, signal.SIGKILL)  # the Ray worker process of server0's actor
    assert run.wait(RUN_TIMEOUT) not in (0, None), run.output()
    causes = [f["cause"] for f in read_jsonl(run_dir / "logs" / "failures.jsonl")]
    assert any("generation servers are dead" in c for c in causes), (causes, run.output())
    run.assert_no_survivors()
