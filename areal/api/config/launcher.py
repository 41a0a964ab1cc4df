"""Launcher config section: how many servers and trainer processes, and their deadlines."""

from __future__ import annotations

from dataclasses import dataclass

from areal.api.config.loader import param


@dataclass(frozen=True)
class LauncherConfig:
    """Process layout of one run on one machine (``areal launch local``)."""

    n_servers: int = param(0, ge=0, help="Generation servers to start (RL runs need >= 1).")
    trainer_nprocs: int = param(1, ge=1, help="Trainer ranks started by torchrun (data parallel).")
    server_setup_timeout: float = param(
        180.0, gt=0, help="Seconds each server gets to answer /health before the launch fails."
    )
    stop_timeout: float = param(
        20.0, gt=0, help="Seconds processes get after SIGTERM before they are killed."
    )
    server_threads: int = param(
        0, ge=0, help="OMP/torch threads per server process; 0 = torch's default."
    )
    trainer_threads: int = param(
        0, ge=0, help="OMP/torch threads per trainer rank; 0 = torch's default."
    )
    echo: bool = param(True, help="Echo every process's output to the console with a prefix.")
