"""Model workers: the interface the master drives, and an in-process implementation.

A model worker hosts engines keyed by :class:`~areal.api.mfc.ModelName` and a store of sample
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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from areal.api.mfc import MFC, ModelFn, ModelName, fn_name
from areal.core import realloc
from areal.core.dfg import Allocation
from areal.core.realloc import Box
from areal.runtime.step import call_mfc
from areal.utils.batch import PackedBatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from areal.engine.fsdp import FSDPEngine

SNAPSHOT_WAIT = 600.0  # seconds a reader waits for a reallocation's source shards


@dataclass(frozen=True)
class MFCRequest:
    """One data-parallel rank's share of an MFC: its samples, in order, and where their inputs
    are."""

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


@dataclass(frozen=True)
class Moved:
    """What one destination worker's share of a reallocation moved."""

    bytes: int  # fetched from other workers (pieces it already held are not counted)
    seconds: float  # on the worker, waiting for the source's shards included


@dataclass
class SampleFields:
    """One sample's fields as a worker stores them."""

    tokens: dict[str, torch.Tensor]  # [L, ...] each
    seqs: dict[str, torch.Tensor]  # [...] each (one row of a sequence field)


class ModelWorker(abc.ABC):
    """What the master needs from a model worker (in-process here; Ray actors in ray_worker)."""

    index: int

    @abc.abstractmethod
    def hosts(self, model: ModelName, fn: ModelFn | str) -> str | None:
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
    def publish_shards(
        self, model: ModelName, token: str, layout: Allocation, n_readers: int
    ) -> Future[None]:
        """Queue: keep this worker's shards of ``model`` (laid out as ``layout``) under ``token``
        until ``n_readers`` have read them (a reallocation's source side; no collective)."""

    @abc.abstractmethod
    def load_shards(
        self, model: ModelName, token: str, source: Allocation, target: Allocation, ema: float
    ) -> Future[Moved]:
        """Queue: set this worker's shards of ``model`` (laid out as ``target``) to ``ema * own +
        (1 - ema) * source's``, reading the pieces it lacks from the workers of ``source`` that
        published ``token`` (:func:`areal.core.realloc.pieces_for`); every source worker is read
        once, an empty read if nothing is needed from it."""

    @abc.abstractmethod
    def read_shards(self, token: str, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        """Boxes of published shards (peers call this; waits for ``token`` to be published)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop running requests (the engines belong to the caller)."""

    def lost(self, error: BaseException) -> bool:
        """Whether ``error``, a queued call's, says this worker's process is gone (the master
        names such a worker before the peers whose collectives it broke). In-process: never."""
        return False


def pack(samples: list[SampleFields]) -> PackedBatch:
    """Stored samples as one packed batch, in order (lengths from their ``input_ids``)."""
    lens = torch.tensor([len(s.tokens["input_ids"]) for s in samples], dtype=torch.long)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tokens = {k: torch.cat([s.tokens[k] for s in samples]) for k in samples[0].tokens}
    seqs = {k: torch.stack([s.seqs[k] for s in samples]) for k in samples[0].seqs}
    return PackedBatch(cu, tokens, seqs)


class InProcessWorker(ModelWorker):
    """A model worker in this process: engines given by the caller, one thread for requests."""

    def __init__(self, index: int, engines: dict[ModelName, FSDPEngine]):
        self.index = index
        self.engines = engines
        self.peers: list = []
        self._store: dict[int, SampleFields] = {}
        self._lock = threading.Lock()  # peers read the store from their threads
        self._published: dict[str, list] = {}  # token -> [own shards, readers left]
        self._published_ready = threading.Condition()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-worker-{index}")

    def build(self, make: Callable[[], dict[ModelName, FSDPEngine]]) -> None:
        """Build this worker's engines with ``make`` on its request thread, where every later
        call on them runs. DTensor caches its sharding decisions per thread, keyed by meshes that
        compare equal when their ranks and dim names do, whatever their process groups: a
        long-lived thread (a Ray actor's) that built an earlier graph's engines hands this
        graph's tensors the old meshes, and their groups, on the ranks where it happens to run
        (a reused actor's dp2 x tp2 step then hung in the weight gather). The request thread is
        new with each worker, so its cache starts empty."""
        self.engines = self._thread.submit(make).result()

    def connect(self, peers: list) -> None:
        """The job's workers, indexed like the allocation's worker indices (self included): each
        a :class:`ModelWorker` or anything with its ``get`` (a remote worker's store)."""
        self.peers = peers

    def hosts(self, model: ModelName, fn: ModelFn | str) -> str | None:
        engine = self.engines.get(model)
        if engine is None:
            hosted = sorted(map(str, self.engines))
            return f"worker {self.index} hosts no model '{model}' (it hosts {hosted})"
        if not callable(getattr(engine, fn_name(fn), None)):
            return (
                f"worker {self.index}'s model '{model}' ({type(engine).__name__}) has no "
                f"model function {fn_name(fn)}"
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
                have = self._store.get(sid) or SampleFields(
                    {}, {}
                )  # an unknown sample holds nothing
                missing = [k for k in keys if k not in have.tokens and k not in have.seqs]
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

    def publish_shards(
        self, model: ModelName, token: str, layout: Allocation, n_readers: int
    ) -> Future[None]:
        def publish() -> None:
            shards = realloc.own_shards(self.engines[model], layout, self.index)
            with self._published_ready:
                self._published[token] = [shards, n_readers]
                self._published_ready.notify_all()

        return self._thread.submit(publish)

    def load_shards(
        self, model: ModelName, token: str, source: Allocation, target: Allocation, ema: float
    ) -> Future[Moved]:
        def load() -> Moved:
            start = time.perf_counter()
            engine = self.engines[model]
            pieces = realloc.pieces_for(self.index, source, target, realloc.engine_shapes(engine))
            got: dict[realloc.Piece, torch.Tensor] = {}
            for w in dict.fromkeys(source.workers):  # each source worker read once
                mine = [p for p in pieces if p.source == w]
                peer = self if w == self.index else self.peers[w]
                got.update(zip(mine, peer.read_shards(token, [(p.name, p.box) for p in mine])))
            tensors = [got[p] for p in pieces]
            realloc.write_pieces(engine, target, self.index, pieces, tensors, ema)
            moved = sum(t.numel() * t.element_size() for p, t in got.items() if not p.local)
            return Moved(moved, time.perf_counter() - start)

        return self._thread.submit(load)

    def read_shards(self, token: str, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        with self._published_ready:
            if not self._published_ready.wait_for(
                lambda: token in self._published, timeout=SNAPSHOT_WAIT
            ):
                raise TimeoutError(
                    f"worker {self.index} has no published shards {token!r} after {SNAPSHOT_WAIT} s"
                )
            entry = self._published[token]
            entry[1] -= 1
            if entry[1] == 0:  # the last reader: drop it
                del self._published[token]
        return [realloc.cut(entry[0], name, box, self.index) for name, box in wanted]

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

    def _run(self, request: MFCRequest) -> MFCReply:
        mfc = request.mfc
        start = time.perf_counter()
        batch = self._gather(request)
        out, stats = call_mfc(self.engines[mfc.model], mfc, batch)  # what run_step calls
        (before_t, before_s), (after_t, after_s) = batch.keys(), out.keys()
        added_t, added_s = after_t - before_t, after_s - before_s
        with self._lock:
            self._store_fields(request.sample_ids, out, added_t, added_s)
        return MFCReply(
            {k: float(v) for k, v in stats.items()},
            tuple(sorted(added_t | added_s)),
            batch.n_tokens,
            time.perf_counter() - start,
        )
