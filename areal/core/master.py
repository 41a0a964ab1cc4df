"""The master: runs a dataflow graph over model workers, one step at a time, holding metadata only.

Data manager. :meth:`Master.put_batch` takes dataset samples (whole groups of ``group_size``
consecutive sequences), spreads their fields over the workers by token count and records only
metadata in the :class:`~areal.core.buffer.SampleBuffer`: sample ids, lengths, which keys exist
and on which worker. :meth:`Master.step` takes the oldest waiting samples and runs every MFC of
the graph on them once.

Scheduling. An MFC is dispatched as soon as it is ready: every key it reads is in the dataset
or written by an MFC that has finished this step, and every earlier MFC touching one of its
models (its own, or a reallocation hook's source; graph order) has finished, so a model's calls
keep the graph's order (the actor's proximal logp before its update). Independent MFCs run at
once on their workers. Dispatching an MFC splits the step's samples over its model's
data-parallel ranks by token count, keeping groups whole
(:func:`areal.utils.batch.balance_across_ranks`), and sends each rank an
:class:`~areal.core.worker.MFCRequest` naming where each input key of its samples lives (every
tensor-parallel worker of a dp rank gets the rank's share; the first one's outputs are kept); the
workers move the tensors among themselves. When an MFC finishes, its outputs are recorded where
they were computed, and every key whose last reader has run is released on its worker.

Parameter reallocation (an MFC's :class:`~areal.api.mfc.ParamRealloc` hooks) is queued before
the call on the same workers: the source model's workers publish their shards, and every worker
of the MFC's model fetches the pieces of its own shards that it does not hold
(:mod:`areal.core.realloc`: the plan ``areal core graph`` prints); the MFC's stats get
``realloc/<model>/{bytes,seconds}``. A move is skipped while the source has not trained since the
last one.
An :class:`~areal.api.mfc.UpdateServers` hook asks the generation workers to push the source's
weights to their servers, with the source's version: the number of training MFCs it has run
(:attr:`Master.versions`; a resume sets it).

Streamed groups (async PPO): :meth:`Master.put_groups` places each rollout group, whole, on a
model worker by token count. The master fetched its tensors from the object store first: a rollout
worker owns what it put there, so a group is safe from its worker's death only once copied (a
worker that dies before has its groups redone: ``GenerationManager.untake``).

Generation. A graph with a ``generate`` MFC (sync PPO) makes its samples each step: the step's
sample ids are new, the generation workers fill them (prompts from their own dataset) and report
each sample's length; the master then places the new samples on the model workers by token count
(the generation worker sends the tensors there itself) and records them in the buffer.

Failures: an MFC that raises on any worker stops the step with the MFC, the worker and the
cause; an MFC still running after ``mfc_timeout`` seconds stops it too, naming what is running.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from areal.api.mfc import (
    MFC,
    ModelFn,
    ModelName,
    ParamRealloc,
    UpdateServers,
    changes_weights,
    fn_name,
)
from areal.core.buffer import SampleBuffer, SampleMeta
from areal.core.dfg import DataflowGraph
from areal.core.worker import MFCReply, MFCRequest, ModelWorker
from areal.utils.batch import PackedBatch, split_by_tokens

REALLOC_LOAD = "load of the weights of "  # a reallocation hook's load, by its description
FAILURE_GRACE_S = 10.0  # after one call of an MFC fails, how long the others get to finish


@runtime_checkable
class ServerUpdater(Protocol):
    """What the master asks of a worker that runs an MFC with an
    :class:`~areal.api.mfc.UpdateServers` hook (the generation worker)."""

    def update_servers(self, source: ModelName, version: int) -> Future[None]:
        """Queue: push ``source``'s weights to the generation servers as ``version``."""
        ...


@runtime_checkable
class SampleSender(Protocol):
    """What the master asks of a worker that runs a ``generate`` MFC (the generation worker):
    to hand its new samples to the model workers it places them on."""

    def send(self, sample_ids: list[int], keys: tuple[str, ...], target: ModelWorker) -> None:
        """Move those samples' ``keys`` to ``target`` and drop them here."""
        ...


