"""Hang detection for Core's Ray actors (async PPO): :class:`HangWatch`, a thread of the master.

Every ``period`` seconds the watch sends each actor it watches (the model workers, the rollout
workers, the generation manager) a probe, a call that only returns the process id, and collects
the answers without blocking. An actor that has answered before and then leaves a probe
unanswered for ``core.health_timeout`` seconds is hung (stopped, deadlocked, or holding its
Python interpreter): the watch logs one line naming it, how long it was silent and what the
master was running, and kills it, so a hang takes the path a death takes. Ray restarts a rollout
worker (the master reclaims its slots and has its work redone) or the manager (it rebuilds its
state from its record); a model worker is not restarted: the master's pending call on it fails,
which stops the step naming it (``recover.mode=auto`` relaunches the job from its last recover
checkpoint), as for a model worker that died.

A busy actor is not hung: model workers answer from a thread of their own while they compute
(``max_concurrency``), rollout workers run episodes on an event loop thread, and the manager's
calls are short. An actor that died or is being restarted is not judged until it answers again
(Ray fails a call to a restarting actor with ``ActorUnavailableError``; a call to an actor still
being created waits, and it has not answered yet). The verdict is :class:`ProbeClock`'s: pure,
no clock, no Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal.utils.logging import get_logger

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from areal.core.ray_worker import RayWorker
    from areal.core.rollout_side import RayRolloutSide

logger = get_logger("core.health")
PERIOD_S = 2.0  # seconds between probes (at most; a short health_timeout probes more often)


@dataclass
class _Probe:
    sent: float | None = None  # when the probe still unanswered was sent (seconds, monotonic)
    alive: bool = False  # answered since it started, died or was killed: it can be judged


class ProbeClock:
    """Which watched actors are hung: silent for ``timeout`` seconds on a probe, having answered
    one before (an actor starting, dead or restarting is not judged)."""

    def __init__(self, timeout: float):
        if timeout <= 0:
            raise ValueError(f"core.health_timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.probes: dict[str, _Probe] = {}

    def sent(self, name: str, now: float) -> None:
        """A probe went to ``name`` at ``now``."""
        self.probes.setdefault(name, _Probe()).sent = now

    def answered(self, name: str) -> None:
        """``name`` answered its probe."""
        self.probes[name] = _Probe(None, True)

    def failed(self, name: str) -> None:
        """``name``'s probe failed: it died, is being restarted, or was killed."""
        self.probes[name] = _Probe(None, False)

    def forget(self, name: str) -> None:
        """``name`` is no longer watched (a drained rollout worker was stopped)."""
        self.probes.pop(name, None)

    def hung(self, now: float) -> list[tuple[str, float]]:
        """``(name, seconds silent)`` of every actor hung at ``now``."""
        return [
            (name, now - p.sent)
            for name, p in sorted(self.probes.items())
            if p.alive and p.sent is not None and now - p.sent >= self.timeout
        ]


@dataclass
class Watched:
    """One actor to watch: its Ray handle, whether Ray restarts it, and what a kill leads to."""

    handle: ActorHandle
    restartable: bool
    after: str  # what follows the kill, for the log line


class MFCActivity:
    """What the master is running, from its trace (:attr:`~areal.core.master.Master.trace`):
    the MFCs dispatched and not done, each with how long ago the watch first saw it."""

    def __init__(self, trace: list[tuple[str, str]]):
        self.trace, self._read, self._since = trace, 0, {}

    def __call__(self, now: float) -> str:
        """``while MFC 'x' ran for N s`` (seen to within a probe period), or ``between MFCs``."""
        events = self.trace[self._read :]
        self._read += len(events)
        for kind, name in events:
            if kind == "dispatch":
                self._since.setdefault(name, now)
            else:
                self._since.pop(name, None)
        running = ", ".join(f"{n!r} for {now - t:.0f} s" for n, t in sorted(self._since.items()))
        return f"while the master ran MFC {running}" if running else "between MFCs"


class HangWatch:
    """The master's hang watch (module docstring). ``actors()`` gives the actors to watch now,
    by name; ``activity(now)`` says what the master runs (for the log line)."""

    def __init__(
        self,
        actors: Callable[[], dict[str, Watched]],
        timeout: float,
        activity: Callable[[float], str],
        period: float | None = None,
    ):
        import ray

        self._ray, self.actors, self.activity = ray, actors, activity
        self.clock = ProbeClock(timeout)
        self.period = period or min(PERIOD_S, timeout / 4)
        self.named: list[str] = []  # the lines logged, one per hung actor
        self.error: BaseException | None = None  # the watch's own failure (raised by check)
        self._refs: dict[str, object] = {}  # name -> the ObjectRef of its unanswered probe
        self._pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before the master stops the actors itself)."""
        self._stop.set()
        self._thread.join(timeout=10 * self.period)

    def check(self) -> None:
        """Raise the watch's own failure, if it failed (the master calls this every step)."""
        if self.error is not None:
            raise RuntimeError(f"the hang watch failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period):
                self.tick(time.monotonic())
        except Exception as e:  # noqa: BLE001 -- kept and raised in the master's thread by check()
            logger.error(f"the hang watch stopped: {type(e).__name__}: {e}")
            self.error = e

    def tick(self, now: float) -> None:
        """Collect the answers, kill the hung actors, probe those with no probe out."""
        actors, doing = self.actors(), self.activity(now)  # read every tick: it tracks durations
        for name in [n for n in self._refs if n not in actors]:
            del self._refs[name]
            self.clock.forget(name)
        refs = list(self._refs.values())
        ready = set(self._ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for name, ref in [(n, r) for n, r in self._refs.items() if r in ready]:
            del self._refs[name]
            try:
                self._pids[name] = self._ray.get(ref, timeout=0)
                self.clock.answered(name)
            except self._ray.exceptions.RayActorError:
                self.clock.failed(name)  # died or restarting: judged again once it answers
        for name, silent in self.clock.hung(now):
            self._kill(name, actors[name], silent, doing)
        for name, actor in actors.items():
            if name not in self._refs:
                self._refs[name] = actor.handle.pid.remote()
                self.clock.sent(name, now)

    def _kill(self, name: str, actor: Watched, silent: float, doing: str) -> None:
        line = (
            f"{name} (pid {self._pids.get(name, '?')}) is hung: no answer for {silent:.1f} s "
            f"(core.health_timeout={self.clock.timeout:g} s) {doing}; killed: {actor.after}"
        )
        logger.error(line)
        self.named.append(line)
        self._refs.pop(name, None)
        self.clock.failed(name)
        self._ray.kill(actor.handle, no_restart=not actor.restartable)


def async_ppo_actors(
    model_workers: list[RayWorker], side: RayRolloutSide
) -> Callable[[], dict[str, Watched]]:
    """The actors of an async PPO run, as :class:`HangWatch` reads them: ``model_workers``
    (:class:`~areal.core.ray_worker.RayWorker`), and ``side``'s
    (:class:`~areal.core.rollout_side.RayRolloutSide`) rollout workers and manager."""
    fixed = {
        f"model worker {w.index}": Watched(
            w.handle, False, "the step fails as for a dead model worker and the run stops"
        )
        for w in model_workers
    }
    fixed["the generation manager"] = Watched(
        side.manager.handle, True, "Ray restarts it and it rebuilds its state from its record"
    )

    def actors() -> dict[str, Watched]:
        rollout = {
            f"rollout worker {i}": Watched(
                h, True, "Ray restarts it and the master has its rollouts redone"
            )
            for i, h in dict(side.workers).items()
            if i not in side.draining
        }
        return {**fixed, **rollout}

    return actors
