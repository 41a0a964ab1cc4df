"""``areal launch ray SCRIPT --config YAML [overrides]`` (also ``python -m areal.launcher.ray``):
the job on a Ray cluster.

Attaches to the cluster ``launcher.ray.address`` names (empty: Ray's own lookup, which ends in a
new local instance). Reserves one placement group (``launcher.ray.placement_strategy``) with a
bundle per generation server (``cluster.n_servers``) and per trainer rank (``cluster.n_nodes x
cluster.trainer_nprocs``), one accelerator each on GPU clusters (with ``workflow.type:
agent_cmd`` one more, CPU only, for the agent proxy role, areal.launcher.agent_proxy_task: it
registers itself, shares a control token with the trainer ranks by env, and its exit stops the
run), and fails fast, naming wanted vs available resources, when the cluster cannot hold it or
it is not placed within ``launcher.ray.placement_timeout``. Each bundle holds one
:class:`ProcessHost` actor, which runs one process under a :class:`ProcessSupervisor` (log in
RUN_DIR/logs/<name>.log; RUN_DIR must be on a filesystem every node shares): a server is
``areal.launcher.server_task`` (log ``server<i>-task.log``; it picks a port, registers
``host:port`` in the trial registry once healthy, restarts a dead server; the server's own log
is ``server<i>.log``), a trainer
rank runs SCRIPT with torchrun's variables (``MASTER_ADDR``/``MASTER_PORT`` of rank 0's node,
``RANK``, ``LOCAL_RANK`` among the ranks on its node, ``WORLD_SIZE``) and the launch env contract.

Teardown: when the trainer ranks finish, one fails, on Ctrl-C or SIGTERM, every actor is asked
to stop its process (SIGTERM, ``launcher.stop_timeout``, SIGKILL) and is then killed; the
placement group is removed. Actors belong to this driver, so Ray kills them when the driver dies
(even by SIGKILL), and their processes die with them (parent-death signal, pidfd watch).
``recover.mode=auto`` relaunches as the local launcher does.
"""

from __future__ import annotations

import fnmatch
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from areal.api.launch import (
    agent_proxy_env,
    api_key_env,
    devices_env,
    disable_ray_token_auth,
    threads_env,
    torch_dist_env,
    trainer_env,
)
from areal.launcher.common import (
    launch,
    launcher_main,
    reset_trial,
    task_command,
    wait_for_roles,
    without_secrets,
)
from areal.launcher.plan import LaunchPlan, Role, launch_plan
from areal.launcher.procs import ProcessSupervisor, record_failure
from areal.utils.logging import get_logger
from areal.utils.network import free_port

logger = get_logger("launcher")
POLL_S = 0.5
# the roles this launcher places (Role.placement, areal.launcher.plan); others are refused
PLACES = frozenset({"server", "teacher", "agent_proxy", "trainer"})
RPC_TIMEOUT_S = 60.0  # deadline of one call to an actor (start, poll, stop)


def import_ray():
    """The ``ray`` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SystemExit(
            "areal launch ray: Ray is not installed; install the extra with "
            "`pip install -e '.[ray]'` (or `pip install 'ray>=2.30'`)"
        ) from None
    return ray


class ProcessHost:
    """A Ray actor running one process of the job on its node (see the module docstring)."""

    def __init__(self, log_dir: str, echo: bool, stop_timeout: float):
        self.sup = ProcessSupervisor(log_dir, echo=echo, stop_timeout=stop_timeout)

    def node(self) -> dict[str, Any]:
        """This actor's node: IP, accelerator ids Ray gave it, and a free port there."""
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "port": free_port(),
            "host": socket.gethostname(),
        }

    def start(self, name: str, cmd: list[str], env: dict[str, str], cwd: str) -> int:
        """Start the process; its pid."""
        return self.sup.start(name, cmd, env=env, cwd=cwd).proc.pid

    def poll(self) -> tuple[int | None, str]:
        """(exit code or None while it runs, the root-cause line once it failed)."""
        child = self.sup.children[0]
        code = child.proc.poll()
        return code, (child.root_cause() if code else "")

    def tail(self, n: int = 20) -> str:
        return self.sup.children[0].tail(n)

    def stop(self) -> None:
        """SIGTERM the process tree, then SIGKILL what is left after the stop timeout."""
        self.sup.stop_all()


