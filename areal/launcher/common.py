"""What every launcher (local, Ray, Slurm) shares.

- :func:`load_script_config_class`: SCRIPT's ``CONFIG`` class, so the whole config is validated
  before anything starts.
- The trial registry: :func:`reset_trial` clears the trial's subtree at each launch attempt (no
  address of a dead server survives), :func:`register_role` publishes a serving role's
  ``host:port`` once it answers ``/health``, and :func:`wait_for_roles` waits (with a deadline)
  until the roles of the launch plan (:mod:`areal.launcher.plan`) registered. Trainers find the
  servers in the same place (:func:`areal.rollout.remote.discover_servers`).
- How a launcher places the plan's roles: :func:`task_command` (a serving or agent-proxy role as
  a task of its own) and :func:`parse_task_args` (that task's command line),
  :func:`without_secrets`.
- :func:`launcher_main`: a launcher module's command line (SCRIPT, then its overrides).
- :func:`launch`: config errors become a message and exit code 2; the job runs once per attempt
  and, with ``recover.mode=auto``, is relaunched after a failure up to ``recover.retries`` times,
  unless the failure repeats the previous attempt's cause (the root-cause line the supervisor
  recorded in RUN_DIR/logs/failures.jsonl): a deterministic failure is reported, not retried.
  Ctrl-C or SIGTERM stops it (exit 130) after the attempt tore its processes down.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal.api.config import BaseExperimentConfig, ConfigError, load_config, save_config
from areal.api.config.loader import iter_fields
from areal.launcher.plan import SERVING, Role, launch_plan, refusals
from areal.launcher.procs import read_failures
from areal.runtime.preflight import preflight
from areal.utils.logging import add_log_file, get_logger
from areal.utils.name_resolve import NameRepository, make_repository, trial_key
from areal.utils.recover import resume_pending

logger = get_logger("launcher")


# one attempt of the job: (validated config, attempt number from 0) -> exit code
RunOnce = Callable[[BaseExperimentConfig, int], int]


class ScriptError(ValueError):
    """SCRIPT cannot be launched as it is (it defines no ``CONFIG``): a user error, no crash."""


def load_script_config_class(script: str | Path) -> type:
    """SCRIPT's ``CONFIG`` class (SCRIPT's directory goes on ``sys.path``). When SCRIPT binds it
    to a class it imports (``from M import C`` ... ``CONFIG = C``, as every entry script here
    does), only module M is imported: the script's own imports (torch, transformers, the
    engines) cost a launcher, and each server or proxy task, seconds of CPU it does not use.
    Otherwise SCRIPT itself is imported (its ``__main__`` guard keeps it from running)."""
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"launch script {path} does not exist")
    # as `python SCRIPT` does for the script's own processes: modules beside it import (a
    # reward or workflow of the user's), here and in the checks before the run starts
    if str(path.resolve().parent) not in sys.path:
        sys.path.insert(0, str(path.resolve().parent))
    imported = config_import(path.read_text())
    if imported is not None:
        module_name, name = imported
        return getattr(importlib.import_module(module_name), name)
    spec = importlib.util.spec_from_file_location(f"_areal_script_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ScriptError(f"{path} cannot be imported as a Python module; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass the script defines resolves its annotations
    spec.loader.exec_module(module)
    if not hasattr(module, "CONFIG"):
        raise ScriptError(
            f"{path} defines no CONFIG; add `CONFIG = GRPOConfig` (its config class) at module "
            "level"
        )
    return module.CONFIG


def config_import(source: str) -> tuple[str, str] | None:
    """``(module, name)`` when ``source`` has a module-level ``CONFIG = NAME`` and NAME's only
    binding anywhere in it is a module-level ``from module import NAME [as ...]``; None for any
    other ``CONFIG`` (a class the script defines, a conditional choice)."""
    tree = ast.parse(source)
    bound = [
        node.value.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["CONFIG"]
        and isinstance(node.value, ast.Name)
    ]
    if len(bound) != 1:
        return None
    name = bound[0]
    imports = [
        (node.module, alias.name)
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        for alias in node.names
        if (alias.asname or alias.name) == name
    ]
    bindings = sum(
        (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id == name)
        or (isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name)
        or (isinstance(n, ast.alias) and (n.asname or n.name) == name)
        for n in ast.walk(tree)
    )
    return imports[0] if len(imports) == 1 and bindings == 1 else None


def reset_trial(cfg: BaseExperimentConfig) -> NameRepository:
    """The trial's registry, with every key of the trial deleted."""
    registry = make_repository(cfg.cluster.name_resolve, cfg.name_resolve_root)
    registry.clear_subtree(trial_key(cfg.experiment_name, cfg.trial_name))
    return registry


