"""Core's entry configs: the ``core`` section (where the model workers run and which models each
hosts) and the sync PPO config (``areal core sync-ppo``; ``areal core sft``'s is beside its script)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from areal.api.config import GRPOConfig
from areal.api.config.loader import param
from areal.core.graphs import ModelAllocationConfig


@dataclass(frozen=True)
class CoreWorkersConfig:
    """Where Core's model workers run."""

    backend: Literal["in_process", "ray"] = param("in_process", help="in_process: one worker in this "
                                                  "process; ray: n_workers Ray actors.")
    n_workers: int = param(1, ge=1, help="Model workers (ray); in_process has exactly one.")
    allocations: list[ModelAllocationConfig] = param(
        factory=list, help="Which model workers host each model, and its mesh (docs/core.md); "
        "empty = every model on every worker, dp = n_workers.")
    ray_address: str = param("", help="Ray cluster address (host:port); empty = RAY_ADDRESS, else a "
                             "local instance on 127.0.0.1 sized for the workers.")
    cpus_per_worker: float = param(1.0, gt=0, help="Ray CPUs reserved per worker actor.")
    torch_threads: int = param(1, ge=1, help="torch intra-op threads per worker actor.")
    mfc_timeout: float = param(600.0, gt=0, help="Seconds an MFC (generation included) may run before "
                               "the step stops naming it and its workers.")
    gpus_per_worker: int = param(0, ge=0, le=1, help="GPUs per worker actor (ray): 0 = CPU and gloo; "
                                 "1 = one GPU each, placed by Ray, NCCL.")

    def check(self) -> Iterator[str]:
        if self.backend == "in_process" and self.n_workers != 1:
            yield f"n_workers: in_process has one worker, got {self.n_workers}; set backend=ray for more"
        if self.backend == "in_process" and self.allocations:
            yield "allocations: in_process hosts every model on its one worker; set backend=ray to allocate"


@dataclass(frozen=True)
class CoreGRPOConfig(GRPOConfig):
    """Sync PPO / GRPO through Core's master (areal core sync-ppo)."""

    core: CoreWorkersConfig = param(factory=CoreWorkersConfig, help="Core: where the model workers run.")

    def check(self) -> Iterator[str]:
        yield from super().check()
        if self.rollout.max_staleness != 0:
            yield (f"rollout.max_staleness: {self.rollout.max_staleness}; sync PPO generates every batch "
                   "with the current weights, set rollout.max_staleness=0")
        if self.cluster.trainer_nprocs != 1 or self.cluster.n_nodes != 1:
            yield (f"cluster.trainer_nprocs: the Core master is one process (got trainer_nprocs="
                   f"{self.cluster.trainer_nprocs}, n_nodes={self.cluster.n_nodes}); set both to 1 and "
                   "size the model workers with core.n_workers")
