"""Run reward functions in worker processes with a deadline per call, and count failures.

:class:`RewardRunner` keeps ``n_workers`` long-lived processes (:mod:`areal.reward.worker`,
which imports the reward's module and not the training script), each fed through its own
socket. A call that misses ``reward.timeout`` gets its worker SIGKILLed and replaced (a plain
``future.result(timeout)`` would leave the hung worker running); a call whose worker dies
(segfault, ``os._exit``) or whose function raises is a failure too. Only the failing call is
affected: other calls hold other workers.

Failures are data, never silent: each one is logged with its sample id and counted by
:class:`FailureTracker`, a small pure class. ``failure_policy=zero`` scores a failed call 0.0;
``commit_batch()`` returns the batch's metrics and raises :class:`RewardFailureError` when more
than ``max_failure_fraction`` of the batch failed. ``failure_policy=raise`` stops at the first one.
The trainer calls ``commit_batch()`` once per training batch.

A reward that is not finite as float32 (NaN, inf, or beyond float32's range such as ``1e308``:
:func:`areal.api.sampling.finite_in_float32`) would turn its group's advantages and the whole
update into NaN. It is counted (``reward/n_non_finite``), logged with its sample id, and handled by
``reward.non_finite``: ``drop`` scores it 0.0 as a failed call (status ``error_reward``, not
trained on, counted toward ``max_failure_fraction``), ``zero`` scores it 0.0 and trains on it,
``error`` stops the run.

Reward functions must be picklable (module-level functions or ``functools.partial`` of them) and
return something ``float()`` accepts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

from areal.api.config.reward import RewardConfig
from areal.api.sampling import finite_in_float32
from areal.reward.resolve import wants_prompt

logger = logging.getLogger("areal.reward")
_WORKER = Path(__file__).with_name("worker.py")  # run by path: see its docstring


class RewardFailureError(RuntimeError):
    """Too many reward calls failed (or one did, under ``failure_policy=raise``)."""


@dataclass
class RewardOutcome:
    """One scored call: the reward (0.0 when it failed) and the failure, if any."""

    reward: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the reward function returned normally within its deadline."""
        return self.error is None


@dataclass
class FailureTracker:
    """Counts reward-call outcomes of the current batch and applies the failure policy."""

    max_failure_fraction: float
    policy: str = "zero"  # "zero" | "raise"
    non_finite: str = "drop"  # "drop" | "zero" | "error": reward.non_finite
    n_calls: int = 0
    n_timeouts: int = 0
    n_errors: int = 0
    n_non_finite: int = 0  # returned normally, but NaN / inf as float32
    examples: list[str] = field(default_factory=list)  # "sample_id: error", first few only

    def record(
        self, sample_id: str, error: str | None, timed_out: bool = False, non_finite: bool = False
    ) -> None:
        """Count one call; ``error`` is None on success. Raises at once under policy ``raise``
        (a non-finite reward: under ``non_finite=error``)."""
        self.n_calls += 1
        if error is None:
            return
        if non_finite:
            self._record_non_finite(sample_id, error)
            return
        if timed_out:
            self.n_timeouts += 1
        else:
            self.n_errors += 1
        if len(self.examples) < 5:
            self.examples.append(f"{sample_id}: {error}")
        if self.policy == "raise":
            raise RewardFailureError(
                f"reward call for sample {sample_id} failed: {error}; reward.failure_policy=raise "
                "stops the run (set reward.failure_policy=zero to score failures 0 and go on)"
            )

    def _record_non_finite(self, sample_id: str, error: str) -> None:
        self.n_non_finite += 1
        if self.non_finite == "error":
            raise RewardFailureError(
                f"reward for sample {sample_id} {error}; reward.non_finite=error stops the run "
                "(drop: train without the sample; zero: train on it with reward 0)"
            )
        if len(self.examples) < 5:
            self.examples.append(f"{sample_id}: {error}")

    @property
    def n_failed(self) -> int:
        """Failed calls in the current batch: timeouts, errors and, under ``non_finite=drop``,
        non-finite rewards (scored 0 and not trained on)."""
        dropped = self.n_non_finite if self.non_finite == "drop" else 0
        return self.n_timeouts + self.n_errors + dropped

    def commit(self) -> dict[str, float]:
        """The batch's metrics; resets the counts; raises if the failed fraction is too high."""
        n, failed = self.n_calls, self.n_failed
        frac = failed / n if n else 0.0
        stats = {
            "reward/n_calls": float(n),
            "reward/n_failed": float(failed),
            "reward/n_timeouts": float(self.n_timeouts),
            "reward/n_errors": float(self.n_errors),
            "reward/n_non_finite": float(self.n_non_finite),
            "reward/failure_fraction": frac,
        }
        examples = "; ".join(self.examples)
        self.n_calls = self.n_timeouts = self.n_errors = self.n_non_finite = 0
        self.examples = []
        if frac > self.max_failure_fraction:
            raise RewardFailureError(
                f"{failed} of {n} reward calls in this batch failed ({frac:.0%}), more than "
                f"reward.max_failure_fraction={self.max_failure_fraction}; first failures: "
                f"{examples}. Fix the reward function or raise reward.timeout"
            )
        return stats