def register_role(registry: NameRepository, role: Role, address: str) -> None:
    """Publish a serving role's ``host:port`` (once it answers) under its registry key."""
    registry.add_subentry(role.registry_key, address)


def wait_for_roles(registry: NameRepository, roles: list[Role], timeout: float) -> None:
    """Wait until every one of ``roles`` that registers did (at most ``timeout`` seconds in
    all; TimeoutError naming the key that is short)."""
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    for r in roles:
        if r.registry_key:
            counts[r.registry_key] = counts.get(r.registry_key, 0) + 1
    for key, n in counts.items():
        registry.wait_subtree(key, n, max(0.0, deadline - time.monotonic()))


def task_command(
    role: Role, python: str, script: str, argv: list[str], host: str, port: int = 0
) -> list[str]:
    """The command line of a serving or agent-proxy role run as a task of its own on a node
    (Ray, Slurm; the local launcher runs its agent proxy so too): ``server_task`` or
    ``agent_proxy_task`` on ``host`` (the proxy on ``port``, 0: a free one; a server task picks
    its own); ``argv`` holds no secret (:func:`without_secrets`)."""
    if role.kind in SERVING:
        return [python, "-m", "areal.launcher.server_task", "--name", role.name, "--host", host,
                script, *argv]  # fmt: skip
    if role.kind == "agent_proxy":
        return [python, "-m", "areal.launcher.agent_proxy_task", "--host", host,
                "--port", str(port), script, *argv]  # fmt: skip
    raise ValueError(f"{role.name}: a {role.kind} role runs the entry script, not a task")


def parse_task_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed by ``parser`` (a task's own options) plus what every task
    :func:`task_command` starts takes: ``--host``, SCRIPT and SCRIPT's config arguments."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind and to register")
    parser.add_argument("script", help="the entry script (its CONFIG class reads the config)")
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="--config YAML and key=value overrides"
    )
    return parser.parse_args(argv)


def without_secrets(argv: list[str], cfg) -> list[str]:
    """``argv`` less the overrides of ``secret`` fields (they travel by env, not command line)."""
    secret = {path for path, f, _ in iter_fields(type(cfg)) if f.metadata.get("secret")}
    return [a for a in argv if a.split("=", 1)[0].lstrip("-") not in secret]


def checked_config(
    script: str, argv: list[str], launcher: str, places: frozenset[str]
) -> BaseExperimentConfig:
    """SCRIPT's config, validated with what it points at, and checked to hold no role of the
    launch plan that ``launcher`` cannot place (it places ``places``); ConfigError otherwise."""
    cfg = load_config(load_script_config_class(script), argv)
    problems = preflight(cfg)
    if problems:
        raise ConfigError(problems, "what the config points at")
    problems = refusals(launch_plan(cfg), launcher, places)
    if problems:
        raise ConfigError(problems, f"the launch plan for `areal launch {launcher}`")
    return cfg


