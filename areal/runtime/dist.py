"""The distributed context of a trainer process: ``torch.distributed`` is initialised here, once,
and every engine gets its device mesh from here, in its constructor.

Engines never use the default group: each runs its collectives on its own mesh's group. Today a
job's trainer ranks form one data-parallel mesh (``("dp",)``) that every engine shares;
:meth:`DistContext.split` cuts the ranks into disjoint data-parallel sub-meshes, one per model,
which is how a job hosts several models on different ranks (Core mode). Tensor or sequence
parallel dimensions would be further mesh dimensions beside ``dp``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal.api.launch import LaunchEnv
from areal.utils.process import die_with

TIMEOUT = datetime.timedelta(minutes=10)  # any collective that waits longer fails the run


@dataclass(frozen=True)
class DistContext:
    """This process's place among the trainer ranks, and the mesh over all of them."""

    rank: int  # global rank
    world_size: int  # trainer ranks of the job
    device: torch.device  # cuda:LOCAL_RANK with NCCL, else cpu
    mesh: DeviceMesh  # 1-D ("dp",) over every trainer rank

    def split(self, n_models: int) -> tuple[int, DeviceMesh]:
        """Disjoint data-parallel sub-meshes of ``world_size // n_models`` consecutive ranks:
        ``(index of this rank's sub-mesh, the sub-mesh)``. Collective: every rank calls it."""
        if n_models < 1 or self.world_size % n_models:
            raise ValueError(
                f"split({n_models}): {self.world_size} ranks do not divide into "
                f"{n_models} equal sub-meshes; use a divisor of the world size"
            )
        per = self.world_size // n_models
        grid = init_device_mesh(self.device.type, (n_models, per), mesh_dim_names=("model", "dp"))
        return self.rank // per, grid["dp"]

    def barrier(self) -> None:
        """Wait for every trainer rank (no-op with one rank)."""
        if self.world_size > 1:
            dist.barrier(group=self.mesh.get_group())


def group_backend(backend: Literal["gloo", "nccl"]) -> str:
    """The backend string a process group is built with: on GPUs NCCL for CUDA tensors *and*
    gloo for host tensors and objects, so a CPU value (stats, counters) never meets an NCCL-only
    group (torch: "No backend type associated with device type cpu"); see :mod:`areal.utils.comm`."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"


def init_distributed(
    backend: Literal["auto", "gloo", "nccl"] = "auto", env: LaunchEnv | None = None
) -> DistContext:
    """Initialise ``torch.distributed`` for this process (a later call joins what is already
    initialised). Under torchrun the ranks rendezvous through ``MASTER_ADDR``/``MASTER_PORT``; a
    process started without them is a job of one rank. ``auto`` = NCCL on GPU, gloo on CPU.
    Under an areal launcher the rank exits once the launcher has (see :mod:`areal.utils.process`)."""
    env = env or LaunchEnv.read()
    if env.launcher_pid:  # a rank outlives neither the launcher nor torchrun (our parent)
        die_with(env.launcher_pid)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if env.launched:
            dist.init_process_group(
                group_backend(backend), rank=env.rank, world_size=env.world_size, timeout=TIMEOUT
            )
        else:  # one process: no rendezvous
            dist.init_process_group(
                group_backend(backend),
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=TIMEOUT,
            )
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistContext(dist.get_rank(), world, device, mesh)


def close_distributed() -> None:
    """Destroy the process groups :func:`init_distributed` created (end of the run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
