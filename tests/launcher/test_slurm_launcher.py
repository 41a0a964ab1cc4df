"""``areal launch slurm``: the batch script and the pending-reason rules (tier 1), and runs on a
real Slurm cluster of two nodes on this machine (tier 2: slurmctld, a slurmd per node and munged
started by the session fixture, see slurm_cluster.py; skipped, with the reason, when not root or
the daemons cannot start).

Every run must leave nothing behind: no job in the queue and no process of the run, whether the
trainer finishes or fails, the job is cancelled from outside, or the launcher is interrupted; a
launcher killed by SIGKILL leaves a job that the documented ``scancel --name=...`` removes.
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

from areal.api.config import ConfigError, GRPOConfig, load_config
from areal.launcher.slurm import slurm_problems
from areal.launcher.slurm_errors import never_placed
from areal.launcher.slurm_script import Layout, job_script, layout
from launch_harness import REPO, assert_finite, read_jsonl, train_steps

ENTRY = Path(__file__).parent / "entry_script.py"
GRPO_SCRIPT = REPO / "examples" / "gsm8k_grpo.py"
GRPO_YAML = REPO / "examples" / "arithmetic_grpo.yaml"
DISTILL_YAML = REPO / "examples" / "arithmetic_distill.yaml"
RUN_TIMEOUT = 240.0  # seconds; a short run takes ~30-60 s on a quiet 2-core machine
RL_LOSSES = ["loss/pg_loss", "loss/loss", "loss/entropy", "loss/grad_norm", "loss/approx_kl"]


def _cfg(*overrides: str):
    base = [
        "actor.path=/models/m",
        "actor.use_critic=false",
        "cluster.n_servers=1",
        "experiment_name=e",
        "trial_name=t",
        "fileroot=/shared/areal",
        "cluster.devices_per_node=0",
    ]
    return load_config(GRPOConfig, [*base, *overrides])


# ----------------------------------------------------------------------------- tier 1


def test_layout_asks_each_node_for_its_trainer_ranks_and_its_share_of_servers():
    # 3 servers over 2 nodes: ceil(3 / 2) = 2 per node at most; 2 ranks + 2 servers = 4 processes,
    # x 4 CPUs = 16 CPUs per node, and one GPU per process = 4 GPUs.
    lay = Layout(nodes=2, trainer_nprocs=2, servers=3, cpus_per_process=4, gpus=True)
    assert (lay.servers_per_node, lay.processes_per_node) == (2, 4)
    assert lay.wanted("1:00:00") == (
        "2 node(s), each 4 process(es) (2 trainer rank(s) + up to 2 server(s)) "
        "x 4 CPU(s) = 16 CPUs and 4 GPU(s), time limit 1:00:00"
    )


def test_job_script_places_server_i_on_node_i_mod_n_and_one_torchrun_per_node():
    cfg = _cfg(
        "cluster.n_nodes=2",
        "cluster.n_servers=3",
        "cluster.trainer_nprocs=2",
        "cluster.devices_per_node=4",
        "launcher.slurm.partition=gpu",
        "launcher.slurm.account=lab",
        "launcher.slurm.time_limit=2:00:00",
        "launcher.slurm.sbatch_lines=[--qos=high]",
        "launcher.slurm.container_image=nvcr.io#pytorch",
        "launcher.slurm.container_mounts=[/shared:/shared]",
    )
    text = job_script(cfg, "examples/gsm8k_grpo.py", ["lr=1"], attempt=1)
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header[:9] == [
        "#SBATCH --job-name=areal-e-t",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=2:00:00",
        f"#SBATCH --chdir={os.getcwd()}",
    ]
    assert header[-1] == "#SBATCH --qos=high"
    servers = [line for line in text.splitlines() if "areal.launcher.server_task" in line]
    assert len(servers) == 3
    for i, (line, node) in enumerate(zip(servers, [0, 1, 0])):
        step = (
            f"--job-name=server{i} --nodes=1 --ntasks=1 --relative={node} --cpus-per-task=1 "
            "--gpus-per-task=1"
        )
        assert step in line
        assert (
            f'--host "$(node_addr "${{nodes[{node}]}}")"' in line
        )  # its node's address, not loopback
        assert line.endswith(f'launcher.echo=false >> "$run_dir/logs/server{i}-task.log" 2>&1 &')
        assert (
            "--container-image=nvcr.io#pytorch" in line
            and "--container-mounts=/shared:/shared" in line
        )
    [trainer] = [line for line in text.splitlines() if "torch.distributed.run" in line]
    step = (
        "--nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=2 --gpus-per-task=2 "
        "--kill-on-bad-exit=1"
    )
    assert step in trainer
    assert "AREAL_LAUNCH_ATTEMPT=1" in trainer and '--node_rank="$SLURM_NODEID"' in trainer
    assert (
        "--nnodes=2 --nproc_per_node=2" in trainer
        and 'master_addr=$(node_addr "${nodes[0]}")' in text
    )
    assert trainer.endswith('lr=1 >> "$run_dir/logs/trainer.log" 2>&1')


def test_job_script_of_one_node_binds_servers_to_loopback_and_asks_for_no_gpu():
    text = job_script(
        _cfg("launcher.slurm.cpus_per_process=2"), "examples/gsm8k_grpo.py", [], attempt=0
    )
    assert (
        "--host 127.0.0.1" in text and "master_addr=127.0.0.1" in text and "node_addr" not in text
    )
    assert "gpu" not in text.replace("gsm8k_grpo", "") and "--cpus-per-task=2" in text
    assert "AREAL_LAUNCH_ATTEMPT=0" in text and "container" not in text


def test_job_script_of_an_agent_cmd_run_adds_the_agent_proxy_step_without_gpu_or_token():
    cfg = _cfg(
        "cluster.n_nodes=2",
        "cluster.devices_per_node=2",
        "workflow.type=agent_cmd",
        "workflow.agent.command=python agent.py",
    )
    lay = layout(cfg)  # 1 rank + ceil(1 / 2) = 1 server with a GPU each, + the proxy's CPU task
    assert lay.proxy and (lay.processes_per_node, lay.gpus_per_node) == (3, 2)
    assert "+ the agent proxy" in lay.wanted()
    text = job_script(cfg, "examples/gsm8k_grpo.py", [], attempt=0)
    assert "#SBATCH --ntasks-per-node=3" in text and "#SBATCH --gpus-per-node=2" in text
    [proxy] = [line for line in text.splitlines() if "areal.launcher.agent_proxy_task" in line]
    assert "--job-name=agent_proxy --nodes=1 --ntasks=1 --relative=0" in proxy
    assert "--gres=none" in proxy and '--host "$(node_addr "${nodes[0]}")"' in proxy
    assert proxy.endswith('>> "$run_dir/logs/agent_proxy.log" 2>&1 &')
    assert "AGENT_PROXY_TOKEN" not in text  # it travels by sbatch's environment only
    assert "agent_proxy" not in job_script(_cfg(), "examples/gsm8k_grpo.py", [], attempt=0)


def test_job_script_runs_a_teacher_server_as_a_step_of_its_own_after_the_servers():
    cfg = _cfg("cluster.n_nodes=2", "cluster.devices_per_node=2", "distill.teacher_path=/models/t")
    # server0 then teacher0 go round the 2 nodes: teacher0, the second, on node 1; per node
    # 1 rank + ceil(2 / 2) = 1 serving role, one GPU each
    lay = layout(cfg)
    assert (lay.servers, lay.servers_per_node, lay.gpus_per_node) == (2, 1, 2)
    text = job_script(cfg, "examples/gsm8k_grpo.py", [], attempt=0)
    [teacher] = [line for line in text.splitlines() if "--name teacher0" in line]
    assert "--job-name=teacher0 --nodes=1 --ntasks=1 --relative=1" in teacher
    assert "--gpus-per-task=1" in teacher and '--host "$(node_addr "${nodes[1]}")"' in teacher
    assert teacher.endswith('>> "$run_dir/logs/teacher0-task.log" 2>&1 &')


def test_pending_reasons_that_can_never_start_are_told_from_those_that_wait():
    for reason in (
        "PartitionConfig",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "BadConstraints",
        "InvalidAccount",
        "AssocMaxCpuPerJobLimit",
        "QOSMaxGRESPerJob",
    ):
        assert never_placed(reason), reason
    # Resources and Priority wait for others; ReqNodeNotAvail also shows during backfill and for
    # nodes coming back: these wait out launcher.slurm.start_timeout.
    for reason in (
        "None",
        "Resources",
        "Priority",
        "ReqNodeNotAvail",
        "AssocGrpCpuLimit",
        "BeginTime",
    ):
        assert never_placed(reason) == "", reason


def test_slurm_problems_name_the_field_and_the_fix(monkeypatch):
    monkeypatch.delenv("AREAL_SERVER_API_KEY", raising=False)
    text = "\n".join(slurm_problems(_cfg("cluster.devices_per_node=null")))
    assert "cluster.devices_per_node: null" in text and "0 for CPU only" in text
    # 4 + 1 <= 4 GPUs x 2 nodes overall, but the node holding the server needs 5
    cfg = _cfg("cluster.devices_per_node=4", "cluster.trainer_nprocs=4", "cluster.n_nodes=2")
    text = "\n".join(slurm_problems(cfg))
    assert (
        "cluster.devices_per_node: 4 GPUs per node cannot hold 4 trainer rank(s) + 1 server(s)"
        in text
    )
    text = "\n".join(slurm_problems(_cfg("cluster.n_nodes=2")))
    assert (
        "server.api_key: empty, but with cluster.n_nodes=2" in text
        and "AREAL_SERVER_API_KEY" in text
    )
    text = "\n".join(slurm_problems(_cfg("cluster.name_resolve.type=memory")))
    assert "cluster.name_resolve.type: memory lives in one process" in text and "use file" in text
    monkeypatch.setenv("AREAL_SERVER_API_KEY", "k")  # a key by env is enough
    assert not any("api_key" in p for p in slurm_problems(_cfg("cluster.n_nodes=2")))


def test_slurm_config_errors_name_the_field_the_value_and_the_fix():
    with pytest.raises(ConfigError) as e:
        _cfg(
            "launcher.slurm.time_limit=2h",
            "launcher.slurm.sbatch_lines=[qos=high]",
            "launcher.slurm.container_mounts=[/a:/a]",
        )
    text = str(e.value)
    assert "launcher.slurm.time_limit: '2h' is not a Slurm time" in text
    assert "launcher.slurm.sbatch_lines: 'qos=high' is not an sbatch option" in text
    assert "launcher.slurm.container_mounts: ['/a:/a'] without a container_image" in text
    assert layout(_cfg("launcher.slurm.time_limit=1-12:00:00")).nodes == 1


# ------------------------------------------------------------------------ tier 2: a real cluster


@pytest.fixture(scope="session")
def slurm():
    """A Slurm cluster of two nodes (n1, n2: 4 CPUs each) for the whole session; skipped with the
    reason when this machine cannot run one."""
    from slurm_cluster import start_cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        cluster = start_cluster()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"the Slurm daemons could not start: {e}")
    yield cluster
    cluster.stop()


@pytest.fixture
def launch(tmp_path, tiny_model_dir, slurm):
    """``launch(behaviour, *overrides)`` -> (Launch, RUN_DIR) of the test entry script through
    ``areal launch slurm``; at teardown the launcher, the job and every process of the run go."""
    from slurm_cluster import start_slurm_launch

    made = []

    def start(behaviour: str, *overrides: str):
        common = [
            f"actor.path={tiny_model_dir}",
            "actor.use_critic=false",
            "experiment_name=e",
            "trial_name=t",
            "launcher.server_threads=1",
            "launcher.stop_timeout=3",
            "cluster.n_servers=1",
        ]
        run = start_slurm_launch(
            ENTRY,
            None,
            [*common, *overrides],
            tmp_path / "root",
            slurm,
            {"AREAL_TEST_BEHAVIOUR": behaviour, "AREAL_TEST_CONFIG": "grpo"},
        )
        made.append(run)
        return run, tmp_path / "root" / "e" / "t"

    yield start
    for run in made:
        run.cleanup()
    slurm.run("scancel", "--full", "--user=root")
    slurm.wait_queue_empty()


def _until(run_dir: Path, name: str):
    return lambda: bool(read_jsonl(run_dir / name))


def _assert_gone(run, slurm) -> None:
    slurm.wait_queue_empty()
    run.assert_no_survivors(timeout=30)


@pytest.mark.slow
def test_short_grpo_run_on_two_nodes_trains_and_writes_the_local_run_dir_layout(
    tmp_path, tiny_model_dir, slurm
):
    from launch_harness import marked_processes
    from slurm_cluster import start_slurm_launch

    # two nodes need a key; it reaches servers and trainers by env only
    key = f"slurm-test-key-{os.getpid()}"
    run = start_slurm_launch(GRPO_SCRIPT, GRPO_YAML, [
        f"actor.path={tiny_model_dir}", "experiment_name=g", "trial_name=t", "total_train_steps=2",
        "cluster.n_nodes=2", "cluster.n_servers=2", "rollout.max_staleness=0",
        "evaluator.freq_steps=null", "actor.dynamic_sampling=false", "train_dataset.batch_size=2",
        "gconfig.n_samples=4", "gconfig.max_new_tokens=4", "eval_gconfig.max_new_tokens=4",
        "rollout.max_concurrent_rollouts=4", "launcher.stop_timeout=3", "valid_dataset.size=8",
    ], tmp_path / "root", slurm, {"AREAL_SERVER_API_KEY": key})  # fmt: skip
    run_dir = tmp_path / "root" / "g" / "t"
    commands: dict[int, str] = {}  # every process of the run seen, on both nodes

    def record() -> bool:
        commands.update(marked_processes(run.marker))
        return False

    try:
        code = run.wait(RUN_TIMEOUT, until=record)
        assert code == 0, run.output() + "\n" + _tail(run_dir / "logs" / "trainer.log")
        assert "runs on n[1-2]" in run.output()
        stats = train_steps(run_dir)
        assert sorted(stats) == [0, 1, 2], sorted(stats)
        for step in (0, 2):
            assert_finite(stats[step], ["eval/accuracy"])
        for step in (1, 2):
            assert_finite(stats[step], ["reward/mean", "staleness/max", *RL_LOSSES])
            assert (
                stats[step]["staleness/max"] == 0
            )  # synchronous: trained on the weights being trained
        # one torchrun per node, one rank each: each rank trains one of the step's 2 groups
        per_rank = [
            {r["step"]: r["ids"] for r in read_jsonl(run_dir / f"trained_samples-rank{k}.jsonl")}
            for k in (0, 1)
        ]
        for step in (1, 2):
            assert len(per_rank[0][step]) == len(per_rank[1][step]) == 1
            assert per_rank[0][step] != per_rank[1][step]
        _reloads(run_dir / "checkpoints" / "actor" / "step2")
        for name in (
            "config.yaml",
            "slurm/job.sbatch",
            "slurm/job.id",
            "logs/launcher.log",
            "logs/trainer.log",
            "logs/trainer0.log",
            "logs/trainer1.log",
            "logs/server0.log",
            "logs/server1.log",
            "logs/server0-task.log",
            "logs/job.log",
        ):
            assert (run_dir / name).is_file(), name
        assert (run_dir / "slurm" / "trainer.exit").read_text().strip() == "0"
        leaked = [p for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert not leaked, f"the admin key was written to {leaked}"
        assert any("server_task" in cmd for cmd in commands.values()), commands
        seen = [*commands.values(), *(cmd for _, cmd in run.seen.values())]
        assert not [cmd for cmd in seen if key in cmd], "the admin key was on a command line"
        plot = subprocess.run(
            [sys.executable, "-m", "areal.cli", "plot", str(run_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert plot.returncode == 0 and (run_dir / "plot.png").is_file(), plot.stderr
        _assert_gone(run, slurm)
    finally:
        run.cleanup()


def _reloads(ckpt: Path) -> None:
    """The HF export loads with transformers and gives finite logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(ckpt)("1+2=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(AutoModelForCausalLM.from_pretrained(ckpt)(ids).logits).all()


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""


@pytest.mark.slow
def test_impossible_placement_fails_fast_naming_wanted_and_available(launch, slurm):
    started = time.monotonic()
    run, _ = launch(
        "ok", "launcher.slurm.cpus_per_process=64"
    )  # 2 processes x 64 CPUs; a node has 4
    assert run.wait(RUN_TIMEOUT) == 2, run.output()
    assert time.monotonic() - started < 90  # one look at the job, not start_timeout (600 s)
    out = run.output()
    assert "Slurm says PartitionConfig" in out, out
    assert (
        "x 64 CPU(s) = 128 CPUs" in out
        and "2 node(s) (n1: 4 CPUs, no GPUs, idle; n2: 4 CPUs" in out
    ), out
    slurm.wait_queue_empty(timeout=30)  # the pending job was cancelled


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, wanted, available",
    [
        (
            "launcher.slurm.partition=nope",
            "invalid partition",
            "there is no partition 'nope'; partitions here: debug",
        ),
        (
            "cluster.devices_per_node=2",
            "2 GPU(s)",
            "n1: 4 CPUs, no GPUs",
        ),  # nodes without the resource
    ],
)
def test_a_request_sbatch_refuses_names_what_the_cluster_has(
    launch, slurm, override, wanted, available
):
    run, _ = launch("ok", override)
    assert run.wait(RUN_TIMEOUT) == 2, run.output()
    out = run.output()
    assert "sbatch refused the job" in out and wanted in out and available in out, out
    assert not slurm.jobs()