def forwarded_env(patterns: list[str]) -> dict[str, str]:
    """This process's variables whose names match one of ``patterns``
    (``launcher.ray.forward_env``)."""
    return {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def _gpus_per_process(ray, cfg) -> int:
    if cfg.cluster.devices_per_node is not None:
        return 1 if cfg.cluster.devices_per_node > 0 else 0
    return 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0


def _place(ray, cfg, plan: LaunchPlan) -> tuple[Any, dict[str, list[int]]]:
    """A ready placement group of one bundle per process of the plan, in plan order (a role
    without an accelerator gets a CPU-only bundle), and role name -> its bundles; or an error
    naming wanted vs available resources."""
    from ray.util.placement_group import placement_group, remove_placement_group

    rc = cfg.launcher.ray
    gpus = _gpus_per_process(ray, cfg)
    bundle = {"CPU": rc.cpus_per_process, **({"GPU": gpus} if gpus else {})}
    bundles: list[dict] = []
    where: dict[str, list[int]] = {}
    for role in plan.roles:
        where[role.name] = list(range(len(bundles), len(bundles) + role.processes))
        shape = bundle if role.accelerator else {"CPU": rc.cpus_per_process}
        bundles += [dict(shape) for _ in range(role.processes)]
    wanted: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            wanted[k] = wanted.get(k, 0) + v
    total = ray.cluster_resources()
    short = {k: (v, total.get(k, 0.0)) for k, v in wanted.items() if v > total.get(k, 0.0)}
    what = _what(plan, bundle, rc.cpus_per_process)
    if short:
        raise RuntimeError(
            f"launch ray: {what} need {wanted}; the cluster has "
            + ", ".join(f"{k} {have:g} (wanted {want:g})" for k, (want, have) in short.items())
            + "; lower cluster.n_servers / distill.n_servers / cluster.trainer_nprocs / "
            "launcher.ray.cpus_per_process or add nodes"
        )
    pg = placement_group(bundles, strategy=rc.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=rc.placement_timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"launch ray: {what} ({rc.placement_strategy}) were not placed within "
            f"{rc.placement_timeout:g} s (launcher.ray.placement_timeout); wanted {wanted}, "
            f"available now {ray.available_resources()}: other jobs hold resources, or the "
            "strategy cannot be met by the nodes' shapes"
        ) from None
    return pg, where


def _what(plan: LaunchPlan, bundle: dict, cpus: float) -> str:
    """The plan's processes in words: ``1 server(s) + 2 trainer rank(s), {...} each``."""
    teachers = len(plan.of("teacher"))
    return (
        f"{len(plan.of('server'))} server(s)"
        + (f" + {teachers} teacher server(s)" if teachers else "")
        + f" + {plan.trainer.processes} trainer rank(s), {bundle} each"
        + (f", + the agent proxy ({cpus:g} CPU)" if plan.of("agent_proxy") else "")
    )


class _Job:
    """The actors of one attempt and how to stop them."""

    def __init__(self, ray, cfg, pg, bundles: dict[str, list[int]]):
        self.ray, self.cfg, self.pg, self.bundles = ray, cfg, pg, bundles
        self.actors: dict[str, Any] = {}
        self.host_cls = ray.remote(ProcessHost)

    def actor(self, name: str, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lc = self.cfg.launcher
        gpus = self.pg.bundle_specs[bundle].get("GPU", 0)
        a = self.host_cls.options(
            name=None,
            num_cpus=lc.ray.cpus_per_process,
            num_gpus=gpus,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle
            ),
        ).remote(str(self.cfg.run_dir / "logs"), lc.echo, lc.stop_timeout)
        self.actors[name] = a
        return a

    def call(self, ref, what: str):
        try:
            return self.ray.get(ref, timeout=RPC_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"launch ray: {what} did not answer within {RPC_TIMEOUT_S:g} s"
            ) from None

    def poll(self, name: str) -> tuple[int | None, str]:
        """(exit code or None while it runs, cause) of the process of actor ``name``; a dead
        actor counts as exit code 1."""
        try:
            return self.call(self.actors[name].poll.remote(), name)
        except self.ray.exceptions.RayActorError as e:
            return 1, f"its actor died: {e}"

    def stop(self) -> None:
        """Stop every process (in parallel, bounded), kill every actor, free the bundles."""
        from ray.util.placement_group import remove_placement_group

        refs = [a.stop.remote() for a in self.actors.values()]
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=self.cfg.launcher.stop_timeout + 15)
        except Exception as e:  # a dead actor: its process died with it
            logger.warning(f"stopping the job's processes: {e!r}")
        for a in self.actors.values():
            self.ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)


