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
from areal.launcher.common import COLOCATE_LOCAL_ONLY, launch, reset_trial, wait_for_servers
from areal.launcher.local import agent_proxy_command, uses_agent_proxy, without_secrets
from areal.launcher.procs import ProcessSupervisor, record_failure
from areal.utils.logging import get_logger
from areal.utils.name_resolve import agent_proxy_key
from areal.utils.network import free_port

logger = get_logger("launcher")
POLL_S = 0.5
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


def _place(ray, cfg, n_servers: int, n_ranks: int, n_cpu_only: int = 0):
    """A ready placement group of ``n_servers + n_ranks`` bundles (servers first), then
    ``n_cpu_only`` bundles without accelerators (the agent proxy), or an error naming wanted vs
    available resources."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if cfg.cluster.colocate:
        raise ValueError(COLOCATE_LOCAL_ONLY)
    rc = cfg.launcher.ray
    gpus = _gpus_per_process(ray, cfg)
    bundle = {"CPU": rc.cpus_per_process, **({"GPU": gpus} if gpus else {})}
    n = n_servers + n_ranks
    wanted = {k: v * n for k, v in bundle.items()}
    wanted["CPU"] += rc.cpus_per_process * n_cpu_only
    total = ray.cluster_resources()
    short = {k: (v, total.get(k, 0.0)) for k, v in wanted.items() if v > total.get(k, 0.0)}
    what = f"{n_servers} server(s) + {n_ranks} trainer rank(s), {bundle} each" + (
        f", + the agent proxy ({rc.cpus_per_process:g} CPU)" if n_cpu_only else ""
    )
    if short:
        raise RuntimeError(
            f"launch ray: {what} need {wanted}; the cluster has "
            + ", ".join(f"{k} {have:g} (wanted {want:g})" for k, (want, have) in short.items())
            + "; lower cluster.n_servers / cluster.trainer_nprocs / "
            "launcher.ray.cpus_per_process or add nodes"
        )
    bundles = [dict(bundle) for _ in range(n)] + [{"CPU": rc.cpus_per_process}] * n_cpu_only
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
    return pg


class _Job:
    """The actors of one attempt and how to stop them."""

    def __init__(self, ray, cfg, pg):
        self.ray, self.cfg, self.pg = ray, cfg, pg
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
    """One attempt on the Ray cluster; the trainer ranks' exit code (first failure wins)."""
    ray = import_ray()
    cluster, lc = cfg.cluster, cfg.launcher
    n_ranks = cluster.n_nodes * cluster.trainer_nprocs
    if cluster.n_nodes > 1 and cluster.n_servers and not cfg.server.api_key:
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
        pg = _place(ray, cfg, cluster.n_servers, n_ranks, int(uses_agent_proxy(cfg)))
    except RuntimeError as e:
        logger.error(str(e))
        record_failure(_logs(cfg), "launcher", 2, str(e))
        return 2
    job = _Job(ray, cfg, pg)
    try:
        return _run(job, script, argv, attempt, n_ranks)
    finally:
        job.stop()


def _logs(cfg) -> Path:
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _run(job: _Job, script: str, argv: list[str], attempt: int, n_ranks: int) -> int:
    cfg = job.cfg
    cluster, lc = cfg.cluster, cfg.launcher
    script, cwd = str(Path(script).resolve()), os.getcwd()
    public = without_secrets(argv, cfg)
    reserved = max(1, int(lc.ray.cpus_per_process))  # each process's bundle: its threads by default
    server_threads, trainer_threads = lc.server_threads or reserved, lc.trainer_threads or reserved
    logger.info(
        f"threads: per server {server_threads}, per trainer rank {trainer_threads} "
        "(launcher.server_threads / trainer_threads; 0 = the bundle's "
        "launcher.ray.cpus_per_process)"
    )
    server_cfg = getattr(cfg, "server", None)
    key = {
        **forwarded_env(lc.ray.forward_env),
        **api_key_env(server_cfg.api_key if server_cfg else ""),
    }
    registry = reset_trial(cfg)
    servers = _start_servers(job, script, public, {**threads_env(server_threads), **key})
    if servers:
        _wait_registered(job, registry, servers)
    proxy = None
    if uses_agent_proxy(cfg):  # on the last bundle; the trainers share its control token
        key = {**key, **agent_proxy_env(secrets.token_urlsafe(32))}
        proxy = _start_agent_proxy(job, registry, script, argv, cluster.n_servers + n_ranks, key)
    ranks = [job.actor(f"trainer{r}", cluster.n_servers + r) for r in range(n_ranks)]
    nodes = [job.call(a.node.remote(), f"trainer rank {r}'s actor") for r, a in enumerate(ranks)]
    master_addr, master_port = nodes[0]["ip"], nodes[0]["port"]
    local: dict[str, list[int]] = {}  # node ip -> its ranks, in rank order
    for r, node in enumerate(nodes):
        local.setdefault(node["ip"], []).append(r)
    for r, (a, node) in enumerate(zip(ranks, nodes)):
        peers = local[node["ip"]]
        gpus = (
            ",".join(g for p in peers for g in nodes[p]["gpus"]) or None
        )  # cuda:LOCAL_RANK is ours
        env = {
            **torch_dist_env(r, n_ranks, peers.index(r), master_addr, master_port),
            **trainer_env(attempt),
            **threads_env(trainer_threads),
            **devices_env(gpus),
            **key,
        }
        job.call(
            a.start.remote(f"trainer{r}", [sys.executable, script, *public], env, cwd),
            f"trainer rank {r}",
        )
    return _follow(job, servers, ranks, proxy)


