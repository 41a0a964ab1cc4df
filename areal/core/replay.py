"""``areal replay`` of a Core async PPO run (recorded by :mod:`areal.core.record`): what
:func:`~areal.runtime.replay.replay_run` loads as the run's script.

The trainer side of a Core step is the async PPO graph (:mod:`areal.core.graphs`, over the PPO
step of :mod:`areal.runtime.graphs`) walked by the master over the model workers. The replay runs
the same graph in process (:func:`~areal.runtime.step.run_step`, each MFC the call a model worker
makes) on the engines the model workers build (:func:`~areal.core.session.engine_specs`), on
each recorded step's batch (the rollout groups' tensors in sample-id order, as the model workers
received them): each MFC gets only the keys it reads, as a worker hands them (the batch's
``prompt_lens`` would turn on the shared-prefix layout, which Core's MFCs do not read), on a
thread of its own as a model worker computes (OpenMP's threads are per calling thread). So it
replays runs whose actor trained on one model worker (``core.n_workers=1``, or an allocation of
one worker); the torch intra-op threads are the workers' (``core.torch_threads``). Its stats
take the names of a Lite step (``loss/*``, ``timing/*``).

Not replayed: on-policy distillation (its teacher is a node of the graph that the recorded batch
does not hold), and the model workers' RNG states (nothing in the PPO step draws from them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from areal.core.config import CoreAsyncGRPOConfig, uses_ref
from areal.core.graphs import CoreGraphConfig, graph_from_config
from areal.core.ray_worker import build_engine
from areal.core.session import engine_specs
from areal.runtime.graphs import ACTOR, CRITIC, REF
from areal.runtime.step import run_step
from areal.utils.batch import PackedBatch

if TYPE_CHECKING:
    from areal.api.io import FinetuneSpec
    from areal.engine.fsdp import FSDPEngine
    from areal.runtime.run import Run

CONFIG = CoreAsyncGRPOConfig


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
    """One step of the async PPO graph over ``batch`` (a recorded step's samples), in process;
    the MFCs' stats go to ``run``'s tracker as a Lite step's."""
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
    with ThreadPoolExecutor(1, thread_name_prefix="model-worker-0") as thread:
        # each MFC gets only the keys it reads, as on a model worker
        return thread.submit(run_step, graph.mfcs, engines, batch, run.tracker, True).result()