def run_once(script: str, argv: list[str], cfg, attempt: int) -> int:
    """One attempt on the Ray cluster: the launch plan placed, its roles started in plan order
    (each once the roles it waits for registered); the trainer ranks' exit code (first failure
    wins)."""
    ray = import_ray()
    plan, lc = launch_plan(cfg), cfg.launcher
    if cfg.cluster.n_nodes > 1 and plan.serving and not cfg.server.api_key:
        logger.error(
            "cluster.n_nodes > 1: servers bind their node's address, which needs "
            "server.api_key (pass it by env: AREAL_SERVER_API_KEY)"
        )
        return 2
    handler = signal.getsignal(signal.SIGTERM)
    if not ray.is_initialized():
        disable_ray_token_auth()  # an empty address may start a local instance
        ray.init(address=lc.ray.address or None, log_to_driver=lc.echo, include_dashboard=False)
    signal.signal(signal.SIGTERM, handler)  # ray.init installs its own; ours tears down first
    try:
        pg, bundles = _place(ray, cfg, plan)
    except RuntimeError as e:
        logger.error(str(e))
        record_failure(_logs(cfg), "launcher", 2, str(e))
        return 2
    job = _Job(ray, cfg, pg, bundles)
    try:
        return _run(job, plan, script, argv, attempt)
    finally:
        job.stop()


def _logs(cfg) -> Path:
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _run(job: _Job, plan: LaunchPlan, script: str, argv: list[str], attempt: int) -> int:
    """Start the plan's roles in order, each once the roles it waits for registered; follow."""
    cfg, lc = job.cfg, job.cfg.launcher
    script = str(Path(script).resolve())
    reserved = max(1, int(lc.ray.cpus_per_process))  # each process's bundle: its threads by default
    logger.info(
        f"threads: per server {lc.server_threads or reserved}, per trainer rank "
        f"{lc.trainer_threads or reserved} (launcher.server_threads / trainer_threads; 0 = the "
        "bundle's launcher.ray.cpus_per_process)"
    )
    server_cfg = getattr(cfg, "server", None)
    common = {
        **forwarded_env(lc.ray.forward_env),
        **api_key_env(server_cfg.api_key if server_cfg else ""),
    }
    token = agent_proxy_env(secrets.token_urlsafe(32) if plan.of("agent_proxy") else "")
    env = {
        r.name: {
            **common,
            **threads_env(r.threads or reserved),
            **(token if r.shares_token else {}),
        }
        for r in plan.roles
    }
    registry, public = reset_trial(cfg), without_secrets(argv, cfg)
    for role in plan.tasks:
        _wait_registered(job, registry, plan.of(*role.after))
        _start_task(job, role, script, public, env[role.name])
    _wait_registered(job, registry, plan.of(*plan.trainer.after))
    ranks = _start_ranks(job, plan.trainer, script, public, env[plan.trainer.name], attempt)
    return _follow(job, plan.tasks, ranks)


def _start_task(job: _Job, role: Role, script: str, public: list[str], env: dict) -> None:
    """``role`` (a serving or agent-proxy role) as a task on its bundle; a serving role's task
    logs to ``<name>-task.log``, its server to ``<name>.log``."""
    a = job.actor(role.name, job.bundles[role.name][0])
    node = job.call(a.node.remote(), f"{role.name}'s actor")
    host = "127.0.0.1" if job.cfg.cluster.n_nodes == 1 else node["ip"]
    cmd = task_command(role, sys.executable, script, public, host)
    job.call(a.start.remote(role.task_log, cmd, env, os.getcwd()), role.name)


