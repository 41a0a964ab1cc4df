"""Tier 2: Core async PPO end to end (``areal core async-ppo``'s script under the real local
launcher: a real generation server, Ray with 2 model workers (1 in the rollout-side tests), 2
rollout workers and the generation manager, the tiny model). The on-policy run's master starts a
local Ray instance (a user's default); the others join the session's Ray cluster (ray_head).

- On-policy with broadcast weight updates (``weight_update_mode=distributed``, gloo): versions go
  up by one every step; every consumed sample's lag (trained version minus the
  oldest version of its tokens) is <= ``rollout.max_staleness`` (the script checks each sample
  and stops otherwise; the tests read the logged histogram) for bounds 0 (on-policy), 1 (the
  rollout-worker and server fault run) and 2 (the model-worker fault runs); no prompt is trained
  twice in an epoch; per-MFC, manager and per-worker stats are logged.
- Faults, one after the other in one run: a SIGKILLed rollout worker is restarted by Ray, its
  slots reclaimed and its work redone (counted in stats and ``areal core status``); then a
  SIGKILLed generation server (of 2): the rollout workers fail over to the other, the launcher
  restarts it, the manager's next weight update revives it with the current weights (the manager
  owns the servers and their updates), and the rollout workers route to it again; the run
  completes.
- A SIGKILLed model worker stops the attempt, the launcher relaunches it, and the resumed run
  trains the same sample sequence as an uninterrupted one: the train loader's order, which the
  on-policy run is checked to train.
- An agent program (``workflow.type=agent_cmd``): the launcher's agent proxy role serves the
  rollout workers' sessions, and the rewards the agents posted are what trains.
- Elastic scaling: a server started by hand and a third rollout worker are added mid-run
  (``areal core scale``); once the new worker has rolled out, the launcher's server and a rollout
  worker are removed; the new server gets every weight update from its first step on and serves
  alone at the end, and each prompt is trained once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_sync_ppo's helpers

from test_sync_ppo import RUN_TIMEOUT, YAML, Runs, cluster_runs, runs  # noqa: E402,F401  (fixtures)

from launch_harness import REPO, effective_ids, train_steps  # noqa: E402  (on the path now)

sys.path.insert(0, str(REPO / "tests" / "serving"))
from servers import start_servers, stop_servers  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = REPO / "areal" / "core" / "async_ppo.py"
ASYNC = [  # 2 prompts x 4 samples x 4 tokens a step, a reward that varies
    "actor.dynamic_sampling=false", "train_dataset.batch_size=2", "gconfig.n_samples=4",
    "gconfig.max_new_tokens=4", "eval_gconfig.max_new_tokens=4",
    "rollout.max_concurrent_rollouts=4",
    "valid_dataset=null", "reward_fn=sync_rewards:content_reward", "reward.timeout=300",
    "core.backend=ray", "core.n_workers=2", "core.n_rollout_workers=2", "actor.optimizer.lr=1e-2",
]  # fmt: skip
# The rollout-side tests (an agent program, faults, scaling) train on one model worker: a worker
# process costs ~7 s of CPU to start, and two are checked by the on-policy and model-worker runs.
ONE_MODEL_WORKER = "core.n_workers=1"


def trained(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "trained_samples-rank0.jsonl").read_text().splitlines()
    ]


def loader_ids(model_dir: str, overrides: list[str], n_steps: int) -> dict[int, list[str]]:
    """step -> the ids of the train loader's batch ``step`` under ``overrides``: the manager
    admits the loader's items in order and the master takes groups in admission order, so an
    uninterrupted run trains exactly these, whatever the staleness bound."""
    from transformers import AutoTokenizer

    from areal.api.config import load_config
    from areal.core.config import CoreAsyncGRPOConfig
    from areal.dataset import create_dataloader, load_dataset

    cfg = load_config(CoreAsyncGRPOConfig, ["--config", str(YAML), *overrides])
    train = load_dataset(cfg.train_dataset, AutoTokenizer.from_pretrained(model_dir), cfg.seed)
    batches = iter(create_dataloader(train, cfg.train_dataset, cfg.seed))
    return {step: [item["id"] for item in next(batches)] for step in range(1, n_steps + 1)}


def check_lags(run_dir: Path, staleness: int, n_steps: int) -> dict[int, dict]:
    """Every step: one weight update, every sample's lag checked and within the bound."""
    steps = train_steps(run_dir)
    assert sorted(steps) == list(range(1, n_steps + 1))
    for step, s in steps.items():
        assert s["manager/version"] == step  # one weight update per step
        assert s["core/lag/max"] <= staleness
        assert (
            sum(v for k, v in s.items() if k.startswith("core/lag/hist/")) == 8
        )  # every sample checked
        assert s["mfc/actor_train/n_tokens"] > 0
    assert any(s["loss/grad_norm"] > 0 for s in steps.values())
    if staleness:
        assert any(s["core/lag/max"] > 0 for s in steps.values()), "no rollout overlapped training"
    return steps


