"""``areal launch slurm SCRIPT --config YAML [overrides]`` (also ``python -m areal.launcher.slurm``):
the job as one Slurm batch job, launched from a login node.

One allocation holds everything: ``cluster.n_nodes`` nodes, each asked for ``trainer_nprocs +
ceil(n_servers / n_nodes)`` processes of ``launcher.slurm.cpus_per_process`` CPUs (and one GPU
each when ``cluster.devices_per_node`` > 0). Its batch script, RUN_DIR/slurm/job.sbatch (kept, to
read and to rerun with ``sbatch``), runs ``srun`` steps with exactly those resources:

1. a prologue on the first node clears the trial's registry and picks the rendezvous port;
2. server ``i`` is a one-task step on node ``i mod n_nodes`` running
   :mod:`areal.launcher.server_task` (picks a port, registers ``host:port`` in the trial registry
   once healthy, restarts a dead server), output to RUN_DIR/logs/server<i>-task.log and the
   server's own RUN_DIR/logs/server<i>.log;
3. the trainer is one step of one ``torchrun`` per node (``--node_rank`` = the node's index,
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
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from areal.api.config import ConfigError, load_config
from areal.api.launch import LAUNCHER_PID, api_key_env, server_api_key, threads_env, trainer_env
from areal.launcher.common import (
    COLOCATE_LOCAL_ONLY,
    launch,
    load_script_config_class,
    reset_trial,
    wait_for_servers,
)
from areal.launcher.local import without_secrets
from areal.launcher.procs import record_failure, root_cause
from areal.launcher.slurm_errors import controller_problem
from areal.utils.logging import get_logger
from areal.utils.name_resolve import gen_servers_key
from areal.utils.network import free_port

logger = get_logger("launcher")

PY = '"$py"'  # the interpreter, as the batch script names it
POLL_S = 1.0  # seconds between looks at the job's state and logs
COMMAND_TIMEOUT_S = 60.0  # one call of sbatch / scontrol / scancel / sinfo
CONTROLLER_TIMEOUT_S = 120.0  # slurmctld unreachable this long while the job runs: stop
STEP_SLACK_S = 60.0  # beyond server_setup_timeout: srun step creation, interpreter and config load
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "SPECIAL_EXIT",
    "REVOKED",
}
# Pending reasons of a request Slurm will never start as it stands (slurm.schedmd.com
# job_reason_codes). ReqNodeNotAvail is not one: Slurm also shows it for a while during backfill
# and for nodes that come back; such a job waits out start_timeout like Resources or Priority.
NEVER_PLACED = {
    "PartitionConfig": "the request is more than the partition's nodes have: CPUs, GPUs or memory",
    "PartitionNodeLimit": "more nodes than the partition allows or has up",
    "PartitionTimeLimit": "the time limit is above the partition's MaxTime",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "BadConstraints": "no node has what the job asks for",
    "InvalidAccount": "the account does not exist or you are not in it",
    "InvalidQOS": "the QOS does not exist or you may not use it",
    "AccountNotAllowed": "the partition does not accept this account",
    "DependencyNeverSatisfied": "a dependency can never be met",
    "JobHeldAdmin": "an administrator holds the job",
    "JobHeldUser": "the job is held (scontrol release JOBID)",
}
NEVER_PLACED_PREFIXES = ("AssocMax", "QOSMax")  # a per-job limit of the association or QOS


def never_placed(reason: str) -> str:
    """What a pending reason means when it says the job can never start as asked ('' when it
    may still start: Resources, Priority, ReqNodeNotAvail, ...)."""
    if reason.startswith(NEVER_PLACED_PREFIXES):
        return "the request is above a per-job limit of your association or QOS"
    return NEVER_PLACED.get(reason, "")


class JobFailed(RuntimeError):
    """The attempt failed for a reason worth recording (and, with recover.mode=auto, retrying)."""


@dataclass(frozen=True)
class Layout:
    """What the allocation asks for, per node."""

    nodes: int
    trainer_nprocs: int  # per node
    servers: int  # in all
    cpus_per_process: int
    gpus: bool  # one GPU per process

    @property
    def servers_per_node(self) -> int:
        return math.ceil(self.servers / self.nodes)

    @property
    def processes_per_node(self) -> int:
        return self.trainer_nprocs + self.servers_per_node

    def wanted(self, time_limit: str = "") -> str:
        k, c = self.processes_per_node, self.cpus_per_process
        text = (
            f"{self.nodes} node(s), each {k} process(es) ({self.trainer_nprocs} trainer rank(s) + "
            f"up to {self.servers_per_node} server(s)) x {c} CPU(s) = {k * c} CPUs"
        )
        text += f" and {k} GPU(s)" if self.gpus else ""
        return text + (f", time limit {time_limit}" if time_limit else "")


def layout(cfg) -> Layout:
    c = cfg.cluster
    return Layout(
        c.n_nodes,
        c.trainer_nprocs,
        c.n_servers,
        cfg.launcher.slurm.cpus_per_process,
        bool(c.devices_per_node),
    )


def job_name(cfg) -> str:
    return f"areal-{cfg.experiment_name}-{cfg.trial_name}"


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
    elif cluster.devices_per_node and layout(cfg).processes_per_node > cluster.devices_per_node:
        lay = layout(cfg)
        problems.append(
            f"cluster.devices_per_node: {cluster.devices_per_node} GPUs per node cannot hold "
            f"{lay.trainer_nprocs} trainer rank(s) + {lay.servers_per_node} server(s) per node "
            f"(ceil(cluster.n_servers={cluster.n_servers} / cluster.n_nodes={cluster.n_nodes})); lower "
            "cluster.trainer_nprocs or cluster.n_servers, or raise cluster.n_nodes"
        )
    if cluster.colocate:
        problems.append(COLOCATE_LOCAL_ONLY)
    if cluster.name_resolve.type == "memory":
        problems.append(
            "cluster.name_resolve.type: memory lives in one process, but the job's servers "
            "and trainers are many; use file (a directory every node sees) or etcd"
        )
    server = getattr(cfg, "server", None)
    if cluster.n_nodes > 1 and cluster.n_servers and not server_api_key(server.api_key):
        problems.append(
            f"server.api_key: empty, but with cluster.n_nodes={cluster.n_nodes} the servers bind their "
            "node's address, which other machines reach; export AREAL_SERVER_API_KEY=<key> before "
            "launching (it reaches the job by environment, never a file or a command line)"
        )
    if (
        sc.container_image
        and not problems
        and "--container-image" not in _run(["srun", "--help"]).stdout
    ):
        problems.append(
            f"launcher.slurm.container_image: {sc.container_image!r}, but this srun has no "
            "--container-image option (the pyxis plugin is not installed here); leave it empty or "
            "ask your administrators for pyxis"
        )
    return problems


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm command (deadline COMMAND_TIMEOUT_S); its completed process, never raising on
    a non-zero exit."""
    try:
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            cmd, 124, "", f"{cmd[0]} did not answer within {COMMAND_TIMEOUT_S:g} s"
        )