def _start_ranks(
    job: _Job, trainer: Role, script: str, public: list[str], env: dict, attempt: int
) -> list[str]:
    """The trainer role's ranks, each on its bundle with torchrun's variables; their names."""
    n_ranks = trainer.processes
    names = [f"trainer{r}" for r in range(n_ranks)]
    ranks = [job.actor(n, b) for n, b in zip(names, job.bundles[trainer.name])]
    nodes = [job.call(a.node.remote(), f"trainer rank {r}'s actor") for r, a in enumerate(ranks)]
    master_addr, master_port = nodes[0]["ip"], nodes[0]["port"]
    local: dict[str, list[int]] = {}  # node ip -> its ranks, in rank order
    for r, node in enumerate(nodes):
        local.setdefault(node["ip"], []).append(r)
    for r, (a, node) in enumerate(zip(ranks, nodes)):
        peers = local[node["ip"]]
        gpus = ",".join(g for p in peers for g in nodes[p]["gpus"]) or None  # cuda:LOCAL_RANK
        rank_env = {
            **torch_dist_env(r, n_ranks, peers.index(r), master_addr, master_port),
            **trainer_env(attempt),
            **devices_env(gpus),
            **env,
        }
        cmd = [sys.executable, script, *public]
        job.call(a.start.remote(names[r], cmd, rank_env, os.getcwd()), f"trainer rank {r}")
    return names


def _wait_registered(job: _Job, registry, roles: list[Role]) -> None:
    """Wait (``launcher.server_setup_timeout``) until every one of ``roles`` registered; one
    whose task exits first stops the launch with its cause."""
    cfg = job.cfg
    timeout = cfg.launcher.server_setup_timeout
    deadline = time.monotonic() + timeout
    while roles:
        for role in roles:
            code, cause = job.poll(role.name)
            if code is not None:
                raise RuntimeError(
                    f"{role.name} exited with code {code} before registering: {cause}; "
                    f"see {cfg.run_dir / 'logs' / role.task_log}.log"
                )
        try:
            wait_for_roles(registry, roles, min(2.0, max(0.1, deadline - time.monotonic())))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{', '.join(r.name for r in roles)} did not all register within "
                    f"{timeout:g} s (launcher.server_setup_timeout); see their logs in "
                    f"{cfg.run_dir / 'logs'}"
                ) from None


def _follow(job: _Job, tasks: list[Role], ranks: list[str]) -> int:
    """Poll until every trainer rank exited 0 (0) or one failed, or a task whose exit ends the
    run (the agent proxy) exited (its code, cause recorded); a server that is gone is logged."""
    logs = job.cfg.run_dir / "logs"
    done: set[str] = set()
    gone: set[str] = set()
    while len(done) < len(ranks):
        for role in tasks:
            if role.name in gone:
                continue
            code, cause = job.poll(role.name)
            if code is None:
                continue
            gone.add(role.name)
            if role.ends_run:
                logger.error(f"{role.name} exited with code {code}: {cause}; the run stops")
                record_failure(logs, role.name, code or 1, cause)
                return code or 1
            logger.error(
                f"{role.name} is gone (code {code}: {cause}); the trainer continues on the "
                "other servers"
            )
        for r, name in enumerate(ranks):
            if name in done:
                continue
            code, cause = job.poll(name)
            if code == 0:
                done.add(name)
            elif code is not None:
                logger.error(f"trainer rank {r} exited with code {code}: {cause}")
                record_failure(logs, name, code, cause)
                return code
        time.sleep(POLL_S)
    return 0


def launch_ray(script: str, argv: list[str]) -> int:
    """Validate the config, then run (and, with recover.mode=auto, relaunch) the job on Ray."""
    import_ray()

    def run(cfg, attempt: int) -> int:
        try:
            return run_once(script, argv, cfg, attempt)
        except (RuntimeError, TimeoutError) as e:
            logger.error(str(e))
            record_failure(_logs(cfg), "launcher", 1, str(e))
            return 1

    try:
        return launch(script, argv, run, "ray", PLACES)
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()  # detaches, or stops the instance ray.init started


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.launcher.ray SCRIPT [--config YAML] [overrides]``."""
    return launcher_main("ray", launch_ray, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
