"""``areal replay`` of a Core async PPO run (recorded by :mod:`areal.core.record`): what
:func:`~areal.runtime.replay.replay_run` loads as the run's script.

The trainer side of a Core step is the async PPO graph (:mod:`areal.core.graphs`) walked by the
master over the model workers. The replay walks the same graph with the same
:class:`~areal.core.master.Master` over one :class:`~areal.core.worker.InProcessWorker` (the
object each Ray model worker runs inside), hosting the engines the model workers build
(:func:`~areal.core.session.engine_specs`), in one process, on each recorded step's batch (the
rollout groups' tensors in sample-id order, as the model workers received them). So it replays
runs whose actor trained on one model worker (``core.n_workers=1``, or an allocation of one
worker); the torch intra-op threads are the workers' (``core.torch_threads``).

Not replayed: on-policy distillation (its teacher is a node of the graph that the recorded batch
does not hold), and the model workers' RNG states (nothing in the PPO step draws from them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal.core.config import CoreAsyncGRPOConfig, uses_ref
from areal.core.graphs import ACTOR, CRITIC, REF, CoreGraphConfig, graph_from_config
from areal.core.master import Master
from areal.core.ray_worker import build_engine
from areal.core.session import engine_specs, step_stats
from areal.core.worker import InProcessWorker
from areal.utils.batch import PackedBatch

if TYPE_CHECKING:
    from areal.api.io import FinetuneSpec
    from areal.engine.fsdp import FSDPEngine
    from areal.runtime.run import Run

CONFIG = CoreAsyncGRPOConfig
ONE_RANK = "record with core.n_workers=1, or an allocation putting the actor on one worker"


def setup_trainers(
    cfg: CoreAsyncGRPOConfig, run: Run, ft_spec: FinetuneSpec
) -> tuple[FSDPEngine, FSDPEngine | None, FSDPEngine | None]:
    """The actor, critic and reference as the model workers build them, on this process's mesh."""
    if cfg.distill.enabled:
        raise ValueError(
            "distill.enabled: a Core replay does not run the teacher's node; replay a run "
            "without on-policy distillation"
        )
    engines = {
        m: build_engine(spec, run.dist.mesh) for m, spec in engine_specs(cfg, ft_spec).items()
    }
    return engines[ACTOR], engines.get(CRITIC), engines.get(REF)


def train_step(
    cfg: CoreAsyncGRPOConfig,
    run: Run,
    actor: FSDPEngine,
    critic: FSDPEngine | None,
    ref: FSDPEngine | None,
    batch: PackedBatch,
) -> PackedBatch:
    """One step of the async PPO graph over ``batch`` (a recorded step's samples); the MFCs'
    stats go to ``run``'s tracker under the names the Core run logged."""
    engines = {ACTOR: actor, **({CRITIC: critic} if critic else {}), **({REF: ref} if ref else {})}
    graph = graph_from_config(
        CoreGraphConfig(
            graph="async_ppo",
            n_workers=1,
            use_critic=cfg.actor.use_critic,
            use_ref=uses_ref(cfg),
            prox_logp=cfg.actor.needs_prox_pass,
        )
    )
    worker = InProcessWorker(0, engines)
    worker.connect([worker])
    master = Master(
        graph, [worker], group_size=cfg.gconfig.n_samples, mfc_timeout=cfg.core.mfc_timeout
    )
    try:
        master.put_batch(batch)
        out = master.step(batch.n_seqs)
    finally:
        worker.close()
    run.tracker.scalars(**step_stats(out))
    return batch
