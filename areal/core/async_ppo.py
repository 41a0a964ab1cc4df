"""Core async PPO, top to bottom: ``areal core async-ppo --config YAML [key=value ...]`` (a
CoreAsyncGRPOConfig: the YAML of ``examples/gsm8k_grpo.py`` plus the ``core`` section). It runs
under the local launcher, which starts the generation servers; this script is the master.

Rollout and training overlap. ``core.n_rollout_workers`` rollout workers (Ray actors) generate
all the time against the servers, admitted by one generation manager (a Ray actor) under the
global bound ``rollout.max_staleness``; the master's data step takes the oldest-admitted
``train_dataset.batch_size`` groups from the manager's stream (metadata and object references),
places them on the model workers (who fetch the tensors) and runs the async PPO graph
(:mod:`areal.core.graphs`: the sync graph without ``actor_gen``; the decoupled PPO objective
corrects for stale rollouts). Then the actor's weights go to the servers (Lite's
:class:`~areal.runtime.publisher.WeightPublisher` through the manager, which owns the servers:
admission stops, the servers pause, load the new weights, the version moves on, all resume).

Every consumed sample's lag (the trained version minus the oldest version among its tokens) is
checked against ``rollout.max_staleness`` (the run stops naming the group if one exceeds it)
and logged as ``core/lag/*``. Recover checkpoints hold the model workers' engines, the
manager's state (version, admission counters, loader position, every admitted but untrained
item, re-issued after the resume) and the step.

Failures (docs/core.md): the manager and the rollout workers are restarted by Ray and the run
goes on; a hung actor (silent for ``core.health_timeout``) is named and killed by the master's
hang watch (:mod:`areal.core.health`), so it is treated as a dead one; a model worker's loss
stops the run (``recover.mode=auto`` relaunches it from the last recover checkpoint).
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from areal.api.config import load_config
from areal.core.config import CoreAsyncGRPOConfig, graph_config
from areal.core.graphs import graph_from_config
from areal.core.health import HangWatch, MFCActivity, async_ppo_actors
from areal.core.manager import Finished
from areal.core.master import Master
from areal.core.ray_worker import RayWorker
from areal.core.record import AsyncRecorder
from areal.core.rollout_side import ManagedServers, RayRolloutSide
from areal.core.session import (
    ActorWeights,
    Engine,
    ManagerCheckpoint,
    close_session,
    recorded_master,
    saved_engines,
    start_model_workers,
)
from areal.core.status import mark_finished, take_stop_request, write_status
from areal.core.worker import ModelWorker
from areal.runtime.graphs import ACTOR
from areal.runtime.publisher import WeightPublisher
from areal.runtime.rl import RolloutSide, setup_rollout
from areal.runtime.run import Run, init_run
from areal.runtime.step import step_stats
from areal.utils.logging import get_logger

logger = get_logger("core.async_ppo")

CONFIG = CoreAsyncGRPOConfig  # what the launcher validates before starting anything


def worker_stats(status: dict[str, Any]) -> dict[str, float]:
    """The manager's counters plus each rollout worker's episodes, tokens/s, reward failure
    metrics (``reward/*``) and server counters (``remote/*``)."""
    out = {
        **status["manager"],
        "core/servers": float(len(status["servers"])),
        "core/servers_refused": float(len(status["servers_refused"])),
        "core/rollout_workers": float(sum(not w["draining"] for w in status["workers"])),
    }
    for w in status["workers"]:
        out.update(
            {f"rollout_worker/{w['index']}/{k}": float(w[k]) for k in ("episodes", "tokens_per_s")}
        )
        out.update({f"rollout_worker/{w['index']}/{k}": float(v) for k, v in w["stats"].items()})
    return out


def lag_stats(groups: list, version: int, bound: int) -> dict[str, float]:
    """``core/lag/*`` of the consumed samples; raise if one is older than the bound."""
    lags = Counter()
    for g in groups:
        for v in g.min_versions:
            if v < 0:  # nothing of it is trained
                continue
            if version - v > bound:
                raise RuntimeError(
                    f"group {g.group_id} (ticket {g.ticket}) has a sample generated at version "
                    f"{v}, trained at {version}: lag {version - v} > rollout.max_staleness={bound}"
                )
            lags[version - v] += 1
    n = sum(lags.values())
    out = {f"core/lag/hist/{d}": float(c) for d, c in sorted(lags.items())}
    if n:
        out["core/lag/max"] = float(max(lags))
        out["core/lag/mean"] = sum(d * c for d, c in lags.items()) / n
    return out


def start_rollout(
    cfg: CoreAsyncGRPOConfig, run: Run, side: RolloutSide, actor: Engine, n_train: int
) -> tuple[RayRolloutSide, WeightPublisher]:
    """The generation manager and the rollout workers (Ray actors, not generating yet), and the
    publisher of ``actor``'s weights to the manager's servers (the manager is its admission)."""
    rollout = RayRolloutSide(
        cfg,
        [s.address for s in side.rollout.servers],
        str(run.run_dir / "rollouts"),
        n_train,
        side.rollout,  # the master's own client: evaluation
    )
    publisher = WeightPublisher(
        cfg.weight_update_mode,
        actor,
        ManagedServers(rollout),
        rollout,
        run.dist,
        cfg.weights_dir,
    )
    publisher.connect()
    return rollout, publisher


def start_generation(
    cfg: CoreAsyncGRPOConfig, rollout: RayRolloutSide, workers: list[ModelWorker], master: Master
) -> tuple[HangWatch, list[int]]:
    """The rollout workers start generating and the hang watch starts watching every actor;
    returns the watch and the model workers' pids (for RUN_DIR/core_status.json)."""
    ray_workers = [w for w in workers if isinstance(w, RayWorker)]  # async PPO runs on Ray
    rollout.start()
    pids = rollout.get([w.handle.pid.remote() for w in ray_workers], "the model workers")
    activity = MFCActivity(master.trace)
    watch = HangWatch(async_ppo_actors(ray_workers, rollout), cfg.core.health_timeout, activity)
    watch.start()
    return watch, pids


def batch_stats(
    groups: list[Finished], lags: dict[str, float], mfc_stats: dict[str, float], status
) -> dict[str, float]:
    """A step's stats: the lags, the master's MFC stats (named by ``step_stats``), the rollout
    side's counters and the groups' mean reward."""
    rewards = [r for g in groups for r in g.rewards]
    return {
        **lags,
        **mfc_stats,
        **worker_stats(status),
        "reward/mean": sum(rewards) / len(rewards),
    }


def main(argv: list[str]) -> int:
    cfg = load_config(CoreAsyncGRPOConfig, argv)
    run = init_run(cfg, cfg.actor.path)
    data = run.load_data()
    valid_loader, n_steps = data.valid_loader, data.n_steps
    side = setup_rollout(cfg, run)  # the master's client: evaluation and weight updates
    graph = graph_from_config(graph_config(cfg, cfg.core, "async_ppo"))
    workers, engines = start_model_workers(cfg, run, graph, data.ft_spec)  # attaches Ray
    rollout, publisher = start_rollout(cfg, run, side, engines[ACTOR], data.n_train)
    recorder = AsyncRecorder(cfg, run, workers, graph)
    master = recorded_master(cfg, graph, recorder)
    weights = ActorWeights(master, publisher)  # the master counts the actor's versions

    # a resume re-issues what the manager admitted but did not train; servers get its version
    start = run.resume(saved_engines(engines), manager=ManagerCheckpoint(rollout, weights))
    if start == 0 and valid_loader is not None:  # the starting model's held-out accuracy
        side.evaluate(valid_loader, run)
        run.commit(0, n_steps, run.tracker.export())
    recorder.start(start)
    watch, model_pids = start_generation(cfg, rollout, workers, master)
    n_groups, registry = cfg.train_dataset.batch_size, run.registry()
    for step, epoch_done in run.steps(start, n_steps, len(data.loader)):
        if take_stop_request(run.run_dir):  # `areal core stop`: this step is the last
            run.end_at(step)
        rollout.rescale(run.run_dir, registry.get_subtree(run.servers_key))
        with run.tracker.timer("step"):
            with run.tracker.timer("wait_rollouts"):
                groups, data = rollout.take(n_groups, cfg.rollout.watchdog_timeout, step)
            lags = lag_stats(groups, master.versions[ACTOR], cfg.rollout.max_staleness)
            ids = master.put_groups(groups, [d.packed for d in data])
            with recorder.step_groups(step, data, ids, engines[ACTOR], master.versions[ACTOR]):
                out = master.step(n_groups * cfg.gconfig.n_samples)  # for areal view / replay
            with run.tracker.timer("update_weights"):
                publisher.publish(master.versions[ACTOR])
        run.log_trained(step, [g.group_id for g in groups])
        watch.check()
        status = rollout.check_health()
        write_status(run.run_dir, step, n_steps, {**status, "model_worker_pids": model_pids})
        stats = batch_stats(groups, lags, step_stats(graph.mfcs, out), status)
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(engines[ACTOR], step)
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            side.evaluate(valid_loader, run)
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    mark_finished(run.run_dir)
    watch.stop()
    rollout.close()
    publisher.close()  # the weight dirs of disk updates: the last export holds the weights
    registry.close()
    close_session(workers, engines, side, run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