def test_core_async_ppo_on_policy(runs, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = runs.run(
        "async0",
        SCRIPT,
        [
            f"actor.path={tiny_model_dir}",
            *ASYNC,
            "total_train_steps=4",
            "rollout.max_staleness=0",
            "weight_update_mode=distributed",
        ],
    )
    steps = check_lags(run, 0, 4)
    assert all(
        s["rollout_worker/0/episodes"] + s["rollout_worker/1/episodes"] >= 2 * n
        for n, s in steps.items()
    )
    assert (
        steps[4]["rollout_worker/0/remote/servers_alive"] == 1.0
    )  # each worker's client and reward counters
    assert (
        steps[4]["manager/remote/servers_alive"] == 1.0
    )  # the manager's client: the one that updates weights
    assert "rollout_worker/1/reward/n_calls" in steps[4]
    ids = [i for r in trained(run) for i in r["ids"]]
    assert len(ids) == 8 and len(set(ids)) == 8  # 4 steps x 2 prompts, each once
    assert effective_ids(run) == loader_ids(tiny_model_dir, [*ASYNC, "total_train_steps=4"], 4)
    # issue 34: no Ray error line about actor restarts (the manager is found by name), and a
    # finished run says so in `areal core status` and refuses `areal core scale`
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("*.log"))
    assert "restart will fail" not in logs and "set_vital" not in logs
    cli = [sys.executable, "-m", "areal.cli", "core"]
    shown = subprocess.run(
        [*cli, "status", str(run)], capture_output=True, text=True, check=True
    ).stdout
    assert (
        shown.startswith("run ended: it finished at step 4/4") and "rollouts running" not in shown
    ), shown
    scale = subprocess.run(
        [*cli, "scale", str(run), "--rollout-workers", "3"], capture_output=True, text=True
    )
    assert (
        scale.returncode != 0 and "the run has ended (it finished at step 4/4)" in scale.stderr
    ), scale.stderr
    assert not (run / "core_scale.json").exists()


def test_core_async_ppo_trains_an_agent_program_through_the_proxy_role(
    cluster_runs, tiny_model_dir
):
    """workflow.type=agent_cmd under Core: the launcher's agent proxy role serves the rollout
    workers' sessions (their control token by Ray's runtime env), and their samples train."""
    agent = REPO / "tests" / "workflow" / "turns_agent.py"
    run = cluster_runs.run(
        "agent0",
        SCRIPT,
        [
            f"actor.path={tiny_model_dir}",
            *ASYNC,
            ONE_MODEL_WORKER,
            "total_train_steps=2",
            "rollout.max_staleness=1",
            "workflow.type=agent_cmd",
            f"workflow.agent.command=python {agent}",
        ],
    )
    steps = train_steps(run)  # the agent's reward is always 1.0: no gradient to expect
    assert sorted(steps) == [1, 2]
    for step, st in steps.items():
        assert st["manager/version"] == step and st["core/lag/max"] <= 1
        assert sum(v for k, v in st.items() if k.startswith("core/lag/hist/")) == 8
        assert st["mfc/actor_train/n_tokens"] > 0
        assert st["reward/mean"] == 1.0  # the rewards the agents posted, not reward_fn's
    proxy_log = (run / "logs" / "agent_proxy.log").read_text()
    assert "agent proxy serves on" in proxy_log and "Traceback" not in proxy_log


