"""Weight transfer from a trainer to generation servers over a torch.distributed group.

Wire protocol (version 1). Trainer = rank 0; server ``i`` = rank ``rank_offset + i``.

1. Join, once. The trainer opens a ``TCPStore`` master at ``master_address:master_port`` and
   builds its group with :func:`init_weight_update_group` (``rank=0``) while, concurrently, it
   POSTs to each server ``/init_weights_update_group`` with JSON
   ``{"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}``
   (``backend``: ``gloo`` on CPU, ``nccl`` on GPU). The server joins as a store client with the
   same call and answers ``{"success": true}`` once the group is formed. Both sides wait at most
   ``timeout`` seconds.
2. Each update. The trainer POSTs ``/update_weights_from_distributed`` with JSON
   ``{"names": [...], "dtypes": ["float32", ...], "shapes": [[...], ...], "group_name",
   "bucket_bytes", "weight_version" (optional; default: current + 1)}`` and, concurrently, calls
   :func:`broadcast_weights` with the tensors in the same order. The announcement is the whole
   contract: both sides derive the same buckets from it with :func:`plan_buckets` - consecutive
   tensors packed while the bucket stays <= ``bucket_bytes`` (a larger tensor travels alone).
   Each bucket is one contiguous ``uint8`` tensor, the raw bytes of its tensors back to back,
   broadcast from rank 0. The server rebuilds each tensor (dtype, shape) from its byte range,
   loads them all between two decode steps, sets the version and answers
   ``{"success": true, "weight_version": v}``.

Names are Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``); the trainer
sends full (unsharded) tensors. The same functions serve both sides.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype (``torch.float32`` -> ``"float32"``)."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be sent; supported: {sorted(DTYPES)}")


@dataclass(frozen=True)
class TensorSpec:
    """One announced tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def specs_from_announcement(names: object, dtypes: object, shapes: object) -> list[TensorSpec]:
    """Parse the JSON announcement; raises ValueError naming the bad field."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes, shapes: each must be a list")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names/dtypes/shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    specs = []
    for n, d, s in zip(names, dtypes, shapes):
        if d not in DTYPES:
            raise ValueError(f"dtypes: {d!r} for {n!r} is not one of {sorted(DTYPES)}")
        if not (isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s)):
            raise ValueError(f"shapes: {s!r} for {n!r} must be a list of non-negative ints")
        specs.append(TensorSpec(str(n), DTYPES[d], tuple(s)))
    return specs


def announcement(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """The ``names``/``dtypes``/``shapes`` part of the update request body."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive specs per bucket, each bucket <= ``bucket_bytes`` unless alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        if buckets and size + spec.nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += spec.nbytes
        else:
            buckets.append([i])
            size = spec.nbytes
    return buckets


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a standalone process group; no global torch.distributed state."""
    td = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=(rank == 0), timeout=td
    )
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, td)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")


def broadcast_weights(
    named_tensors: list[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup,
    bucket_bytes: int,
    timeout: float = 300.0,
) -> None:
    """Sender (rank 0): broadcast tensors in announcement order, bucketed as in the protocol."""
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named_tensors]
    device = named_tensors[0][1].device if named_tensors else torch.device("cpu")
    for bucket in plan_buckets(specs, bucket_bytes):
        parts = [
            named_tensors[i][1].detach().contiguous().view(-1).view(torch.uint8) for i in bucket
        ]
        buf = torch.cat(parts).to(device) if len(parts) > 1 else parts[0].clone()
        group.broadcast(buf, 0, datetime.timedelta(seconds=timeout)).wait()


def receive_weights(
    specs: list[TensorSpec],
    group: dist.ProcessGroup,
    bucket_bytes: int,
    device: torch.device | str = "cpu",
    timeout: float = 300.0,
) -> dict[str, torch.Tensor]:
    """Receiver: the inverse of :func:`broadcast_weights` for the announced ``specs``."""
    out: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(specs, bucket_bytes):
        total = sum(specs[i].nbytes for i in bucket)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        group.broadcast(buf, 0, datetime.timedelta(seconds=timeout)).wait()
        offset = 0
        for i in bucket:
            s = specs[i]
            raw = buf[offset : offset + s.nbytes]
            out[s.name] = raw.view(s.dtype).view(s.shape).clone()
            offset += s.nbytes
    return out
