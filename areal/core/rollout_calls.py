"""Calls to Core's rollout actors, which Ray restarts when they die: what each answers (typed
seams) and the one helper that makes a call again while its actor restarts.

Seams. :class:`ManagerCalls` is what the generation manager's actor answers
(:class:`~areal.core.rollout_worker.ManagerActor` declares it), to the master
(:class:`~areal.core.rollout_side.RayRolloutSide`) and to the rollout workers;
:class:`RolloutWorkerCalls` is what a rollout worker answers to the master
(:class:`~areal.core.rollout_worker.RolloutWorker` declares it). A call names its method by one of
these functions, ``calls.call(ManagerCalls.take, n, step)``, so a type checker checks the name,
the arguments and the answer's type; this module imports no Ray, so the master's modules that
import it need Ray only when an async run starts.

Restarts. :class:`RestartingActor` makes a call again, every ``RETRY_S``, while Ray says the actor
died (``RayActorError``; ``ActorUnavailableError`` while it restarts), for at most ``restart_s``
seconds from the first try, then raises naming the actor and what sets that deadline. Each answer
is awaited at most ``answer_s`` seconds (a hung actor: a :class:`TimeoutError` naming it; the
master's hang watch names and kills it much sooner). Every method called this way is idempotent
or keyed, since a call lost to a death may have run (the manager's ``take`` is keyed by the step,
its ``begin_update`` by the version).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from areal.api.io import WeightUpdateMeta
from areal.core.manager import Finished
from areal.utils.logging import get_logger

logger = get_logger("core.rollout")
RETRY_S = 0.5  # seconds between calls to an actor Ray is restarting
A = TypeVar("A")
P = ParamSpec("P")
R = TypeVar("R")


def answer(ref: Any, who: str, timeout: float) -> Any:
    """The value of the Ray object ``ref``, waiting at most ``timeout`` seconds for ``who``."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise TimeoutError(
            f"{who} did not answer within {timeout:.0f} s: it is hung or overloaded"
        ) from None


@dataclass(frozen=True)
class RestartingActor(Generic[A]):
    """Typed calls to the Ray actor ``handle`` of class (or protocol) ``A`` (module docstring)."""

    handle: Any  # the Ray actor handle
    who: str  # how messages name it: "the generation manager", "rollout worker 3"
    restart_s: float  # seconds it may take to come back after a death
    answer_s: float  # seconds one answer may take
    why: str  # what sets restart_s, for the message: "rollout.setup_timeout + ..."

    def within(self, answer_s: float, restart_s: float | None = None) -> RestartingActor[A]:
        """The same actor, each answer awaited at most ``answer_s`` seconds (and a restart
        ``restart_s``; 0: a call to a dead actor fails at once)."""
        restart_s = self.restart_s if restart_s is None else restart_s
        return dataclasses.replace(self, answer_s=answer_s, restart_s=restart_s)

    def call(self, method: Callable[Concatenate[A, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """The actor's ``method(*args, **kwargs)``, made again while Ray restarts the actor."""
        from ray.exceptions import RayActorError

        deadline, name, lost = time.monotonic() + self.restart_s, method.__name__, 0
        while True:
            try:
                ref = getattr(self.handle, name).remote(*args, **kwargs)
                return answer(ref, f"{self.who} ({name})", self.answer_s)
            except RayActorError as e:
                self._lost(e, name, deadline, lost)
            lost += 1
            time.sleep(RETRY_S)

    async def acall(
        self, method: Callable[Concatenate[A, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """:meth:`call` for an event loop: it waits without blocking the loop."""
        from ray.exceptions import RayActorError

        deadline, name, lost = time.monotonic() + self.restart_s, method.__name__, 0
        while True:
            try:
                ref = getattr(self.handle, name).remote(*args, **kwargs)
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.answer_s)
            except TimeoutError:
                raise TimeoutError(
                    f"{self.who} ({name}) did not answer within {self.answer_s:.0f} s: it is "
                    "hung or overloaded"
                ) from None
            except RayActorError as e:
                self._lost(e, name, deadline, lost)
            lost += 1
            await asyncio.sleep(RETRY_S)

    def _lost(self, error: Exception, name: str, deadline: float, before: int) -> None:
        """A call to ``name`` found the actor dead (``before`` times already): raise once past
        ``deadline``, else log the first time; the caller tries again."""
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{self.who} died and was not back within {self.restart_s:.0f} s "
                f"({self.why}): {error}"
            ) from error
        if before == 0:
            logger.warning(
                f"{self.who} is gone ({type(error).__name__} on {name}); asking again while "
                f"Ray restarts it, up to {self.restart_s:.0f} s"
            )


class ManagerCalls(Protocol):
    """What the generation manager's actor answers (:class:`~areal.core.manager.GenerationManager`
    and :class:`~areal.core.rollout_worker.ManagerActor` hold the contracts)."""

    # the rollout workers': admission and reports
    def acquire_at(self, worker: int, want: int) -> tuple[int, int, list[tuple[int, Any]] | None]:
        """(version, confirmed ticket, slots; None: rejoin first)."""
        ...

    def finish(
        self, worker: int, ticket: int, group: Finished | None, failed: bool = False
    ) -> bool: ...

    def rejoin(self, worker: int, held: list[int], kept: list[Finished]) -> int: ...

    # the master's: the stream, the workers' accounting, recover checkpoints, status
    def take(self, n: int, step: int | None = None) -> list[Finished] | None: ...

    def untake(self, step: int, dead: list[int]) -> int: ...

    def reclaim(self, worker: int, restarted: bool = False) -> int: ...

    def drop_worker_groups(self, worker: int) -> int: ...

    def holds(self, worker: int) -> int: ...

    def resume_at(self, version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def pid(self) -> int: ...

    # the master's, to the servers (the manager's own thread for them)
    def servers(self) -> list[str]: ...

    def set_servers(self, addresses: list[str]) -> None: ...

    def weight_group_size(self) -> int: ...

    def pause_servers(self) -> None: ...

    def begin_update(
        self, meta: WeightUpdateMeta, announcement: dict[str, list] | None = None
    ) -> None: ...

    def begin_join(self, meta: WeightUpdateMeta) -> None: ...

    def update_done(self) -> bool: ...

    def resume_servers(self, version: int) -> list[str]: ...

    def shutdown(self) -> None: ...


class RolloutWorkerCalls(Protocol):
    """What a rollout worker answers to the master (:class:`~areal.core.rollout_worker.
    RolloutWorker` holds the contracts)."""

    def start(self) -> None: ...

    def health(self) -> dict[str, Any]: ...

    def set_max_in_flight(self, n: int) -> None: ...

    def drain(self) -> None: ...

    def set_servers(self, addresses: list[str]) -> None: ...

    def shutdown(self) -> None: ...