# ----------------------------------------------------------------------------- the batch script


def _srun(cfg, options: list[str], command: list[str]) -> list[str]:
    """``srun`` for one step: exactly the resources it names (``--exact``), sharing the job's
    memory with the other steps (``--mem=0``), in the container if one is set."""
    sc = cfg.launcher.slurm
    cmd = ["srun", "--exact", "--mem=0", *options]
    if sc.container_image:
        cmd += [f"--container-image={sc.container_image}", f"--container-workdir={os.getcwd()}"]
        cmd += (
            [f"--container-mounts={','.join(sc.container_mounts)}"] if sc.container_mounts else []
        )
    return cmd + command


def _env(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def _line(words: list[str], raw: set[str] = frozenset()) -> str:
    """A shell command line: every word quoted except those in ``raw`` (shell expressions)."""
    return " ".join(w if w in raw else shlex.quote(w) for w in words)


def _sbatch_header(cfg, lay: Layout) -> list[str]:
    sc = cfg.launcher.slurm
    options = [
        f"--job-name={job_name(cfg)}",
        f"--nodes={lay.nodes}",
        f"--ntasks-per-node={lay.processes_per_node}",
        f"--cpus-per-task={lay.cpus_per_process}",
    ]
    options += [f"--gpus-per-node={lay.processes_per_node}"] if lay.gpus else []
    options += [f"--partition={sc.partition}"] if sc.partition else []
    options += [f"--account={sc.account}"] if sc.account else []
    options += [f"--time={sc.time_limit}"] if sc.time_limit else []
    options += [
        f"--chdir={os.getcwd()}",
        f"--output={cfg.run_dir.resolve() / 'logs' / 'job.log'}",
        "--open-mode=append",
        *sc.sbatch_lines,
    ]
    return [f"#SBATCH {o}" for o in options]


def _preamble(cfg, lay: Layout, attempt: int) -> list[str]:
    """The script's comments, #SBATCH lines, variables and the rendezvous address."""
    run_dir = cfg.run_dir.resolve()
    lines = [
        "#!/bin/bash",
        f"# Written by `areal launch slurm` for launch attempt {attempt} of {cfg.experiment_name}/"
        f"{cfg.trial_name}. Rerun by hand: sbatch {run_dir / 'slurm' / 'job.sbatch'}",
        "# (export AREAL_SERVER_API_KEY first if the servers use an admin key: it is never written here).",
        f"# Asks for {lay.wanted()}.",
        f"# Server i is a one-task step on node i mod {lay.nodes}; the trainer is one torchrun per node.",
        "# Logs: RUN_DIR/logs/{job,trainer,server<i>,server<i>-task}.log.",
        *_sbatch_header(cfg, lay),
        "set -u -o pipefail",
        f"py={shlex.quote(cfg.launcher.slurm.python or sys.executable)}",
        f"run_dir={shlex.quote(str(run_dir))}",
        'rm -f "$run_dir/slurm/trainer.exit"',
        'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $(date)"',
    ]
    if lay.nodes == 1:
        return lines + ["master_addr=127.0.0.1"]
    # the address Slurm reaches each node at: servers bind it, rank 0's node hosts the rendezvous
    return lines + [
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "node_addr() { scontrol show node -o \"$1\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p'; }",
        'master_addr=$(node_addr "${nodes[0]}")',
    ]


def _trainer_lines(cfg, lay: Layout, attempt: int, args: list[str]) -> list[str]:
    """One torchrun per node (node rank = the node's index in the job); its code ends the job."""
    per_node = [f"--gpus-per-task={lay.trainer_nprocs}"] if lay.gpus else []
    env = {**trainer_env(attempt), **threads_env(cfg.launcher.trainer_threads)}
    torchrun = [
        "bash",
        "-c",
        'exec "$0" -m torch.distributed.run --node_rank="$SLURM_NODEID" "$@"',
        PY,
        f"--nnodes={lay.nodes}",
        f"--nproc_per_node={lay.trainer_nprocs}",
        '--master_addr="$master_addr"',
        '--master_port="$master_port"',
        *args,
    ]
    trainer = _srun(
        cfg,
        [
            "--job-name=trainer",
            f"--nodes={lay.nodes}",
            f"--ntasks={lay.nodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={lay.trainer_nprocs * lay.cpus_per_process}",
            *per_node,
            "--kill-on-bad-exit=1",
        ],
        [*_env(env), *torchrun],
    )
    raw = {PY, '--master_addr="$master_addr"', '--master_port="$master_port"'}
    return [
        f'{_line(trainer, raw)} >> "$run_dir/logs/trainer.log" 2>&1',
        "code=$?",
        'echo "$code" > "$run_dir/slurm/trainer.exit"',
        'echo "trainer exited with code $code: $(date); the job ends and Slurm stops the servers"',
        'exit "$code"',
    ]


def job_script(cfg, script: str, argv: list[str], attempt: int) -> str:
    """The batch script of one attempt (see the module docstring); ``argv`` holds no secret."""
    lay = layout(cfg)
    args = [str(Path(script).resolve()), *argv]
    lines = _preamble(cfg, lay, attempt)
    no_gpu = ["--gres=none"] if lay.gpus else []
    prologue = _srun(
        cfg,
        [
            "--job-name=prologue",
            "--nodes=1",
            "--ntasks=1",
            "--relative=0",
            "--cpus-per-task=1",
            *no_gpu,
        ],
        [PY, "-m", "areal.launcher.slurm", "--job-prologue", *args],
    )
    lines += [
        "# clear the trial's registry (no address of an earlier run survives), pick the rendezvous port",
        f"master_port=$({_line(prologue, {PY})} | tail -n 1)",
        '[[ "$master_port" =~ ^[0-9]+$ ]] || { echo "prologue failed (see above)"; exit 2; }',
    ]
    gpu = ["--gpus-per-task=1"] if lay.gpus else []
    for i in range(lay.servers):
        host = f'"$(node_addr "${{nodes[{i % lay.nodes}]}}")"' if lay.nodes > 1 else "127.0.0.1"
        cmd = _srun(
            cfg,
            [
                f"--job-name=server{i}",
                "--nodes=1",
                "--ntasks=1",
                f"--relative={i % lay.nodes}",
                f"--cpus-per-task={lay.cpus_per_process}",
                *gpu,
            ],
            [
                *_env(threads_env(cfg.launcher.server_threads)),
                PY,
                "-m",
                "areal.launcher.server_task",
                "--name",
                f"server{i}",
                "--host",
                host,
                *args,
                "launcher.echo=false",
            ],
        )
        lines.append(f'{_line(cmd, {PY, host})} >> "$run_dir/logs/server{i}-task.log" 2>&1 &')
    return "\n".join(lines + _trainer_lines(cfg, lay, attempt, args)) + "\n"


def job_prologue(script: str, argv: list[str]) -> int:
    """In the job, on its first node: clear the trial's registry; print a free port there."""
    cfg = load_config(load_script_config_class(script), argv)
    reset_trial(cfg)
    print(free_port("0.0.0.0"), flush=True)
    return 0


# ----------------------------------------------------------------------------- the job, seen from here


def available(partition: str) -> str:
    """What ``partition`` (empty: the default one) has, from sinfo: its nodes' CPUs, GPUs and
    states and its time limit; for a partition that does not exist, the ones that do."""
    proc = _run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%G|%T|%l"])
    if proc.returncode:
        return f"(sinfo failed: {proc.stderr.strip()})"
    parts: dict[str, list[list[str]]] = {}
    default = ""
    for row in (line.split("|") for line in proc.stdout.splitlines()):
        if len(row) != 6:
            continue
        if row[1].endswith("*"):
            row[1] = default = row[1][:-1]
        parts.setdefault(row[1], []).append(row)
    name = partition or default
    if name not in parts:
        there = ", ".join(sorted(parts)) or "none"
        note = f" (default {default})" if default else ""
        return f"there is no partition {name!r}; partitions here: {there}{note}"
    rows = parts[name]
    shown = "; ".join(
        f"{node}: {cpus} CPUs, {'GRES ' + gres if gres != '(null)' else 'no GPUs'}, {state}"
        for node, _, cpus, gres, state, _ in rows[:8]
    )
    more = f"; {len(rows) - 8} more" if len(rows) > 8 else ""
    return f"partition {name} has {len(rows)} node(s) ({shown}{more}), time limit {rows[0][5]}"


class SlurmJob:
    """One submitted job: its fields as ``scontrol show job`` reports them, and its cancellation."""

    def __init__(self, job_id: str):
        self.id = job_id
        self.fields: dict[str, str] = {}
        self._answered = time.monotonic()  # the controller's last answer

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "PENDING")

    @property
    def reason(self) -> str:
        return self.fields.get("Reason", "None")

    @property
    def ended(self) -> bool:
        """Out of the queue: finished and cleaned up (not COMPLETING), or forgotten by Slurm."""
        return self.state in ENDED or self.state == "GONE"

    def refresh(self) -> str:
        """Look the job up again; its state. Raises JobFailed when slurmctld has not answered
        for CONTROLLER_TIMEOUT_S."""
        proc = _run(["scontrol", "show", "job", "-o", self.id])
        if proc.returncode == 0:
            self.fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
            self._answered = time.monotonic()
        elif "Invalid job id" in proc.stderr:  # purged (MinJobAge) or never known
            self.fields = {**self.fields, "JobState": "GONE"}
        elif time.monotonic() - self._answered > CONTROLLER_TIMEOUT_S:
            raise JobFailed(
                f"slurmctld did not answer `scontrol show job` for {CONTROLLER_TIMEOUT_S:g} s: "
                f"{proc.stderr.strip()}"
            )
        return self.state

    def steps(self) -> set[str] | None:
        """Names of the job's running steps (server<i>, trainer, ...); None if squeue failed."""
        proc = _run(["squeue", "-h", "-s", "-j", self.id, "-o", "%j"])
        return set(proc.stdout.split()) if proc.returncode == 0 else None

    def cancel(self, timeout: float) -> None:
        """``scancel`` the job and wait until it left the queue."""
        if not self.ended:
            logger.info(f"cancelling job {self.id} (scancel {self.id})")
            proc = _run(["scancel", self.id])
            if proc.returncode:
                logger.error(f"scancel {self.id} failed: {proc.stderr.strip()}")
        self.wait_gone(timeout)

    def wait_gone(self, timeout: float) -> None:
        """Wait until the job left the queue (its processes stopped); an error naming it after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ended and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
            try:
                self.refresh()
            except JobFailed:
                break
        if not self.ended:
            logger.error(
                f"job {self.id} is still {self.state} {timeout:g} s later (launcher.slurm.cancel_timeout); "
                f"check `squeue -j {self.id}`, scancel it again, or ask an administrator about "
                "nodes stuck in COMPLETING"
            )


class LogFollower:
    """Echoes the new lines of the job's logs (RUN_DIR/logs/*.log, the launcher's own excepted)
    to the console with a ``[name]`` prefix, as the local launcher echoes its children."""

    def __init__(self, log_dir: Path, echo: bool):
        self.dir, self.echo = log_dir, echo
        self.offsets = {p: p.stat().st_size for p in self._logs()}  # earlier attempts: not again

    def _logs(self) -> list[Path]:
        return [p for p in sorted(self.dir.glob("*.log")) if p.name != "launcher.log"]

    def poll(self) -> None:
        if not self.echo:
            return
        for path in self._logs():
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            *lines, rest = data.split(
                b"\n"
            )  # a last line without its newline waits for the next poll
            self.offsets[path] = start + len(data) - len(rest)
            for line in lines:
                sys.stdout.write(f"[{path.stem}] {line.decode(errors='replace')}\n")
        sys.stdout.flush()


def _tail(path: Path, n: int, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def submit(cfg, path: Path, lay: Layout) -> SlurmJob:
    """``sbatch`` the script with this env (the servers' key), less our pid (nobody remote watches it)."""
    sc = cfg.launcher.slurm
    server = getattr(cfg, "server", None)
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID}
    env.update(api_key_env(server_api_key(server.api_key) if server else ""))
    proc = _run(["sbatch", "--parsable", str(path)], env=env)
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
    "Ask for less (cluster.n_nodes, cluster.trainer_nprocs, cluster.n_servers, cluster.devices_per_node, "
    "launcher.slurm.cpus_per_process, launcher.slurm.time_limit) or choose another launcher.slurm.partition"
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
            raise ConfigError(
                [
                    f"job {job.id} can never start as asked: Slurm says {reason}: {meaning}. Wanted "
                    f"{lay.wanted(sc.time_limit)}; {available(sc.partition or job.fields.get('Partition', ''))}. {_FIX}"
                ],
                "the Slurm placement",
            )
        if time.monotonic() > deadline:
            raise JobFailed(
                f"the job did not start within {sc.start_timeout:g} s (launcher.slurm.start_timeout); "
                f"Slurm's last pending reason: {reason}. Wanted {lay.wanted(sc.time_limit)}; "
                f"{available(sc.partition)}. Raise the timeout to wait for a busy cluster, or ask for less"
            )
        time.sleep(POLL_S)
    if job.state != "RUNNING":
        raise JobFailed(f"the job went {job.state} (reason {job.reason}) before it ran")