def _start_servers(job: _Job, script: str, public: list[str], env: dict[str, str]) -> dict:
    """One server task per server bundle (the first ``cluster.n_servers``); name -> actor."""
    cluster = job.cfg.cluster
    servers = {f"server{i}": job.actor(f"server{i}", i) for i in range(cluster.n_servers)}
    for name, a in servers.items():
        node = job.call(a.node.remote(), f"{name}'s actor")
        host = "127.0.0.1" if cluster.n_nodes == 1 else node["ip"]
        cmd = [sys.executable, "-m", "areal.launcher.server_task", "--name", name,
               "--host", host, script, *public]  # fmt: skip
        job.call(a.start.remote(f"{name}-task", cmd, env, os.getcwd()), name)
    return servers


def _start_agent_proxy(job: _Job, registry, script: str, argv: list[str], bundle: int, env):
    """The agent proxy role (areal.launcher.agent_proxy_task) on bundle ``bundle``, once it
    registered itself (``launcher.server_setup_timeout``); its actor."""
    cfg = job.cfg
    a = job.actor("agent_proxy", bundle)
    node = job.call(a.node.remote(), "the agent proxy's actor")
    host = "127.0.0.1" if cfg.cluster.n_nodes == 1 else node["ip"]
    cmd = agent_proxy_command(script, argv, cfg, host)
    job.call(
        a.start.remote("agent_proxy", cmd, {**threads_env(1), **env}, os.getcwd()),
        "the agent proxy",
    )
    key = agent_proxy_key(cfg.experiment_name, cfg.trial_name)
    deadline = time.monotonic() + cfg.launcher.server_setup_timeout
    while not registry.get_subtree(key):
        code, cause = job.call(a.poll.remote(), "the agent proxy")
        if code is not None:
            raise RuntimeError(
                f"the agent proxy exited with code {code} before registering: {cause}; "
                f"see {cfg.run_dir / 'logs' / 'agent_proxy.log'}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the agent proxy did not register within {cfg.launcher.server_setup_timeout:g} s "
                "(launcher.server_setup_timeout); see RUN_DIR/logs/agent_proxy.log"
            )
        time.sleep(POLL_S)
    return a


def _wait_registered(job: _Job, registry, servers: dict[str, Any]) -> None:
    """Wait (``launcher.server_setup_timeout``) until every server registered; a server task
    that exits first stops the launch with its cause."""
    cfg = job.cfg
    deadline = time.monotonic() + cfg.launcher.server_setup_timeout
    while True:
        for name, a in servers.items():
            code, cause = job.call(a.poll.remote(), name)
            if code is not None:
                raise RuntimeError(
                    f"{name} exited with code {code} before registering: {cause}; "
                    f"see {cfg.run_dir / 'logs' / name}.log"
                )
        try:
            wait_for_servers(registry, cfg, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{len(servers)} server(s) did not all register "
                    f"within {cfg.launcher.server_setup_timeout:g} s "
                    "(launcher.server_setup_timeout); see RUN_DIR/logs/server*.log"
                ) from None


def _follow(job: _Job, servers: dict[str, Any], ranks: list, proxy=None) -> int:
    """Poll until every trainer rank exited 0 (0) or one failed, or the agent proxy exited (its
    code, cause recorded)."""
    cfg, ray = job.cfg, job.ray
    done: set[int] = set()
    gone: set[str] = set()
    while len(done) < len(ranks):
        if proxy is not None:
            try:
                code, cause = job.call(proxy.poll.remote(), "the agent proxy")
            except ray.exceptions.RayActorError as e:
                code, cause = 1, f"its actor died: {e}"
            if code is not None:
                logger.error(f"the agent proxy exited with code {code}: {cause}; the run stops")
                record_failure(cfg.run_dir / "logs", "agent_proxy", code or 1, cause)
                return code or 1
        for r, a in enumerate(ranks):
            if r in done:
                continue
            try:
                code, cause = job.call(a.poll.remote(), f"trainer rank {r}")
            except ray.exceptions.RayActorError as e:
                code, cause = 1, f"the actor of trainer rank {r} died: {e}"
            if code == 0:
                done.add(r)
            elif code is not None:
                logger.error(f"trainer rank {r} exited with code {code}: {cause}")
                record_failure(cfg.run_dir / "logs", f"trainer{r}", code, cause)
                return code
        for name, a in servers.items():
            if name in gone:
                continue
            try:
                code, cause = job.call(a.poll.remote(), name)
            except ray.exceptions.RayActorError as e:
                code, cause = 1, f"its actor died: {e}"
            if code is not None:
                gone.add(name)
                logger.error(
                    f"{name} is gone (code {code}: {cause}); the trainer continues on the "
                    "other servers"
                )
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
        return launch(script, argv, run)
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()  # detaches, or stops the instance ray.init started


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.launcher.ray SCRIPT [--config YAML] [overrides]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: areal launch ray SCRIPT [--config YAML] [key=value ...]", file=sys.stderr)
        return 2
    return launch_ray(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
