"""The batch script of one Slurm launch attempt, RUN_DIR/slurm/job.sbatch (the layout of the
allocation, the ``#SBATCH`` header and one ``srun`` step per process group): see
:mod:`areal.launcher.slurm` for the steps it runs and the launcher that submits it."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from areal.api.launch import threads_env, trainer_env
from areal.launcher.common import task_command
from areal.launcher.plan import Role, launch_plan

PY = '"$py"'  # the interpreter, as the batch script names it


@dataclass(frozen=True)
class Layout:
    """What the allocation asks for, per node."""

    nodes: int
    trainer_nprocs: int  # per node
    servers: int  # in all: the plan's serving roles (generation, then teacher servers)
    cpus_per_process: int
    gpus: bool  # one GPU per process (the agent proxy's excepted)
    proxy: bool = False  # the agent proxy role, a CPU-only process on the first node

    @property
    def servers_per_node(self) -> int:
        return math.ceil(self.servers / self.nodes)

    @property
    def gpus_per_node(self) -> int:
        return self.trainer_nprocs + self.servers_per_node if self.gpus else 0

    @property
    def processes_per_node(self) -> int:
        return self.trainer_nprocs + self.servers_per_node + int(self.proxy)

    def wanted(self, time_limit: str = "") -> str:
        k, c = self.processes_per_node, self.cpus_per_process
        proxy = " + the agent proxy" if self.proxy else ""
        text = (
            f"{self.nodes} node(s), each {k} process(es) ({self.trainer_nprocs} trainer rank(s) + "
            f"up to {self.servers_per_node} server(s){proxy}) x {c} CPU(s) = {k * c} CPUs"
        )
        text += f" and {self.gpus_per_node} GPU(s)" if self.gpus else ""
        return text + (f", time limit {time_limit}" if time_limit else "")


def layout(cfg) -> Layout:
    """What the launch plan (:mod:`areal.launcher.plan`) asks of the allocation."""
    plan = launch_plan(cfg)
    return Layout(
        cfg.cluster.n_nodes,
        cfg.cluster.trainer_nprocs,
        len(plan.serving),
        cfg.launcher.slurm.cpus_per_process,
        bool(cfg.cluster.devices_per_node),
        bool(plan.of("agent_proxy")),
    )


def job_name(cfg) -> str:
    return f"areal-{cfg.experiment_name}-{cfg.trial_name}"


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


def _line(words: list[str], raw: AbstractSet[str] = frozenset()) -> str:
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
    options += [f"--gpus-per-node={lay.gpus_per_node}"] if lay.gpus else []
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
        "# (export AREAL_SERVER_API_KEY first if the servers use an admin key: it is never "
        "written here).",
        f"# Asks for {lay.wanted()}.",
        f"# Serving role k (servers, then teachers) is a one-task step on node k mod {lay.nodes}; "
        "the trainer is one torchrun per node.",
        "# Logs: RUN_DIR/logs/{job,trainer,<role>,<role>-task}.log.",
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
        "# clear the trial's registry (no address of an earlier run survives), pick the "
        "rendezvous port",
        f"master_port=$({_line(prologue, {PY})} | tail -n 1)",
        '[[ "$master_port" =~ ^[0-9]+$ ]] || { echo "prologue failed (see above)"; exit 2; }',
    ]
    for role in launch_plan(cfg).tasks:
        lines += _task_lines(cfg, lay, role, args)
    return "\n".join(lines + _trainer_lines(cfg, lay, attempt, args)) + "\n"


def _task_lines(cfg, lay: Layout, role: Role, args: list[str]) -> list[str]:
    """A one-task step on the role's node running it (``server_task``: output to
    ``<name>-task.log``, the server's own to ``<name>.log``; ``agent_proxy_task``, CPU only:
    ``agent_proxy.log``, its control token by sbatch's env), in the background."""
    node = role.node or 0
    host = f'"$(node_addr "${{nodes[{node}]}}")"' if lay.nodes > 1 else "127.0.0.1"
    if not lay.gpus:
        devices = []
    else:
        devices = ["--gpus-per-task=1"] if role.accelerator else ["--gres=none"]
    cmd = _srun(
        cfg,
        [f"--job-name={role.name}", "--nodes=1", "--ntasks=1", f"--relative={node}",
         f"--cpus-per-task={lay.cpus_per_process}", *devices],
        [*_env(threads_env(role.threads)),
         *task_command(role, PY, args[0], [*args[1:], "launcher.echo=false"], host)],
    )  # fmt: skip
    return [
        f"# {role.name} ({role.setting})",
        f'{_line(cmd, {PY, host})} >> "$run_dir/logs/{role.task_log}.log" 2>&1 &',
    ]