def status(run_dir: Path) -> dict | None:
    path = run_dir / "core_status.json"
    return json.loads(path.read_text()) if path.is_file() else None


def start(runs: Runs, name: str, overrides: list[str]):
    return runs.start(name, SCRIPT, overrides), runs.root / name / "t"


def finish(launch, run_dir: Path) -> None:
    code = launch.wait(RUN_TIMEOUT)
    log = run_dir / "logs" / "trainer.log"
    assert code == 0, f"exit {code}:\n{launch.output()}\n{log.read_text(errors='replace')[-3000:]}"
    launch.assert_no_survivors()


def wait_for_step(launch, run_dir: Path, step: int) -> dict:
    launch.wait(RUN_TIMEOUT, until=lambda: (status(run_dir) or {}).get("step", 0) >= step)
    assert launch.proc.poll() is None, f"the run ended before step {step}:\n{launch.output()}"
    return status(run_dir)


def test_a_killed_rollout_worker_then_a_killed_server_are_restarted_and_the_run_goes_on(
    cluster_runs, tiny_model_dir
):
    """Two faults one after the other in one run (a Core run starts in ~1 CPU-minute here): a
    SIGKILLed rollout worker is restarted by Ray, its slots reclaimed and its work redone; then a
    SIGKILLed server (of 2): the rollout workers fail over to the other, the launcher restarts
    it, the manager's next weight update revives it and the workers route to it again."""
    n = 60  # a ceiling: the test stops the run once the restarted server served a step
    launch, run_dir = start(
        cluster_runs,
        "faults",
        [
            f"actor.path={tiny_model_dir}",
            *ASYNC,
            ONE_MODEL_WORKER,
            f"total_train_steps={n}",
            "rollout.max_staleness=1",
            "cluster.n_servers=2",
        ],
    )
    st = wait_for_step(launch, run_dir, 2)
    both, victim = st["servers"], st["workers"][1]["pid"]
    assert len(both) == 2
    os.kill(victim, signal.SIGKILL)
    wait_for(
        launch,
        run_dir,
        lambda st: st["workers"][1]["pid"] not in (victim, None),
        "Ray restarted the rollout worker",
    )
    pid = int(
        re.search(
            r"started server1 \(pid (\d+)\)", (run_dir / "logs" / "launcher.log").read_text()
        ).group(1)
    )
    os.kill(pid, signal.SIGKILL)
    wait_for(
        launch,
        run_dir,
        lambda st: len(st["servers"]) == 1,
        "the rollout workers left the dead server",
    )
    st = wait_for(
        launch, run_dir, lambda st: len(st["servers"]) == 2, "the restarted server served again"
    )
    last = stop_after(launch, run_dir, st["step"] + 1)  # a step on both servers again
    steps = check_lags(run_dir, 1, last)  # no rollout ran on stale weights
    assert (
        steps[last]["rollout_worker/1/restarts"] == 1
        and steps[last]["rollout_worker/0/restarts"] == 0
    )
    assert status(run_dir)["workers"][1]["pid"] != victim
    assert sorted(status(run_dir)["servers"]) == sorted(both)
    assert steps[last]["manager/remote/revived"] >= 1  # by the manager's weight update
    ids = [i for r in effective_ids(run_dir).values() for i in r]
    assert len(ids) == 2 * last and len(set(ids)) == 2 * last  # redone work is trained once
    shown = core("status", run_dir)
    row = [line.split() for line in shown.splitlines() if line.split()[:1] == ["1"]][0]
    assert row[-1] == "1"  # worker 1 restarted once
    assert f"run ended: it was stopped at step {last}/{n} (areal core stop)" in shown, shown


