"""``areal launch slurm SCRIPT --config YAML [overrides]`` (also ``python -m
areal.launcher.slurm``): the job as one Slurm batch job, launched from a login node.

One allocation holds everything: ``cluster.n_nodes`` nodes, each asked for ``trainer_nprocs +
ceil(n_servers / n_nodes)`` processes of ``launcher.slurm.cpus_per_process`` CPUs (and one GPU
each when ``cluster.devices_per_node`` > 0). Its batch script, RUN_DIR/slurm/job.sbatch (kept, to
read and to rerun with ``sbatch``), runs ``srun`` steps with exactly those resources:

1. a prologue on the first node clears the trial's registry and picks the rendezvous port;
2. server ``i`` is a one-task step on node ``i mod n_nodes`` running
   :mod:`areal.launcher.server_task` (picks a port, registers ``host:port`` in the trial registry
   once healthy, restarts a dead server), output to RUN_DIR/logs/server<i>-task.log and the
   server's own RUN_DIR/logs/server<i>.log;
3. with ``workflow.type: agent_cmd``, the agent proxy role (:mod:`areal.launcher.agent_proxy_task`)
   is a one-task step on the first node (one more CPU task per node is asked for; no GPU),
   output to RUN_DIR/logs/agent_proxy.log; it registers itself, and its control token is made
   per attempt and reaches it and the trainers through sbatch's environment;
4. the trainer is one step of one ``torchrun`` per node (``--node_rank`` = the node's index,
   rendezvous on the first node), output to RUN_DIR/logs/trainer.log. Its exit code is written
   to RUN_DIR/slurm/trainer.exit and ends the batch script; Slurm then stops the servers.

This launcher submits the script (``sbatch --parsable``), waits for the job to start
(``launcher.slurm.start_timeout``; a pending reason that means it can never be placed stops it at
once, naming wanted vs available), waits for the servers to register
(``launcher.server_setup_timeout``), follows the job (echoing its logs) and returns the trainer's
exit code. On Ctrl-C, SIGTERM, any failure or deadline it ``scancel``s the job and waits for it to
leave the queue (``launcher.slurm.cancel_timeout``). A launcher killed by SIGKILL cannot do that:
the job id is in its log and in RUN_DIR/slurm/job.id; ``scancel --name=areal-<experiment>-<trial>``
cancels it (docs/launchers.md). The servers' admin key reaches the job through sbatch's
environment (``--export=ALL``), never a file or a command line. RUN_DIR, the registry
(``cluster.name_resolve``) and the interpreter must be on a filesystem every node sees.

The parts: :mod:`areal.launcher.slurm_script` writes the batch script,
:mod:`areal.launcher.slurm_job` watches the job through Slurm's commands and echoes its logs,
:mod:`areal.launcher.slurm_errors` says what Slurm's refusals, pending reasons and end states
mean; this module checks the config and runs one attempt from submission to the trainer's end.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from functools import partial
from pathlib import Path

from areal.api.config import ConfigError, load_config
from areal.api.launch import LAUNCHER_PID, agent_proxy_env, api_key_env, server_api_key
from areal.launcher.common import (
    launch,
    launcher_main,
    load_script_config_class,
    reset_trial,
    wait_for_roles,
    without_secrets,
)
from areal.launcher.plan import launch_plan
from areal.launcher.procs import record_failure, root_cause
from areal.launcher.slurm_errors import ENDED_WHY, controller_problem, never_placed
from areal.launcher.slurm_job import (
    POLL_S,
    JobFailed,
    LogFollower,
    SlurmJob,
    available,
    run_command,
    tail_lines,
)
from areal.launcher.slurm_script import Layout, job_name, job_script, layout
from areal.utils.logging import get_logger
from areal.utils.network import free_port

logger = get_logger("launcher")

# the roles this launcher places (Role.placement, areal.launcher.plan); others are refused
PLACES = frozenset({"server", "teacher", "agent_proxy", "trainer"})
STEP_SLACK_S = 60.0  # beyond server_setup_timeout: srun step creation, interpreter and config load


def slurm_problems(cfg) -> list[str]:
    """What stops this config from being submitted, each with the fix (empty: none)."""
    sc, cluster = cfg.launcher.slurm, cfg.cluster
    problems = [
        f"{tool} is not on PATH: `areal launch slurm` runs where Slurm's client commands "
        "do (a login node; apt-get install slurm-client, or your site's slurm module)"
        for tool in ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
        if shutil.which(tool) is None
    ]
    if cluster.devices_per_node is None:
        problems.append(
            "cluster.devices_per_node: null; on Slurm say what to ask for per node: the "
            "GPUs of each node (one per server and per trainer rank), or 0 for CPU only"
        )
    elif cluster.devices_per_node and layout(cfg).gpus_per_node > cluster.devices_per_node:
        lay = layout(cfg)
        problems.append(
            f"cluster.devices_per_node: {cluster.devices_per_node} GPUs per node cannot "
            f"hold {lay.trainer_nprocs} trainer rank(s) + {lay.servers_per_node} server(s) per "
            f"node (ceil(cluster.n_servers={cluster.n_servers} / "
            f"cluster.n_nodes={cluster.n_nodes})); lower cluster.trainer_nprocs or "
            "cluster.n_servers, or raise cluster.n_nodes"
        )
    if cluster.name_resolve.type == "memory":
        problems.append(
            "cluster.name_resolve.type: memory lives in one process, but the job's servers "
            "and trainers are many; use file (a directory every node sees) or etcd"
        )
    server = getattr(cfg, "server", None)
    serving = launch_plan(cfg).serving
    if cluster.n_nodes > 1 and serving and not server_api_key(server.api_key if server else ""):
        problems.append(
            f"server.api_key: empty, but with cluster.n_nodes={cluster.n_nodes} the servers bind "
            "their node's address, which other machines reach; export AREAL_SERVER_API_KEY=<key> "
            "before launching (it reaches the job by environment, never a file or a command line)"
        )
    if (
        sc.container_image
        and not problems
        and "--container-image" not in run_command(["srun", "--help"]).stdout
    ):
        problems.append(
            f"launcher.slurm.container_image: {sc.container_image!r}, but this srun has no "
            "--container-image option (the pyxis plugin is not installed here); leave it empty or "
            "ask your administrators for pyxis"
        )
    return problems


def job_prologue(script: str, argv: list[str]) -> int:
    """In the job, on its first node: clear the trial's registry; print a free port there."""
    cfg = load_config(load_script_config_class(script), argv)
    reset_trial(cfg)
    print(free_port("0.0.0.0"), flush=True)
    return 0