def wait_registered(job: SlurmJob, registry, cfg, follower: LogFollower) -> None:
    """Wait until ``cluster.n_servers`` servers registered (``launcher.server_setup_timeout``
    plus STEP_SLACK_S to start the steps); a server's step ending first stops the run, the job
    ending first stops the wait."""
    n, logs = cfg.cluster.n_servers, cfg.run_dir / "logs"
    limit = cfg.launcher.server_setup_timeout + STEP_SLACK_S
    deadline = time.monotonic() + limit
    seen: set[str] = set()  # server steps seen running
    while n:
        try:
            wait_for_servers(registry, cfg, POLL_S)
            return
        except TimeoutError:
            follower.poll()
        names = [f"server{i}" for i in range(n)]
        running = job.steps()
        seen |= running or set()
        ended = [s for s in names if running is not None and s in seen - running]
        why = ""
        if job.refresh() != "RUNNING":
            return  # the job is ending: follow() reports how (the trainer's code, or Slurm's state)
        if ended:
            why = f"the step of {', '.join(ended)} ended before all servers registered"
        elif time.monotonic() > deadline:
            got = len(registry.get_subtree(gen_servers_key(cfg.experiment_name, cfg.trial_name)))
            why = (
                f"{got} of {n} server(s) registered within {limit:g} s (launcher.server_setup_timeout="
                f"{cfg.launcher.server_setup_timeout:g} + {STEP_SLACK_S:g} s to start the steps)"
            )
        if why:
            for s in ended or names:
                logger.error(
                    f"last lines of {logs / s}-task.log:\n{_tail(logs / f'{s}-task.log', 8)}"
                )
            raise JobFailed(why)


