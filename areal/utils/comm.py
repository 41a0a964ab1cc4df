"""Tensor collectives through one door that knows which devices a process group can serve.

A process group reduces only tensors on the device types its backends cover: ``gloo`` serves
``cpu``, ``nccl`` only ``cuda``, ``cpu:gloo,cuda:nccl`` both (what
:func:`areal.runtime.dist.init_distributed` builds on a GPU). torch's own error for a CPU tensor
on an NCCL-only group ("No backend type associated with device type cpu") comes from deep inside
the call, after the other ranks may already wait; here a tensor the group cannot serve is refused
before the collective, naming the device, the group's backend and the fix, and host-side values
(stats) are staged on a device the group serves.

Every tensor collective of the library goes through this module (``tests/test_guard_rails.py``
checks it); object collectives (``all_gather_object``) and barriers are device-agnostic as long
as the current CUDA device is set, which ``init_distributed`` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_device_types(group: dist.ProcessGroup | None) -> tuple[str, ...]:
    """Device types ``group`` (``None`` = the default group) can reduce tensors on, CPU first."""
    pg = group if group is not None else dist.group.WORLD
    types = sorted({d.type for d in pg._device_types}, key=lambda t: (t != "cpu", t))
    return tuple(types)


def check_served(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise ``ValueError`` unless ``group`` can serve a tensor on ``tensor.device``."""
    served = group_device_types(group)
    if tensor.device.type not in served:
        backend = dist.get_backend(group)
        raise ValueError(
            f"{what}: a {tensor.device.type} tensor cannot go through process group {backend!r}, "
            f"which serves {', '.join(served)}; move it to {served[0]} first (comm.all_reduce_host "
            f"stages host values), or build the group with 'cpu:gloo,cuda:nccl'"
        )


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device to stage host values on for ``group``: the CPU where it serves one, else the
    current device of its first accelerator type."""
    kind = group_device_types(group)[0]
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    if not module.is_available():
        raise ValueError(
            f"process group {dist.get_backend(group)!r} serves only {kind}, which this "
            f"process does not have; use a gloo group (cluster.dist_backend=gloo) on CPU"
        )
    return torch.device(kind, module.current_device())


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``, refused (``ValueError``) when the group
    cannot serve its device; returns ``tensor``."""
    check_served(tensor, group, "all_reduce")
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_host(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-reduce a host (CPU) tensor over any group: reduced on the CPU where the group serves
    it, else on the group's device and copied back. Returns a CPU tensor."""
    device = group_device(group)
    staged = tensor.to(device)
    dist.all_reduce(staged, op=op, group=group)
    return staged.cpu() if device.type != "cpu" else staged
