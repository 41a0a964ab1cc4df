"""The distributed context of a trainer process: ``torch.distributed`` is initialised here, once,
and every engine gets its device mesh from here, in its constructor.

Engines never use the default group: each runs its collectives on its own mesh's group. Every
mesh of the library comes from :func:`build_mesh`: Lite's trainer ranks form one data-parallel
mesh (``("dp",)``) that every engine shares; Core builds one mesh per model over the model
workers of its allocation, ``pp x dp x tp`` (:mod:`areal.core.ray_worker`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from areal.api.launch import LaunchEnv
from areal.utils.process import die_with

TIMEOUT = datetime.timedelta(minutes=10)  # any collective that waits longer fails the run


@dataclass(frozen=True)
class DistContext:
    """This process's place among the trainer ranks, and the mesh over all of them."""

    rank: int  # global rank
    world_size: int  # trainer ranks of the job
    device: torch.device  # cuda:LOCAL_RANK with NCCL, else cpu
    mesh: DeviceMesh  # 1-D ("dp",) over every trainer rank (build_mesh)

    def barrier(self) -> None:
        """Wait for every trainer rank (no-op with one rank)."""
        if self.world_size > 1:
            dist.barrier(group=self.mesh.get_group())


def check_layout(n_ranks: int, dp: int, tp: int = 1, pp: int = 1, who: str = "mesh") -> None:
    """Raise ``ValueError`` (one line, naming the field and the fix) unless ``dp x tp x pp``
    ranks are exactly ``n_ranks``."""
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
        if size < 1:
            raise ValueError(f"{who}: {name}={size}; each of dp, tp, pp must be >= 1")
    if dp * tp * pp != n_ranks:
        fit = f"dp={n_ranks // (tp * pp)}" if n_ranks % (tp * pp) == 0 else "dp, tp, pp"
        raise ValueError(
            f"{who}: dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but it has {n_ranks}; "
            f"give it dp*tp*pp ranks or set {fit}"
        )


def build_mesh(
    device_type: str, ranks: Sequence[int], dp: int, tp: int = 1, pp: int = 1
) -> DeviceMesh:
    """The device mesh of one model over global ``ranks``, in Core's allocation order
    (:class:`~areal.core.dfg.Allocation`): ``ranks[(p * dp + d) * tp + t]`` is pipeline stage
    ``p``, data-parallel rank ``d``, tensor-parallel rank ``t``. Dims: ``("dp",)`` when ``tp = pp
    = 1``, ``("dp", "tp")`` when ``pp = 1``, else ``("pp", "dp", "tp")`` (what
    :class:`~areal.engine.fsdp.FSDPEngine` reads). The whole-mesh group of a multi-dimensional
    mesh is flattened here (``"dp_tp"``, ``"pp_dp_tp"``: the engines' checkpoints and exports).
    Collective over the whole job: every rank calls it with the same arguments in the same
    order, also ranks outside ``ranks``."""
    check_layout(len(ranks), dp, tp, pp)
    grid = torch.tensor(list(ranks), dtype=torch.int)
    if tp == 1 and pp == 1:
        return DeviceMesh(device_type, grid, mesh_dim_names=("dp",))
    if pp == 1:
        mesh = DeviceMesh(device_type, grid.reshape(dp, tp), mesh_dim_names=("dp", "tp"))
    else:
        shape, names = (pp, dp, tp), ("pp", "dp", "tp")
        mesh = DeviceMesh(device_type, grid.reshape(shape), mesh_dim_names=names)
    mesh._flatten("_".join(mesh.mesh_dim_names or ()))
    return mesh


def mesh_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """The process groups :func:`build_mesh` made for ``mesh`` on this rank (one per dim and the
    flattened whole-mesh group), less the default group, which a mesh over every rank reuses."""
    default = dist.distributed_c10d._get_default_group()
    flat = [m.get_group() for m in mesh._flatten_mapping.values()]  # pyright: ignore[reportPrivateUsage]  # torch keeps the flattened meshes only here
    out: list[dist.ProcessGroup] = []
    for g in [*mesh.get_all_groups(), *flat]:
        if g is not default and all(g is not o for o in out):
            out.append(g)
    return out


def group_backend(backend: Literal["gloo", "nccl"]) -> str:
    """The backend string a process group is built with: on GPUs NCCL for CUDA tensors *and*
    gloo for host tensors and objects, so a CPU value (stats, counters) never meets an NCCL-only
    group (torch: "No backend type associated with device type cpu"); see
    :mod:`areal.utils.comm`."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"


def init_distributed(
    backend: Literal["auto", "gloo", "nccl"] = "auto", env: LaunchEnv | None = None
) -> DistContext:
    """Initialise ``torch.distributed`` for this process (a later call joins what is already
    initialised). Under torchrun the ranks rendezvous through ``MASTER_ADDR``/``MASTER_PORT``; a
    process started without them is a job of one rank. ``auto`` = NCCL on GPU, gloo on CPU.
    Under an areal launcher the rank exits once the launcher has (see
    :mod:`areal.utils.process`)."""
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
                store=dist.HashStore(),  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it unmarked
                rank=0,
                world_size=1,
                timeout=TIMEOUT,
            )
    world = dist.get_world_size()
    mesh = build_mesh(device.type, range(world), dp=world)
    return DistContext(dist.get_rank(), world, device, mesh)


def close_distributed() -> None:
    """Destroy the process groups :func:`init_distributed` created (end of the run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
