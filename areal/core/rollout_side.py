"""The master's side of Core async PPO's rollout: the generation manager and the rollout workers
(Ray actors, :mod:`areal.core.rollout_worker`), their health, and elastic scaling.

Health. :meth:`RayRolloutSide.check_health` (every step, and every ``HEALTH_EVERY_S`` while the
master waits for a batch) asks every worker: an error stops the run naming the worker; a worker
Ray restarted (a new pid) has its slots reclaimed and its finished, untaken groups redone, and is
started again. Hangs are the master's hang watch's (:class:`~areal.core.health.HangWatch`): it
kills an actor silent for ``core.health_timeout``, so a hung worker takes this path (the master's
own calls wait ``rollout.setup_timeout + core.health_timeout``, as a backstop).

The manager is restarted by Ray when it dies (``core.manager_restarts``) and rebuilds its state
from its record (``RUN_DIR/rollouts/core_manager.pkl``, :mod:`areal.core.rollout_worker`); a call
the master makes to it (:meth:`RayRolloutSide.ask`) is made again while it restarts, as a call to
a rollout worker is (:class:`~areal.core.rollout_calls.RestartingActor`; each call is idempotent:
:meth:`~areal.core.manager.GenerationManager.take` is keyed by the step).

Scaling, while the job runs (:meth:`RayRolloutSide.rescale`, before each step):

- ``areal core scale RUN_DIR --rollout-workers N`` (or ``--add-server`` / ``--remove-server``)
  writes RUN_DIR/core_scale.json (:mod:`areal.core.status`); the master takes it at the next
  step. New rollout workers get fresh indices and start asking the manager for slots at once.
  Removed ones (the newest first) drain: they ask for nothing more, their running episodes finish
  and are reported, and the worker is stopped once the master has taken all its groups (their
  tensors live with it).
- Servers: the wanted set is the registered ones (the trial's registry: a server that registers
  itself is picked up), plus those added, minus those removed. The manager, which owns the
  servers and their weight updates, takes the wanted set first, so a new server gets the current
  weights and version in the step's weight update; after the update the rollout workers (and
  the master's evaluation client) are moved to the servers that are live there
  (:meth:`RayRolloutSide.sync_servers`): a new server serves only once it holds the current
  weights, a removed one gets no new request (in-flight ones finish), and a server the launcher
  restarted is revived by the manager's disk update and then served again. Servers cannot join
  a running broadcast group: with ``weight_update_mode=distributed`` a new server is refused
  (logged, counted in ``core/servers_refused``).

Weight updates (Lite's :class:`~areal.runtime.publisher.WeightPublisher`, whose
:class:`~areal.api.protocols.WeightTarget` is :class:`ManagedServers` and whose
:class:`~areal.api.protocols.Admission` is :class:`RayRolloutSide`): the master calls the manager
after each actor train step: pause (admission stops, the servers pause) -> the model workers
write or broadcast the weights while the manager has the servers load or receive them ->
``resume(version)``: the rollout workers route to the live servers, then the servers and
admission resume at that version.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from areal.api.config.rollout import InferenceEngineConfig
from areal.api.io import WeightUpdateMeta
from areal.api.launch import agent_proxy_env, agent_proxy_token
from areal.api.protocols import Admission, Checkpointable, StateDict, WeightTarget
from areal.core.manager import Finished
from areal.core.rollout_calls import ManagerCalls, RestartingActor, RolloutWorkerCalls, answer
from areal.core.status import ScaleRequest, take_scale_request
from areal.rollout.remote import RemoteInferenceEngine
from areal.utils.batch import PackedBatch
from areal.utils.logging import get_logger

if TYPE_CHECKING:
    from areal.api.io import Trajectory

logger = get_logger("core.rollout")
P = ParamSpec("P")
R = TypeVar("R")
POLL_S = 0.05  # seconds between asks for a batch
HEALTH_EVERY_S = 5.0  # seconds between health checks while waiting for a batch
RECORD_FILE = "core_manager.pkl"  # the manager's failover record, in the rollouts' dir


@dataclass
class GroupData:
    """A taken group's data, fetched from the object store by the master."""

    packed: PackedBatch  # the tensors the model workers store (ROLLOUT_KEYS)
    trajectories: list[Trajectory] | None = None  # shipped when samples are recorded (areal view)


def fetch_groups(
    groups: list[Finished], get: Callable[[Any, str], Any]
) -> tuple[list[GroupData], set[int]]:
    """The data of ``groups`` whose workers still own it (``get(ref, who)`` fetches one
    reference), and the workers whose groups were lost: a rollout worker owns what it put in the
    object store, and its death loses it."""
    from ray.exceptions import ObjectLostError

    data, dead = [], set()
    for g in groups:
        try:
            data.append(GroupData(*(get(r, f"rollout worker {g.worker}") for r in g.ref)))
        except ObjectLostError as e:
            logger.warning(f"rollout worker {g.worker} lost group {g.group_id}: {e}")
            dead.add(g.worker)
    return data, dead