def test_a_killed_model_worker_resumes_with_the_uninterrupted_sample_sequence(
    cluster_runs, tiny_model_dir
):
    common = [
        f"actor.path={tiny_model_dir}",
        *ASYNC,
        "total_train_steps=6",
        "rollout.max_staleness=2",
        "recover.mode=auto",
        "recover.freq_steps=1",
        "recover.retries=2",
    ]
    launch, run_dir = start(cluster_runs, "mwkill", common)
    victim = wait_for_step(launch, run_dir, 3)["model_worker_pids"][1]
    os.kill(victim, signal.SIGKILL)
    finish(launch, run_dir)
    attempts = {
        json.loads(line)["attempt"] for line in (run_dir / "trained_samples-rank0.jsonl").open()
    }
    assert attempts == {0, 1}, "the kill did not cost an attempt"
    # the uninterrupted sequence: the loader's order (test_core_async_ppo_on_policy runs it)
    assert effective_ids(run_dir) == loader_ids(tiny_model_dir, common, 6)
    check_lags(run_dir, 2, 6)


def core(action: str, run_dir: Path, *args: str) -> str:
    """``areal core ACTION RUN_DIR ARGS``'s output (it must succeed)."""
    out = subprocess.run(
        [sys.executable, "-m", "areal.cli", "core", action, str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def stop_after(launch, run_dir: Path, step: int) -> int:
    """Once the run reached ``step``: ``areal core stop``, the run's end; its last step (a test
    ends the run once it saw what it checks instead of waiting out total_train_steps)."""
    wait_for_step(launch, run_dir, step)
    core("stop", run_dir)
    finish(launch, run_dir)
    st = status(run_dir)
    assert st["state"] == "finished" and step < st["step"] < st["total_steps"], st  # stopped
    return st["step"]


def wait_for(launch, run_dir: Path, what, label: str) -> dict:
    launch.wait(RUN_TIMEOUT, until=lambda: (st := status(run_dir)) is not None and what(st))
    assert launch.proc.poll() is None, f"the run ended before {label}:\n{launch.output()}"
    return status(run_dir)


def server_version(addr: str) -> int:
    with urllib.request.urlopen(f"http://{addr}/get_server_info", timeout=10) as resp:
        return json.loads(resp.read())["weight_version"]


def test_rollout_workers_and_servers_scale_while_the_job_runs(cluster_runs, tiny_model_dir):
    extra = start_servers(str(tiny_model_dir), 1)
    n = 60  # a ceiling (the paced reward leaves time for both scalings on a loaded machine);
    # the test stops the run once it has run on the new server alone
    try:
        launch, run_dir = start(
            cluster_runs,
            "elastic",
            [
                f"actor.path={tiny_model_dir}",
                *ASYNC,
                ONE_MODEL_WORKER,
                f"total_train_steps={n}",
                "rollout.max_staleness=1",
                "reward_fn=sync_rewards:paced_content_reward",
            ],
        )
        ((_, added),) = extra
        first = wait_for_step(launch, run_dir, 2)["servers"]
        core("scale", run_dir, "--rollout-workers", "3", "--add-server", added)
        worked = lambda st: any(w["index"] == 2 and w["episodes"] > 0 for w in st["workers"])  # noqa: E731
        st = wait_for(
            launch,
            run_dir,
            lambda st: len(st["servers"]) == 2 and worked(st),
            "the new worker rolled out",
        )
        grown = st["step"]
        core("scale", run_dir, "--rollout-workers", "2", "--remove-server", first[0])
        st = wait_for(
            launch,
            run_dir,
            lambda st: st["servers"] == [added] and len(st["workers"]) == 2,
            "scaling down",
        )
        shrunk = st["step"]
        last = stop_after(launch, run_dir, shrunk + 2)  # steps on the new server alone
        assert server_version(added) == last  # it got every update from its first step on
    finally:
        stop_servers(extra)
    steps = check_lags(run_dir, 1, last)
    assert steps[grown]["core/servers"] == 2 and steps[grown]["core/rollout_workers"] == 3
    assert steps[grown]["rollout_worker/2/episodes"] > 0  # the added worker rolled out
    assert steps[last]["core/servers"] == 1 and steps[last]["core/rollout_workers"] == 2
    assert (
        "rollout_worker/2/episodes" not in steps[last]
    )  # it drained (the newest goes first) and stopped
    assert steps[last]["manager/lost"] == 0
    ids = [i for r in effective_ids(run_dir).values() for i in r]
    assert len(ids) == 2 * last and len(set(ids)) == 2 * last
