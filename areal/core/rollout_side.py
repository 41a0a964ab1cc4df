"""The master's side of Core async PPO's rollout: the generation manager and the rollout workers
(Ray actors, :mod:`areal.core.rollout_worker`), their health, and elastic scaling.

Health. :meth:`RayRolloutSide.check_health` (every step, and every ``HEALTH_EVERY_S`` while the
master waits for a batch) asks every worker with a deadline (``core.health_timeout``): an error
stops the run naming the worker; a worker Ray restarted (a new pid) has its slots reclaimed and
its finished, untaken groups redone, and is started again.

Scaling, while the job runs (:meth:`RayRolloutSide.rescale`, before each step):

- ``areal core scale RUN_DIR --rollout-workers N`` (or ``--add-server`` / ``--remove-server``)
  writes RUN_DIR/core_scale.json; the master takes it at the next step. New rollout workers get
  fresh indices and start asking the manager for slots at once. Removed ones (the newest first)
  drain: they ask for nothing more, their running episodes finish and are reported, and the
  worker is stopped once the master has taken all its groups (their tensors live with it).
- Servers: the wanted set is the registered ones (the trial's registry: a server that registers
  itself is picked up), plus those added, minus those removed. The master's own client (the one
  that pushes weights) routes to the wanted set first, so a new server gets the current weights
  and version in the step's weight update; after the update the rollout workers are moved to the
  servers that are live there (:meth:`RayRolloutSide.sync_servers`): a new server serves only
  once it holds the current weights, a removed one gets no new request (in-flight ones finish),
  and a server the launcher restarted is revived by the master's disk update and then served
  again. Servers cannot join a running broadcast group: with ``weight_update_mode=distributed``
  a new server is refused (logged, counted in ``core/servers_refused``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from areal.utils.logging import get_logger

logger = get_logger("core.rollout")
POLL_S = 0.05  # seconds between asks for a batch
HEALTH_EVERY_S = 5.0  # seconds between health checks while waiting for a batch
SCALE_FILE = "core_scale.json"


def request_scale(run_dir: Path, rollout_workers: int | None, add: list[str], remove: list[str]) -> dict:
    """Merge a scaling request into RUN_DIR/core_scale.json (the master takes it next step)."""
    path = Path(run_dir) / SCALE_FILE
    if not (Path(run_dir) / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    if rollout_workers is not None and rollout_workers < 1:
        raise ValueError(f"--rollout-workers {rollout_workers}: keep at least 1")
    req = json.loads(path.read_text()) if path.is_file() else {"add_servers": [], "remove_servers": []}
    if rollout_workers is not None:
        req["rollout_workers"] = rollout_workers
    req["add_servers"] += add
    req["remove_servers"] += remove
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(req))
    tmp.replace(path)
    return req


def take_scale_request(run_dir: Path) -> dict | None:
    """The pending scaling request, removed from disk (None if there is none)."""
    path = Path(run_dir) / SCALE_FILE
    if not path.is_file():
        return None
    req = json.loads(path.read_text())
    path.unlink()
    return req


class RayRolloutSide:
    """The master's handle on the manager and the rollout workers (see the module docstring)."""

    def __init__(self, cfg, addresses: list[str], dump_dir: str, reject_limit: int):
        import ray

        from areal.core.rollout_worker import ManagerActor, RolloutWorker

        self._ray, self.cfg = ray, cfg
        self.timeout = cfg.core.health_timeout
        self.manager = ray.remote(ManagerActor).options(num_cpus=0, max_restarts=0).remote(cfg)
        self._cls = ray.remote(RolloutWorker).options(num_cpus=0, max_restarts=cfg.core.rollout_worker_restarts)
        self._args = (cfg, self.manager, dump_dir, reject_limit)
        self.servers = list(addresses)  # what the rollout workers route to
        self.removed: set[str] = set()  # servers removed by request: not picked up again
        self.refused: set[str] = set()
        self.workers: dict[int, Any] = {}
        self._next_index = 0
        self.draining: set[int] = set()
        self.pids: dict[int, int] = {}
        self.started = False
        self.executor = None  # the master's own executor, paused with admission (set by main)
        self.client = None  # the master's own client (set by main)
        self.get(self.manager.stats.remote(), "the manager")  # built (loads the dataset)
        self.add_workers(cfg.core.n_rollout_workers)

    def get(self, ref, who: str) -> Any:
        try:
            return self._ray.get(ref, timeout=self.timeout)
        except self._ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{who} did not answer within core.health_timeout={self.timeout} s: it is "
                               "hung or overloaded") from None

    def start(self) -> None:
        self.started = True
        self.check_health()  # starts every worker

    # -- workers ------------------------------------------------------------------------------

    def _share(self) -> None:
        """Each active worker keeps at most its share of ``rollout.max_concurrent_rollouts``
        running, so a new worker is not starved by the older ones."""
        share = -(-self.cfg.rollout.max_concurrent_rollouts // max(1, len(self.active)))
        for i in self.active:
            self.get(self.workers[i].set_max_in_flight.remote(share), f"rollout worker {i}")

    def add_workers(self, n: int) -> None:
        cfg, manager, dump_dir, reject_limit = self._args
        for _ in range(n):
            i, self._next_index = self._next_index, self._next_index + 1  # never reused
            self.workers[i] = self._cls.remote(i, cfg, self.servers, manager, dump_dir, reject_limit)
            logger.info(f"rollout worker {i} added ({len(self.active)} active)")
        self._share()

    @property
    def active(self) -> list[int]:
        return [i for i in self.workers if i not in self.draining]

    def remove_workers(self, n: int) -> None:
        """Drain the ``n`` newest active workers (stopped once the master took their groups)."""
        for i in sorted(self.active)[-n:]:
            self.get(self.workers[i].drain.remote(), f"rollout worker {i}")
            self.draining.add(i)
            logger.info(f"rollout worker {i} draining ({len(self.active)} active)")
        self._share()

    def _health(self, i: int) -> dict[str, Any]:
        """Worker ``i``'s health; while Ray restarts it, retry until ``core.health_timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.get(self.workers[i].health.remote(), f"rollout worker {i}")
            except self._ray.exceptions.RayActorError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout worker {i} died and did not come back within "
                                       f"core.health_timeout={self.timeout} s: {e}") from e
                time.sleep(0.5)

    def check_health(self) -> dict[str, Any]:
        """Every rollout worker's state (restarts handled, drained workers stopped); raise naming
        a worker that failed or hangs."""
        workers = []
        for i in list(self.workers):
            h = self._health(i)
            if h["errors"]:
                raise RuntimeError(f"rollout worker {i} failed: {h['errors'][0]} ({len(h['errors'])} errors)")
            if self.pids.setdefault(i, h["pid"]) != h["pid"]:  # Ray restarted it
                lost = self.get(self.manager.reclaim.remote(i, True), "the manager")
                lost += self.get(self.manager.drop_worker_groups.remote(i), "the manager")
                logger.warning(f"rollout worker {i} restarted (pid {self.pids[i]} -> {h['pid']}); "
                               f"{lost} of its rollouts are redone")
                self.pids[i] = h["pid"]
                if i in self.draining:
                    self.get(self.workers[i].drain.remote(), f"rollout worker {i}")
            if self.started and not h["started"]:
                self.get(self.workers[i].start.remote(), f"rollout worker {i}")
            if i in self.draining and self.get(self.manager.holds.remote(i), "the manager") == 0:
                self._stop(i)
                logger.info(f"rollout worker {i} drained and stopped")
                continue
            workers.append({"index": i, "draining": i in self.draining,
                            **{k: h[k] for k in ("pid", "episodes", "tokens_per_s", "stats")}})
        return {"workers": workers, "servers": list(self.servers), "servers_refused": sorted(self.refused),
                "manager": self.get(self.manager.stats.remote(), "the manager")}

    def _stop(self, i: int) -> None:
        w = self.workers.pop(i)
        self.draining.discard(i)
        try:
            self.get(w.shutdown.remote(), f"rollout worker {i}")
        finally:
            self._ray.kill(w, no_restart=True)

    # -- scaling ------------------------------------------------------------------------------

    def rescale(self, run_dir: Path, registered: list[str]) -> None:
        """Before a step: apply a scaling request, and route the master's client to the wanted
        servers (new ones get the current weights in this step's update)."""
        req = take_scale_request(run_dir) or {"add_servers": [], "remove_servers": []}
        n = req.get("rollout_workers")
        if n is not None and n > len(self.active):
            self.add_workers(n - len(self.active))
            if self.started:
                self.check_health()  # starts them
        elif n is not None and n < len(self.active):
            self.remove_workers(len(self.active) - n)
        self.removed |= set(req["remove_servers"])
        self.removed -= set(req["add_servers"])
        current = [s.address for s in self.client.servers]
        wanted = [a for a in dict.fromkeys([*current, *registered, *req["add_servers"]]) if a not in self.removed]
        new = [a for a in wanted if a not in current]
        if new and self.cfg.weight_update_mode == "distributed":
            logger.error(f"servers {new} cannot join the running weight broadcast group "
                         "(weight_update_mode=distributed); they are not used")
            self.refused |= set(new)
            wanted = [a for a in wanted if a not in new]
        if wanted and wanted != current:
            self.client.set_servers(wanted)

    def sync_servers(self) -> None:
        """At the end of a weight update, before admission resumes: the rollout workers route to
        the servers live on the master's client (those hold the current weights)."""
        live = [s.address for s in self.client.servers if s.alive]
        if live and live != self.servers:
            self.servers = live
            for i, w in self.workers.items():
                self.get(w.set_servers.remote(live), f"rollout worker {i}")
            logger.info(f"rollout workers now route to {live}")

    # -- the stream ---------------------------------------------------------------------------

    def take(self, n_groups: int, deadline_s: float) -> list:
        """The next ``n_groups`` groups of the stream, checking the workers while waiting."""
        start = checked = time.monotonic()
        while True:
            groups = self.get(self.manager.take.remote(n_groups), "the manager")
            if groups is not None:
                return groups
            if time.monotonic() - checked > HEALTH_EVERY_S:
                checked = time.monotonic()
                self.check_health()
            if time.monotonic() - start > deadline_s:
                stats = self.get(self.manager.stats.remote(), "the manager")
                raise TimeoutError(f"no batch of {n_groups} groups within rollout.watchdog_timeout="
                                   f"{deadline_s} s; manager: {stats}")
            time.sleep(POLL_S)

    # the WeightPublisher's "executor": admission stops with the servers, resumes at the new version
    def pause(self) -> None:
        self.get(self.manager.pause.remote(), "the manager")
        self.executor.pause()

    def resume(self) -> None:
        """Servers resume; the rollout workers move to the servers that got this update; only
        then does admission resume at the new version (no new rollout on stale weights)."""
        self.executor.resume()
        self.sync_servers()
        self.get(self.manager.resume_at.remote(self.client.get_version()), "the manager")

    def close(self) -> None:
        for i in list(self.workers):
            self._stop(i)
        self._ray.kill(self.manager, no_restart=True)
