"""The master's sample buffer: metadata only (ids, lengths, which keys exist and on which worker).

A pure class (no threads, no tensors). Samples enter in groups, oldest first; a step takes the
oldest samples not yet in a step; each MFC of the step marks the samples it has used. A key of a
sample is released once every MFC reading it has run on that sample (the worker holding it can
drop the tensor); a sample leaves the buffer once every MFC of the step has used it, and its
remaining keys are released with it. The buffer is bounded: :meth:`SampleBuffer.put` past
``capacity`` raises :class:`BufferFull` (the producer waits for a step to finish and retries).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class BufferFull(RuntimeError):
    """The buffer has no room for the samples offered."""


@dataclass
class SampleMeta:
    """What the master knows about one sample (one sequence): never its tensors."""

    sample_id: int
    seqlen: int  # tokens
    keys: dict[str, int] = field(default_factory=dict)  # key -> index of the worker holding it
    used_by: set[str] = field(default_factory=set)  # MFCs of its step that have run on it
    in_step: bool = False


class SampleBuffer:
    """Bounded, oldest-first metadata of the samples between the dataset and the last MFC.

    ``consumers`` maps each key to the MFCs reading it; ``step_mfcs`` are the MFCs every sample
    of a step goes through.
    """

    def __init__(self, capacity: int, consumers: dict[str, set[str]], step_mfcs: set[str]):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 sample, got {capacity}")
        self.capacity = capacity
        self.consumers = consumers
        self.step_mfcs = step_mfcs
        self._samples: OrderedDict[int, SampleMeta] = OrderedDict()  # insertion order = age

    def __len__(self) -> int:
        return len(self._samples)

    def has_room(self, n: int) -> bool:
        return len(self._samples) + n <= self.capacity

    def check_room(self, n: int) -> None:
        """Raise :class:`BufferFull` unless ``n`` more samples fit."""
        if not self.has_room(n):
            raise BufferFull(
                f"the buffer holds {len(self)} of {self.capacity} samples and cannot take "
                f"{n} more; run a step first or raise the buffer capacity"
            )

    def put(self, metas: list[SampleMeta]) -> None:
        """Add samples (newest last); all or none."""
        self.check_room(len(metas))
        for m in metas:
            if m.sample_id in self._samples:
                raise ValueError(f"sample {m.sample_id} is already in the buffer")
        for m in metas:
            self._samples[m.sample_id] = m

    def meta(self, sample_id: int) -> SampleMeta:
        return self._samples[sample_id]

    def take_oldest(self, n: int) -> list[int]:
        """Ids of the ``n`` oldest samples not in a step yet, oldest first; they join the step."""
        free = [m for m in self._samples.values() if not m.in_step]
        if len(free) < n:
            raise ValueError(
                f"a step of {n} samples was asked for but the buffer has {len(free)} "
                "waiting; put more samples first"
            )
        for m in free[:n]:
            m.in_step = True
        return [m.sample_id for m in free[:n]]

    def add_keys(self, sample_ids: list[int], keys: tuple[str, ...], worker: int) -> None:
        """Record that ``worker`` now holds ``keys`` of these samples."""
        for sid in sample_ids:
            for key in keys:
                self._samples[sid].keys[key] = worker

    def mark_used(self, mfc: str, sample_ids: list[int]) -> list[tuple[int, str, int]]:
        """``mfc`` has run on these samples; returns what to release: ``(worker, key, sample)``.

        A key is released when every MFC reading it has run on the sample; a sample finished by
        every MFC of the step leaves the buffer and releases all its keys.
        """
        released: list[tuple[int, str, int]] = []
        for sid in sample_ids:
            m = self._samples[sid]
            m.used_by.add(mfc)
            finished = self.step_mfcs <= m.used_by
            for key, worker in list(m.keys.items()):
                if finished or self.consumers.get(key, set()) and self.consumers[key] <= m.used_by:
                    released.append((worker, key, sid))
                    del m.keys[key]
            if finished:
                del self._samples[sid]
        return released
