"""What Core's PPO entry scripts share (``areal core sync-ppo``, ``areal core async-ppo``): how
the model workers build the engines, starting them, the master over the recorder's workers
(:mod:`areal.core.record`: the timeline and samples ``areal view`` shows), the actor's weight
version as a recover checkpoint keeps it, and closing. The master's stats take Lite's names by
:func:`areal.runtime.step.step_stats`.

The version. In Core the actor's version is the master's count of its updates
(:attr:`~areal.core.master.Master.versions`); :class:`ActorWeights` is the
:class:`~areal.api.protocols.Publisher` :meth:`~areal.runtime.run.Run.resume` and
:meth:`~areal.runtime.run.Run.checkpoint` see: it records that count and, on a resume, sets it
and publishes the checkpoint's weights to the servers under it. Async PPO keeps the version in
the generation manager's state (:class:`ManagerCheckpoint`).
"""

from __future__ import annotations

import time
from dataclasses import replace

from areal.api.config import GRPOConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.engine import TrainEngine
from areal.api.io import FinetuneSpec
from areal.api.mfc import ModelName
from areal.api.protocols import Checkpointable, Persistent, Publisher, StateDict
from areal.core.config import CoreAsyncGRPOConfig, CoreGRPOConfig, CoreWorkersConfig, uses_ref
from areal.core.dfg import DataflowGraph
from areal.core.graphs import replica_sources
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, RayModel, RayWorker, build_engine
from areal.core.record import CoreRecorder
from areal.core.rollout_side import RayRolloutSide
from areal.core.worker import InProcessWorker, ModelWorker
from areal.runtime.graphs import ACTOR, CRITIC, REF, TEACHER
from areal.runtime.publisher import WeightPublisher
from areal.runtime.rl import RolloutSide
from areal.runtime.run import Run
from areal.utils.logging import get_logger

logger = get_logger("core")

Engine = TrainEngine | RayModel  # a model as an entry script holds it: in process, or on Ray


def engine_specs(cfg: GRPOConfig, ft_spec: FinetuneSpec) -> dict[ModelName, EngineSpec]:
    """How the model workers build the actor, the critic, the reference and a distillation
    teacher (Lite's engines)."""
    g = cfg.gconfig
    specs = {
        ACTOR: EngineSpec(
            "ppo_actor",
            cfg.actor,
            g.temperature,
            g.n_samples,
            g.max_new_tokens,
            ft_spec,
            distill=cfg.distill,
        )
    }
    if cfg.actor.use_critic:
        assert cfg.critic is not None  # GRPOConfig.check: use_critic needs a critic section
        specs[CRITIC] = EngineSpec(
            "ppo_critic", cfg.critic, group_size=g.n_samples, ft_spec=ft_spec
        )
    if uses_ref(cfg) and cfg.ref is not None:
        specs[REF] = EngineSpec("lm", cfg.ref, temperature=g.temperature)
    if cfg.distill.enabled:  # frozen, at temperature 1 like the student's logprobs
        specs[TEACHER] = EngineSpec("lm", TrainEngineConfig(path=cfg.distill.teacher_path))
    return specs


def start_model_workers(
    cfg: CoreGRPOConfig | CoreAsyncGRPOConfig, run: Run, graph: DataflowGraph, ft_spec: FinetuneSpec
) -> tuple[list[ModelWorker], dict[ModelName, Engine]]:
    """The model workers and, per model, what the script uses as its engine (the engine itself
    in process, a :class:`~areal.core.ray_worker.RayModel` on Ray). A layout replica
    (``core.layouts``) is built like its source model, frozen."""
    specs = engine_specs(cfg, ft_spec)
    specs |= {r: replace(specs[s], ft_spec=None) for r, s in replica_sources(graph).items()}
    engines: dict[ModelName, Engine]
    if cfg.core.backend == "ray":
        ray_workers = _start_ray(cfg.core, graph, specs)
        engines = {m: RayModel(ray_workers, m, graph.allocations[m].workers) for m in specs}
        return [*ray_workers], engines
    local = {m: build_engine(spec, run.dist.mesh) for m, spec in specs.items()}
    return [InProcessWorker(0, local)], {**local}


