"""The generation worker: hosts the ``rollout`` model of a graph's ``generate`` MFC (sync PPO).

It runs in the master's process and is Lite's rollout side (:mod:`areal.runtime.rl`): the client
to the generation servers, the reward workers, the training workflow and the workflow executor,
drawing prompts from the train dataset's loader (with DAPO's dynamic-sampling filter when the
config asks). One ``generate`` call is one
:meth:`~areal.rollout.executor.WorkflowExecutor.prepare_batch`: a batch of scored groups, stored
under the step's new sample ids; the master then has the worker
:meth:`send` each sample's fields to the model worker it places it on. The trajectories of the
last call (:meth:`GenerationWorker.trained`) are what ``areal view`` records
(:mod:`areal.core.record`), stamped ``worker<index>``.

``update_servers`` (the :class:`~areal.api.mfc.UpdateServers` hook) pushes the actor's weights
to the servers through the Lite :class:`~areal.runtime.publisher.WeightPublisher` (disk or
broadcast; pause, push, version bump, resume) when the actor's version is not the servers'.
Both run on the worker's one thread, so a push always precedes the generation queued after it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from areal.api.mfc import ModelFn, ModelName, fn_name
from areal.core.master import SampleSender, ServerUpdater
from areal.core.worker import InProcessWorker, MFCReply, MFCRequest, ModelWorker, pack
from areal.rollout.trajectory import groups_to_batch
from areal.runtime.publisher import WeightPublisher
from areal.runtime.rl import RolloutSide


class GenerationWorker(InProcessWorker, ServerUpdater, SampleSender):
    """The ``rollout`` model's host (worker ``index``); ``publisher`` pushes ``source``'s
    weights."""

    def __init__(
        self,
        index: int,
        side: RolloutSide,
        loader: Any,
        publisher: WeightPublisher,
        source: ModelName,
        accept: Any = None,
    ):
        super().__init__(index, engines={})
        self.side, self.loader, self.publisher, self.source, self.accept = (
            side,
            loader,
            publisher,
            source,
            accept,
        )
        side.executor.worker = f"worker{index}"  # on each trajectory: its timeline lane
        self.last_groups: list = []  # the groups of the last generate call
        self._last_ids: list[int] = []  # their samples' ids, in order
        self.last_stats: dict[str, float] = {}  # its executor, reward, client and batch stats

    def hosts(self, model: ModelName, fn: ModelFn | str) -> str | None:
        if fn is not ModelFn.GENERATE:
            return (
                f"worker {self.index} is a generation worker; it runs generate, not {fn_name(fn)}"
            )
        return None

    def update_servers(self, source: ModelName, version: int) -> Future[None]:
        """Queue: push ``source``'s weights as ``version`` unless the servers have that version."""
        if source != self.source:
            raise ValueError(f"worker {self.index} pushes {self.source}'s weights, not {source}'s")
        return self._thread.submit(self.push, version)

    def push(self, version: int) -> None:
        """Push the source's weights as ``version`` now, unless the servers already have it."""
        if version != self.publisher.version:
            self.publisher.publish(version)

    def trained(self) -> tuple[list, list[int]]:
        """The last generate call's groups of trajectories and their samples' ids, in order."""
        return self.last_groups, self._last_ids

    def send(self, sample_ids: list[int], keys: tuple[str, ...], target: ModelWorker) -> None:
        """Move those samples' ``keys`` to ``target`` (a model worker) and drop them here."""
        target.put(sample_ids, pack(self.get(tuple(sample_ids), keys)))
        self.free([(k, sid) for sid in sample_ids for k in keys])

    def _run(self, request: MFCRequest) -> MFCReply:
        start = time.perf_counter()
        mfc, executor = request.mfc, self.side.executor
        groups = executor.prepare_batch(self.loader, self.side.workflow, self.accept)
        batch = groups_to_batch(groups)
        if batch.n_seqs != len(request.sample_ids):
            raise RuntimeError(
                f"generation made {batch.n_seqs} sequences; the step asked for "
                f"{len(request.sample_ids)} (train_dataset.batch_size x gconfig.n_samples)"
            )
        missing = set(mfc.outputs) - set(batch.tokens) - set(batch.seqs)
        if missing:
            raise ValueError(
                f"MFC {mfc.name!r} declares outputs {sorted(missing)}, which rollouts lack"
            )
        with self._lock:
            self._store_fields(
                list(request.sample_ids),
                batch,
                set(batch.tokens) & set(mfc.outputs),
                set(batch.seqs) & set(mfc.outputs),
            )
        self.last_groups, self._last_ids = groups, list(request.sample_ids)
        self.last_stats = {
            **executor.last_batch_stats,
            **self.side.reward.commit_batch(),
            **self.side.rollout.stats(),
            "reward/mean": float(batch["rewards"].float().mean()),
            "perf/n_tokens": float(batch.n_tokens),
            "perf/n_trained_tokens": float(batch["loss_mask"].sum()),
        }
        return MFCReply(
            {},
            tuple(sorted(mfc.outputs)),
            batch.n_tokens,
            time.perf_counter() - start,
            tuple(batch.seqlens.tolist()),
        )