def submit(cfg, path: Path, lay: Layout) -> SlurmJob:
    """``sbatch`` the script with this env (the servers' key; with the agent proxy, a control
    token made for this attempt), less our pid (nobody remote watches it)."""
    sc = cfg.launcher.slurm
    server = getattr(cfg, "server", None)
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID}
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a native crash leaves its Python stack (procs.py)
    env.update(api_key_env(server_api_key(server.api_key) if server else ""))
    env.update(agent_proxy_env(secrets.token_urlsafe(32) if lay.proxy else ""))
    proc = run_command(["sbatch", "--parsable", str(path)], env=env)
    if proc.returncode == 0:
        return SlurmJob(proc.stdout.strip().split(";")[0])
    error = proc.stderr.strip().replace("\n", "; ")
    if problem := controller_problem(
        error, timed_out=proc.returncode == 124
    ):  # not the request's size
        raise JobFailed(problem)
    raise ConfigError(
        [
            f"sbatch refused the job ({error}). Wanted {lay.wanted(sc.time_limit)}; "
            f"{available(sc.partition)}. {_FIX}"
        ],
        "the Slurm placement",
    )


_FIX = (
    "Ask for less (cluster.n_nodes, cluster.trainer_nprocs, cluster.n_servers, "
    "cluster.devices_per_node, launcher.slurm.cpus_per_process, launcher.slurm.time_limit) or "
    "choose another launcher.slurm.partition"
)


def wait_started(job: SlurmJob, cfg, lay: Layout) -> None:
    """Wait until the job runs (``launcher.slurm.start_timeout``); a pending reason that means
    it can never start raises ConfigError at once, with wanted vs available."""
    sc = cfg.launcher.slurm
    deadline = time.monotonic() + sc.start_timeout
    while job.refresh() in ("PENDING", "CONFIGURING"):
        reason = job.reason
        meaning = never_placed(reason)
        if meaning:
            partition = sc.partition or job.fields.get("Partition", "")
            raise ConfigError(
                [
                    f"job {job.id} can never start as asked: Slurm says {reason}: {meaning}. "
                    f"Wanted {lay.wanted(sc.time_limit)}; {available(partition)}. {_FIX}"
                ],
                "the Slurm placement",
            )
        if time.monotonic() > deadline:
            raise JobFailed(
                f"the job did not start within {sc.start_timeout:g} s "
                f"(launcher.slurm.start_timeout); Slurm's last pending reason: {reason}. "
                f"Wanted {lay.wanted(sc.time_limit)}; {available(sc.partition)}. Raise the timeout "
                "to wait for a busy cluster, or ask for less"
            )
        time.sleep(POLL_S)
    if job.state != "RUNNING":
        raise JobFailed(f"the job went {job.state} (reason {job.reason}) before it ran")