def _unfit(graph: DataflowGraph, workers: Sequence[ModelWorker]) -> list[str]:
    """Why ``workers`` cannot run ``graph``'s MFCs, one line each (none: they can)."""
    problems = [
        f"MFC {m.name!r}: {why}"
        for m in graph.mfcs
        for w in graph.allocations[m.model].workers
        if (why := workers[w].hosts(m.model, m.fn)) is not None
    ]
    problems += [
        f"MFC {m.name!r}: worker {w} cannot push weights to generation servers "
        f"({type(workers[w]).__name__})"
        for m in graph.mfcs
        if any(isinstance(h, UpdateServers) for h in m.hooks)
        for w in graph.allocations[m.model].workers
        if not isinstance(workers[w], ServerUpdater)
    ]
    problems += [
        f"MFC {m.name!r}: worker {w} cannot send generated samples ({type(workers[w]).__name__})"
        for m in graph.mfcs
        if m.fn is ModelFn.GENERATE
        for w in graph.allocations[m.model].workers
        if not isinstance(workers[w], SampleSender)
    ]
    return problems


@dataclass
class _Running:
    mfc: MFC
    shares: list[tuple[int, list[int]]]  # (worker index, sample ids), one per worker of the mesh
    futures: list[Future[MFCReply]]
    hooks: list[tuple[str, int, Future]]  # (what, worker index, its future)
    start: float  # time.monotonic()

    def parts(self) -> list[tuple[str, int, Future]]:
        """(what, worker index, future) of every queued call: the hooks, then the shares ("")."""
        return [*self.hooks, *(("", w, f) for (w, _), f in zip(self.shares, self.futures))]

    def all_futures(self) -> list[Future]:
        return [f for _, _, f in self.parts()]