@pytest.mark.slow
def test_a_job_that_cannot_start_in_time_is_cancelled_naming_the_pending_reason(launch, slurm):
    blocker = slurm.run(
        "sbatch",
        "--parsable",
        "-n",
        "8",
        "--job-name=blocker",
        "--output=/dev/null",
        "--wrap",
        "sleep 300",
    )
    assert blocker.returncode == 0, blocker.stderr
    run, run_dir = launch("ok", "launcher.slurm.start_timeout=3")
    assert run.wait(RUN_TIMEOUT) == 1, run.output()
    out = run.output()
    assert (
        "did not start within 3 s (launcher.slurm.start_timeout); Slurm's last pending reason: "
        in out
    ), out
    assert [line.split()[1] for line in slurm.jobs()] == ["blocker"]  # ours was cancelled
    assert "did not start" in read_jsonl(run_dir / "logs" / "failures.jsonl")[-1]["cause"]


@pytest.mark.slow
def test_a_server_that_cannot_register_stops_the_run_with_its_log(launch, slurm):
    run, _ = launch("sleep", "launcher.server_setup_timeout=1")  # the server needs seconds to load
    assert run.wait(RUN_TIMEOUT) == 1, run.output()
    out = run.output()
    assert "the step of server0 ended before all servers registered" in out, out
    assert "did not answer" in out and "raise launcher.server_setup_timeout" in out, (
        out
    )  # server_task's cause
    _assert_gone(run, slurm)