def wait_registered(job: SlurmJob, registry, cfg, follower: LogFollower) -> None:
    """Wait until the plan's serving roles registered (``launcher.server_setup_timeout`` plus
    STEP_SLACK_S to start the steps); a serving step ending first stops the run, the job ending
    first stops the wait."""
    serving, logs = launch_plan(cfg).serving, cfg.run_dir / "logs"
    limit = cfg.launcher.server_setup_timeout + STEP_SLACK_S
    deadline = time.monotonic() + limit
    seen: set[str] = set()  # serving steps seen running
    names = [r.name for r in serving]
    while serving:
        try:
            wait_for_roles(registry, serving, POLL_S)
            return
        except TimeoutError:
            follower.poll()
        running = job.steps()
        seen |= running or set()
        ended = [s for s in names if running is not None and s in seen - running]
        why = ""
        if job.refresh() != "RUNNING":
            return  # the job is ending: follow() reports how (the trainer's code, or Slurm's state)
        if ended:
            why = f"the step of {', '.join(ended)} ended before all servers registered"
        elif time.monotonic() > deadline:
            keys = {r.registry_key for r in serving}
            got = sum(len(registry.get_subtree(k)) for k in keys)
            why = (
                f"{got} of {len(serving)} server(s) registered within {limit:g} s "
                f"(launcher.server_setup_timeout={cfg.launcher.server_setup_timeout:g} "
                f"+ {STEP_SLACK_S:g} s to start the steps)"
            )
        if why:
            for r in serving:
                if r.name in ended or not ended:
                    log = logs / f"{r.task_log}.log"
                    logger.error(f"last lines of {log}:\n{tail_lines(log, 8)}")
            raise JobFailed(why)


def follow(job: SlurmJob, cfg, follower: LogFollower) -> int:
    """Follow the running job until it is over; the trainer's exit code."""
    while not job.ended:
        follower.poll()
        time.sleep(POLL_S)
        job.refresh()
    follower.poll()
    exit_file = cfg.run_dir / "slurm" / "trainer.exit"
    if not exit_file.is_file():
        why = ENDED_WHY.get(job.state, f"ended {job.state}")
        raise JobFailed(
            f"the job {why} before the trainer finished "
            f"(ExitCode {job.fields.get('ExitCode', '?')})"
        )
    return int(exit_file.read_text().strip())


class _SignalsHeld:
    """SIGINT and SIGTERM wait while the job is cancelled (a bounded wait), then arrive."""

    def __enter__(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def run_once(script: str, argv: list[str], cfg, attempt: int) -> int:
    """Submit, watch and (on any way out but the job's own end) cancel one attempt; the
    trainer's exit code, or 1 when the job failed around it (the cause recorded)."""
    problems = slurm_problems(cfg)
    if problems:
        raise ConfigError(problems, "the Slurm launch")
    lay, sc, logs = layout(cfg), cfg.launcher.slurm, cfg.run_dir / "logs"
    registry = reset_trial(cfg)
    slurm_dir = cfg.run_dir / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    (slurm_dir / "trainer.exit").unlink(missing_ok=True)
    path = slurm_dir / "job.sbatch"
    path.write_text(job_script(cfg, script, without_secrets(argv, cfg), attempt))
    follower = LogFollower(logs, cfg.launcher.echo)
    trainer_start = follower.offsets.get(logs / "trainer.log", 0)
    job, done = None, False
    try:
        with _SignalsHeld():  # a Ctrl-C during sbatch arrives once the job is known, to cancel it
            job = submit(cfg, path, lay)
        (slurm_dir / "job.id").write_text(f"{job.id}\n")
        logger.info(
            f"submitted job {job.id} ({path}); should this launcher be killed, cancel it with "
            f"`scancel {job.id}` or `scancel --name={job_name(cfg)}`"
        )
        wait_started(job, cfg, lay)
        logger.info(f"job {job.id} runs on {job.fields.get('NodeList', '?')}")
        wait_registered(job, registry, cfg, follower)
        code = follow(job, cfg, follower)
        done = True
    except JobFailed as e:
        logger.error(f"job {job.id if job else '(not submitted)'}: {e}; logs in {logs}")
        record_failure(logs, "job", 1, str(e))
        return 1
    finally:
        if job is not None:
            with _SignalsHeld():
                job.wait_gone(sc.cancel_timeout) if done else job.cancel(sc.cancel_timeout)
    if code != 0:
        lines = tail_lines(logs / "trainer.log", 400, trainer_start).splitlines()
        cause = root_cause(lines, code)
        logger.error(
            f"trainer exited with code {code} ({cause}); last lines:\n" + "\n".join(lines[-20:])
        )
        record_failure(logs, "trainer", code, cause)
    return code


def launch_slurm(script: str, argv: list[str]) -> int:
    """Validate the config, then run (and, with recover.mode=auto, relaunch) the job on Slurm."""
    run = partial(run_once, script, argv)
    return launch(script, argv, run, "slurm", PLACES)


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.launcher.slurm SCRIPT [--config YAML] [overrides]``; inside the job,
    ``--job-prologue SCRIPT ...`` (see :func:`job_prologue`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--job-prologue"] and len(argv) > 1:
        return job_prologue(argv[1], argv[2:])
    try:
        return launcher_main("slurm", launch_slurm, argv)
    except ConfigError as e:
        print(f"areal launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