ENDED_WHY = {
    "CANCELLED": "was cancelled (scancel by a user or an administrator, or preemption)",
    "TIMEOUT": "reached its time limit (launcher.slurm.time_limit, or the partition's)",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "PREEMPTED": "was preempted",
    "BOOT_FAIL": "could not boot its nodes",
    "OUT_OF_MEMORY": "ran out of memory",
    "DEADLINE": "passed its deadline",
    "GONE": "is unknown to Slurm",
}


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
            f"the job {why} before the trainer finished (ExitCode {job.fields.get('ExitCode', '?')})"
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
        lines = _tail(logs / "trainer.log", 400, trainer_start).splitlines()
        cause = root_cause(lines, code)
        logger.error(
            f"trainer exited with code {code} ({cause}); last lines:\n" + "\n".join(lines[-20:])
        )
        record_failure(logs, "trainer", code, cause)
    return code


def launch_slurm(script: str, argv: list[str]) -> int:
    """Validate the config, then run (and, with recover.mode=auto, relaunch) the job on Slurm."""
    return launch(script, argv, lambda cfg, attempt: run_once(script, argv, cfg, attempt))


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.launcher.slurm SCRIPT [--config YAML] [overrides]``; inside the job,
    ``--job-prologue SCRIPT ...`` (see :func:`job_prologue`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--job-prologue"] and len(argv) > 1:
        return job_prologue(argv[1], argv[2:])
    if not argv or argv[0].startswith("-"):
        print("usage: areal launch slurm SCRIPT [--config YAML] [key=value ...]", file=sys.stderr)
        return 2
    try:
        return launch_slurm(argv[0], argv[1:])
    except ConfigError as e:
        print(f"areal launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
