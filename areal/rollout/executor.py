"""Runs rollout workflows concurrently under staleness control, for a synchronous trainer.

The executor owns an asyncio loop in a background thread. The trainer thread calls
:meth:`WorkflowExecutor.submit`, :meth:`~WorkflowExecutor.wait`,
:meth:`~WorkflowExecutor.rollout_batch` (synchronous: evaluation, or synchronous training) and
:meth:`~WorkflowExecutor.prepare_batch` (asynchronous: rollouts stay in flight across training
steps). Admission is decided by :class:`~areal.rollout.staleness.StalenessManager`; results come
back oldest-submitted first; nothing finished is discarded; a group the ``should_accept`` filter
rejects frees its slot so a replacement item is admitted and the batch size stays fixed.

Failures: an exception inside a workflow (or its filter) is recorded with the item and raised
to the caller of ``wait`` / ``prepare_batch`` / ``rollout_batch``, then again on every later
call (the run must stop). A watchdog stops the run when rollouts are running but none completes
within ``rollout.watchdog_timeout`` seconds (time spent paused does not count).

Weight updates: call :meth:`pause` (stops admission and pauses the engine), update the weights,
``set_version(v + 1)``, then :meth:`resume`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Iterable, Iterator, TypeVar

from areal.api.config.rollout import InferenceEngineConfig
from areal.api.engine import InferenceEngine
from areal.api.io import Trajectory
from areal.api.workflow import RolloutWorkflow
from areal.rollout.staleness import StalenessManager
from areal.rollout.trajectory import staleness_stats
from areal.utils.logging import get_logger

logger = get_logger("executor")
T = TypeVar("T")
Group = list[Trajectory]
ShouldAccept = Callable[[Group], bool]


class RolloutError(RuntimeError):
    """A workflow (or its should_accept filter) raised; the message names the item."""


class RolloutWatchdogError(RuntimeError):
    """Rollouts were running but none completed within ``rollout.watchdog_timeout``."""


class EventLoopThread:
    """An asyncio loop running forever in a daemon thread; other threads hand it coroutines."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run ``coro`` on the loop and block for its result, at most ``timeout`` seconds."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine itself raised TimeoutError (same class since 3.11)
                raise
            fut.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout} s") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (thread-safe)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every task, stop the loop and join the thread."""
        if self._thread.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


@dataclass
class _Job:
    seq: int  # submission order: results are returned by increasing seq
    item: Any
    workflow: RolloutWorkflow
    should_accept: ShouldAccept | None
    exempt: bool  # rollout_batch jobs: concurrency cap only, not staleness-bound
    task: asyncio.Task | None = None


def _describe(job: _Job) -> str:
    text = repr(job.item)
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(job.workflow).__name__} on item #{job.seq} {text}"


def _iter_batches(dataloader: Iterable) -> Iterator[list[Any]]:
    """Batches (lists of items) of a dataloader, epoch after epoch.

    Whole batches are handed out so the executor submits every item of a batch at once: the
    dataloader's state then never counts an item that is neither submitted nor recorded.
    """
    while True:
        n = 0
        for batch in dataloader:
            items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
            n += len(items)
            yield items
        if n == 0:
            raise ValueError("prepare_batch: the dataloader yielded no items; check the dataset")