@pytest.mark.slow
def test_failed_trainer_stops_the_run_with_the_cause(launch, slurm):
    run, run_dir = launch("raise")
    assert run.wait(RUN_TIMEOUT) not in (0, None), (
        run.output()
    )  # torchrun's code for a failed worker
    assert "RuntimeError: entry script failed on purpose" in run.output()
    # the last record is what the relaunch loop reads (server_task may record its server's SIGTERM
    # from the job's end before it)
    failure = read_jsonl(run_dir / "logs" / "failures.jsonl")[-1]
    assert (
        failure["process"] == "trainer"
        and failure["cause"] == "RuntimeError: entry script failed on purpose"
    )
    _assert_gone(run, slurm)


@pytest.mark.slow
def test_an_agent_cmd_job_runs_the_agent_proxy_role_the_trainer_reaches(launch, slurm):
    run, run_dir = launch(
        "agent_proxy", "workflow.type=agent_cmd", "workflow.agent.command=python agent.py"
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    answer = json.loads((run_dir / "agent_proxy.json").read_text())
    assert answer["tokens"] >= 1 and answer["address"].startswith("127.0.0.1:")
    assert "agent proxy serves on" in (run_dir / "logs" / "agent_proxy.log").read_text()
    _assert_gone(run, slurm)


@pytest.mark.slow
def test_a_distillation_job_runs_its_teacher_server_role_as_a_step(tmp_path, tiny_model_dir, slurm):
    from areal.utils.tiny_model import build_tiny_model
    from slurm_cluster import start_slurm_launch

    teacher = build_tiny_model(tmp_path / "teacher", size="tiny", seed=1)  # disagrees: seed 1
    run = start_slurm_launch(GRPO_SCRIPT, DISTILL_YAML, [
        f"actor.path={tiny_model_dir}", f"distill.teacher_path={teacher}", "experiment_name=d",
        "trial_name=t", "total_train_steps=2", "valid_dataset=null", "actor.dynamic_sampling=false",
        "train_dataset.batch_size=2", "gconfig.n_samples=4", "gconfig.max_new_tokens=4",
        "rollout.max_concurrent_rollouts=4", "launcher.stop_timeout=3",
    ], tmp_path / "root", slurm)  # fmt: skip
    run_dir = tmp_path / "root" / "d" / "t"
    try:
        code = run.wait(RUN_TIMEOUT)
        assert code == 0, run.output() + "\n" + _tail(run_dir / "logs" / "trainer.log")
        stats = train_steps(run_dir)
        assert sorted(stats) == [1, 2], sorted(stats)
        for step in (1, 2):
            assert_finite(stats[step], ["loss/distill_reverse_kl", "loss/pg_loss"])
            assert stats[step]["loss/distill_reverse_kl"] != 0.0  # the teacher scored
        assert "--job-name=teacher0" in (run_dir / "slurm" / "job.sbatch").read_text()
        assert "teacher0 serves on" in (run_dir / "logs" / "teacher0-task.log").read_text()
        _assert_gone(run, slurm)
    finally:
        run.cleanup()


@pytest.mark.slow
def test_a_job_cancelled_from_outside_stops_the_run_with_the_cause(launch, slurm):
    run, run_dir = launch("sleep")
    assert run.wait(RUN_TIMEOUT, until=_until(run_dir, "entry.jsonl")) is None, run.output()
    job_id = (run_dir / "slurm" / "job.id").read_text().strip()
    assert slurm.run("scancel", job_id).returncode == 0
    assert run.wait(RUN_TIMEOUT) == 1, run.output()
    assert (
        "the job was cancelled (scancel by a user or an administrator, or preemption)"
        in run.output()
    )
    _assert_gone(run, slurm)


@pytest.mark.slow
@pytest.mark.parametrize("sig, behaviour", [(signal.SIGINT, "sleep"), (signal.SIGTERM, "stubborn")])
def test_interrupted_launcher_cancels_the_job_even_one_ignoring_sigterm(
    launch, slurm, sig, behaviour
):
    run, run_dir = launch(behaviour)
    assert run.wait(RUN_TIMEOUT, until=_until(run_dir, "entry.jsonl")) is None, run.output()
    run.proc.send_signal(sig)
    assert run.wait(60) == 130, run.output()
    assert "cancelling job" in run.output() and "interrupted" in run.output()
    assert not slurm.jobs()  # the launcher waited until the job left the queue
    run.assert_no_survivors(timeout=30)


@pytest.mark.slow
def test_a_killed_launchers_job_is_gone_after_the_documented_scancel(launch, slurm):
    run, run_dir = launch("sleep")
    assert run.wait(RUN_TIMEOUT, until=_until(run_dir, "entry.jsonl")) is None, run.output()
    run.proc.kill()  # SIGKILL: no cleanup of the launcher runs
    run.proc.wait(10)
    time.sleep(2)
    assert [line.split()[1:] for line in slurm.jobs()] == [
        ["areal-e-t", "RUNNING"]
    ]  # the job lives on
    done = slurm.run("scancel", "--name=areal-e-t")  # as docs/launchers.md says
    assert done.returncode == 0, done.stderr
    _assert_gone(run, slurm)
