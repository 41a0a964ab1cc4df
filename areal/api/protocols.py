"""The seams Lite and Core share, as runtime-checkable protocols.

Each protocol names what one side of a seam needs of the other. The classes that fill a seam
declare it (they subclass the protocol), so a type checker holds them to it and a reader who
Ctrl-clicks from a use lands here, not in one of the implementations.

=================  ==============================  =========================  ======================
protocol           used by                         Lite                       Core
=================  ==============================  =========================  ======================
WeightSource       WeightPublisher (the actor)     FSDPEngine (TrainEngine)   RayModel
WeightTarget       WeightPublisher (the servers)   RemoteInferenceEngine      ManagedServers
SharesDevice       WeightPublisher (colocated)     RemoteInferenceEngine      --
Admission          WeightPublisher (rollouts)      WorkflowExecutor           RayRolloutSide
Persistent         Run (HF export, recover)        FSDPEngine (TrainEngine)   RayModel
Checkpointable     Run.resume / Run.checkpoint     WorkflowExecutor, the      RayRolloutSide,
                                                   data loader (structurally) ManagerCheckpoint
Publisher          Run.resume / Run.checkpoint     WeightPublisher            ActorWeights
=================  ==============================  =========================  ======================

A weight update (:class:`areal.runtime.publisher.WeightPublisher`) is: ``Admission.pause()`` ->
``WeightSource.update_weights`` with ``WeightTarget.update_weights[_async]`` -> every trainer
rank waits -> ``WeightSource.set_version`` -> ``Admission.resume(version)``: the version travels
with the call that needs it.
"""

from __future__ import annotations

import abc
from typing import Protocol, runtime_checkable

from areal.api.config.rollout import InferenceEngineConfig
from areal.api.io import SaveLoadMeta, WeightUpdateMeta

# What a recover checkpoint keeps of one part (data loader, executor, generation manager).
StateDict = dict[str, object]


class Pending(Protocol):
    """A weight update running on the servers; ``result(timeout)`` waits for it or raises."""

    def result(self, timeout: float, /) -> object:
        """Wait at most ``timeout`` seconds for the update; raise its failure or a timeout."""
        ...


@runtime_checkable
class WeightSource(Protocol):
    """The trainer side of a weight update: the actor, on every rank of its mesh."""

    @abc.abstractmethod
    def init_weight_update_group(self, meta: WeightUpdateMeta, world_size: int) -> None:
        """Join the broadcast group (trainer rank 0 = group rank 0, servers 1..world_size-1)."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Write the HF dir (``disk``) or broadcast the weights in buckets (``distributed``)."""

    @abc.abstractmethod
    def weight_announcement(self) -> dict[str, list]:
        """Names, dtypes and shapes of what a broadcast sends, in order (the servers' side)."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """Version of the current weights."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the weight version counter."""


@runtime_checkable
class WeightTarget(Protocol):
    """The generation servers' side of a weight update (the first trainer rank talks to them)."""

    config: InferenceEngineConfig  # setup_timeout and weight_update_timeout bound the waits

    @property
    @abc.abstractmethod
    def weight_group_size(self) -> int:
        """World size of the broadcast group: the trainer plus every live server."""

    @abc.abstractmethod
    def init_weights_update_group_async(self, meta: WeightUpdateMeta) -> Pending:
        """Start the servers joining the trainer's broadcast group."""

    @abc.abstractmethod
    def update_weights_async(
        self, meta: WeightUpdateMeta, announcement: dict[str, list] | None = None
    ) -> Pending:
        """Start loading ``meta.path`` (disk), or receiving ``announcement``'s tensors."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Load ``meta.path`` on every live server; returns once they report ``meta.version``."""


@runtime_checkable
class SharesDevice(Protocol):
    """Servers colocated on the trainer's accelerators: they give back memory for a train step."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Paused servers give back their accelerator memory (the KV cache)."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Servers take back the memory :meth:`release_memory` gave back."""


@runtime_checkable
class Admission(Protocol):
    """Who admits new rollouts: stopped for a weight update, started again at its version."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Admit nothing more and pause generation (interrupted requests continue later)."""

    @abc.abstractmethod
    def resume(self, version: int) -> None:
        """Generate again with the weights of ``version``; admission counts from it."""


@runtime_checkable
class Persistent(Protocol):
    """A model whose weights are saved (HF export, DCP recover checkpoint) and loaded."""

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None:
        """Save HF weights (export) or a DCP checkpoint (exact recovery), as ``meta`` says."""

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None:
        """Load what :meth:`save` wrote."""


@runtime_checkable
class Checkpointable(Protocol):
    """A part of a run whose state a recover checkpoint keeps and a resume restores."""

    @abc.abstractmethod
    def state_dict(self) -> StateDict:
        """What a resume needs to lose nothing (picklable)."""

    @abc.abstractmethod
    def load_state_dict(self, state: StateDict, /) -> None:
        """Restore :meth:`state_dict` output before the part is used."""


@runtime_checkable
class Publisher(Protocol):
    """The trained weights as the servers see them: a recover checkpoint records their
    ``version``; a resume publishes the checkpoint's weights again under it."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The version a recover checkpoint records."""

    @abc.abstractmethod
    def publish(self, version: int, /) -> int:
        """Push the trained weights to the servers as ``version``; returns it."""