class Master:
    """Walks ``graph`` each step over ``workers`` (indexed as the allocations name them)."""

    def __init__(
        self,
        graph: DataflowGraph,
        workers: Sequence[ModelWorker],
        group_size: int = 1,
        buffer_capacity: int = 1 << 20,
        mfc_timeout: float = 600.0,
    ):
        if len(workers) != graph.n_workers:
            raise ValueError(
                f"graph {graph.name!r} is allocated over {graph.n_workers} workers, "
                f"got {len(workers)}"
            )
        problems = _unfit(graph, workers)
        if problems:
            raise ValueError(
                "the workers cannot run the graph:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        self.graph, self.workers, self.group_size = graph, workers, group_size
        self._updaters = {i: w for i, w in enumerate(workers) if isinstance(w, ServerUpdater)}
        self._senders = {i: w for i, w in enumerate(workers) if isinstance(w, SampleSender)}
        self.mfc_timeout = mfc_timeout
        consumers: dict[str, set[str]] = defaultdict(set)
        for m in graph.mfcs:
            for key in m.inputs:
                consumers[key].add(m.name)
        self.buffer = SampleBuffer(buffer_capacity, dict(consumers), {m.name for m in graph.mfcs})
        self.trace: list[tuple[str, str]] = []  # ("dispatch" | "done", MFC name), in order
        self.versions: dict[ModelName, int] = {m: 0 for m in graph.allocations}  # training MFCs run
        self._generate = next((m for m in graph.mfcs if m.fn is ModelFn.GENERATE), None)
        generation = (
            set(graph.allocations[self._generate.model].workers) if self._generate else set()
        )
        self._model_workers = [w for w in range(graph.n_workers) if w not in generation]
        self._next_id = 0
        self._steps = 0
        self._trained = {m.model for m in graph.mfcs if changes_weights(m.fn)}
        self._changes: dict[ModelName, int] = defaultdict(int)  # trainings and moves into it
        self._moved: dict[tuple[ModelName, ModelName], int] = {}  # (target, source) -> changes

    # ------------------------------------------------------------------------------ data

    def put_batch(self, batch: PackedBatch) -> list[int]:
        """Add dataset samples (the graph's dataset keys of ``batch``); returns their ids."""
        missing = [k for k in self.graph.dataset_keys if k not in batch]
        if missing:
            raise ValueError(
                f"graph {self.graph.name!r} reads dataset keys {missing}, which the batch "
                f"lacks (it has {sorted(set(batch.tokens) | set(batch.seqs))})"
            )
        if batch.n_seqs % self.group_size:
            raise ValueError(f"{batch.n_seqs} sequences are not whole groups of {self.group_size}")
        self.buffer.check_room(batch.n_seqs)  # before any tensor is placed
        ids = list(range(self._next_id, self._next_id + batch.n_seqs))
        self._next_id += batch.n_seqs
        keys = self.graph.dataset_keys
        data = PackedBatch(
            batch.cu_seqlens,
            {k: v for k, v in batch.tokens.items() if k in keys},
            {k: v for k, v in batch.seqs.items() if k in keys},
        )
        seqlens = batch.seqlens.tolist()
        n_place = min(len(self.workers), batch.n_seqs // self.group_size)
        metas = []
        for w, positions in enumerate(split_by_tokens(seqlens, n_place, self.group_size)):
            self.workers[w].put([ids[i] for i in positions], data.select(positions))
            metas += [SampleMeta(ids[i], seqlens[i], {k: w for k in keys}) for i in positions]
        self.buffer.put(sorted(metas, key=lambda m: m.sample_id))
        return ids

    def put_groups(self, groups: list, packed: list[PackedBatch]) -> list[int]:
        """Add streamed rollout groups (async PPO; :class:`~areal.core.manager.Finished`, each
        with its tensors ``packed``): each is placed whole on a model worker by token count.
        Returns the new sample ids."""
        bad = [g.group_id for g in groups if len(g.seqlens) != self.group_size]
        if bad:
            raise ValueError(f"groups {bad} do not hold group_size={self.group_size} samples")
        seqlens = [n for g in groups for n in g.seqlens]
        self.buffer.check_room(len(seqlens))
        ids = list(range(self._next_id, self._next_id + len(seqlens)))
        self._next_id += len(seqlens)
        keys, size = self.graph.dataset_keys, self.group_size
        metas = []
        n_place = min(len(self._model_workers), len(groups))
        for rank, positions in enumerate(split_by_tokens(seqlens, n_place, size)):
            target = self._model_workers[rank]
            for g in sorted({p // size for p in positions}):
                self.workers[target].put(ids[g * size : (g + 1) * size], packed[g])
            metas += [SampleMeta(ids[i], seqlens[i], {k: target for k in keys}) for i in positions]
        self.buffer.put(sorted(metas, key=lambda m: m.sample_id))
        return ids

    # ------------------------------------------------------------------------------ step

    def step(self, n_samples: int) -> dict[str, dict[str, float]]:
        """Run every MFC once over the oldest ``n_samples`` waiting samples; stats per MFC:
        rank 0's (the engines reduce theirs over the mesh), ``n_tokens`` over ranks,
        ``wall_time`` (dispatch to done) and ``compute_time`` (the slowest rank), in seconds."""
        if self._generate is not None:  # new samples, made by the generate MFC
            if n_samples % self.group_size:
                raise ValueError(
                    f"a step of {n_samples} samples is not whole groups of {self.group_size}"
                )
            self.buffer.check_room(n_samples)
            ids = list(range(self._next_id, self._next_id + n_samples))
            self._next_id += n_samples
        else:
            ids = self.buffer.take_oldest(n_samples)
        self._steps += 1
        pending, running, done = list(self.graph.mfcs), {}, set()
        stats: dict[str, dict[str, float]] = {}
        while pending or running:
            for m in [m for m in pending if self._ready(m, done)]:
                running[m.name] = self._dispatch(m, ids)
                pending.remove(m)
                self.trace.append(("dispatch", m.name))
            assert running, (
                f"no MFC of {[m.name for m in pending]} can run; build_graph admits no such graph"
            )
            self._wait(running)
            for name, run in list(running.items()):
                if all(f.done() for f in run.all_futures()):
                    stats[name] = self._finish(run)
                    del running[name]
                    done.add(name)
                    self.trace.append(("done", name))
        return stats

    def _ready(self, mfc: MFC, done: set[str]) -> bool:
        producers = self.graph.producers
        if any(producers[k] not in done for k in mfc.inputs if k in producers):
            return False
        earlier = self.graph.mfcs[: self.graph.mfcs.index(mfc)]
        return all(m.name in done for m in earlier if m.models & mfc.models)

    def _reallocate(self, mfc: MFC) -> list[tuple[str, int, Future]]:
        """Queue each hook's weight move: the source's workers publish their shards, then every
        worker of the MFC's model loads the pieces of its own shards it lacks from them
        (:mod:`areal.core.realloc`). A move is skipped when the source's weights have not
        changed (trained or moved into) since the last one (no EMA, the target never trains)."""
        queued = []
        target = self.graph.allocations[mfc.model]
        for i, hook in enumerate(mfc.hooks):
            if isinstance(hook, UpdateServers):
                version = self.versions[hook.source]
                queued += [
                    (
                        f"weights of {hook.source} to the servers",
                        w,
                        self._updaters[w].update_servers(hook.source, version),
                    )
                    for w in target.workers
                ]
                continue
            pair, changes = (mfc.model, hook.source), self._changes[hook.source]
            if not hook.ema and mfc.model not in self._trained and self._moved.get(pair) == changes:
                continue
            self._moved[pair] = changes
            self._changes[mfc.model] += 1
            token = f"step{self._steps}/{mfc.name}/{i}"
            source = self.graph.allocations[hook.source]
            n_readers = len(target.workers)
            for w in source.workers:
                publish = self.workers[w].publish_shards(hook.source, token, source, n_readers)
                queued.append((f"shards of {hook.source}", w, publish))
            for w in target.workers:
                load = self.workers[w].load_shards(mfc.model, token, source, target, hook.ema)
                queued.append((REALLOC_LOAD + str(hook.source), w, load))
        return queued

    def _dispatch(self, mfc: MFC, ids: list[int]) -> _Running:
        hooks = self._reallocate(mfc)  # queued first, so the call runs on the moved weights
        alloc = self.graph.allocations[mfc.model]
        if mfc.fn is ModelFn.GENERATE:  # no lengths yet: whole groups, near-equal counts
            groups = [ids[i : i + self.group_size] for i in range(0, len(ids), self.group_size)]
            shares = [
                (w, [s for g in groups[r :: alloc.dp] for s in g])
                for r, w in enumerate(alloc.workers)
            ]
        else:  # each dp rank's share goes to every worker of that rank: its stages and tp ranks
            seqlens = [self.buffer.meta(sid).seqlen for sid in ids]
            parts = split_by_tokens(seqlens, alloc.dp, self.group_size)
            shares = [
                (alloc.worker_at(p, d, t), [ids[i] for i in part])
                for d, part in enumerate(parts)
                for p in range(alloc.pp)
                for t in range(alloc.tp)
            ]
        futures = []
        for worker, sids in shares:  # every rank of the mesh gets it before any later MFC
            sources: dict[str, dict[int, tuple[int, ...]]] = {}
            for key in mfc.inputs:
                where: dict[int, list[int]] = defaultdict(list)
                for sid in sids:
                    where[self.buffer.meta(sid).keys[key]].append(sid)
                sources[key] = {w: tuple(s) for w, s in where.items()}
            futures.append(self.workers[worker].submit(MFCRequest(mfc, tuple(sids), sources)))
        return _Running(mfc, shares, futures, hooks, time.monotonic())

    def _wait(self, running: dict[str, _Running]) -> None:
        """Until some MFC share finishes; raise on a failed share or a passed deadline."""
        futures = [f for run in running.values() for f in run.all_futures()]
        first_deadline = min(run.start for run in running.values()) + self.mfc_timeout
        wait(
            futures,
            timeout=max(0.0, first_deadline - time.monotonic()),
            return_when=FIRST_COMPLETED,
        )
        for run in running.values():
            if any(f.done() and f.exception() is not None for f in run.all_futures()):
                raise self._failure(run)
        late = [
            f"{r.mfc.name!r} on workers "
            f"{[w for (w, _), f in zip(r.shares, r.futures) if not f.done()]}"
            for r in running.values()
            if time.monotonic() - r.start > self.mfc_timeout
            and not all(f.done() for f in r.all_futures())
        ]
        if late:
            raise TimeoutError(
                f"MFCs still running after mfc_timeout={self.mfc_timeout} s: "
                f"{', '.join(late)}; a worker is stuck or the timeout is too short"
            )

    def _failure(self, run: _Running) -> RuntimeError:
        """The error for ``run``, one of whose calls failed, naming the cause first. A killed
        rank's live peers fail at once (their collective loses a peer) while Ray reports the
        dead rank's own call a moment later, so the other calls get up to
        :data:`FAILURE_GRACE_S` to finish; then a worker whose process is gone
        (:meth:`ModelWorker.lost`) is named before the others that failed."""
        wait(run.all_futures(), timeout=FAILURE_GRACE_S)
        failed = [
            (what, w, e)
            for what, w, f in run.parts()
            if f.done() and (e := f.exception()) is not None
        ]
        failed.sort(key=lambda part: not self.workers[part[1]].lost(part[2]))  # stable
        what, worker, error = failed[0]
        others = sorted({w for _, w, _ in failed} - {worker})
        during = f" ({what})" if what else ""
        also = f"\n(the MFC also failed on workers {others})" if others else ""
        out = RuntimeError(
            f"MFC {run.mfc.name!r} ({run.mfc.model}.{fn_name(run.mfc.fn)}) failed on "
            f"worker {worker}{during}: {error}{also}"
        )
        out.__cause__ = error
        return out

    def _admit_generated(self, run: _Running, replies: list[MFCReply]) -> None:
        """Place a generate MFC's new samples on the model workers by token count (the
        generation worker sends the tensors) and record them in the buffer, in this step."""
        metas = []
        for (gen, sids), reply in zip(run.shares, replies):
            if len(reply.seqlens) != len(sids):
                raise RuntimeError(
                    f"MFC {run.mfc.name!r}: worker {gen} generated {len(reply.seqlens)} "
                    f"samples, {len(sids)} were asked for"
                )
            n_place = min(len(self._model_workers), len(sids) // self.group_size)
            for rank, positions in enumerate(
                split_by_tokens(list(reply.seqlens), n_place, self.group_size)
            ):
                target = self._model_workers[rank]
                part = [sids[i] for i in positions]
                self._senders[gen].send(part, reply.outputs, self.workers[target])
                metas += [
                    SampleMeta(
                        sids[i], reply.seqlens[i], {k: target for k in reply.outputs}, in_step=True
                    )
                    for i in positions
                ]
        self.buffer.put(sorted(metas, key=lambda m: m.sample_id))

    def set_version(self, model: ModelName, version: int) -> None:
        """Set how many training MFCs ``model`` has run (a resume restores it)."""
        self.versions[model] = version

    def _finish(self, run: _Running) -> dict[str, float]:
        """Record where the outputs are, release what no later MFC reads; the MFC's stats."""
        replies = [f.result() for f in run.futures]
        if run.mfc.fn is ModelFn.GENERATE:
            self._admit_generated(run, replies)
        if changes_weights(run.mfc.fn):
            self.versions[run.mfc.model] += 1
            self._changes[run.mfc.model] += 1
        alloc = self.graph.allocations[run.mfc.model]
        copies = alloc.tp * alloc.pp  # shares per dp rank, in a row (stage 0, tp rank 0 first)
        heads = [
            (share, reply)
            for i, (share, reply) in enumerate(zip(run.shares, replies))
            if i % copies == 0
        ]
        for i, ((worker, sids), reply) in enumerate(zip(run.shares, replies)):
            if i % copies:  # another stage's or tp rank's copy of its dp rank's outputs
                self.workers[worker].free([(k, sid) for sid in sids for k in reply.outputs])
        all_ids = []
        for (worker, sids), reply in heads:
            if run.mfc.fn is not ModelFn.GENERATE:  # generated keys were placed on admission
                self.buffer.add_keys(sids, reply.outputs, worker)
            all_ids += sids
        released: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for worker, key, sid in self.buffer.mark_used(run.mfc.name, all_ids):
            released[worker].append((key, sid))
        for worker, items in released.items():
            self.workers[worker].free(items)
        return {
            **replies[0].stats,
            **self._realloc_stats(run),
            "n_tokens": float(sum(r.n_tokens for _, r in heads)),
            "wall_time": time.monotonic() - run.start,
            "compute_time": max(r.compute_time for r in replies),
        }

    def _realloc_stats(self, run: _Running) -> dict[str, float]:
        """``realloc/<model>/bytes`` (fetched between workers, summed over the target's
        workers) and ``realloc/<model>/seconds`` (the slowest target worker) of the MFC's
        reallocation hooks; 0 when a move was skipped (the source unchanged)."""
        if not any(isinstance(h, ParamRealloc) for h in run.mfc.hooks):
            return {}
        moved = [f.result() for what, _, f in run.hooks if what.startswith(REALLOC_LOAD)]
        key = f"realloc/{run.mfc.model}"
        return {
            f"{key}/bytes": float(sum(m.bytes for m in moved)),
            f"{key}/seconds": max((m.seconds for m in moved), default=0.0),
        }
