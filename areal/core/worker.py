"""Model workers: the interface the master drives, and an in-process implementation.

A model worker hosts engines keyed by :class:`~areal.core.dfg.ModelName` and a store of sample
fields (tensors) keyed by sample id. The master sends it :class:`MFCRequest`s (metadata only:
which MFC, which samples, on which worker each input key of those samples lives); the worker
fetches what it lacks straight from its peers (:meth:`ModelWorker.get`), runs the engine's model
function on the packed batch, keeps the added fields in its own store and replies with stats
and the keys it added. Tensors never pass through the master.

A worker runs its requests one at a time in the order received. The master sends each MFC to all
workers of the model's mesh before the next MFC, so every worker of a mesh runs shared MFCs in
the same order and their collectives match.

:class:`InProcessWorker` lives in the master's process (one thread per worker): the
implementation for tests of the master without Ray and for a job of one process, and what each
Ray actor of :mod:`areal.core.ray_worker` runs inside.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from areal.core.dfg import MFC, ModelFn, ModelName
from areal.utils.batch import PackedBatch

SNAPSHOT_WAIT = 600.0  # seconds a reader waits for a weight snapshot to be taken
TRAINING_FNS = (
    ModelFn.PPO_UPDATE,
    ModelFn.TRAIN_LM,
    ModelFn.TRAIN_RW,
)  # the worker steps the LR after


@dataclass(frozen=True)
class MFCRequest:
    """One data-parallel rank's share of an MFC: its samples, in order, and where their inputs are."""

    mfc: MFC
    sample_ids: tuple[int, ...]
    sources: dict[str, dict[int, tuple[int, ...]]]  # input key -> {worker index: sample ids there}


@dataclass(frozen=True)
class MFCReply:
    """What a rank reports back: the engine's stats, the keys it added, its tokens and time."""

    stats: dict[str, float]
    outputs: tuple[str, ...]
    n_tokens: int
    compute_time: float  # seconds on the worker, fetching inputs included
    seqlens: tuple[int, ...] = ()  # generate: the length of each new sample, in request order


@dataclass
class SampleFields:
    """One sample's fields as a worker stores them."""

    tokens: dict[str, torch.Tensor]  # [L, ...] each
    seqs: dict[str, torch.Tensor]  # [...] each (one row of a sequence field)


class ModelWorker(abc.ABC):
    """What the master needs from a model worker (in-process here; Ray actors in ray_worker)."""

    index: int

    @abc.abstractmethod
    def hosts(self, model: ModelName, fn: ModelFn) -> str | None:
        """None if this worker can run ``model.fn``, else why not."""

    @abc.abstractmethod
    def submit(self, request: MFCRequest) -> Future[MFCReply]:
        """Queue one MFC share; requests run one at a time, in the order submitted."""

    @abc.abstractmethod
    def put(self, sample_ids: list[int], batch: PackedBatch) -> None:
        """Store ``batch``'s fields as those samples' (dataset keys)."""

    @abc.abstractmethod
    def get(self, sample_ids: tuple[int, ...], keys: tuple[str, ...]) -> list[SampleFields]:
        """Those samples' fields ``keys`` (peers call this to fetch inputs)."""

    @abc.abstractmethod
    def free(self, items: list[tuple[str, int]]) -> None:
        """Drop ``(key, sample)`` fields from the store."""

    @abc.abstractmethod
    def snapshot(self, model: ModelName, token: str, n_readers: int) -> Future[None]:
        """Queue: gather ``model``'s full weights (collective over its mesh); its first rank keeps
        them under ``token`` until ``n_readers`` have read them."""

    @abc.abstractmethod
    def load_weights(self, model: ModelName, holder: int, token: str, ema: float) -> Future[None]:
        """Queue: set ``model``'s weights to the snapshot ``token`` held by worker ``holder``
        (``ema * own + (1 - ema) * snapshot``), resharded to this model's mesh."""

    @abc.abstractmethod
    def read_snapshot(self, token: str) -> dict[str, torch.Tensor]:
        """A snapshot this worker holds (peers call this; waits for it to exist)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop running requests (the engines belong to the caller)."""


