"""The generation manager: the one authority over what Core's rollout workers may start, and the
stream of their finished groups (async PPO).

Admission is Lite's staleness rule (:class:`~areal.rollout.staleness.StalenessManager`) counted
over every rollout worker at once: with ``B`` groups per training batch, actor version ``v`` and
bound ``s``, a rollout may start only while ``(s + v + 1) * B > accepted + running``, and at most
``max_concurrent`` run at once. A worker asks with :meth:`GenerationManager.acquire`; each slot
granted is a *ticket* (a global admission number) with the dataset item to roll out. Asks that
get fewer slots than wanted are counted by cause: ``staleness`` (the bound), ``capacity``
(``max_concurrent``), ``paused`` (a weight update is running), ``fair_share`` (another worker
that was refused holds fewer slots, or as few while this one was not refused: it goes first, so a
new worker is not starved by old ones that happen to ask first whenever slots open).

Data. The manager hands out the items, from one loader over the train dataset: one data order for
the whole job, so adding or removing a rollout worker never reshards, and a recover checkpoint
holds, atomically, the loader position and every item admitted but not yet trained (re-issued
first after a resume, under new tickets).

Stream. A worker reports each ticket with :meth:`finish`: its group (metadata and a reference to
the packed tensors, which stay with the worker until the master fetches them), or ``None``
when the group was filtered out or the episode failed (its slot is freed). :meth:`take` hands the
master the ``n`` oldest-admitted accepted groups, only once every older ticket has finished: the
n-th admitted rollout is trained in batch ``n // B`` or later, which is what the bound assumes
(delivering in finish order would let a slow early rollout fall further behind).

Workers. In-flight tickets are tracked per worker, so a dead worker's slots are reclaimed
(:meth:`reclaim`): its running items are re-issued, counted in ``lost``; a late report for a
reclaimed ticket is dropped, so nothing is trained twice. A taken group whose worker died before
the master fetched its tensors is redone too (:meth:`untake`).

Failover. :meth:`snapshot` is all of the state but the groups' object references (those stay with
the rollout workers that made them, until :meth:`take` hands them out *and* the master confirms
it got them by asking for its next step). The Ray actor writes it to a record after every
change; a restarted actor restores it (:meth:`restore`), and each rollout worker rejoins
(:meth:`rejoin`) with the tickets it still runs and the groups it keeps: a running ticket its worker
does not hold (the grant's reply was lost) is re-issued, a finished one gets its reference back (or
is re-issued if
its worker lost it), and a :meth:`take` asked again for the same step returns the same groups.
So no item is trained twice or dropped, and the version, the loader position and the admission
counters go on where they were.

The class is plain Python (no clock, no I/O): Core runs it as a Ray actor (:class:`ManagerActor`)
and the admission tests drive it directly.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from areal.api.protocols import Checkpointable, StateDict
from areal.rollout.staleness import StalenessManager

REFUSAL_CAUSES = ("staleness", "capacity", "paused", "fair_share")


@dataclass
class Finished:
    """One accepted group in the stream: what the master needs to place and check it."""

    ticket: int
    worker: int
    ref: list  # [ray.ObjectRef] of the packed group (a list, so Ray passes the reference itself)
    seqlens: tuple[int, ...]
    group_id: str
    min_versions: tuple[int, ...]  # per sample: the oldest weight version among its trained tokens
    rewards: tuple[float, ...] = ()


@dataclass
class _Ticket:
    worker: int
    item: Any
    version: int  # the actor version when it was admitted


@dataclass
class WorkerCounts:
    """What one rollout worker has done (stats and ``areal core status``)."""

    in_flight: int = 0
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    reclaimed: int = 0
    restarts: int = 0


def _finished(entries: dict[int, tuple[Finished | None, _Ticket]]) -> list[Finished] | None:
    """The groups of ``entries``, in order; None while one waits for its worker to rejoin."""
    groups = [g for g, _ in entries.values() if g is not None]
    return groups if len(groups) == len(entries) else None


class GenerationManager:
    """Admission, items, the ordered stream and per-worker accounting (module docstring)."""

    def __init__(
        self,
        max_staleness: int,
        batch_groups: int,
        max_concurrent: int,
        loader: Iterable[list[Any]],
    ):
        self.staleness = StalenessManager(max_staleness, batch_groups, max_concurrent)
        self.loader = loader
        self.version = 0
        self.paused = False
        self.refused: Counter[str] = Counter({c: 0 for c in REFUSAL_CAUSES})
        self.workers: dict[int, WorkerCounts] = {}
        self.lost = 0  # tickets reclaimed from dead workers (their items re-issued)
        self.late = 0  # reports for tickets already reclaimed (dropped)
        self.restarts = 0  # times this manager was restored from its record
        self.confirmed = -1  # every accepted ticket <= this one reached the master
        self._next_ticket = 0
        self._waiting: set[int] = set()  # workers whose last ask got fewer slots than wanted
        self._running: dict[int, _Ticket] = {}
        # finished and accepted, untaken; the group is None after a restore until its worker
        # rejoins with it
        self._done: dict[int, tuple[Finished | None, _Ticket]] = {}
        self._taken: tuple[int | None, dict[int, tuple[Finished | None, _Ticket]]] | None = None
        self._taken_lost = ""  # why the last take cannot be handed out again (its groups died)
        self._unjoined: set[int] = set()  # workers that have not rejoined since a restore
        self._reissue: deque[Any] = deque()  # items to redo (reclaimed or restored), first
        self._batches: Iterator[list[Any]] | None = None
        self._rest: deque[Any] = deque()  # the current loader batch's items not yet handed out

    # -- admission -----------------------------------------------------------------------------

    def acquire(self, worker: int, want: int) -> list[tuple[int, Any]]:
        """Up to ``want`` ``(ticket, item)`` slots for ``worker``, as admission allows now."""
        counts = self.workers.setdefault(worker, WorkerCounts())
        if want <= 0:  # full or draining: it waits for nothing
            self._waiting.discard(worker)
            return []
        if self.paused:
            self.refused["paused"] += 1
            return []
        granted = min(want, self.staleness.capacity(self.version))
        waiting = [self.workers[w].in_flight for w in self._waiting if w != worker]
        if (
            granted
            and waiting
            and (
                counts.in_flight > min(waiting)
                or (worker not in self._waiting and counts.in_flight == min(waiting))
            )
        ):  # a refused worker holding fewer slots (or as few) goes first
            granted, cause = 0, "fair_share"
        elif granted < want:  # the bound binds (ties included), else max_concurrent does
            cause = self.staleness.refusal_cause(self.version)
        if granted < want:
            self.refused[cause] += 1
            self._waiting.add(worker)
        else:
            self._waiting.discard(worker)
        out = []
        for _ in range(granted):
            item = self._reissue.popleft() if self._reissue else self._next_item()
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self.staleness.on_start()
            self._running[ticket] = _Ticket(worker, item, self.version)
            out.append((ticket, item))
        counts.in_flight += granted
        return out

    def _next_item(self) -> Any:
        while (
            not self._rest
        ):  # the loader yields batches (lists) of items; a new epoch when it ends
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                self._rest.extend(next(self._batches))
            except StopIteration:
                self._batches = None
        return self._rest.popleft()

    def finish(
        self, worker: int, ticket: int, group: Finished | None, failed: bool = False
    ) -> bool:
        """``worker`` finished ``ticket``: ``group`` accepted, or ``None`` (filtered out, or
        ``failed``). False when the ticket was reclaimed meanwhile (the report is dropped)."""
        job = self._running.get(ticket)
        if job is None or job.worker != worker:
            self.late += 1
            return False
        del self._running[ticket]
        counts = self.workers[worker]
        counts.in_flight -= 1
        self.staleness.on_finish(group is not None)
        if group is not None:
            counts.accepted += 1
            self._done[ticket] = (group, job)
        elif failed:
            counts.failed += 1
        else:
            counts.rejected += 1
        return True

    def reclaim(self, worker: int, restarted: bool = False) -> int:
        """Free every slot ``worker`` holds (it died; ``restarted``: it is coming back) and
        re-issue its items first; returns how many."""
        counts = self.workers.setdefault(worker, WorkerCounts())
        mine = sorted(t for t, job in self._running.items() if job.worker == worker)
        for t in mine:
            self._reissue.append(self._running.pop(t).item)
            self.staleness.on_finish(False)
        counts.in_flight = 0
        self._waiting.discard(worker)
        counts.reclaimed += len(mine)
        counts.restarts += int(restarted)
        self.lost += len(mine)
        return len(mine)

    def drop_worker_groups(self, worker: int) -> int:
        """Forget ``worker``'s finished, untaken groups (their tensors died with it): their items
        are re-issued and their slots freed; returns how many."""
        gone = sorted(t for t, (_, job) in self._done.items() if job.worker == worker)
        for t in gone:
            _, job = self._done.pop(t)
            self._reissue.append(job.item)
            self.staleness.undeliver()  # never delivered: admission counts it again when redone
        self.lost += len(gone)
        return len(gone)

    def holds(self, worker: int) -> int:
        """Rollouts of ``worker`` running, finished and untaken, or taken and not yet confirmed
        (a draining worker is stopped at 0: the groups' tensors live with it)."""
        taken = self._taken[1] if self._taken else {}
        return sum(job.worker == worker for job in self._running.values()) + sum(
            job.worker == worker for _, job in [*self._done.values(), *taken.values()]
        )

    # -- the master's side ---------------------------------------------------------------------

    def take(self, n: int, step: int | None = None) -> list[Finished] | None:
        """The ``n`` oldest-admitted accepted groups once no older ticket is running (or waits
        for its worker to rejoin), else None. ``step``: the master's step; asking again for the
        same step (the reply was lost to a restart) returns the same groups, and asking for
        another confirms the last take (the master has it). None: confirmed at once."""
        if self._taken is not None and step is not None and self._taken[0] == step:
            if self._taken_lost:
                raise RuntimeError(self._taken_lost)
            return _finished(self._taken[1])
        self._confirm()
        waiting = (t for t, (g, _) in self._done.items() if g is None)
        blocking = min([*self._running, *waiting], default=math.inf)
        ready = sorted(t for t in self._done if t < blocking)
        if len(ready) < n:
            return None
        self._taken = (step, {t: self._done.pop(t) for t in ready[:n]})
        groups = _finished(self._taken[1])
        assert groups is not None  # a ticket whose group waits for its worker blocks later ones
        if step is None:
            self._confirm()
        return groups

    def untake(self, step: int, dead: Iterable[int]) -> int:
        """The master could not fetch the groups of step ``step``'s take that the workers ``dead``
        made (their tensors died with them): those items, and the other finished groups of
        ``dead``, are re-issued; the take's other groups go back to the stream, so the master's
        next take for ``step`` starts again. Returns how many items are redone (0 when asked
        again: the take is already undone)."""
        if self._taken is None or self._taken[0] != step:
            return 0
        self._done.update(self._taken[1])
        self._taken, self._taken_lost = None, ""
        return sum(self.drop_worker_groups(w) for w in sorted(set(dead)))

    def _confirm(self) -> None:
        """The last take reached the master: its workers may forget those groups."""
        if self._taken is not None:
            self.confirmed = max([self.confirmed, *self._taken[1]])
        self._taken, self._taken_lost = None, ""

    def set_version(self, version: int) -> None:
        """The actor's weights on the servers are now ``version``."""
        self.version = version

    def pause(self) -> None:
        """Admit nothing until :meth:`resume` (a weight update is running)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stats(self) -> dict[str, float]:
        """Counters: admission, refusals by cause, buffer occupancy, per-worker work."""
        out = {
            "manager/version": float(self.version),
            "manager/accepted": float(self.staleness.accepted),
            "manager/running": float(len(self._running)),
            "manager/buffered": float(len(self._done)),
            "manager/lost": float(self.lost),
            "manager/late_reports": float(self.late),
            "manager/restarts": float(self.restarts),
        }
        out.update({f"manager/refused/{c}": float(n) for c, n in self.refused.items()})
        for w, c in sorted(self.workers.items()):
            out.update({f"rollout_worker/{w}/{k}": float(v) for k, v in vars(c).items()})
        return out

    # -- recovery ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Version, admission counters, loader position and every admitted, untrained item."""
        admitted = {**{t: job for t, (_, job) in self._done.items()}, **self._running}
        pending = [admitted[t].item for t in sorted(admitted)] + list(
            self._reissue
        )  # admission order
        pending += list(self._rest)  # the loader's position is past them
        return {
            "version": self.version,
            # delivered only: the untaken ones are redone
            "staleness": self.staleness.state_dict(undelivered=len(self._done)),
            "loader": self._loader_state(),
            "pending": pending,
            "refused": dict(self.refused),
            "lost": self.lost,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output before any slot is granted."""
        if self._running or self._done:
            raise RuntimeError("load_state_dict must run before any rollout is admitted")
        self.version = int(state["version"])
        self.staleness.load_state_dict(state["staleness"])
        self.staleness.fast_forward(self.version)
        self._restore_loader(state["loader"])
        self._batches, self._rest = None, deque()
        self._reissue = deque(state["pending"])
        self.refused.update({c: int(n) for c, n in state["refused"].items()})
        self.lost = int(state["lost"])

    def _loader_state(self) -> StateDict | None:
        """The loader's position, if it keeps one (a plain iterable does not)."""
        return self.loader.state_dict() if isinstance(self.loader, Checkpointable) else None

    def _restore_loader(self, state: StateDict | None) -> None:
        if state is None:
            return
        if not isinstance(self.loader, Checkpointable):
            raise ValueError(
                f"the checkpoint holds a loader position but this manager's loader "
                f"({type(self.loader).__name__}) has no state_dict/load_state_dict; build it "
                "with the loader the checkpoint was taken with"
            )
        self.loader.load_state_dict(state)

    # -- failover (a restarted manager; module docstring) ---------------------------------------

    def snapshot(self) -> dict[str, object]:
        """Everything of this manager but the groups' object references (its failover record)."""

        def jobs(entries: dict[int, tuple[Finished | None, _Ticket]]) -> dict[int, tuple]:
            return {t: (job.worker, job.item, job.version) for t, (_, job) in entries.items()}

        return {
            "version": self.version,
            "paused": self.paused,
            "staleness": self.staleness.state_dict(),
            "refused": dict(self.refused),
            "workers": {w: dict(vars(c)) for w, c in self.workers.items()},
            "lost": self.lost,
            "late": self.late,
            "restarts": self.restarts,
            "confirmed": self.confirmed,
            "next_ticket": self._next_ticket,
            "running": {t: (j.worker, j.item, j.version) for t, j in self._running.items()},
            "done": jobs(self._done),
            "taken": None if self._taken is None else (self._taken[0], jobs(self._taken[1])),
            "reissue": list(self._reissue),
            "rest": list(self._rest),
            "loader": self._loader_state(),
        }

    def restore(self, state: dict) -> None:
        """Rebuild from :meth:`snapshot` (a restart): the finished groups wait for their workers
        to :meth:`rejoin` with the references; every known worker must rejoin."""
        if self._running or self._done:
            raise RuntimeError("restore must run before any rollout is admitted")
        self.version, self.paused = int(state["version"]), bool(state["paused"])
        self.staleness.load_state_dict(state["staleness"], running=len(state["running"]))
        self.refused.update(state["refused"])
        self.workers = {int(w): WorkerCounts(**c) for w, c in state["workers"].items()}
        self.lost, self.late = int(state["lost"]), int(state["late"])
        self.restarts, self.confirmed = int(state["restarts"]) + 1, int(state["confirmed"])
        self._next_ticket = int(state["next_ticket"])
        self._running = {t: _Ticket(*job) for t, job in state["running"].items()}
        self._done = {t: (None, _Ticket(*job)) for t, job in state["done"].items()}
        if state["taken"] is not None:
            step, taken = state["taken"]
            self._taken = (step, {t: (None, _Ticket(*job)) for t, job in taken.items()})
        self._reissue, self._rest = deque(state["reissue"]), deque(state["rest"])
        self._restore_loader(state["loader"])
        self._batches = None
        self._unjoined = set(self.workers)

    def must_rejoin(self, worker: int) -> bool:
        """Whether ``worker`` has to :meth:`rejoin` before it is granted anything."""
        return worker in self._unjoined

    def rejoin(self, worker: int, held: list[int], kept: list[Finished]) -> int:
        """After a restore: ``worker`` runs the tickets ``held`` and keeps the groups ``kept``.
        Its running tickets it does not hold are re-issued; its finished groups get their
        references back, those it lost are re-issued. Returns how many items are re-issued."""
        self._unjoined.discard(worker)
        counts = self.workers.setdefault(worker, WorkerCounts())
        mine = {g.ticket: g for g in kept if g.worker == worker}
        gone = sorted(t for t, j in self._running.items() if j.worker == worker and t not in held)
        for t in gone:
            self._reissue.append(self._running.pop(t).item)
            self.staleness.on_finish(False)
        counts.in_flight -= len(gone)
        n = len(gone)
        for t, (g, job) in sorted(self._done.items()):
            if g is None and job.worker == worker:
                if t in mine:
                    self._done[t] = (mine[t], job)
                else:  # its tensors died with an earlier process of the worker: redone
                    del self._done[t]
                    self._reissue.append(job.item)
                    self.staleness.undeliver()
                    n += 1
        step, taken = self._taken if self._taken is not None else (None, {})
        for t, (g, job) in taken.items():
            if g is None and job.worker == worker:
                if t in mine:
                    taken[t] = (mine[t], job)
                else:
                    self._taken_lost = (
                        f"the groups of step {step} were lost: the manager restarted "
                        f"before the master got them and rollout worker {worker} (holding ticket "
                        f"{t}) had restarted too; resume from the last recover checkpoint"
                    )
        self.lost += n
        return n