class _Worker:
    """One worker process (:mod:`areal.reward.worker`) and the parent's end of its socket."""

    def __init__(self) -> None:
        self.conn, theirs = Pipe()  # a socketpair: the child's end is passed by fd number
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(_WORKER), str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.conn.send(sys.path)

    def call(self, payload: tuple, timeout: float) -> tuple[str, Any]:
        """("ok", value) | ("error", msg) | ("timeout", None) | ("crash", msg)."""
        try:
            self.conn.send(payload)
            if not self.conn.poll(timeout):
                return "timeout", None
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            try:
                code = self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            return "crash", f"reward worker died (exit code {code})"

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        self.proc.kill()
        self.proc.wait(5.0)
        self.conn.close()


class RewardRunner:
    """Scores with ``fn`` in a pool of worker processes; see the module docstring."""

    def __init__(self, fn: Callable[..., float], cfg: RewardConfig):
        self.fn = fn
        self.wants_prompt = wants_prompt(fn)  # workflows pass prompt= to such a reward
        self.cfg = cfg
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(cfg.n_workers):
            self._idle.put(_Worker())
        self._threads = ThreadPoolExecutor(cfg.n_workers, thread_name_prefix="reward")
        self._lock = threading.Lock()
        self.tracker = FailureTracker(cfg.max_failure_fraction, cfg.failure_policy, cfg.non_finite)
        self._closed = False

    def call(self, sample_id: str, *args: Any, **kwargs: Any) -> float:
        """Blocking, thread-safe: ``fn(*args, **kwargs)`` in a worker, 0.0 if it failed."""
        return self.score(sample_id, *args, **kwargs).reward

    def score(self, sample_id: str, *args: Any, **kwargs: Any) -> RewardOutcome:
        """Like :meth:`call`, but also says whether (and why) the call failed."""
        if self._closed:
            raise RuntimeError("RewardRunner.call after close(); create a new runner")
        worker = self._idle.get()
        try:
            status, value = worker.call((self.fn, args, kwargs), self.cfg.timeout)
            if status in ("timeout", "crash"):
                worker.kill()
                worker = _Worker()
        finally:
            self._idle.put(worker)
        return self._settle(sample_id, status, value)

    def _settle(self, sample_id: str, status: str, value: Any) -> RewardOutcome:
        non_finite = status == "ok" and not finite_in_float32(value)
        if non_finite:
            error = (  # NaN, inf, or past float32's range (~3.4e38): the training dtype
                f"{value!r} is not finite as float32 (the training dtype; float32 ends near 3.4e38)"
            )
        elif status == "ok":
            error = None
        elif status == "timeout":
            error = f"missed the {self.cfg.timeout}s deadline (worker killed and replaced)"
        else:
            error = str(value)
        if error is not None:
            how = {"drop": "scored 0.0, not trained on", "zero": "scored 0.0"}
            what = how.get(self.cfg.non_finite, "stops the run") if non_finite else "scored 0.0"
            logger.warning("reward for sample %s failed, %s: %s", sample_id, what, error)
        with self._lock:
            self.tracker.record(sample_id, error, status == "timeout", non_finite)
        if non_finite and self.cfg.non_finite == "zero":  # trained on, with reward 0
            return RewardOutcome(0.0)
        return RewardOutcome(value if error is None else 0.0, error)

    async def ascore(self, sample_id: str, *args: Any, **kwargs: Any) -> RewardOutcome:
        """Async :meth:`score`: runs on a thread so the event loop keeps serving rollouts."""
        loop = asyncio.get_running_loop()
        call = functools.partial(self.score, sample_id, *args, **kwargs)
        return await loop.run_in_executor(self._threads, call)

    def map(self, sample_ids: list[str], *arg_lists: list[Any]) -> list[float]:
        """Score many calls concurrently (blocking): ``fn(a[i], b[i], ...)`` per sample id."""
        futures = [
            self._threads.submit(self.call, sid, *args)
            for sid, *args in zip(sample_ids, *arg_lists)
        ]
        return [f.result() for f in futures]

    def commit_batch(self) -> dict[str, float]:
        """Failure metrics of the batch so far (then reset); raises past the failure limit."""
        with self._lock:
            return self.tracker.commit()

    def close(self) -> None:
        """Stop the threads and kill every worker process."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        while not self._idle.empty():
            self._idle.get().kill()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
