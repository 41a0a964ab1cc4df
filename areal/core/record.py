"""What a Core PPO run records for ``areal view`` (sync and async) and ``areal replay`` (async):
docs/viewer.md.

The master holds metadata only, so the recorder watches its model workers instead of changing
it: :class:`TimedWorker` wraps each worker the master drives (:class:`TimedGenerationWorker` a
sync run's generation worker) and

- times every call the master queues on it (an MFC share, a weight move, a server push): when it
  was queued, when the worker ran it (its reply's ``compute_time``, or a move's ``seconds``, back
  from the moment the answer came; a call that reports no time, from when it was queued) and
  when the answer came, on the master's clock;
- on a step whose samples are recorded, holds back the master's release of ``advantages`` and
  ``trainer_logp`` (actor_train's per-token output) until :class:`CoreRecorder` has read them.

:class:`CoreRecorder` then writes, per step:

- ``RUN_DIR/timeline.jsonl``: one line per step, ``{"step", "time" (its start, Unix seconds),
  "seconds", "spans": [{"worker", "name", "kind" (mfc | hook), "queued", "start", "end"}]}``
  (span times in seconds since the step's start);
- the step's samples (``RUN_DIR/samples``, :class:`~areal.runtime.samples.SampleRecorder`): the
  trajectories the step trained, with the kept per-token fields. Sync PPO: the generation
  worker's groups of the step (it runs in the master's process). Async PPO
  (:class:`AsyncRecorder`): the rollout workers put each accepted group's trajectories beside its
  packed tensors in the object store (``Finished.ref[1]``), and the master fetches them with the
  group (:class:`~areal.core.rollout_side.GroupData`);
- async PPO with ``stats_logger.replay.enabled``: the step's packed batch (the groups' tensors as
  the model workers received them, in sample-id order) and the actor's weight hashes
  (:class:`~areal.runtime.replay.ReplayRecorder`); :mod:`areal.core.replay` replays them.

Recording a step moves its samples' kept fields to the master (samples) and the actor's full
weights (replay: once per step); neither happens on a step that records nothing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from areal.api.mfc import ModelFn, ModelName
from areal.core.dfg import Allocation, DataflowGraph
from areal.core.generation import GenerationWorker
from areal.core.master import SampleSender, ServerUpdater
from areal.core.realloc import Box
from areal.core.worker import MFCReply, MFCRequest, ModelWorker, Moved, SampleFields
from areal.rollout.trajectory import groups_to_batch
from areal.runtime.graphs import ACTOR
from areal.utils.batch import PackedBatch
from areal.utils.logging import get_logger
from areal.utils.samples import TIMELINE

if TYPE_CHECKING:
    from areal.api.io import Trajectory
    from areal.core.config import CoreAsyncGRPOConfig
    from areal.core.rollout_side import GroupData
    from areal.runtime.run import Run

logger = get_logger("core.record")
KEPT = ("advantages", "trainer_logp")  # released by the master after actor_train / the step
R = TypeVar("R")
# The script ``areal replay`` loads for a Core run (areal.core.replay, named by its file: it
# imports the session, which imports this module), and how to record a replayable run.
REPLAY_SCRIPT = Path(__file__).with_name("replay.py")
ONE_RANK = "record with core.n_workers=1, or an allocation putting the actor on one worker"
# after the step: the groups of trajectories it trained and their sample ids, in that order
Trained = Callable[[], tuple[Sequence[Sequence["Trajectory"]], list[int]]]


class TimedWorker(ModelWorker):
    """A model worker as the master sees it, timing each queued call and holding back the
    release of :data:`KEPT` fields while :attr:`keep` is set (see the module docstring)."""

    def __init__(self, inner: ModelWorker, clock: Callable[[], float] = time.time):
        self.inner, self.clock = inner, clock
        self.index = inner.index
        self.keep = False
        self.held: list[tuple[str, int]] = []  # (key, sample id) whose release waits
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # answers arrive on other threads

    def submit(self, request: MFCRequest) -> Future[MFCReply]:
        """Queue an MFC share (timed)."""
        return self._timed(self.inner.submit(request), request.mfc.name, "mfc")

    def publish_shards(
        self, model: ModelName, token: str, layout: Allocation, n_readers: int
    ) -> Future[None]:
        """Queue a reallocation's source side (timed)."""
        queued = self.inner.publish_shards(model, token, layout, n_readers)
        return self._timed(queued, f"publish_shards {model}", "hook")

    def load_shards(
        self, model: ModelName, token: str, source: Allocation, target: Allocation, ema: float
    ) -> Future[Moved]:
        """Queue a reallocation's destination side (timed)."""
        queued = self.inner.load_shards(model, token, source, target, ema)
        return self._timed(queued, f"load_shards {model}", "hook")

    def hosts(self, model: ModelName, fn: ModelFn | str) -> str | None:
        return self.inner.hosts(model, fn)

    def lost(self, error: BaseException) -> bool:
        return self.inner.lost(error)

    def put(self, sample_ids: list[int], batch: PackedBatch) -> None:
        self.inner.put(sample_ids, batch)

    def get(self, sample_ids: tuple[int, ...], keys: tuple[str, ...]) -> list[SampleFields]:
        return self.inner.get(sample_ids, keys)

    def read_shards(self, token: str, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        return self.inner.read_shards(token, wanted)

    def close(self) -> None:
        self.inner.close()

    def free(self, items: list[tuple[str, int]]) -> None:
        """Release fields; those of :data:`KEPT` wait while :attr:`keep` is set."""
        held = [it for it in items if self.keep and it[0] in KEPT]
        self.held += held
        rest = [it for it in items if not (self.keep and it[0] in KEPT)]
        if rest:
            self.inner.free(rest)

    def release_held(self) -> None:
        """Release what :meth:`free` held back."""
        held, self.held = self.held, []
        if held:
            self.inner.free(held)

    def take_spans(self) -> list[dict[str, Any]]:
        """The spans timed since the last call."""
        with self._lock:
            spans, self.spans = self.spans, []
        return spans

    def _timed(self, future: Future[R], name: str, kind: str) -> Future[R]:
        queued = self.clock()

        def done(f: Future[R]) -> None:
            end = self.clock()
            reply = None if f.cancelled() or f.exception() is not None else f.result()
            busy = getattr(reply, "compute_time", getattr(reply, "seconds", None))
            start = queued if busy is None else max(queued, end - busy)  # no time told: all of it
            span = {"worker": self.index, "name": name, "kind": kind, "queued": queued,
                    "start": start, "end": end}  # fmt: skip
            with self._lock:
                self.spans.append(span)

        future.add_done_callback(done)
        return future


class TimedGenerationWorker(TimedWorker, ServerUpdater, SampleSender):
    """A sync run's generation worker as the master sees it: a :class:`TimedWorker` that also
    pushes weights to the servers (timed, a hook) and sends its samples to the model workers."""

    def __init__(self, inner: GenerationWorker, clock: Callable[[], float] = time.time):
        super().__init__(inner, clock)
        self.generation = inner

    def update_servers(self, source: ModelName, version: int) -> Future[None]:
        """Queue a push of ``source``'s weights to the servers (timed)."""
        queued = self.generation.update_servers(source, version)
        return self._timed(queued, f"update_servers {source}", "hook")

    def send(self, sample_ids: list[int], keys: tuple[str, ...], target: ModelWorker) -> None:
        """Move generated samples to ``target`` (on the master's thread, as it admits them)."""
        self.generation.send(sample_ids, keys, target)


def timed(worker: ModelWorker) -> TimedWorker:
    """``worker`` wrapped for the recorder: a generation worker keeps its extra calls."""
    if isinstance(worker, GenerationWorker):
        return TimedGenerationWorker(worker)
    return TimedWorker(worker)


class CoreRecorder:
    """Wraps the workers the master drives (:attr:`workers`, for the master) and records each
    step's timeline and samples (see the module docstring)."""

    def __init__(self, run: Run, workers: Sequence[ModelWorker]):
        """``run``: the master's :class:`~areal.runtime.run.Run` (its sample recorder);
        ``workers``: the master's, in the graph's order."""
        self.run = run
        self.workers = [timed(w) for w in workers]
        self.timeline = Path(run.run_dir) / TIMELINE

    def start(self, step: int) -> None:
        """Before the first step: drop timeline lines of steps after ``step`` (a resume redoes
        them; a fresh run, step 0, starts an empty file)."""
        kept = []
        if step and self.timeline.is_file():
            kept = [ln for ln in self.timeline.read_text().splitlines() if _step_of(ln) <= step]
        self.timeline.write_text("".join(ln + "\n" for ln in kept))

    @contextlib.contextmanager
    def step(self, step: int, version: int, trained: Trained | None) -> Iterator[None]:
        """Around the master's step ``step`` on the actor's ``version``: its timeline and, when
        ``stats_logger.samples`` keeps this step and ``trained`` is given (async PPO: the
        rollout workers shipped the trajectories), the samples ``trained()`` names after it."""
        cfg = self.run.samples.cfg
        keep = trained is not None and cfg.enabled and not step % cfg.keep_every
        for w in self.workers:
            w.keep = keep
        start = time.time()
        yield
        self._write_timeline(step, start, time.time())
        if trained is not None and keep:
            groups, ids = trained()
            batch = self._with_kept(groups_to_batch(groups), ids)
            self.run.samples.record(step, groups, batch, version)
        for w in self.workers:
            w.keep = False
            w.release_held()

    def _with_kept(self, batch: PackedBatch, ids: list[int]) -> PackedBatch:
        """``batch`` plus the :data:`KEPT` token fields read from where the workers hold them."""
        where: dict[str, dict[int, TimedWorker]] = {k: {} for k in KEPT}
        for w in self.workers:
            for key, sid in w.held:
                where[key].setdefault(sid, w)
        fields = {}
        for key, at in where.items():
            if len(at) != len(ids):
                continue  # not computed this step (no actor_train): recorded as null
            got: dict[int, torch.Tensor] = {}
            for w in {id(w): w for w in at.values()}.values():
                sids = tuple(s for s in ids if at[s] is w)
                got.update(zip(sids, (f.tokens[key] for f in w.inner.get(sids, (key,)))))
            fields[key] = torch.cat([got[s].cpu() for s in ids])
        return batch.with_fields(tokens=fields)

    def _write_timeline(self, step: int, start: float, end: float) -> None:
        spans = sorted((s for w in self.workers for s in w.take_spans()), key=lambda s: s["queued"])
        for s in spans:
            for k in ("queued", "start", "end"):
                s[k] = round(s[k] - start, 4)
        line = {"step": step, "time": start, "seconds": round(end - start, 4), "spans": spans}
        with open(self.timeline, "a") as f:
            f.write(json.dumps(line) + "\n")


class AsyncRecorder(CoreRecorder):
    """Core async PPO's recorder: the samples are the trajectories the master fetched with the
    groups, and the step's batch and the actor's hashes go to the replay record."""

    def __init__(
        self,
        cfg: CoreAsyncGRPOConfig,
        run: Run,
        workers: Sequence[ModelWorker],
        graph: DataflowGraph,
    ):
        """``graph``: the one the master walks."""
        super().__init__(run, workers)
        threads = cfg.core.torch_threads if cfg.core.backend == "ray" else torch.get_num_threads()
        ranks = len(graph.allocations[ACTOR].workers)
        run.replay.describe(REPLAY_SCRIPT, ranks, threads, ONE_RANK)

    @contextlib.contextmanager
    def step_groups(
        self, step: int, data: list[GroupData], ids: list[int], actor: Any, version: int
    ) -> Iterator[None]:
        """Around the master's step over the groups of ``data`` (their sample ``ids``, as
        ``put_groups`` returned them): the timeline, the samples and the replay record of
        ``step``."""
        shipped = data[0].trajectories is not None  # the rollout workers put them beside

        def trained() -> tuple[list[Sequence[Trajectory]], list[int]]:
            return [d.trajectories or [] for d in data], ids

        batch = _packed(data) if self.run.replay.cfg.enabled else None
        with self.step(step, version, trained if shipped else None):
            with self.run.replay.step(step, batch, actor) if batch is not None else _nothing():
                yield


def _packed(data: list[GroupData]) -> PackedBatch:
    """The step's packed batch as the model workers store it: the groups' tensors in order."""
    parts = [d.packed for d in data]
    lens = torch.cat([p.seqlens for p in parts])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tokens = {k: torch.cat([p.tokens[k] for p in parts]) for k in parts[0].tokens}
    seqs = {k: torch.cat([p.seqs[k] for p in parts]) for k in parts[0].seqs}
    return PackedBatch(cu, tokens, seqs)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError):  # a half-written last line of a killed run
        return 1 << 62


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield
