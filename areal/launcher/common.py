"""What every launcher shares (local now; Ray and Slurm build on the same pieces).

- :func:`load_script_config_class`: SCRIPT's ``CONFIG`` class, so the whole config is validated
  before anything starts.
- The trial registry: :func:`reset_trial` clears the trial's subtree at each launch attempt (no
  address of a dead server survives), :func:`register_server` publishes a server's
  ``host:port`` once it answers ``/health``, and :func:`wait_for_servers` waits (with a deadline)
  until ``cluster.n_servers`` are registered. Trainers find the servers in the same place
  (:func:`areal.rollout.remote.discover_servers`).
- :func:`launch`: config errors become a message and exit code 2; the job runs once per attempt
  and, with ``recover.mode=auto``, is relaunched after a failure up to ``recover.retries`` times;
  Ctrl-C or SIGTERM stops it (exit 130) after the attempt tore its processes down.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from areal.api.config import ConfigError, load_config, save_config
from areal.utils.logging import add_log_file, get_logger
from areal.utils.name_resolve import NameRepository, gen_servers_key, make_repository, trial_key

logger = get_logger("launcher")


def load_script_config_class(script: str | Path) -> type:
    """Import SCRIPT (its ``__main__`` guard keeps it from running) and return its ``CONFIG``."""
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"launch script {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_areal_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "CONFIG"):
        raise AttributeError(
            f"{path} defines no CONFIG; add `CONFIG = GRPOConfig` (its config class) at module level"
        )
    return module.CONFIG


def reset_trial(cfg: Any) -> NameRepository:
    """The trial's registry, with every key of the trial deleted."""
    registry = make_repository(cfg.cluster.name_resolve.type, cfg.name_resolve_root)
    registry.clear_subtree(trial_key(cfg.experiment_name, cfg.trial_name))
    return registry


def register_server(registry: NameRepository, cfg: Any, address: str) -> None:
    """Publish a healthy server's ``host:port`` for the trial's trainers."""
    registry.add_subentry(gen_servers_key(cfg.experiment_name, cfg.trial_name), address)


def wait_for_servers(registry: NameRepository, cfg: Any, timeout: float) -> list[str]:
    """The addresses of the trial's ``cluster.n_servers`` servers, once all registered."""
    key = gen_servers_key(cfg.experiment_name, cfg.trial_name)
    return registry.wait_subtree(key, cfg.cluster.n_servers, timeout)


def launch(script: str, argv: list[str], run_once: Callable[[Any, int], int]) -> int:
    """Validate SCRIPT's config, then ``run_once(cfg, attempt)`` until it returns 0 or the
    relaunches allowed by ``recover.mode=auto`` are spent; returns the last exit code."""
    try:
        cfg = load_config(load_script_config_class(script), argv)
    except ConfigError as e:  # a message for the user, not a crash: nothing was started
        print(f"areal launch: {e}", file=sys.stderr)
        return 2
    save_config(cfg, cfg.run_dir / "config.yaml")
    add_log_file(cfg.run_dir, "launcher")
    retries = cfg.recover.retries if cfg.recover.mode == "auto" else 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for attempt in range(retries + 1):
            code = run_once(cfg, attempt)
            if code == 0:
                logger.info(f"run finished; logs and outputs in {cfg.run_dir}")
                return 0
            if attempt < retries:
                logger.warning(f"attempt {attempt + 1} failed (code {code}); relaunching (recover.mode=auto)")
        return code
    except KeyboardInterrupt:
        logger.warning("interrupted: every process was stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
