"""``areal launch local SCRIPT --config YAML [overrides]``: one machine, real processes.

Places the run's launch plan (:mod:`areal.launcher.plan`) here. Clears the trial's registry,
starts its serving roles (``cluster.n_servers`` generation servers: ours, or SGLang / vLLM when
``rollout.backend`` says so and they are installed; ``distill.n_servers`` teacher servers), with
``workflow.type: agent_cmd`` the agent proxy role (areal.launcher.agent_proxy_task; a control
token per attempt, by env to it and the trainers; its exit stops the run), and at once, beside
them, SCRIPT under ``torchrun`` on ``cluster.trainer_nprocs`` ranks with the launch env contract
(:mod:`areal.api.launch`): the trainers' start-up overlaps the servers'. Each server is
registered under its role's key once it answers ``/health``; one that dies or misses
``launcher.server_setup_timeout`` first stops the run. The trainers wait for the servers in the
registry (``launcher.server_setup_timeout`` + ``rollout.setup_timeout``). On a GPU machine the
trainer ranks get GPUs ``0..trainer_nprocs-1``, server ``i`` the GPU after them and teacher
``j`` generation server ``j``'s (``CUDA_VISIBLE_DEVICES``; inside a server its GPU is
``cuda``). Logs go to RUN_DIR/logs/<process>.log and to the console with a prefix. Everything
is torn down on exit, on Ctrl-C / SIGTERM, and when the trainer fails. A generation server that
dies is restarted on its port with the newest published weights and their version
(``launcher.server_restarts`` times; disk weight updates only; never a teacher), and the
trainer's client takes it back at its next weight update, or at once when it was the last one
(the client waits up to ``rollout.server_restart_timeout`` for it); meanwhile the client fails
over to the others, and past the limit it stops the run once all are gone. With
``recover.mode=auto`` a failed run is relaunched up to ``recover.retries`` times and the script
resumes from its last recover checkpoint.

SCRIPT must define ``CONFIG`` (its config class) at module level so the launcher validates the
whole config before starting anything.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from areal.api.launch import (
    agent_proxy_env,
    api_key_env,
    devices_env,
    threads_env,
    trainer_env,
    visible_devices,
)
from areal.launcher.common import (
    launch,
    launcher_main,
    register_role,
    reset_trial,
    task_command,
    thread_split,
    usable_cores,
    without_secrets,
)
from areal.launcher.plan import LaunchPlan, launch_plan
from areal.launcher.procs import Child, ProcessSupervisor, http_ok
from areal.launcher.servers import ManagedServer
from areal.utils.logging import get_logger
from areal.utils.network import free_port

logger = get_logger("launcher")
# the roles this launcher places (Role.placement, areal.launcher.plan); others are refused
PLACES = frozenset({"server", "colocated server", "teacher", "agent_proxy", "trainer"})


def gpu_layout(
    gpus: list[str], trainer_nprocs: int, n_servers: int, colocate: bool | None = None
) -> tuple[str | None, list[str | None]]:
    """CUDA_VISIBLE_DEVICES for the trainer and for each server, from the GPUs ``gpus`` this
    launch may use (the user's CUDA_VISIBLE_DEVICES, else all): trainers take the first
    trainer_nprocs (torchrun's LOCAL_RANK picks one each); server i takes the next one, or with
    ``colocate`` the GPU of trainer rank i mod trainer_nprocs (``None`` = colocate only when the
    GPUs are too few for one each). None everywhere without GPUs (CPU run)."""
    if not gpus:
        return None, [None] * n_servers
    have = f"this launch may use {len(gpus)} ({','.join(gpus)})"
    if len(gpus) < trainer_nprocs:
        raise ValueError(
            f"launcher: {trainer_nprocs} trainer ranks need {trainer_nprocs} GPUs, {have}; lower "
            "cluster.trainer_nprocs or widen CUDA_VISIBLE_DEVICES"
        )
    need = trainer_nprocs + n_servers
    colocated = len(gpus) < need if colocate is None else colocate
    if not colocated and len(gpus) < need:
        raise ValueError(
            f"launcher: {trainer_nprocs} trainer ranks + {n_servers} servers need {need} GPUs, "
            f"{have}; set cluster.colocate=true to put the servers on the trainers' GPUs, "
            "lower cluster.n_servers, or widen CUDA_VISIBLE_DEVICES"
        )
    trainers = gpus[:trainer_nprocs]
    if not colocated:
        own: list[str | None] = [*gpus[trainer_nprocs:need]]
        return ",".join(trainers), own
    if colocate is None:
        logger.info(
            f"launcher: {len(gpus)} GPU(s) for {trainer_nprocs} trainer ranks + {n_servers} "
            "servers: each server shares a trainer's GPU (cluster.colocate=false refuses instead)"
        )
    return ",".join(trainers), [trainers[i % trainer_nprocs] for i in range(n_servers)]


@dataclass
class Starting:
    """A started process the launch waits for, beside the trainer: once ``url`` answers 200,
    ``ready()`` runs (a server is registered for the trainers, which wait for it there)."""

    child: Child
    url: str
    ready: Callable[[], None]


def _start_serving(
    sup: ProcessSupervisor, cfg, plan: LaunchPlan, server_gpus: list[str | None], threads: int
) -> tuple[list[ManagedServer], list[Starting]]:
    """Start the plan's serving roles (``threads`` OMP/torch threads each): generation server i
    on ``server_gpus[i]``, teacher j on generation server j's GPU (one machine has few); each
    is registered under its role's key once it answers ``/health`` (its :class:`Starting`)."""
    registry = reset_trial(cfg)
    servers, starting = [], []
    for k, role in enumerate(plan.serving):
        gpu = server_gpus[k % len(server_gpus)] if server_gpus else None
        env = {**threads_env(threads), **devices_env(gpu), **api_key_env(cfg.server.api_key)}
        s = ManagedServer.start(sup, cfg, role, free_port(), env)
        servers.append(s)
        ready = partial(register_role, registry, role, s.address)
        starting.append(Starting(s.child, f"{s.url}/health", ready))
    return servers, starting


def _start_agent_proxy(
    sup: ProcessSupervisor, plan: LaunchPlan, script: str, argv: list[str], cfg
) -> tuple[Child | None, str]:
    """The plan's agent proxy role, if any (it registers itself once it serves; the trainers
    wait for that, and its exit stops the run), and the control token it shares with the
    trainers; else (None, '')."""
    roles = plan.of("agent_proxy")
    if not roles:
        return None, ""
    token, port = secrets.token_urlsafe(32), free_port()
    env = {**threads_env(roles[0].threads), **api_key_env(cfg.server.api_key)}
    public = without_secrets(argv, cfg)
    cmd = task_command(roles[0], sys.executable, script, public, "127.0.0.1", port)
    return sup.start(roles[0].name, cmd, env={**env, **agent_proxy_env(token)}), token


def _usable_gpus(cfg) -> list[str]:
    """The GPU ids this launch may use: the user's CUDA_VISIBLE_DEVICES when set (respected,
    never widened), else ``0..n-1`` for ``cluster.devices_per_node`` or the GPUs torch sees;
    ``cluster.devices_per_node`` caps how many are used."""
    visible = visible_devices()
    n = cfg.cluster.devices_per_node
    if visible is None:
        visible = [str(i) for i in range(gpu_count() if n is None else n)]
    return visible if n is None else visible[:n]


GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, ROCm's


def gpu_count() -> int:
    """The GPUs torch sees; 0 without importing torch (seconds of CPU per launch) when the
    machine has no GPU driver (none of :data:`GPU_DRIVER_NODES`)."""
    if not any(os.path.exists(dev) for dev in GPU_DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count()


def _trainer_command(script: str, argv: list[str], nprocs: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nprocs), "--nnodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(script), *argv,
    ]  # fmt: skip


def run_once(script: str, argv: list[str], cfg, attempt: int) -> int:
    """Place the launch plan here: start its serving roles, agent proxy and trainer at once,
    wait for the trainer, tear everything down; the trainer's code."""
    lc, cluster, plan = cfg.launcher, cfg.cluster, launch_plan(cfg)
    with ProcessSupervisor(cfg.run_dir / "logs", echo=lc.echo, stop_timeout=lc.stop_timeout) as sup:
        trainer_gpus, server_gpus = gpu_layout(
            _usable_gpus(cfg), cluster.trainer_nprocs, cluster.n_servers, cluster.colocate
        )
        server_threads, trainer_threads, how = thread_split(
            lc.server_threads, lc.trainer_threads, len(plan.serving), cluster.trainer_nprocs,
            usable_cores(),
        )  # fmt: skip
        logger.info(f"launcher: {how}")
        # the trainer starts beside the roles it waits for (its imports overlap their start)
        # and waits for them in the registry, where each is published once it answers
        servers, starting = _start_serving(sup, cfg, plan, server_gpus, server_threads)
        proxy, token = _start_agent_proxy(sup, plan, script, argv, cfg)
        server_cfg = getattr(cfg, "server", None)  # experiments without servers (SFT) have none
        colocated = trainer_gpus is not None and bool(
            set(trainer_gpus.split(",")) & set(server_gpus)
        )
        progress = "bar" if sup.console is not None and sup.console.tty else "lines"
        env = {
            **trainer_env(attempt, colocated, progress),
            **threads_env(trainer_threads),
            **devices_env(trainer_gpus),
            **api_key_env(server_cfg.api_key if server_cfg else ""),
            **agent_proxy_env(token),
        }
        cmd = _trainer_command(script, without_secrets(argv, cfg), cluster.trainer_nprocs)
        trainer = sup.start(plan.trainer.name, cmd, env=env)
        try:
            stopped = _watch(sup, cfg, trainer, servers, proxy, starting)
        except (RuntimeError, TimeoutError) as e:  # one died or hung while starting
            logger.error(f"{e}\nthe run stops")
            return 1
        if stopped is not None:
            return stopped
        code = trainer.proc.returncode
        if code != 0:
            logger.error(
                f"trainer exited with code {code}: {trainer.root_cause()}\n"
                f"last lines of this run's trainer output:\n{trainer.tail(20)}"
            )
        return code


def _watch(
    sup: ProcessSupervisor,
    cfg,
    trainer: Child,
    servers: list[ManagedServer],
    proxy: Child | None,
    starting: list[Starting],
) -> int | None:
    """Until the trainer exits: publish each :class:`Starting` once it answers (raises when one
    dies first or misses ``launcher.server_setup_timeout``), restart dead servers (up to
    ``launcher.server_restarts``); the agent proxy's exit code (or 1) if it dies, else None."""
    timeout = cfg.launcher.server_setup_timeout
    deadline = time.monotonic() + timeout
    restartable = [s for s in servers if not any(p.child is s.child for p in starting)]
    while trainer.proc.poll() is None:
        for p in list(starting):
            if http_ok(p.child, p.url, deadline, timeout):
                p.ready()
                starting.remove(p)
                restartable += [s for s in servers if s.child is p.child]
        for s in list(restartable):
            if s.child.proc.poll() is not None and not s.restart(sup, cfg):
                restartable.remove(s)
        if proxy is not None and proxy.proc.poll() is not None:
            logger.error(
                f"the agent proxy exited with code {proxy.proc.returncode}: "
                f"{proxy.root_cause()}; the run stops (see {proxy.log_path})"
            )
            return proxy.proc.returncode or 1
        time.sleep(0.2)
    return None


def launch_local(script: str, argv: list[str]) -> int:
    """Validate the config, then run (and, with recover.mode=auto, relaunch) the job here."""

    def run_local(cfg, attempt: int) -> int:
        if cfg.cluster.n_nodes != 1:
            logger.error(
                f"cluster.n_nodes={cfg.cluster.n_nodes}: `areal launch local` runs one "
                "machine; set cluster.n_nodes=1"
            )
            return 2
        return run_once(script, argv, cfg, attempt)

    return launch(script, argv, run_local, "local", PLACES)


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.launcher.local SCRIPT [--config YAML] [overrides]``."""
    return launcher_main("local", launch_local, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
