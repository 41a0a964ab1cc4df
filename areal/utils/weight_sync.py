"""Weight transfer from a trainer to generation servers: over a torch.distributed group
(``weight_update_mode=distributed``, a broadcast) or, for a server on the trainer's machine and
device, by shared tensors (``ipc``). Imports torch and the standard library only: the vLLM worker
extension (areal/launcher/vllm_ext) loads this file by path inside vLLM's own venv.

Broadcast wire protocol (version 2). Trainer = rank 0; server ``i`` = rank ``rank_offset + i``.

1. Join, once. Every member calls :func:`init_weight_update_group` the way SGLang's
   ``init_weights_update_group`` does (a ``tcp://`` rendezvous at ``master_address:master_port``
   whose store rank 0 hosts, keys under ``group_name``, torch's own group constructor), so our
   server, vLLM (through our worker extension) and SGLang all join the trainer's group alike.
   The trainer (``rank=0``) joins while, concurrently, it POSTs to each server
   ``/init_weights_update_group`` with JSON ``{"master_address", "master_port", "rank_offset",
   "world_size", "group_name", "backend"}`` (``backend``: ``gloo`` on CPU, ``nccl`` on GPU).
   The server answers ``{"success": true}`` once the group is formed. Both sides wait at most
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
   ``{"success": true, "weight_version": v}``. SGLang's layout is one broadcast per tensor in
   its own dtype and shape (:func:`broadcast_each`; SGLang allocates each from the
   announcement and receives it with ``torch.distributed.broadcast``).

IPC (``ipc``): the trainer packs the full tensors into one buffer on its device
(:class:`SharedBuffer`, each tensor at a 64-byte aligned offset) and pickles it with torch's
multiprocessing reductions (a CUDA IPC handle on a GPU; on CPU a shared-memory file, torch's
``file_system`` strategy). It POSTs ``/update_weights_from_ipc`` with JSON ``{"names",
"dtypes", "shapes", "offsets", "handles" (base64), "devices" ({index: GPU UUID}),
"weight_version"}`` and keeps the buffer alive until the answer; the server rebuilds the buffer
with :func:`open_shared` (an unpickler that admits torch's rebuild functions only), views each
tensor in it and copies them into its weights. On a GPU no byte crosses the host or the disk.

Names are Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``); the trainer
sends full (unsharded) tensors. The same functions serve both sides.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import io
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.distributed import distributed_c10d as c10d
from torch.multiprocessing import reductions

GROUP_NAME = "areal_weight_update"

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


def spec_announcement(specs: list[TensorSpec]) -> dict:
    """:func:`announcement` of specs (the trainer announces before it gathers anything)."""
    return {
        "names": [s.name for s in specs],
        "dtypes": [dtype_name(s.dtype) for s in specs],
        "shapes": [list(s.shape) for s in specs],
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
    group_name: str = GROUP_NAME,
) -> dist.ProcessGroup:
    """Join (rank 0: host the store of) a standalone group, formed as SGLang forms its weight
    update group (so a trainer, our server, a vLLM worker and SGLang meet in one). The default
    group of the process, if any, is not touched; :func:`destroy_weight_update_group` leaves."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
    td = datetime.timedelta(seconds=timeout)
    url = f"tcp://{master_address}:{master_port}"
    rendezvous = dist.rendezvous  # pyright: ignore[reportPrivateImportUsage] (public, not in __all__)
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=td))
    store.set_timeout(td)
    group, _ = c10d._new_process_group_helper(  # what SGLang's init_custom_process_group calls
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=cast(Any, group_name),  # torch's GroupName, a NewType of str
        timeout=td,
    )
    assert isinstance(group, dist.ProcessGroup)  # a member of the group it forms
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Leave a group of :func:`init_weight_update_group` (its name can be joined again)."""
    dist.destroy_process_group(group)


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


def send_weights(
    specs: list[TensorSpec],
    gather: Callable[[TensorSpec], torch.Tensor],
    device: torch.device,
    sender: bool,
    bucket_bytes: int,
    group: dist.ProcessGroup | None = None,
    per_tensor: bool = False,
    send_shared: Callable[[dict[str, object]], None] | None = None,
    timeout: float = 300.0,
) -> None:
    """The trainer's one delivery loop: ``gather`` each spec's full tensor (a collective every
    trainer rank runs), one bucket at a time, onto ``device``; the ``sender`` (first rank)
    broadcasts each bucket over ``group`` (:func:`broadcast_weights`, or :func:`broadcast_each`
    with ``per_tensor``) or, given ``send_shared``, packs them into one :class:`SharedBuffer`
    and hands its payload to it (the buffer lives until it returns)."""
    if sender and group is None and send_shared is None:
        raise RuntimeError(
            "update_weights(type='distributed') before init_weight_update_group(), or type='ipc' "
            "without meta.send_shared"
        )
    shared = SharedBuffer(specs, device) if sender and send_shared is not None else None
    for bucket in plan_buckets(specs, bucket_bytes):
        named = [(specs[i].name, gather(specs[i]).to(device)) for i in bucket]
        if not sender:
            continue
        if shared is not None:  # packed as gathered: at most one bucket beside the buffer
            for i, (_, t) in zip(bucket, named):
                shared.put(i, t)
        elif per_tensor:
            broadcast_each(named, group, timeout)  # pyright: ignore[reportArgumentType]
        else:
            broadcast_weights(named, group, bucket_bytes, timeout)  # pyright: ignore[reportArgumentType]
    if shared is not None and send_shared is not None:
        send_shared(shared.payload())  # the buffer lives until the servers answered


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


def broadcast_each(
    named_tensors: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, timeout: float = 300.0
) -> None:
    """Sender (rank 0), SGLang's layout: one broadcast per tensor, in its dtype and shape."""
    td = datetime.timedelta(seconds=timeout)
    for _, t in named_tensors:
        group.broadcast(t.detach().contiguous(), 0, td).wait()


