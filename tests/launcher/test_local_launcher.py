"""Tier 2: ``areal launch local`` with real processes (servers, torchrun, a test entry script).

Every run must leave nothing behind: no process of the run (servers, torchrun, its workers) and
no bound server port, whether the trainer finishes, fails, or the launcher is interrupted.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from launch_harness import (
    Launch,
    assert_ports_free,
    marked_processes,
    read_jsonl,
    server_ports,
    start_launch,
)

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "entry_script.py"
RUN_TIMEOUT = 120.0  # seconds; a run here takes a few seconds on a quiet machine


@pytest.fixture
def launch(tmp_path, tiny_model_dir):
    """``launch(behaviour, *overrides, config="grpo")`` -> (Launch, RUN_DIR); killed at teardown."""
    made: list[Launch] = []

    def start(behaviour: str, *overrides: str, config: str = "grpo") -> tuple[Launch, Path]:
        model = (
            [f"actor.path={tiny_model_dir}", "actor.use_critic=false"]
            if config == "grpo"
            else [f"model.path={tiny_model_dir}"]
        )
        common = [
            "experiment_name=e",
            "trial_name=t",
            "launcher.server_threads=1",
            "launcher.stop_timeout=3",
        ]
        env = {"AREAL_TEST_BEHAVIOUR": behaviour, "AREAL_TEST_CONFIG": config}
        run = start_launch(SCRIPT, None, [*model, *common, *overrides], tmp_path / "root", env)
        made.append(run)
        return run, tmp_path / "root" / "e" / "t"

    yield start
    for run in made:
        run.cleanup()


def _started_entries(run_dir: Path, n: int = 1):
    return lambda: len(read_jsonl(run_dir / "entry.jsonl")) >= n


def test_finished_run_exits_zero_and_leaves_no_process_or_port(launch, tmp_path):
    from areal.utils.name_resolve import FileNameRepository, gen_servers_key

    stale = "127.0.0.1:1"  # a dead server of an earlier launch of the same trial
    FileNameRepository(tmp_path / "root" / "name_resolve").add_subentry(
        gen_servers_key("e", "t"), stale
    )
    run, run_dir = launch("ok", "cluster.n_servers=2")
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    [entry] = read_jsonl(run_dir / "entry.jsonl")
    # the script found both servers in the trial's registry, cleared of the stale entry at launch
    assert len(entry["addrs"]) == 2 and stale not in entry["addrs"]
    assert {entry["pid"], entry["ppid"]} <= set(run.seen)  # worker and torchrun were tracked
    run.assert_no_survivors()
    assert_ports_free(server_ports(run_dir))


AGENT_CMD = ["workflow.type=agent_cmd", "workflow.agent.command=python agent.py"]


def test_an_agent_cmd_run_gets_the_agent_proxy_role_and_its_death_stops_the_run(launch):
    run, run_dir = launch("agent_proxy", "cluster.n_servers=1", *AGENT_CMD)
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    answer = json.loads((run_dir / "agent_proxy.json").read_text())
    assert answer["tokens"] >= 1 and answer["address"].startswith("127.0.0.1:")
    run.assert_no_survivors()
    run, run_dir = launch("sleep", "cluster.n_servers=1", *AGENT_CMD)  # the same trial again
    assert run.wait(RUN_TIMEOUT, until=_started_entries(run_dir, 2)) is None, run.output()
    [pid] = [p for p, cmd in marked_processes(run.marker).items() if "agent_proxy_task" in cmd]
    os.kill(pid, signal.SIGKILL)
    assert run.wait(RUN_TIMEOUT) not in (0, None), run.output()
    assert "the agent proxy exited with code -9" in run.output()
    run.assert_no_survivors()


def test_a_server_that_dies_while_starting_stops_the_run_the_trainer_waited_beside(
    launch, tmp_path, tiny_model_dir
):
    """The trainer starts beside the servers and waits for them in the registry; a server that
    exits before it answers /health stops the run with one error naming it, no traceback."""
    import shutil

    broken = tmp_path / "broken_model"
    shutil.copytree(tiny_model_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    run, run_dir = launch("ok", "cluster.n_servers=1", f"actor.path={broken}")
    assert run.wait(RUN_TIMEOUT) == 1, run.output()
    out = run.output()
    assert "started trainer" in out and "server0 exited with code" in out, out
    assert "before http://127.0.0.1:" in out and "the run stops" in out, out
    assert "launcher/local.py" not in out, out  # no traceback of the launcher's own
    assert not (run_dir / "entry.jsonl").exists()  # the trainer was still waiting for it
    run.assert_no_survivors()


def test_failed_trainer_stops_the_run_and_tears_everything_down(launch):
    run, run_dir = launch("exit3", "cluster.n_servers=1")
    assert run.wait(RUN_TIMEOUT) not in (0, None), (
        run.output()
    )  # torchrun's code for a failed worker
    assert "trainer exited with code" in run.output()
    assert "exitcode  : 3" in (run_dir / "logs" / "trainer.log").read_text()  # the cause is logged
    run.assert_no_survivors()
    assert_ports_free(server_ports(run_dir))


def test_the_closing_excerpt_names_the_root_cause_from_this_runs_output_only(launch, tmp_path):
    stale = tmp_path / "root" / "e" / "t" / "logs" / "trainer.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("OldError: a line an earlier run left in the log\n")
    run, run_dir = launch("raise", "cluster.n_servers=0", "train_dataset.type=sft", config="sft")
    assert run.wait(RUN_TIMEOUT) not in (0, None), run.output()
    out = run.output(200)
    # the worker's exception, not torchrun's ChildFailedError wrapper
    assert "trainer exited with code 1: RuntimeError: entry script failed on purpose" in out, out
    assert (
        "OldError" not in out and "OldError" in stale.read_text()
    )  # the log keeps it, the excerpt not


@pytest.mark.parametrize("sig, behaviour", [(signal.SIGINT, "sleep"), (signal.SIGTERM, "stubborn")])
def test_interrupted_launcher_stops_every_process_even_one_ignoring_sigterm(launch, sig, behaviour):
    run, run_dir = launch(behaviour, "cluster.n_servers=1")
    assert run.wait(RUN_TIMEOUT, until=_started_entries(run_dir)) is None, run.output()
    [entry] = read_jsonl(run_dir / "entry.jsonl")
    run.snapshot()
    assert entry["pid"] in run.seen
    run.proc.send_signal(sig)
    assert run.wait(30) == 130, run.output()
    assert "interrupted" in run.output()
    run.assert_no_survivors()
    assert_ports_free(server_ports(run_dir))


def test_a_sigkilled_launcher_leaves_no_process_behind(launch):
    run, run_dir = launch("sleep", "cluster.n_servers=1")
    assert run.wait(RUN_TIMEOUT, until=_started_entries(run_dir)) is None, run.output()
    run.snapshot()
    assert any("serve" in cmd for _, cmd in run.seen.values()), run.seen  # a server was running
    run.proc.kill()  # SIGKILL: no teardown code of the launcher runs
    run.proc.wait(10)
    run.assert_no_survivors(timeout=30)  # the kernel's parent-death signal and the pidfd watchers
    assert_ports_free(server_ports(run_dir))


def test_bad_config_fails_before_any_process_starts_and_names_every_problem(launch):
    run, run_dir = launch(
        "ok", "rollout.max_staleness=-1", "cluster.trainer_nprocs=0", "cluster.n_servers=1"
    )
    code = run.wait(RUN_TIMEOUT)
    out = run.output()
    assert code == 2
    assert "rollout.max_staleness" in out and "cluster.trainer_nprocs" in out, out
    assert "Traceback" not in out, f"a config error is a message, not a crash:\n{out}"
    assert not run.seen, f"processes started despite the bad config: {run.seen}"
    assert not (run_dir / "logs").exists()


def test_auto_recover_relaunches_a_failing_run_up_to_the_retry_limit(launch):
    run, run_dir = launch(
        "raise_new",
        "recover.mode=auto",
        "recover.retries=2",
        "cluster.n_servers=0",
        "train_dataset.type=sft",
        config="sft",
    )
    assert run.wait(RUN_TIMEOUT) not in (0, None), run.output()
    assert [e["attempt"] for e in read_jsonl(run_dir / "entry.jsonl")] == [0, 1, 2]
    assert run.output().count("relaunching") == 2
    assert "failed on purpose on attempt 0); relaunching" in run.output()  # the cause is named
    run.assert_no_survivors()


def test_auto_recover_does_not_relaunch_a_failure_whose_cause_repeats(launch):
    run, run_dir = launch(
        "raise",
        "recover.mode=auto",
        "recover.retries=3",
        "cluster.n_servers=0",
        "train_dataset.type=sft",
        config="sft",
    )
    assert run.wait(RUN_TIMEOUT) not in (0, None), run.output()
    assert [e["attempt"] for e in read_jsonl(run_dir / "entry.jsonl")] == [0, 1]  # today: 0..3
    out = run.output()
    assert (
        "attempt 2 failed with the same cause as attempt 1: RuntimeError: entry script failed "
        "on purpose; not relaunching" in out
    ), out
    run.assert_no_survivors()


def test_auto_recover_stops_relaunching_once_an_attempt_succeeds(launch):
    run, run_dir = launch(
        "fail_first", "recover.mode=auto", "recover.retries=3", "cluster.n_servers=1"
    )
    assert run.wait(RUN_TIMEOUT) == 0, run.output()
    entries = read_jsonl(run_dir / "entry.jsonl")
    assert [e["attempt"] for e in entries] == [0, 1]
    assert len(server_ports(run_dir)) == 2  # each attempt started its own server
    run.assert_no_survivors()
    assert_ports_free(server_ports(run_dir))


def test_recover_disabled_does_not_relaunch(launch):
    run, run_dir = launch(
        "fail_first", "cluster.n_servers=0", "train_dataset.type=sft", config="sft"
    )
    assert run.wait(RUN_TIMEOUT) not in (0, None), run.output()
    assert [e["attempt"] for e in read_jsonl(run_dir / "entry.jsonl")] == [0]


def test_gpu_layout_gives_trainers_and_servers_disjoint_gpus():
    from areal.launcher.local import gpu_layout

    ids = [str(i) for i in range(8)]
    assert gpu_layout([], 2, 1) == (None, [None])  # CPU machine: nothing pinned
    assert gpu_layout(ids, 7, 1) == ("0,1,2,3,4,5,6", ["7"])
    assert gpu_layout(ids[:4], 2, 2) == ("0,1", ["2", "3"])
    with pytest.raises(
        ValueError, match="need 9 GPUs, this launch may use 8 .*set cluster.colocate=true"
    ):
        gpu_layout(ids, 8, 1, colocate=False)


def test_one_gpu_hosts_trainer_and_server_colocated(caplog):
    from areal.launcher.local import gpu_layout

    with caplog.at_level("INFO", logger="areal.launcher"):
        assert gpu_layout(["0"], 1, 1) == ("0", ["0"])  # auto: too few GPUs for one each
    assert "each server shares a trainer's GPU" in caplog.text
    ids = [str(i) for i in range(8)]
    assert gpu_layout(ids, 8, 1) == ("0,1,2,3,4,5,6,7", ["0"])
    assert gpu_layout(ids[:2], 2, 3, colocate=True) == (
        "0,1",
        ["0", "1", "0"],
    )  # server i on rank i mod 2
    assert gpu_layout(ids, 2, 1, colocate=True) == ("0,1", ["0"])  # asked for, though GPUs are free
    with pytest.raises(ValueError, match="2 trainer ranks need 2 GPUs, this launch may use 1"):
        gpu_layout(["3"], 2, 1, colocate=True)


def test_config_accepts_a_colocated_one_gpu_layout_and_refuses_one_gpu_each():
    from areal.api.config import GRPOConfig, load_config
    from areal.api.config.loader import ConfigError

    base = ["actor.use_critic=false", "cluster.n_servers=1", "cluster.devices_per_node=1"]
    assert load_config(GRPOConfig, base).cluster.colocate is None
    with pytest.raises(ConfigError, match="cannot hold 1 trainer ranks \\+ 1 servers one GPU each"):
        load_config(GRPOConfig, [*base, "cluster.colocate=false"])


def test_the_users_cuda_visible_devices_is_respected(monkeypatch):
    from areal.api.config import GRPOConfig, load_config
    from areal.launcher.local import _usable_gpus, gpu_layout

    cfg = load_config(GRPOConfig, ["actor.use_critic=false", "cluster.n_servers=1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert gpu_layout(_usable_gpus(cfg), 2, 1) == ("4,5", ["6"])  # never GPUs 0-2 of the machine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _usable_gpus(cfg) == []  # the user hid every GPU: a CPU run


def test_a_dead_server_is_restarted_on_its_port_with_the_newest_weights(tmp_path, tiny_model_dir):
    from launch_harness import start_launch

    script = Path(__file__).parent / "restart_entry.py"
    overrides = [
        f"actor.path={tiny_model_dir}",
        "actor.use_critic=false",
        "experiment_name=e",
        "trial_name=t",
        "launcher.server_threads=1",
        "launcher.stop_timeout=3",
        "cluster.n_servers=1",
    ]
    run = start_launch(script, None, overrides, tmp_path / "root")
    try:
        assert run.wait(RUN_TIMEOUT) == 0, run.output()
        log = (tmp_path / "root" / "e" / "t" / "logs" / "launcher.log").read_text()
        assert "restarting it on port" in log and "with weights version 3 (1 of 2)" in log, log[
            -2000:
        ]
        run.assert_no_survivors()
    finally:
        run.cleanup()


def test_a_restarted_servers_weights_are_pinned_against_the_publishers_cleanup(tmp_path):
    from areal.launcher.servers import pin_newest_weights

    weights = tmp_path / "weights"
    for v in (1, 3):
        (weights / f"v{v}").mkdir(parents=True)
        (weights / f"v{v}" / "config.json").write_text("{}")
        (weights / f"v{v}" / "model.safetensors").write_bytes(bytes([v]) * 16)
    (weights / "v7").mkdir()  # unfinished: no safetensors yet
    pinned = tmp_path / "servers" / "server1-weights"
    assert pin_newest_weights(weights, pinned) == (str(pinned), 3)
    assert (pinned / "model.safetensors").stat().st_ino == (
        weights / "v3" / "model.safetensors"
    ).stat().st_ino
    for f in (weights / "v3").iterdir():  # the publisher deletes v3 before the server loads it
        f.unlink()
    assert (pinned / "model.safetensors").read_bytes() == bytes([3]) * 16
    assert pin_newest_weights(tmp_path / "none", pinned) is None


def test_a_rank_stops_at_once_when_its_torchrun_is_sigkilled(tmp_path, tiny_model_dir):
    """torchrun starts its workers in sessions of their own: once it is SIGKILLed, the worker
    kept training (and writing stats) until the launcher itself exited. Here the "launcher" (this
    test process) lives on, so a worker that does not watch torchrun would never stop."""
    import os
    import subprocess
    import sys
    import time

    from areal.api.launch import LAUNCHER_PID
    from areal.utils.network import free_port

    run_dir = tmp_path / "e" / "t"
    env = {**os.environ, LAUNCHER_PID: str(os.getpid()), "AREAL_TEST_BEHAVIOUR": "heartbeat",
           "AREAL_TEST_CONFIG": "sft"}  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        f"fileroot={tmp_path}",
        "experiment_name=e",
        "trial_name=t",
        f"model.path={tiny_model_dir}",
        "train_dataset.type=sft",
    ]
    torchrun = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    worker = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (run_dir / "heartbeat").is_file():
            assert torchrun.poll() is None and time.monotonic() < deadline, (
                "the worker never started"
            )
            time.sleep(0.1)
        [entry] = read_jsonl(run_dir / "entry.jsonl")
        worker = entry["pid"]
        assert entry["ppid"] == torchrun.pid
        torchrun.kill()
        torchrun.wait(10)
        killed_at = time.time()
        while Path(f"/proc/{worker}").exists() and time.time() < killed_at + 10:
            time.sleep(0.02)
        assert not Path(f"/proc/{worker}").exists(), "the orphaned worker kept running"
        last_beat = float((run_dir / "heartbeat").read_text().split()[-1])
        assert last_beat < killed_at + 0.5, (
            f"the worker ran {last_beat - killed_at:.2f} s after torchrun died"
        )
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
        if worker is not None and Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)
