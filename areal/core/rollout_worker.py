"""Core's rollout side for async PPO: the generation manager and the rollout workers as Ray actors.

:class:`ManagerActor` is the :class:`~areal.core.manager.GenerationManager` in its own process,
with the train dataset's loader (items are handed out with the admission tickets) and the one
client that owns the generation servers: their membership (scaling, a restarted server revived),
pause and resume, and every weight update (the master's publisher drives it through
:class:`~areal.core.rollout_side.ManagedServers`). Server calls run in their own thread (Ray
concurrency group ``servers``), so a slow weight load or a new server's health wait never holds
up the rollout workers' asks and reports.

:class:`RolloutWorker` (one process each) runs Lite's rollout pieces against the generation
servers: the client (:class:`~areal.rollout.remote.RemoteInferenceEngine`: routing, retries,
failover, pause/resume with re-submission), the reward workers and the training workflow of
``workflow.type`` (RLVR, multi-turn, agent or yours), with DAPO's filter when configured. Its loop
asks the manager for slots (the manager replaces the Lite executor's admission: the bound is
global), runs each episode as a task, and reports every ticket: an accepted group is packed
(:func:`~areal.rollout.trajectory.groups_to_batch`, its ``group_index`` set to the ticket so
groups never merge) and put in Ray's object store; the manager and the master see only its
reference and metadata, and the model worker the master places it on fetches the tensors.

Failures: an episode that raises is reported as failed (its slot is freed) and recorded; the
master reads each worker's :meth:`RolloutWorker.health` every step (with a deadline) and stops
the run naming the worker and the first error, as Lite's executor does.

The manager survives its death (``core.manager_restarts``): after every change it writes its state
(:meth:`~areal.core.manager.GenerationManager.snapshot`, the weight update running, its servers)
to a record in the run dir; Ray restarts it with the same arguments and name, and the new process
reads the record back. The servers are the launcher's processes, not its children, so they keep
running (and keep their weights and version). A rollout worker retries a manager call that failed
because the manager died (until ``rollout.setup_timeout + core.health_timeout``); told to rejoin,
it reports the tickets it runs and the accepted groups it keeps (each until the master confirmed
it got them: the references keep the tensors alive), so running episodes are reported once, lost
grants are re-issued once, and finished groups are trained once. A disk weight update cut by the
restart is redone (same dir, same version); a broadcast one cannot be, and stops the run.
"""

# The actors here declare the seams the master calls them through (rollout_calls.py): hold every
# method to its protocol's signature (basic mode does not check overrides).
# pyright: reportIncompatibleMethodOverride=true

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

import ray

from areal.api.config import GRPOConfig
from areal.api.io import WeightUpdateMeta
from areal.api.launch import drop_torchrun_env
from areal.core.config import CoreAsyncGRPOConfig
from areal.core.graphs import ROLLOUT_KEYS
from areal.core.manager import Finished, GenerationManager
from areal.core.rollout_calls import ManagerCalls, RestartingActor, RolloutWorkerCalls
from areal.rollout.executor import EventLoopThread
from areal.rollout.trajectory import groups_to_batch
from areal.utils.batch import PackedBatch
from areal.utils.logging import get_logger

logger = get_logger("core.rollout")
POLL_S = 0.05  # seconds between asks for slots while the worker is refused
HEARTBEAT_S = 1.0  # seconds between asks of a full or draining worker (it learns of a restart)
P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


def _tokenizer(cfg: GRPOConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)


SERVERS = "servers"  # the manager's concurrency group for server calls (a thread of their own)


def _servers_thread(method: F) -> F:
    """``ray.method(concurrency_group=SERVERS)``: ``method`` runs on the servers' thread. Ray
    sets an attribute on the function and returns it; its stubs type the result as a handle's
    remote method, hence the cast, which keeps the method's own type for :class:`ManagerCalls`."""
    return cast(F, ray.method(concurrency_group=SERVERS)(method))