def launch(
    script: str, argv: list[str], run_once: RunOnce, launcher: str, places: frozenset[str]
) -> int:
    """:func:`checked_config` (as ``launcher``, which places ``places``), then ``run_once(cfg,
    attempt)`` until it returns 0 or the relaunches allowed by ``recover.mode=auto`` are spent,
    or a failure repeats the cause of the one before (``run_once`` records causes with
    :func:`areal.launcher.procs.record_failure`); returns the last exit code. RUN_DIR/config.yaml
    is written here only for a fresh run: with a recover checkpoint, the trainer writes it once
    it accepted the resume."""
    try:
        cfg = checked_config(script, argv, launcher, places)
    except (
        ConfigError,
        ScriptError,
    ) as e:  # a message for the user, not a crash: nothing was started
        print(f"areal launch: {e}", file=sys.stderr)
        return 2
    if not resume_pending(cfg.run_dir / "recover", cfg.recover.mode):
        save_config(cfg, cfg.run_dir / "config.yaml")
    add_log_file(cfg.run_dir, "launcher")
    retries = cfg.recover.retries if cfg.recover.mode == "auto" else 0
    logs = cfg.run_dir / "logs"
    # SIGINT too, explicitly: a launcher started in the background by a shell without job
    # control (nohup ... &, CI runners) inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt for it
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        last_cause = ""
        for attempt in range(retries + 1):
            seen = len(read_failures(logs))
            code = run_once(cfg, attempt)
            if code == 0:
                logger.info(f"run finished; logs and outputs in {cfg.run_dir}")
                return 0
            recorded = read_failures(logs)[seen:]
            cause = recorded[-1]["cause"] if recorded else ""
            if attempt == retries:
                break
            if same_cause(cause, last_cause):
                logger.error(
                    f"attempt {attempt + 1} failed with the same cause as "
                    f"attempt {attempt}: {cause}; not relaunching (recover.mode=auto retries only "
                    "failures whose cause changes: fix the cause, then launch again to resume). "
                    f"Logs in {logs}"
                )
                break
            last_cause = cause
            logger.warning(
                f"attempt {attempt + 1} failed (code {code}: {cause or 'cause unknown'}); "
                "relaunching (recover.mode=auto)"
            )
        return code
    except KeyboardInterrupt:
        logger.warning("interrupted: every process was stopped")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launcher_main(
    launcher: str, launch_job: Callable[[str, list[str]], int], argv: list[str]
) -> int:
    """``python -m areal.launcher.LAUNCHER SCRIPT [--config YAML] [overrides]``:
    ``launch_job(SCRIPT, overrides)``, or the usage line and exit code 2 without a SCRIPT."""
    if not argv or argv[0].startswith("-"):
        print(
            f"usage: areal launch {launcher} SCRIPT [--config YAML] [key=value ...]",
            file=sys.stderr,
        )
        return 2
    return launch_job(argv[0], argv[1:])


def same_cause(cause: str, previous: str) -> bool:
    """True when ``cause`` repeats ``previous`` (both known), hex addresses and numbers of four
    digits or more (pids, ports, timestamps) masked; shorter numbers such as exit codes or steps
    still tell causes apart."""

    def key(text: str) -> str:
        return re.sub(r"0x[0-9a-fA-F]+|\d{4,}", "#", text.strip())

    return bool(cause) and bool(previous) and key(cause) == key(previous)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a cgroup, taskset, Slurm's
    allocation), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def thread_split(
    server_threads: int, trainer_threads: int, n_servers: int, n_trainers: int, cores: int
) -> tuple[int, int, str]:
    """(threads per server, threads per trainer rank, the log line saying so). A count of 0
    (``launcher.server_threads`` / ``trainer_threads``) becomes an even share of ``cores``
    among the ``n_servers + n_trainers`` processes of this machine, at least 1: torch's own
    default (every core in each process) oversubscribes the cores as soon as two processes
    share them, which made a busy 2-core machine's SFT step 10-30x slower."""
    share = max(1, cores // max(1, n_servers + n_trainers))

    def pick(configured: int, field: str) -> tuple[int, str]:
        if configured:
            return configured, f"{configured} (launcher.{field})"
        return share, f"{share} (launcher.{field}=0: an even share of the cores)"

    server, server_how = pick(server_threads, "server_threads")
    trainer, trainer_how = pick(trainer_threads, "trainer_threads")
    line = (
        f"threads: {cores} usable cores for {n_servers} server(s) + {n_trainers} trainer rank(s) "
        f"on this machine; per server {server_how}, per trainer rank {trainer_how}"
    )
    return server, trainer, line