class WorkflowExecutor:
    """Submit/wait/rollout_batch/prepare_batch over an :class:`InferenceEngine`."""

    def __init__(
        self,
        config: InferenceEngineConfig,
        engine: InferenceEngine,
        should_accept: ShouldAccept | None = None,
        poll_interval: float = 0.02,  # seconds between admission/watchdog checks
        consumer_batch_size: int | None = None,
    ):
        """``consumer_batch_size``: groups per training batch when the script derives it (e.g.
        dataset batch size / trainer ranks); None = ``config.consumer_batch_size``."""
        self.config = config
        self.engine = engine
        self.should_accept = should_accept
        self.poll_interval = poll_interval
        self.batch_size = consumer_batch_size or config.consumer_batch_size
        self.staleness = StalenessManager(
            config.max_staleness, self.batch_size, config.max_concurrent_rollouts
        )
        self.last_batch_stats: dict[str, float] = {}
        self._cond = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._pending_exempt: deque[_Job] = deque()
        self._running: dict[int, _Job] = {}
        self._finished: dict[int, Group] = {}  # accepted, undelivered
        self._exempt_done: dict[int, Group | None] = {}
        self._recovered: list[tuple[int, Any]] = []  # in-flight items of a restored checkpoint
        self._next_seq = 0
        self._error: BaseException | None = None
        self._n_errors = 0
        self._paused = False
        self._last_progress = time.monotonic()
        self._thread: EventLoopThread | None = None
        self._data: tuple[Iterable, Iterator[Any]] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def initialize(self) -> None:
        """Start the loop thread; count batches consumed before a restart (see staleness.py)."""
        self.staleness.fast_forward(self.engine.get_version())
        self._thread = EventLoopThread("rollout-executor")
        self._thread.submit(self._ticker())

    def destroy(self) -> None:
        """Cancel running rollouts and stop the loop thread."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    async def _ticker(self) -> None:
        while True:
            self._schedule()
            self._check_watchdog()
            await asyncio.sleep(self.poll_interval)

    def _loop_thread(self) -> EventLoopThread:
        if self._thread is None:
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first")
        return self._thread

    # -- the loop side ------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Start every pending job admission allows (runs on the loop thread)."""
        starts = []
        with self._cond:
            if self._paused or self._error is not None:
                return
            version = self.engine.get_version()
            queues = ((self._pending_exempt, True), (self._pending, False))
            for queue, exempt in queues:
                while queue and (
                    self.staleness.concurrency_capacity() if exempt
                    else self.staleness.capacity(version)
                ) > 0:
                    if not self._running:
                        self._last_progress = time.monotonic()
                    job = queue.popleft()
                    self.staleness.on_start(exempt=exempt)
                    self._running[job.seq] = job
                    starts.append(job)
        loop = asyncio.get_running_loop()
        for job in starts:
            job.task = loop.create_task(self._run(job))

    async def _run(self, job: _Job) -> None:
        try:
            group = await job.workflow.arun_episode(self.engine, job.item)
            accepted = self._judge(job, group)
        except asyncio.CancelledError:
            self._settle(job, None, accepted=False)
            raise
        except Exception as e:  # noqa: BLE001 -- recorded and re-raised to the trainer thread
            err = RolloutError(f"{_describe(job)} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._settle(job, None, accepted=False, error=err)
            return
        self._settle(job, group, accepted)
        self._schedule()

    def _judge(self, job: _Job, group: Any) -> bool:
        if group is None:
            return False
        if not isinstance(group, list) or not all(isinstance(t, Trajectory) for t in group):
            raise TypeError(
                f"{type(job.workflow).__name__}.arun_episode must return list[Trajectory] or "
                f"None, got {type(group).__name__}"
            )
        return job.should_accept is None or bool(job.should_accept(group))

    def _settle(
        self, job: _Job, group: Group | None, accepted: bool, error: BaseException | None = None
    ) -> None:
        with self._cond:
            if self._running.pop(job.seq, None) is None:
                return
            self.staleness.on_finish(accepted, exempt=job.exempt)
            self._last_progress = time.monotonic()
            if error is not None:
                self._n_errors += 1
                self._error = self._error or error
            elif job.exempt:
                self._exempt_done[job.seq] = group if accepted else None
            elif accepted:
                self._finished[job.seq] = group
            self._cond.notify_all()

    def _check_watchdog(self) -> None:
        with self._cond:
            if self._error is not None or self._paused or not self._running:
                return
            idle = time.monotonic() - self._last_progress
            if idle <= self.config.watchdog_timeout:
                return
            oldest = self._running[min(self._running)]
            self._error = RolloutWatchdogError(
                f"no rollout completed in {idle:.1f} s (rollout.watchdog_timeout="
                f"{self.config.watchdog_timeout}) while {len(self._running)} were running; oldest: "
                f"{_describe(oldest)}. Check that the generation servers are alive and not stuck, "
                "or raise rollout.watchdog_timeout for very long generations."
            )
            jobs = list(self._running.values())
            self._cond.notify_all()
        logger.error("%s", self._error)
        for job in jobs:
            if job.task is not None:
                job.task.cancel()

    # -- the trainer side ---------------------------------------------------------------------

    def _enqueue(self, item: Any, workflow: RolloutWorkflow, should_accept: ShouldAccept | None,
                 exempt: bool, seq: int | None = None) -> int:
        if not isinstance(workflow, RolloutWorkflow):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(workflow).__name__}")
        thread = self._loop_thread()
        with self._cond:
            if seq is None:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
            job = _Job(seq, item, workflow, should_accept or self.should_accept, exempt)
            (self._pending_exempt if exempt else self._pending).append(job)
        thread.call_soon(self._schedule)
        return seq

    def submit(self, item: Any, workflow: RolloutWorkflow,
               should_accept: ShouldAccept | None = None) -> int:
        """Queue one episode (admitted when staleness allows); returns its submission number."""
        return self._enqueue(item, workflow, should_accept, exempt=False)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _take(self, count: int, timeout: float | None, strict: bool,
              in_order: bool = False) -> list[Group] | None:
        """Up to ``timeout`` seconds for ``count`` accepted groups; None on timeout.

        ``strict``: raise when nothing is running or queued (the wait could never end).
        ``in_order``: also wait until every older staleness-bound rollout has finished, so the
        groups are the ``count`` oldest-submitted accepted ones whatever the completion order.
        """
        self._loop_thread()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_failed()
                if len(self._finished) >= count:
                    seqs = sorted(self._finished)[:count]
                    if not in_order or self._oldest_unfinished() > seqs[-1]:
                        return [self._finished.pop(s) for s in seqs]
                idle = not (self._running or self._pending or self._pending_exempt)
                if strict and idle and not self._paused:
                    raise RuntimeError(
                        f"wait({count}) can never return: {len(self._finished)} accepted groups "
                        "are ready and nothing is running or queued; submit more items"
                    )
                left = 1.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))

    def _oldest_unfinished(self) -> float:
        """Smallest seq of a staleness-bound rollout still running or queued (inf if none)."""
        running = (s for s, j in self._running.items() if not j.exempt)
        return min((*running, *(j.seq for j in self._pending)), default=float("inf"))

    def wait(self, count: int, timeout: float | None = None) -> list[Group]:
        """The ``count`` oldest-submitted accepted groups, blocking up to ``timeout`` seconds."""
        got = self._take(count, timeout, strict=True)
        if got is None:
            with self._cond:
                state = (f"{len(self._finished)} ready, {len(self._running)} running, "
                         f"{len(self._pending)} queued")
            raise TimeoutError(f"wait({count}) timed out after {timeout} s: {state}")
        return got

    def rollout_batch(self, items: list[Any], workflow: RolloutWorkflow,
                      should_accept: ShouldAccept | None = None) -> list[Group]:
        """Run one episode per item now and return the accepted groups in item order.

        Not bound by staleness (the caller blocks, so no weight update can happen meanwhile);
        bound by ``max_concurrent_rollouts``. Rejected items are dropped, not replaced. Sets
        :attr:`last_batch_stats`, as :meth:`prepare_batch` does (synchronous training logs them).
        """
        seqs = [self._enqueue(item, workflow, should_accept, exempt=True) for item in items]
        with self._cond:
            while not all(s in self._exempt_done for s in seqs):
                self._raise_if_failed()
                self._cond.wait(1.0)
            groups = [g for g in (self._exempt_done.pop(s) for s in seqs) if g is not None]
        self.last_batch_stats = {**staleness_stats(groups, self.engine.get_version()), **self.stats()}
        return groups

    def prepare_batch(self, dataloader: Iterable, workflow: RolloutWorkflow,
                      should_accept: ShouldAccept | None = None) -> list[Group]:
        """One training batch: the :attr:`batch_size` oldest-submitted accepted groups.

        Keeps pulling items from ``dataloader`` (which yields lists of items; it is restarted at
        the end of an epoch) so rollouts stay in flight across training steps, as far as the
        staleness bound allows. Pass the same dataloader object every step: its iterator is kept
        between calls, and a different object starts a new iteration. Sets
        :attr:`last_batch_stats` (staleness and executor counters).

        Groups are delivered in submission order even when younger rollouts finish first, so the
        trained sequence of items depends on the data order only, not on completion timing: a
        resumed run trains exactly what the uninterrupted one would, and the n-th admitted
        rollout is trained in batch n // B, which is what the staleness bound assumes.
        """
        self._loop_thread()
        for seq, item in self._recovered:
            self._enqueue(item, workflow, should_accept, exempt=False, seq=seq)
        self._recovered = []
        if self._data is None or self._data[0] is not dataloader:
            self._data = (dataloader, _iter_batches(dataloader))
        while True:
            with self._cond:
                self._raise_if_failed()
                room = max(1, self.staleness.capacity(self.engine.get_version()))
                want = room - len(self._pending)
            while want > 0:  # whole batches; extras wait in the (checkpointed) queue
                items = next(self._data[1])
                for item in items:
                    self.submit(item, workflow, should_accept)
                want -= len(items)
            got = self._take(self.batch_size, 5 * self.poll_interval, strict=False, in_order=True)
            if got is not None:
                stats = staleness_stats(got, self.engine.get_version())
                self.last_batch_stats = {**stats, **self.stats()}
                return got

    def pause(self) -> None:
        """Stop admitting rollouts and pause the engine (in-flight requests resume later)."""
        with self._cond:
            self._paused = True
        self.engine.pause()

    def resume(self) -> None:
        """Resume the engine and admission; the watchdog clock restarts."""
        self.engine.resume()
        with self._cond:
            self._paused = False
            self._last_progress = time.monotonic()
        if self._thread is not None:
            self._thread.call_soon(self._schedule)

    def stats(self) -> dict[str, float]:
        """Counters for logging: accepted/rejected/errors so far, running/queued/buffered now."""
        with self._cond:
            return {
                "rollout/accepted": float(self.staleness.accepted),
                "rollout/rejected": float(self.staleness.rejected),
                "rollout/errors": float(self._n_errors),
                "rollout/running": float(len(self._running)),
                "rollout/queued": float(len(self._pending)),
                "rollout/buffered": float(len(self._finished)),
            }

    # -- recovery -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a recover checkpoint needs to lose nothing.

        ``staleness``: the StalenessManager counters; ``version``: the engine version;
        ``next_seq``; ``finished``: undelivered accepted groups ``[(seq, [Trajectory as dict])]``;
        ``in_flight``: items running or queued ``[(seq, item)]`` -- re-issued from scratch by
        the next :meth:`prepare_batch` (their partial generations are not kept).
        """
        with self._cond:
            in_flight = [(j.seq, j.item) for j in self._running.values() if not j.exempt]
            in_flight += [(j.seq, j.item) for j in self._pending] + self._recovered
            return {
                "staleness": self.staleness.state_dict(),
                "version": self.engine.get_version(),
                "next_seq": self._next_seq,
                "finished": [(s, [dataclasses.asdict(t) for t in g])
                             for s, g in sorted(self._finished.items())],
                "in_flight": sorted(in_flight, key=lambda x: x[0]),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output before any rollout is submitted."""
        with self._cond:
            if self._running or self._pending or self._finished or self._pending_exempt:
                raise RuntimeError("load_state_dict must be called before any rollout is submitted")
            self.staleness.load_state_dict(state["staleness"])
            self.staleness.fast_forward(self.engine.get_version())
            self._next_seq = int(state["next_seq"])
            self._finished = {s: [Trajectory(**d) for d in g] for s, g in state["finished"]}
            self._recovered = [(int(s), item) for s, item in state["in_flight"]]