class ManagerActor(GenerationManager, ManagerCalls):
    """The manager in its own Ray process: items from the run's train dataset, and the servers at
    ``addresses`` through its own client; its state goes to the file ``record`` after every
    change and comes back from it when Ray restarts it (see the module docstring)."""

    def __init__(self, cfg: GRPOConfig, addresses: list[str], record: str):
        from areal.dataset import create_dataloader, load_dataset
        from areal.rollout.remote import RemoteInferenceEngine

        drop_torchrun_env()
        train = load_dataset(cfg.train_dataset, _tokenizer(cfg), cfg.seed)
        loader = create_dataloader(train, cfg.train_dataset, cfg.seed)
        super().__init__(
            cfg.rollout.max_staleness,
            cfg.train_dataset.batch_size,
            cfg.rollout.max_concurrent_rollouts,
            loader,
        )
        self._record, self._lock = Path(record), threading.Lock()
        # (kind, meta, announcement) of the server push running: "update" or "join"
        self._push: tuple[str, WeightUpdateMeta, dict | None] | None = None
        self._broken = ""  # why the push running cannot finish (a restart cut a broadcast)
        saved = self._read_record()
        self.client = RemoteInferenceEngine(cfg.rollout, api_key=cfg.server.api_key)
        self.client.initialize(saved["servers"] if saved else addresses)
        self._update: concurrent.futures.Future | None = None  # the weight push running
        if saved is not None:
            self._resume(saved)
        self._write_record()

    def _read_record(self) -> dict | None:
        """The record of the process this one replaces (None at the first start)."""
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            return None
        if not self._record.is_file():
            logger.warning("generation manager restarted before its first record: starting afresh")
            return None
        return pickle.loads(self._record.read_bytes())

    def _resume(self, saved: dict) -> None:
        """Take the restarted process's state back: admission, tickets, loader, version; a disk
        weight update it was running is redone (the same dir and version)."""
        self.restore(saved["manager"])
        self.client.set_version(self.version)
        if saved["push"] is not None:
            kind, meta, announcement = saved["push"]
            if kind == "update" and meta.type == "disk":
                self._push = saved["push"]
                self._update = self.client.update_weights_async(meta, announcement)
            else:
                self._broken = (
                    f"the generation manager restarted during a {kind} of the weight broadcast "
                    f"group (version {meta.version}), which cannot be redone; relaunch the run "
                    "(recover.mode=auto resumes it from its last recover checkpoint)"
                )
        logger.warning(
            f"generation manager restarted ({self.restarts}): version {self.version}, "
            f"{len(self._running)} rollouts running, {len(self._done)} finished groups awaiting "
            f"their workers, {len(self._reissue)} items to re-issue"
        )

    def _write_record(self) -> None:
        """Replace the record with the current state (the caller holds the lock)."""
        state = {
            "manager": self.snapshot(),
            "servers": [s.address for s in self.client.servers],
            "push": self._push,
        }
        tmp = self._record.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(state))
        tmp.replace(self._record)

    def _changed(self, method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method(*args)``, recorded before the caller gets the answer."""
        with self._lock:
            out = method(*args, **kwargs)
            self._write_record()
        return out

    def pid(self) -> int:
        """This process's id (the master's status and hang probe)."""
        return os.getpid()

    def finish(
        self, worker: int, ticket: int, group: Finished | None, failed: bool = False
    ) -> bool:
        return self._changed(super().finish, worker, ticket, group, failed)

    def reclaim(self, worker: int, restarted: bool = False) -> int:
        return self._changed(super().reclaim, worker, restarted)

    def drop_worker_groups(self, worker: int) -> int:
        return self._changed(super().drop_worker_groups, worker)

    def rejoin(self, worker: int, held: list[int], kept: list[Finished]) -> int:
        n = self._changed(super().rejoin, worker, held, kept)
        logger.info(f"rollout worker {worker} rejoined: {len(held)} running, {n} re-issued")
        return n

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._changed(super().load_state_dict, state)

    def untake(self, step: int, dead: Iterable[int]) -> int:
        return self._changed(super().untake, step, dead)

    def take(self, n: int, step: int | None = None) -> list[Finished] | None:
        with self._lock:
            before = self._taken
            out = super().take(n, step)
            if out is not None or self._taken is not before:
                self._write_record()
        return out

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **{f"manager/{k}": v for k, v in self.client.stats().items()}}

    # -- the servers (concurrency group SERVERS) ------------------------------------------------

    @_servers_thread
    def servers(self) -> list[str]:
        """Every server the manager routes weight updates to (live or not)."""
        return [s.address for s in self.client.servers]

    @_servers_thread
    def set_servers(self, addresses: list[str]) -> None:
        """Exactly these servers from now on (new ones once healthy; they get the next update)."""
        self.client.set_servers(addresses)
        with self._lock:
            self._write_record()

    @_servers_thread
    def weight_group_size(self) -> int:
        return self.client.weight_group_size

    @_servers_thread
    def pause_servers(self) -> None:
        """A weight update begins: admit nothing, then pause every server (in-flight requests are
        aborted; their rollout workers re-submit them after the resume)."""
        self._changed(self.pause)
        self.client.pause()

    @_servers_thread
    def begin_update(
        self, meta: WeightUpdateMeta, announcement: dict[str, list] | None = None
    ) -> None:
        """Start pushing weights to every live server (``disk``: dead ones are probed first and a
        restarted one loads them too; ``distributed``: they receive the trainer's broadcast);
        :meth:`update_done` says when it finished. Asked again for the version being pushed (a
        retry across a restart, which redid it already), it does nothing."""
        running = self._update is not None and not self._update.done()
        if running and self._push is not None and self._push[1].version == meta.version:
            return
        self._begin("update", meta, announcement)
        self._update = self.client.update_weights_async(meta, announcement)

    @_servers_thread
    def begin_join(self, meta: WeightUpdateMeta) -> None:
        """Start the live servers joining the trainer's broadcast group (``distributed``)."""
        self._begin("join", meta, None)
        self._update = self.client.init_weights_update_group_async(meta)

    def _begin(self, kind: str, meta: WeightUpdateMeta, announcement: dict | None) -> None:
        with self._lock:
            self._push = (kind, meta, announcement)
            self._write_record()

    @_servers_thread
    def update_done(self) -> bool:
        """Whether the push :meth:`begin_update` / :meth:`begin_join` started has finished
        (raises its error: a server that failed it is named)."""
        if self._broken:
            raise RuntimeError(self._broken)
        if self._update is not None and not self._update.done():
            return False
        fut, self._update = self._update, None
        if fut is not None:
            fut.result()
            with self._lock:
                self._push = None
                self._write_record()
        return True

    @_servers_thread
    def resume_servers(self, version: int) -> list[str]:
        """The servers hold ``version``: they generate again; returns the live ones (the master
        routes the rollout workers to them, then admission resumes with :meth:`resume_at`)."""
        self.client.set_version(version)
        self.client.resume()
        return [s.address for s in self.client.servers if s.alive]

    @_servers_thread
    def shutdown(self) -> None:
        """The run is over: close the client and remove the record."""
        self.client.destroy()
        self._record.unlink(missing_ok=True)

    def resume_at(self, version: int) -> None:
        """A weight update finished: the servers hold ``version``; admit again."""
        with self._lock:
            self.set_version(version)
            self.resume()
            self._write_record()

    def acquire_at(self, worker: int, want: int) -> tuple[int, int, list[tuple[int, Any]] | None]:
        """(the current weight version, the confirmed ticket, :meth:`acquire`'s slots): the
        worker's client seeds its sampling with the version, as Lite's client does
        (``gconfig.seed``), and forgets the groups up to that ticket. Slots None: this manager
        was restarted and the worker must :meth:`rejoin` first."""
        with self._lock:
            if self.must_rejoin(worker):
                return self.version, self.confirmed, None
            slots = self.acquire(worker, want)
            if slots:
                self._write_record()
        return self.version, self.confirmed, slots


def min_versions(group: list) -> tuple[int, ...]:
    """Per trajectory: the oldest weight version among its trained tokens (-1: none trained)."""
    out = []
    for t in group:
        vs = [v for v, m in zip(t.versions, t.loss_mask) if m and v >= 0]
        out.append(min(vs) if vs else -1)
    return tuple(out)


class RolloutWorker(RolloutWorkerCalls):
    """One rollout worker (wrapped by ``ray.remote``); see the module docstring."""

    def __init__(
        self,
        index: int,
        cfg: CoreAsyncGRPOConfig,
        addresses: list[str],
        manager_name: str,
        dump_dir: str,
        reject_limit: int,
    ):
        """``manager_name``: the :class:`ManagerActor`'s Ray name, looked up here (also when Ray
        restarts this worker; the handle stays valid when Ray restarts the manager)."""
        import ray

        from areal.reward.resolve import resolve_reward
        from areal.reward.runner import RewardRunner
        from areal.rollout.remote import RemoteInferenceEngine
        from areal.runtime.rl import make_workflow
        from areal.workflow.filters import DynamicSamplingFilter

        drop_torchrun_env()
        self.index = index
        # seconds the manager may take to come back; also the backstop on any call to it (the
        # master's hang watch names a hung manager after core.health_timeout)
        restart_s = cfg.rollout.setup_timeout + cfg.core.health_timeout
        self.manager = RestartingActor[ManagerCalls](
            ray.get_actor(manager_name),
            "the generation manager",
            restart_s,
            restart_s,
            "rollout.setup_timeout + core.health_timeout",
        )
        self.max_in_flight = cfg.rollout.max_concurrent_rollouts
        self.engine = RemoteInferenceEngine(cfg.rollout, api_key=cfg.server.api_key)
        self.engine.initialize(addresses)
        self.reward = RewardRunner(resolve_reward(cfg.reward_fn), cfg.reward)
        self.workflow = make_workflow(cfg, self.reward, _tokenizer(cfg), dump_dir)
        self.accept = DynamicSamplingFilter(reject_limit) if cfg.actor.dynamic_sampling else None
        self.record_samples = cfg.stats_logger.samples.enabled  # for areal view
        self.errors: list[str] = []
        self.n_episodes = 0
        self.n_tokens = 0
        self.started = time.monotonic()
        self.draining = False
        self.running = 0  # episodes in flight
        self._held: set[int] = set()  # tickets whose episode runs or is being reported
        self._kept: dict[int, Finished] = {}  # accepted groups the master has not confirmed
        self._asked = 0.0  # time.monotonic() of the last ask
        self._thread = EventLoopThread(f"rollout-worker-{index}")
        self._main = None

    def start(self) -> None:
        """Start asking for slots and rolling out (returns at once)."""
        if self._main is None:
            self._main = self._thread.submit(self._loop())

    async def _loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self.errors:
                tasks = {t for t in tasks if not t.done()}
                self.running = len(tasks)
                want = 0 if self.draining else self.max_in_flight - len(tasks)
                if want <= 0 and time.monotonic() - self._asked < HEARTBEAT_S:
                    await asyncio.sleep(POLL_S)
                    continue
                self._asked = time.monotonic()
                version, confirmed, slots = await self.manager.acall(
                    ManagerCalls.acquire_at, self.index, max(want, 0)
                )
                self._kept = {t: g for t, g in self._kept.items() if t > confirmed}
                if slots is None:  # the manager restarted: say what this worker holds
                    await self.manager.acall(
                        ManagerCalls.rejoin, self.index, sorted(self._held), [*self._kept.values()]
                    )
                    continue
                if slots:
                    self.engine.set_version(version)
                for ticket, item in slots:
                    self._held.add(ticket)
                    tasks.add(asyncio.create_task(self._episode(ticket, item)))
                await asyncio.sleep(0 if slots else POLL_S)
        except Exception as e:  # noqa: BLE001 -- the manager is unreachable: recorded, read by the master
            self._record(f"rollout worker {self.index} lost the manager: {type(e).__name__}: {e}")
        for t in tasks:
            t.cancel()

    def _record(self, error: str) -> None:
        logger.error("%s", error)
        self.errors.append(error)

    async def _episode(self, ticket: int, item: Any) -> None:
        group, failed = None, False
        try:
            group = await self.workflow.arun_episode(self.engine, item)
            if group is not None and self.accept is not None and not self.accept(group):
                group = None
        except Exception as e:  # noqa: BLE001 -- counted by the manager, named to the master
            failed = True
            self._record(
                f"rollout worker {self.index}: ticket {ticket} failed: {type(e).__name__}: {e}"
            )
        self.n_episodes += 1
        entry = self._publish(ticket, group) if group else None
        if entry is not None:  # kept until the master has it (a restarted manager asks for it)
            self._kept[ticket] = entry
        try:
            await self.manager.acall(ManagerCalls.finish, self.index, ticket, entry, failed)
        except Exception as e:  # noqa: BLE001
            self._record(f"rollout worker {self.index} could not report ticket {ticket}: {e}")
        finally:
            self._held.discard(ticket)

    def _publish(self, ticket: int, group: list) -> Finished:
        """Put the packed group in the object store; the manager gets its reference."""
        import torch

        batch = groups_to_batch([group])
        seqs = {k: v for k, v in batch.seqs.items() if k in ROLLOUT_KEYS}
        seqs["group_index"] = torch.full_like(seqs["group_index"], ticket)
        packed = PackedBatch(
            batch.cu_seqlens, {k: v for k, v in batch.tokens.items() if k in ROLLOUT_KEYS}, seqs
        )
        self.n_tokens += packed.n_tokens
        for t in group:
            t.worker = f"worker{self.index}"
        # [1]: the trajectories themselves, which the master records for areal view (core/record.py)
        refs = [ray.put(packed), *([ray.put(group)] if self.record_samples else [])]
        return Finished(
            ticket,
            self.index,
            refs,
            tuple(packed.seqlens.tolist()),
            group[0].group_id,
            min_versions(group),
            tuple(float(t.reward) for t in group),
        )

    def set_max_in_flight(self, n: int) -> None:
        """Keep at most ``n`` episodes running (this worker's share of the global cap)."""
        self.max_in_flight = n

    def drain(self) -> None:
        """Ask for no more slots; the episodes running finish and are reported (scaling down)."""
        self.draining = True

    def set_servers(self, addresses: list[str]) -> None:
        """Route to exactly these servers from now on (they hold the current weights)."""
        self.engine.set_servers(addresses)

    def pid(self) -> int:
        """This process's id (the master's hang probe)."""
        return os.getpid()

    def health(self) -> dict[str, Any]:
        """Errors so far, throughput counters, and ``stats``: the reward workers' failure
        metrics since the last call (committing them applies ``reward.max_failure_fraction``:
        past it this call raises, which stops the run) and the client's server counters."""
        wall = time.monotonic() - self.started
        return {
            "pid": os.getpid(),
            "started": self._main is not None,
            "errors": list(self.errors),
            "episodes": self.n_episodes,
            "running": self.running,
            "tokens_per_s": self.n_tokens / max(wall, 1e-9),
            "stats": {**self.reward.commit_batch(), **self.engine.stats()},
        }

    def shutdown(self) -> None:
        self._thread.stop()
        self.engine.destroy()
        self.reward.close()
