"""``areal launch local SCRIPT --config YAML [overrides]``: one machine, real processes.

Starts ``launcher.n_servers`` generation servers (ours, or SGLang / vLLM when
``rollout.backend`` says so and they are installed), waits for each ``/health`` with a deadline,
then runs SCRIPT under ``torchrun`` on ``launcher.trainer_nprocs`` ranks with the server addresses
in ``AREAL_LLM_SERVER_ADDRS``. On a GPU machine the trainer ranks get GPUs
``0..trainer_nprocs-1`` and server ``i`` the GPU after them (``CUDA_VISIBLE_DEVICES``; inside a
server its GPU is ``cuda``). Logs go to RUN_DIR/logs/<process>.log and to the console with a
prefix. Everything is torn down on exit, on Ctrl-C / SIGTERM, and when the trainer fails. A
server that dies alone is logged; the trainer's client fails over to the others and stops the
run only if all are gone. With ``recover.mode=auto`` a failed run is relaunched up to
``recover.retries`` times and the script resumes from its last recover checkpoint.

SCRIPT must define ``CONFIG`` (its config class) at module level so the launcher validates the
whole config before starting anything.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
import time
from pathlib import Path

from areal.api.config import ConfigError, load_config, save_config
from areal.launcher.procs import ProcessSupervisor
from areal.utils.network import free_port
from areal.launcher.servers import server_command
from areal.utils.logging import add_log_file, get_logger

logger = get_logger("launcher")
ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
ATTEMPT_ENV = "AREAL_LAUNCH_ATTEMPT"


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


def _threads_env(n: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n), "AREAL_TORCH_THREADS": str(n)} if n else {}


def gpu_layout(n_gpus: int, trainer_nprocs: int, n_servers: int) -> tuple[str | None, list[str | None]]:
    """CUDA_VISIBLE_DEVICES for the trainer and for each server: trainers take GPUs
    0..trainer_nprocs-1 (torchrun's LOCAL_RANK picks one each), server i the next free GPU.
    None everywhere on a machine without GPUs (CPU run)."""
    if n_gpus == 0:
        return None, [None] * n_servers
    need = trainer_nprocs + n_servers
    if n_gpus < need:
        raise ValueError(
            f"launcher: {trainer_nprocs} trainer ranks + {n_servers} servers need {need} GPUs, this "
            f"machine has {n_gpus}; lower launcher.trainer_nprocs or launcher.n_servers"
        )
    trainer = ",".join(str(g) for g in range(trainer_nprocs))
    return trainer, [str(trainer_nprocs + i) for i in range(n_servers)]


def _gpu_env(devices: str | None) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {}


def _start_servers(sup: ProcessSupervisor, cfg, server_gpus: list[str | None]) -> list[str]:
    lc = cfg.launcher
    children = []
    for i in range(lc.n_servers):
        port = free_port()
        cmd = server_command(cfg, port, cfg.run_dir / f"server{i}.yaml")
        env = {**_threads_env(lc.server_threads), **_gpu_env(server_gpus[i])}
        child = sup.start(f"server{i}", cmd, env=env)
        children.append((child, f"127.0.0.1:{port}"))
    for child, addr in children:
        sup.wait_http_ok(child, f"http://{addr}/health", lc.server_setup_timeout)
    return [addr for _, addr in children]


def _cuda_device_count() -> int:
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
    """Start servers and trainer, wait for the trainer, tear everything down; trainer's code."""
    lc = cfg.launcher
    with ProcessSupervisor(cfg.run_dir / "logs", echo=lc.echo, stop_timeout=lc.stop_timeout) as sup:
        trainer_gpus, server_gpus = gpu_layout(_cuda_device_count(), lc.trainer_nprocs, lc.n_servers)
        addrs = _start_servers(sup, cfg, server_gpus)
        env = {ADDRS_ENV: ",".join(addrs), ATTEMPT_ENV: str(attempt),
               **_threads_env(lc.trainer_threads), **_gpu_env(trainer_gpus)}
        trainer = sup.start("trainer", _trainer_command(script, argv, lc.trainer_nprocs), env=env)
        dead_servers: set[str] = set()
        while trainer.proc.poll() is None:
            for child in sup.children:
                if child is not trainer and child.proc.poll() is not None and child.name not in dead_servers:
                    dead_servers.add(child.name)
                    logger.error(
                        f"{child.name} exited with code {child.proc.returncode}; the trainer "
                        f"continues on the other servers. Last lines:\n{child.tail(10)}"
                    )
            time.sleep(0.2)
        code = trainer.proc.returncode
        if code != 0:
            logger.error(f"trainer exited with code {code}; last lines:\n{trainer.tail(20)}")
        return code


def launch_local(script: str, argv: list[str]) -> int:
    """Validate the config, then run (and, with recover.mode=auto, relaunch) the job."""
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
            code = run_once(script, argv, cfg, attempt)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.launcher.local SCRIPT [--config YAML] [overrides]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: areal launch local SCRIPT [--config YAML] [key=value ...]", file=sys.stderr)
        return 2
    return launch_local(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
