"""``python -m areal.launcher.server_task --name NAME [--host HOST] SCRIPT [--config YAML]
[overrides]``: one serving role of the launch plan (:mod:`areal.launcher.plan`: generation
server ``server<i>`` or distillation teacher server ``teacher<j>``) on a cluster node, for the
Ray and Slurm launchers.

It picks a free port on this node, starts the role's server (:class:`ManagedServer`, under a
:class:`ProcessSupervisor`: logs in RUN_DIR/logs/NAME.log, the server dies with this task),
registers ``host:port`` under the role's key in the trial's registry once ``/health`` answers
(deadline ``launcher.server_setup_timeout``), and stays in front of it: a server that dies is
restarted as the local launcher does, as often as its role allows (``launcher.server_restarts``
for a generation server; never a teacher). SIGTERM/SIGINT stop the server; the exit
code is the server's (0 after a clean stop). ``--host`` is the address the server binds and
trainers connect to (default 127.0.0.1, a one-machine cluster; a non-loopback address needs
``server.api_key``, passed by env).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from areal.api.config import ConfigError, load_config
from areal.api.launch import LaunchEnv, api_key_env, threads_env
from areal.launcher.common import load_script_config_class, parse_task_args, register_role
from areal.launcher.plan import launch_plan
from areal.launcher.procs import ProcessSupervisor
from areal.launcher.servers import ManagedServer
from areal.utils.logging import get_logger
from areal.utils.name_resolve import make_repository
from areal.utils.network import free_port
from areal.utils.process import die_with

logger = get_logger("server_task")


def run_server_task(name: str, host: str, script: str, argv: list[str]) -> int:
    """Start, register and keep alive one server (see the module docstring); its exit code."""
    cfg = load_config(load_script_config_class(script), argv)
    lc, role = cfg.launcher, launch_plan(cfg).role(name)
    launcher = LaunchEnv.read().launcher_pid
    if launcher:  # a Ray actor or a batch step: stop (SIGTERM, handled below) once it is gone
        die_with(launcher)
    env = {**threads_env(role.threads), **api_key_env(cfg.server.api_key)}
    stop = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        # The server's output goes to its own log only: this task's output (the caller's log)
        # says where it serves, and when it was restarted.
        with ProcessSupervisor(
            cfg.run_dir / "logs", echo=False, stop_timeout=lc.stop_timeout
        ) as sup:
            server = ManagedServer.start(sup, cfg, role, free_port(), env, host)
            sup.wait_http_ok(server.child, f"{server.url}/health", lc.server_setup_timeout)
            registry = make_repository(cfg.cluster.name_resolve, cfg.name_resolve_root)
            register_role(registry, role, server.address)
            logger.info(f"{name} serves on {server.address} (registered for the trial)")
            while not stop:
                if server.child.proc.poll() is not None and not server.restart(sup, cfg):
                    return server.child.proc.returncode or 1
                time.sleep(0.2)
            logger.info(f"{name}: signal {stop[0]}, stopping the server")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal.launcher.server_task")
    parser.add_argument(
        "--name",
        required=True,
        help="the serving role of the launch plan (server<i>, teacher<j>); its log is "
        "RUN_DIR/logs/NAME.log",
    )
    args = parse_task_args(parser, argv)
    try:
        return run_server_task(args.name, args.host, args.script, args.rest)
    except (ConfigError, FileNotFoundError, TimeoutError, RuntimeError, ValueError) as e:
        print(f"server_task {args.name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
