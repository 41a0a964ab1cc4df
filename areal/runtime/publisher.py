"""The weight publisher: the one owner of a weight update and the only writer of the version.

An update is: pause admission (in-flight generations are aborted and re-submitted later) -> hand
the actor's weights to every generation server (``disk``: an HF dir the servers load;
``distributed``: a broadcast from trainer rank 0 over gloo on CPU or NCCL on GPU, in byte
buckets, or one tensor at a time for SGLang; ``ipc``: the full tensors shared with a server on
the trainer's machine and device, CUDA IPC handles on a GPU, shared memory on CPU, held until
the servers copied them) -> every trainer rank waits for the push -> the actor moves to the new
version -> admission resumes at it (the version travels with the call). Only the first trainer
rank talks to the servers; every rank runs the collective parts. ``disk`` keeps the newest
``keep`` weight dirs under RUN_DIR/weights and deletes older ones; :meth:`close` deletes the
rest when the run ends (the servers hold the weights in memory, a restarted server loads a
hard-linked copy of its own, and the run's last HF export holds the final weights). With servers
colocated on the trainer's GPUs, :meth:`yield_device` pauses rollouts and has the servers give
back their KV cache before the train step, and :meth:`publish` gives it back to them after the
push.

The publisher is typed against the seams of :mod:`areal.api.protocols`, which Lite and Core
both fill: the actor is a :class:`~areal.api.protocols.WeightSource` (Lite's FSDP engine, Core's
``RayModel``), the servers a :class:`~areal.api.protocols.WeightTarget` (Lite's HTTP client,
Core's ``ManagedServers``), admission an :class:`~areal.api.protocols.Admission` (Lite's
workflow executor, Core's ``RayRolloutSide``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Literal

from areal.api.io import WeightUpdateMeta
from areal.api.protocols import Admission, Publisher, SharesDevice, WeightSource, WeightTarget
from areal.runtime.dist import DistContext
from areal.utils.network import free_port


class WeightPublisher(Publisher):
    """Pushes ``actor``'s weights to ``servers`` (see the module docstring)."""

    def __init__(
        self,
        mode: Literal["disk", "distributed", "ipc"],
        actor: WeightSource,
        servers: WeightTarget,
        admission: Admission,
        dist_ctx: DistContext,
        weights_dir: Path,
        keep: int = 2,
        colocated: bool = False,
    ):
        if mode not in ("disk", "distributed", "ipc"):
            raise ValueError(
                f"weight_update_mode must be 'disk', 'distributed' or 'ipc', got {mode!r}"
            )
        if mode == "ipc" and not isinstance(servers, SharesDevice):  # Core's servers: not here
            raise ValueError(
                f"weight_update_mode=ipc: {type(servers).__name__} cannot take the trainer's "
                "shared tensors (Lite's client can); use weight_update_mode=distributed"
            )
        if keep < 1:
            raise ValueError(f"keep={keep}: the dir the servers are loading must be kept; use >= 1")
        # servers on the trainer's GPUs: they sleep while it steps
        self.device: SharesDevice | None = None
        if colocated:
            if not isinstance(servers, SharesDevice):
                raise ValueError(
                    f"cluster.colocate: {type(servers).__name__} cannot give back the servers' "
                    "memory (release_memory/resume_memory); run the servers apart"
                )
            self.device = servers
        self.mode = mode
        self.actor, self.servers, self.admission, self.dist = actor, servers, admission, dist_ctx
        self.weights_dir = Path(weights_dir)
        self.keep = keep
        self._group_meta: WeightUpdateMeta | None = None
        self._version = actor.get_version()
        self._yielded = False

    @property
    def version(self) -> int:
        """The version of the weights the servers generate with."""
        return self._version

    @property
    def _leader(self) -> bool:
        return self.dist.rank == 0

    def connect(self) -> None:
        """``distributed`` mode: form the broadcast group of trainer rank 0 and every server
        (collective over the trainer ranks; a no-op for ``disk``)."""
        if self.mode != "distributed" or self._group_meta is not None:
            return
        meta = WeightUpdateMeta(
            "distributed",
            master_port=free_port() if self._leader else 0,
            # NCCL puts one rank on a GPU: servers on the trainer's GPUs (colocated) take gloo
            backend="nccl" if self.dist.device.type == "cuda" and self.device is None else "gloo",
            per_tensor=self.servers.config.backend == "sglang",  # SGLang's layout
            timeout=self.servers.config.weight_update_timeout,
        )
        future = self.servers.init_weights_update_group_async(meta) if self._leader else None
        self.actor.init_weight_update_group(meta, self.servers.weight_group_size)
        if future is not None:
            future.result(self.servers.config.setup_timeout)
        self._group_meta = meta

    def yield_device(self) -> None:
        """Colocated servers (no-op otherwise): stop rollouts (admission waits, in-flight
        generations are re-submitted later) and have the servers give back their KV cache, so the
        train step has the GPU; the next :meth:`publish` takes it back. Every rank calls it."""
        if self.device is None or self._yielded:
            return
        self.admission.pause()
        if self._leader:
            self.device.release_memory()
        self.dist.barrier()
        self._yielded = True

    def publish(self, version: int | None = None) -> int:
        """Push the actor's weights as ``version`` (default: the current one + 1; a resume
        passes the checkpoint's) and move everything to it. Returns the new version."""
        version = self._version + 1 if version is None else version
        if not self._yielded:
            self.admission.pause()
        if self.mode == "disk":
            self._push_disk(version)
        elif self.mode == "ipc":
            self._push_ipc(version)
        else:
            self._push_broadcast(version)
        self.dist.barrier()
        self._version = version
        self.actor.set_version(version)
        if self._yielded and self._leader and self.device is not None:
            self.device.resume_memory()
        self._yielded = False
        self.admission.resume(version)
        return version

    def _push_disk(self, version: int) -> None:
        path = self.weights_dir / f"v{version}"
        meta = WeightUpdateMeta("disk", path=str(path), version=version)
        self.actor.update_weights(meta)  # collective: the first rank writes the HF dir
        if self._leader:
            self.servers.update_weights(meta)
            for old in self.weights_dir.glob("v*"):
                if old.name[1:].isdigit() and int(old.name[1:]) <= version - self.keep:
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """End of the run (``disk``, first rank): delete the weight dirs the updates left, so
        RUN_DIR (or ``weight_update_dir``, a tmpfs) does not keep two copies of the model."""
        if self.mode != "disk" or not self._leader:
            return
        for old in self.weights_dir.glob("v*"):
            if old.name[1:].isdigit():
                shutil.rmtree(old, ignore_errors=True)

    def _push_broadcast(self, version: int) -> None:
        self.connect()
        assert self._group_meta is not None  # connect() formed the group
        meta = dataclasses.replace(self._group_meta, version=version)
        future = (
            self.servers.update_weights_async(meta, self.actor.weight_announcement())
            if self._leader
            else None
        )
        self.actor.update_weights(meta)  # collective: broadcast in buckets from rank 0
        if future is not None:
            future.result(self.servers.config.weight_update_timeout + 10)

    def _push_ipc(self, version: int) -> None:
        meta = WeightUpdateMeta("ipc", version=version)
        if self._leader:  # the actor's first rank shares the tensors and holds them meanwhile
            meta.send_shared = lambda shared: self.servers.update_weights(
                dataclasses.replace(meta, shared=shared, send_shared=None)
            )
        self.actor.update_weights(meta)  # collective: gathered, then shared by the first rank