class RayRolloutSide(Admission, Checkpointable):
    """The master's handle on the manager and the rollout workers (see the module docstring);
    ``client`` is the master's own client to the servers (its evaluation)."""

    def __init__(
        self,
        cfg,
        addresses: list[str],
        dump_dir: str,
        reject_limit: int,
        client: RemoteInferenceEngine,
    ):
        import ray

        from areal.core.rollout_worker import SERVERS, ManagerActor, RolloutWorker

        self._ray, self.cfg = ray, cfg
        self.server_timeout = cfg.rollout.setup_timeout + 10  # a server call may wait for health
        # seconds a (re)started actor may take to come back (its construction waits for servers);
        # also the backstop on any call (the hang watch names a hung actor much sooner)
        self.timeout = cfg.rollout.setup_timeout + cfg.core.health_timeout
        record = Path(dump_dir) / RECORD_FILE  # dump_dir: RUN_DIR/rollouts
        record.parent.mkdir(parents=True, exist_ok=True)
        record.unlink(missing_ok=True)  # an earlier launch's: this manager starts anew
        # The rollout workers find the manager by name: an actor handle among a restartable
        # actor's constructor arguments lives in the object store, which Ray cannot promise to
        # keep for a restart (ray-project/ray#53727; it logs an error line for each such actor).
        manager_name = f"areal-manager-{uuid.uuid4().hex}"
        manager = (
            ray.remote(concurrency_groups={SERVERS: 1})(  # pyright: ignore[reportCallIssue]  # ray's overloads lack this option
                ManagerActor
            )
            .options(name=manager_name, num_cpus=0, max_restarts=cfg.core.manager_restarts)
            .remote(cfg, addresses, str(record))
        )
        self.manager = RestartingActor[ManagerCalls](
            manager,
            "the generation manager",
            self.timeout,
            self.timeout,
            "rollout.setup_timeout + core.health_timeout; "
            f"core.manager_restarts={cfg.core.manager_restarts}",
        )
        # workflow.type=agent_cmd: the agent proxy's control token reaches the workers by env as
        # in Lite (a Ray cluster given by address does not inherit this process's environment)
        env = agent_proxy_env(agent_proxy_token())
        self._cls = ray.remote(RolloutWorker).options(
            num_cpus=0,
            max_restarts=cfg.core.rollout_worker_restarts,
            **({"runtime_env": {"env_vars": env}} if env else {}),
        )
        self._args = (cfg, manager_name, dump_dir, reject_limit)
        self.servers = list(addresses)  # what the rollout workers route to
        self.removed: set[str] = set()  # servers removed by request: not picked up again
        self.refused: set[str] = set()
        self.workers: dict[int, Any] = {}  # index -> the Ray handle
        self._next_index = 0
        self.draining: set[int] = set()
        self.pids: dict[int, int] = {}
        self.started = False
        self.client = client
        self.ask_servers(ManagerCalls.stats)  # built, servers healthy
        self.add_workers(cfg.core.n_rollout_workers)

    def get(self, ref: Any, who: str) -> Any:
        """The value of the Ray object ``ref`` (from ``who``), within the backstop timeout."""
        return answer(ref, who, self.timeout)

    def ask(
        self, method: Callable[Concatenate[ManagerCalls, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """The manager's ``method(*args)``, made again while Ray restarts it, for up to
        ``rollout.setup_timeout + core.health_timeout`` seconds."""
        return self.manager.call(method, *args, **kwargs)

    def ask_servers(
        self, method: Callable[Concatenate[ManagerCalls, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """:meth:`ask` for a call that waits for the servers (an answer within
        ``rollout.setup_timeout + 10`` s)."""
        return self.manager.within(self.server_timeout).call(method, *args, **kwargs)

    def worker(self, i: int) -> RestartingActor[RolloutWorkerCalls]:
        """Calls to rollout worker ``i``, made again while Ray restarts it."""
        return RestartingActor[RolloutWorkerCalls](
            self.workers[i],
            f"rollout worker {i}",
            self.timeout,
            self.timeout,
            "rollout.setup_timeout + core.health_timeout",
        )

    def start(self) -> None:
        self.started = True
        self.check_health()  # starts every worker

    # -- workers ------------------------------------------------------------------------------

    def _share(self) -> None:
        """Each active worker keeps at most its share of ``rollout.max_concurrent_rollouts``
        running, so a new worker is not starved by the older ones."""
        share = -(-self.cfg.rollout.max_concurrent_rollouts // max(1, len(self.active)))
        for i in self.active:
            self.worker(i).call(RolloutWorkerCalls.set_max_in_flight, share)

    def add_workers(self, n: int) -> None:
        cfg, manager, dump_dir, reject_limit = self._args
        for _ in range(n):
            i, self._next_index = self._next_index, self._next_index + 1  # never reused
            self.workers[i] = self._cls.remote(
                i, cfg, self.servers, manager, dump_dir, reject_limit
            )
            logger.info(f"rollout worker {i} added ({len(self.active)} active)")
        self._share()

    @property
    def active(self) -> list[int]:
        return [i for i in self.workers if i not in self.draining]

    def remove_workers(self, n: int) -> None:
        """Drain the ``n`` newest active workers (stopped once the master took their groups)."""
        for i in sorted(self.active)[-n:]:
            self.worker(i).call(RolloutWorkerCalls.drain)
            self.draining.add(i)
            logger.info(f"rollout worker {i} draining ({len(self.active)} active)")
        self._share()

    def check_health(self) -> dict[str, Any]:
        """Every rollout worker's state (restarts handled, drained workers stopped); raise naming
        a worker that failed or hangs."""
        workers = []
        for i in list(self.workers):
            h = self.worker(i).call(RolloutWorkerCalls.health)
            if h["errors"]:
                raise RuntimeError(
                    f"rollout worker {i} failed: {h['errors'][0]} ({len(h['errors'])} errors)"
                )
            if self.pids.setdefault(i, h["pid"]) != h["pid"]:  # Ray restarted it
                lost = self.ask(ManagerCalls.reclaim, i, True)
                lost += self.ask(ManagerCalls.drop_worker_groups, i)
                logger.warning(
                    f"rollout worker {i} restarted (pid {self.pids[i]} -> {h['pid']}); "
                    f"{lost} of its rollouts are redone"
                )
                self.pids[i] = h["pid"]
                if i in self.draining:
                    self.worker(i).call(RolloutWorkerCalls.drain)
            if self.started and not h["started"]:
                self.worker(i).call(RolloutWorkerCalls.start)
            if i in self.draining and self.ask(ManagerCalls.holds, i) == 0:
                self._stop(i)
                logger.info(f"rollout worker {i} drained and stopped")
                continue
            workers.append(
                {
                    "index": i,
                    "draining": i in self.draining,
                    **{k: h[k] for k in ("pid", "episodes", "tokens_per_s", "stats")},
                }
            )
        return {
            "workers": workers,
            "servers": list(self.servers),
            "servers_refused": sorted(self.refused),
            "manager": self.ask(ManagerCalls.stats),
            "manager_pid": self.ask(ManagerCalls.pid),
        }

    def _stop(self, i: int) -> None:
        calls = self.worker(i)
        del self.workers[i]
        self.draining.discard(i)
        try:  # a dead worker is not waited for: it is stopped for good
            calls.within(self.timeout, restart_s=0.0).call(RolloutWorkerCalls.shutdown)
        finally:
            self._ray.kill(calls.handle, no_restart=True)

    # -- scaling ------------------------------------------------------------------------------

    def rescale(self, run_dir: Path, registered: list[str]) -> None:
        """Before a step: apply a scaling request, and route the master's client to the wanted
        servers (new ones get the current weights in this step's update)."""
        req: ScaleRequest = take_scale_request(run_dir) or {"add_servers": [], "remove_servers": []}
        n = req.get("rollout_workers")
        if n is not None and n > len(self.active):
            self.add_workers(n - len(self.active))
            if self.started:
                self.check_health()  # starts them
        elif n is not None and n < len(self.active):
            self.remove_workers(len(self.active) - n)
        self.removed |= set(req["remove_servers"])
        self.removed -= set(req["add_servers"])
        current = self.ask(ManagerCalls.servers)
        wanted = [
            a
            for a in dict.fromkeys([*current, *registered, *req["add_servers"]])
            if a not in self.removed
        ]
        new = [a for a in wanted if a not in current]
        if new and self.cfg.weight_update_mode == "distributed":
            logger.error(
                f"servers {new} cannot join the running weight broadcast group "
                "(weight_update_mode=distributed); they are not used"
            )
            self.refused |= set(new)
            wanted = [a for a in wanted if a not in new]
        if wanted and wanted != current:  # new servers: once healthy
            self.ask_servers(ManagerCalls.set_servers, wanted)

    def sync_servers(self, live: list[str]) -> None:
        """At the end of a weight update, before admission resumes: the rollout workers and the
        master's evaluation client route to the servers the manager has live (those hold the
        current weights)."""
        if live and live != self.servers:
            self.servers = live
            for i in self.workers:
                self.worker(i).call(RolloutWorkerCalls.set_servers, live)
            self.client.set_servers(live)
            logger.info(f"rollout workers now route to {live}")

    # -- the stream ---------------------------------------------------------------------------

    def take(
        self, n_groups: int, deadline_s: float, step: int
    ) -> tuple[list[Finished], list[GroupData]]:
        """The next ``n_groups`` groups of the stream for ``step`` (asked again for the same step,
        the manager hands out the same groups) and their data, fetched by the master while their
        workers live; checks the workers while waiting."""
        start = checked = time.monotonic()
        while True:
            groups = self.ask(ManagerCalls.take, n_groups, step)
            data = None if groups is None else self._fetch(groups, step)
            if groups is not None and data is not None:
                return groups, data
            if time.monotonic() - checked > HEALTH_EVERY_S:
                checked = time.monotonic()
                self.check_health()
            if time.monotonic() - start > deadline_s:
                stats = self.ask(ManagerCalls.stats)
                raise TimeoutError(
                    f"no batch of {n_groups} groups within rollout.watchdog_timeout="
                    f"{deadline_s} s; manager: {stats}"
                )
            time.sleep(POLL_S)

    def _fetch(self, groups: list[Finished], step: int) -> list[GroupData] | None:
        """The groups' data, or None when a worker died before its groups were fetched: its
        groups are redone, the others go back to the stream
        (:meth:`~areal.core.manager.GenerationManager.untake`)."""
        data, dead = fetch_groups(groups, self.get)
        if not dead:
            return data
        n = self.ask(ManagerCalls.untake, step, sorted(dead))
        logger.warning(
            f"rollout workers {sorted(dead)} died before the master fetched their groups of "
            f"step {step}: {n} rollouts are redone"
        )
        return None

    # -- the weight publisher's admission: it stops with the servers, resumes at the new version

    def pause(self) -> None:
        """Admission stops and the servers pause (the manager owns both)."""
        self.ask_servers(ManagerCalls.pause_servers)

    def resume(self, version: int) -> None:
        """Servers resume at ``version``; the rollout workers (and the master's evaluation
        client, which tags its tokens with it) move to the servers that got this update; only
        then does admission resume at ``version`` (no new rollout on stale weights)."""
        self.client.set_version(version)
        self.sync_servers(self.ask_servers(ManagerCalls.resume_servers, version))
        self.ask(ManagerCalls.resume_at, version)

    # -- recover checkpoints: the manager's state (version, admission counters, loader position,
    # admitted but untrained items, re-issued after a resume)

    def state_dict(self) -> StateDict:
        """The generation manager's state."""
        return self.ask(ManagerCalls.state_dict)

    def load_state_dict(self, state: StateDict) -> None:
        """Restore :meth:`state_dict` output in the manager before any rollout is admitted."""
        self.ask(ManagerCalls.load_state_dict, state)

    def close(self) -> None:
        for i in list(self.workers):
            self._stop(i)
        try:
            self.ask(ManagerCalls.shutdown)
        finally:
            self._ray.kill(self.manager.handle, no_restart=True)


class _Pending:
    """A push running in the manager; ``result(timeout)`` waits for it (the publisher's future)."""

    def __init__(self, side: RayRolloutSide, what: str):
        self.side, self.what = side, what

    def result(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.side.ask(ManagerCalls.update_done):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.what} did not finish on the servers within {timeout} s "
                    "(rollout.weight_update_timeout); see the server logs"
                )
            time.sleep(POLL_S)


class ManagedServers(WeightTarget):
    """The generation servers as Lite's :class:`~areal.runtime.publisher.WeightPublisher` sees
    them (its :class:`~areal.api.protocols.WeightTarget`): every call goes to the generation
    manager, which owns them; the version reaches them with ``RayRolloutSide.resume``."""

    def __init__(self, side: RayRolloutSide):
        self.side = side
        self.config: InferenceEngineConfig = side.cfg.rollout

    @property
    def weight_group_size(self) -> int:
        return self.side.ask(ManagerCalls.weight_group_size)

    def init_weights_update_group_async(self, meta: WeightUpdateMeta) -> _Pending:
        self.side.ask(ManagerCalls.begin_join, meta)
        return _Pending(self.side, "joining the weight-update group")

    def update_weights_async(
        self, meta: WeightUpdateMeta, announcement: dict[str, list] | None = None
    ) -> _Pending:
        self.side.ask(ManagerCalls.begin_update, meta, announcement)
        return _Pending(self.side, f"the {meta.type} weight update to version {meta.version}")

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self.update_weights_async(meta).result(self.config.weight_update_timeout + 10)