def pack(samples: list[SampleFields]) -> PackedBatch:
    """Stored samples as one packed batch, in order (lengths from their ``input_ids``)."""
    lens = torch.tensor([len(s.tokens["input_ids"]) for s in samples], dtype=torch.long)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tokens = {k: torch.cat([s.tokens[k] for s in samples]) for k in samples[0].tokens}
    seqs = {k: torch.stack([s.seqs[k] for s in samples]) for k in samples[0].seqs}
    return PackedBatch(cu, tokens, seqs)


def load_full_state(engine: Any, full: dict[str, torch.Tensor], ema: float) -> None:
    """Set ``engine.model``'s parameters to ``ema * own + (1 - ema) * full`` (full, unsharded
    tensors by name, as ``full_state_dict`` gives them). Each rank cuts its own shard from the
    full tensor, so no communication is needed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if name not in full:
                raise KeyError(
                    f"the reallocated weights have no {name!r}; source and target must be "
                    "the same architecture"
                )
            src = full[name].to(param.dtype)
            if isinstance(param, DTensor):
                own = param.to_local()
                src = distribute_tensor(
                    src, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
            else:
                own = param.data
            own.copy_(own * ema + src.to(own.device) * (1.0 - ema) if ema else src.to(own.device))


class InProcessWorker(ModelWorker):
    """A model worker in this process: engines given by the caller, one thread for requests."""

    def __init__(self, index: int, engines: dict[ModelName, Any]):
        self.index = index
        self.engines = engines
        self.peers: list = []
        self._store: dict[int, SampleFields] = {}
        self._lock = threading.Lock()  # peers read the store from their threads
        self._snapshots: dict[str, list] = {}  # token -> [weights, readers left]
        self._snapshot_ready = threading.Condition()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-worker-{index}")

    def connect(self, peers: list) -> None:
        """The job's workers, indexed like the allocation's worker indices (self included): each
        a :class:`ModelWorker` or anything with its ``get`` (a remote worker's store)."""
        self.peers = peers

    def hosts(self, model: ModelName, fn: ModelFn) -> str | None:
        engine = self.engines.get(model)
        if engine is None:
            return f"worker {self.index} hosts no model '{model}' (it hosts {sorted(map(str, self.engines))})"
        if not callable(getattr(engine, fn.value, None)):
            return (
                f"worker {self.index}'s model '{model}' ({type(engine).__name__}) has no "
                f"model function {fn.value}"
            )
        return None

    def submit(self, request: MFCRequest) -> Future[MFCReply]:
        return self._thread.submit(self._run, request)

    def put(self, sample_ids: list[int], batch: PackedBatch) -> None:
        if len(sample_ids) != batch.n_seqs:
            raise ValueError(
                f"{len(sample_ids)} sample ids for a batch of {batch.n_seqs} sequences"
            )
        with self._lock:
            self._store_fields(sample_ids, batch, set(batch.tokens), set(batch.seqs))

    def _store_fields(
        self, sample_ids, batch: PackedBatch, tokens: set[str], seqs: set[str]
    ) -> None:
        lens = batch.seqlens.tolist()
        split = {k: torch.split(batch.tokens[k], lens) for k in tokens}
        for i, sid in enumerate(sample_ids):
            sample = self._store.setdefault(sid, SampleFields({}, {}))
            sample.tokens.update({k: split[k][i] for k in tokens})
            sample.seqs.update({k: batch.seqs[k][i] for k in seqs})

    def get(self, sample_ids: tuple[int, ...], keys: tuple[str, ...]) -> list[SampleFields]:
        out = []
        with self._lock:
            for sid in sample_ids:
                have = self._store.get(sid)
                missing = [
                    k for k in keys if have is None or (k not in have.tokens and k not in have.seqs)
                ]
                if missing:
                    raise KeyError(f"worker {self.index} holds no {missing} of sample {sid}")
                out.append(
                    SampleFields(
                        {k: have.tokens[k] for k in keys if k in have.tokens},
                        {k: have.seqs[k] for k in keys if k in have.seqs},
                    )
                )
        return out

    def free(self, items: list[tuple[str, int]]) -> None:
        with self._lock:
            for key, sid in items:
                sample = self._store.get(sid)
                if sample is None:
                    continue
                sample.tokens.pop(key, None)
                sample.seqs.pop(key, None)
                if not sample.tokens and not sample.seqs:
                    del self._store[sid]

    def snapshot(self, model: ModelName, token: str, n_readers: int) -> Future[None]:
        def take() -> None:
            full = self.engines[model].full_state_dict()  # {} except on the mesh's first rank
            if full:
                with self._snapshot_ready:
                    self._snapshots[token] = [full, n_readers]
                    self._snapshot_ready.notify_all()

        return self._thread.submit(take)

    def load_weights(self, model: ModelName, holder: int, token: str, ema: float) -> Future[None]:
        def load() -> None:
            source = self if holder == self.index else self.peers[holder]
            load_full_state(self.engines[model], source.read_snapshot(token), ema)

        return self._thread.submit(load)

    def read_snapshot(self, token: str) -> dict[str, torch.Tensor]:
        with self._snapshot_ready:
            if not self._snapshot_ready.wait_for(
                lambda: token in self._snapshots, timeout=SNAPSHOT_WAIT
            ):
                raise TimeoutError(
                    f"worker {self.index} has no weight snapshot {token!r} after {SNAPSHOT_WAIT} s"
                )
            entry = self._snapshots[token]
            entry[1] -= 1
            if entry[1] == 0:  # the last reader: drop it
                del self._snapshots[token]
            return entry[0]

    def submit_call(self, model: ModelName, method: str, *args: Any) -> Future[Any]:
        """Queue ``engines[model].method(*args)`` behind the MFCs already queued (whole-model
        calls such as save/load, which every rank of the mesh must make in the same order)."""
        return self._thread.submit(lambda: getattr(self.engines[model], method)(*args))

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------------------ running

    def _gather(self, request: MFCRequest) -> PackedBatch:
        """The request's samples with its input keys, fetched from wherever they live."""
        fields: dict[int, SampleFields] = {sid: SampleFields({}, {}) for sid in request.sample_ids}
        for key, where in request.sources.items():
            for worker, sids in where.items():
                source = self if worker == self.index else self.peers[worker]
                for sid, got in zip(sids, source.get(sids, (key,))):
                    fields[sid].tokens.update(got.tokens)
                    fields[sid].seqs.update(got.seqs)
        return pack([fields[sid] for sid in request.sample_ids])

    def _call(self, mfc: MFC, batch: PackedBatch):
        engine = self.engines[mfc.model]
        method = getattr(engine, mfc.fn.value)
        if mfc.mb_spec is None:
            return method(batch, **mfc.kwargs)
        own = engine.config  # this call only: the MFC's micro-batch split
        engine.config = dataclasses.replace(own, mb_spec=mfc.mb_spec)
        try:
            return method(batch, **mfc.kwargs)
        finally:
            engine.config = own

    def _run(self, request: MFCRequest) -> MFCReply:
        mfc = request.mfc
        start = time.perf_counter()
        batch = self._gather(request)
        out, stats = self._call(mfc, batch)
        if mfc.fn in TRAINING_FNS:  # as the Lite scripts do after each update
            self.engines[mfc.model].step_lr_scheduler()
        before_t, before_s = batch.keys()
        after_t, after_s = out.keys()
        added_t, added_s = after_t - before_t, after_s - before_s
        if added_t | added_s != set(mfc.outputs):
            raise ValueError(
                f"MFC {mfc.name!r} ({mfc.model}.{mfc.fn.value}) added keys "
                f"{sorted(added_t | added_s)} but the graph declares {sorted(mfc.outputs)}"
            )
        with self._lock:
            self._store_fields(request.sample_ids, out, added_t, added_s)
        return MFCReply(
            {k: float(v) for k, v in stats.items()},
            tuple(sorted(added_t | added_s)),
            batch.n_tokens,
            time.perf_counter() - start,
        )