def _start_ray(
    core: CoreWorkersConfig, graph: DataflowGraph, specs: dict[ModelName, EngineSpec]
) -> list[RayWorker]:
    from areal.core.ray_worker import attach_ray, ray_cpus, start_ray_workers

    start = time.monotonic()  # Ray's start and the models' loads take ~25 s on CPU: said
    where = (
        f"the Ray cluster at {core.ray_address}"
        if core.ray_address
        else "Ray (a local instance unless RAY_ADDRESS names a cluster)"
    )
    logger.info(
        f"core: attaching {where}, then starting {core.n_workers} model worker(s) as Ray actors ..."
    )
    attach_ray(core.ray_address, ray_cpus(core.n_workers, core.cpus_per_worker))
    logger.info(
        f"core: Ray attached after {time.monotonic() - start:.0f} s; the model workers load "
        f"{', '.join(map(str, specs))} ..."
    )
    workers = start_ray_workers(
        graph, specs, core.cpus_per_worker, core.torch_threads, core.gpus_per_worker
    )
    logger.info(
        f"core: {len(workers)} model worker(s) ready after {time.monotonic() - start:.0f} s"
    )
    return workers


def recorded_master(
    cfg: CoreGRPOConfig | CoreAsyncGRPOConfig, graph: DataflowGraph, recorder: CoreRecorder
) -> Master:
    """The master walking ``graph`` over the workers as ``recorder`` wraps them (timed; the
    kept fields of a recorded step held back until the recorder has read them)."""
    return Master(
        graph, recorder.workers, group_size=cfg.gconfig.n_samples, mfc_timeout=cfg.core.mfc_timeout
    )


def saved_engines(engines: dict[ModelName, Engine]) -> dict[str, Persistent]:
    """The trained models a recover checkpoint holds, by their directory name in it."""
    return {"actor": engines[ACTOR], **({"critic": engines[CRITIC]} if CRITIC in engines else {})}


def close_session(
    workers: list[ModelWorker], engines: dict[ModelName, Engine], side: RolloutSide, run: Run
) -> None:
    """Stop the workers; free the engines that live in this process (Ray workers free their
    own); then close the master's rollout client and the run."""
    for w in workers:
        w.close()
    for engine in engines.values():
        if isinstance(engine, TrainEngine):
            engine.destroy()
    side.close()
    run.close()


class ActorWeights(Publisher):
    """The actor's weights as a recover checkpoint keeps them: their version is the master's
    count of actor updates; a resume sets the count and publishes the checkpoint's weights
    under it (see the module docstring)."""

    def __init__(self, master: Master, publisher: WeightPublisher):
        self.master, self.publisher = master, publisher

    @property
    def version(self) -> int:
        """The master's count of actor updates."""
        return self.master.versions[ACTOR]

    def publish(self, version: int) -> int:
        """The master counts from ``version``; the servers get the actor's weights as it."""
        self.master.set_version(ACTOR, version)
        return self.publisher.publish(version)


class ManagerCheckpoint(Checkpointable):
    """Async PPO's ``manager`` entry of a recover checkpoint: the generation manager's state
    (version, admission counters, loader position, admitted but untrained items, re-issued
    after the resume); restoring it also moves the actor to the state's version."""

    def __init__(self, rollout: RayRolloutSide, weights: ActorWeights):
        self.rollout, self.weights = rollout, weights

    def state_dict(self) -> StateDict:
        """The manager's state."""
        return self.rollout.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        """The manager's state back, then the actor's weights at its version."""
        self.rollout.load_state_dict(state)
        version = state["version"]
        if not isinstance(version, int):
            raise TypeError(f"the manager's checkpoint holds version {version!r}, not an int")
        self.weights.publish(version)