# ---------------------------------------------------------------------------------------- IPC

_REBUILDERS = {
    "rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
    "rebuild_storage_empty", "rebuild_cuda_tensor",
}  # fmt: skip
_TORCH_NAMES = {"Tensor", "Size"} | {
    n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)
}


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU tensors are shared as named shared-memory files (``file_system``): the default
    ``file_descriptor`` strategy hands fds to a child process only, not to an unrelated server."""
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(before)


IPC_ALIGN = 64  # bytes: each tensor's offset in the shared buffer (any dtype views it)


def _ipc_offsets(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Byte offset of each spec in the shared buffer (aligned to :data:`IPC_ALIGN`), total."""
    offsets, size = [], 0
    for s in specs:
        offsets.append(size)
        size += -(-s.nbytes // IPC_ALIGN) * IPC_ALIGN
    return offsets, size


class SharedBuffer:
    """The tensors of ``specs`` packed into one buffer on ``device``, shared for
    ``/update_weights_from_ipc``: one CUDA IPC handle (a shared-memory file on CPU) for the whole
    model, since opening one costs what opening each tensor's would. :meth:`put` each tensor
    (then it may be freed), then send :meth:`payload`; keep this object alive until the server
    has answered."""

    def __init__(self, specs: list[TensorSpec], device: torch.device):
        self.specs = specs
        self.offsets, size = _ipc_offsets(specs)
        with _file_system_sharing():  # a named shared-memory file an unrelated process can open
            self.buf = torch.empty(size, dtype=torch.uint8, device=device)
            if not self.buf.is_cuda:
                self.buf.share_memory_()

    def put(self, index: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (of ``specs[index]``) into its place."""
        o, n = self.offsets[index], self.specs[index].nbytes
        self.buf[o : o + n].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))

    def payload(self) -> dict[str, object]:
        """The announcement (``names``/``dtypes``/``shapes``), each tensor's byte ``offsets``,
        the buffer's ``handles`` (base64 text) and, for CUDA, the ``devices`` by UUID (a server
        that numbers its GPUs otherwise finds it)."""
        from multiprocessing.reduction import ForkingPickler  # torch registers its reductions

        with _file_system_sharing():
            raw = ForkingPickler.dumps(self.buf)
        cuda = [self.buf.device.index or 0] if self.buf.is_cuda else []
        return {
            **spec_announcement(self.specs),
            "offsets": self.offsets,
            "handles": base64.b64encode(bytes(raw)).decode("ascii"),
            "devices": {str(i): _device_uuid(i) for i in cuda},
        }


class _HandleUnpickler(pickle.Unpickler):
    """Admits torch's tensor-rebuild functions, storages, dtypes and Size only: a request body
    must not name any other callable."""

    def __init__(self, data: bytes, remap: dict[int, int]):
        super().__init__(io.BytesIO(data))
        self.remap = remap  # the sender's CUDA device index -> this process's

    def find_class(self, module: str, name: str) -> object:
        if module == "torch.multiprocessing.reductions" and name in _REBUILDERS:
            if name == "rebuild_cuda_tensor":
                return functools.partial(_rebuild_cuda, self.remap)
            return getattr(reductions, name)
        if module == "torch" and name in _TORCH_NAMES:
            return getattr(torch, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor handle")


def _rebuild_cuda(remap: dict[int, int], *args: object) -> torch.Tensor:
    """``rebuild_cuda_tensor`` on this process's index of the sender's device (argument 6)."""
    fields = list(args)
    if fields[6] not in remap:
        raise ValueError(f"devices: the sender's CUDA device {fields[6]} is not announced")
    fields[6] = remap[fields[6]]  # type: ignore[index]
    return reductions.rebuild_cuda_tensor(*fields)  # pyright: ignore[reportArgumentType]


def _local_cuda_index(uuids: object) -> dict[int, int]:
    if not isinstance(uuids, dict):
        raise ValueError(f"devices: expected {{index: uuid}}, got {str(uuids)[:100]}")
    if not uuids:
        return {}
    if not torch.cuda.is_available():
        raise ValueError("devices: CUDA tensors were shared but this process sees no GPU")
    here = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    missing = [u for u in uuids.values() if u not in here]
    if missing:
        raise ValueError(
            f"devices: GPU {missing[0]} of the trainer is not visible here; the ipc mode needs the "
            "server on the trainer's GPU (use weight_update_mode=distributed otherwise)"
        )
    return {int(i): here[u] for i, u in uuids.items()}


def open_shared(body: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a :meth:`SharedBuffer.payload` (``body``), rebuilt in this process as
    views of the sender's memory: copy them before answering.
    ValueError naming the field otherwise."""
    specs = specs_from_announcement(body.get("names"), body.get("dtypes"), body.get("shapes"))
    offsets, size = _ipc_offsets(specs)
    if body.get("offsets") != offsets:
        raise ValueError(f"offsets: {str(body.get('offsets'))[:100]} are not SharedBuffer's layout")
    remap = _local_cuda_index(body.get("devices", {}))
    handles = body.get("handles")
    if not isinstance(handles, str):
        raise ValueError(
            f"handles: expected the base64 text of a SharedBuffer, got {type(handles)}"
        )
    try:
        buf = _HandleUnpickler(base64.b64decode(handles, validate=True), remap).load()
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError, RuntimeError) as e:
        raise ValueError(f"handles: not a SharedBuffer's payload, or gone ({e})") from None
    if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.numel() == size):
        raise ValueError(f"handles: expected one uint8 buffer of {size} bytes")
    return [
        (s.name, buf[o : o + s.nbytes].view(s.dtype).view(s.shape)) for s, o in zip(specs, offsets)
    ]
