"""Core sync PPO, top to bottom: ``areal core sync-ppo --config YAML [key=value ...]`` (a
CoreGRPOConfig: a GRPOConfig, the same YAML as ``examples/gsm8k_grpo.py``, plus the ``core``
section). ``areal core sync-ppo`` runs this script under the local launcher, which starts the
generation servers; the script itself is the master (one process).

Each step the master runs the sync PPO graph (:mod:`areal.core.graphs`) once: ``actor_gen`` on
the generation worker (the actor's newest weights pushed to the servers first, then one batch of
scored groups drawn from the train dataset, as Lite's executor does with
``rollout.max_staleness=0``) -> proximal logp / reference logp / critic values on their model
workers -> advantages -> actor and critic updates. The model workers are one worker in this
process (``core.backend=in_process``) or ``core.n_workers`` Ray actors with the allocation
``core.allocations`` gives each model.

The rest is Lite's RL script: RUN_DIR layout, stats (plus ``mfc/<name>/{n_tokens,wall_time,
compute_time}`` per MFC), HF export of the actor, held-out accuracy, recover checkpoints (the
actor's version is the master's count of its updates and is restored with them).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

from areal.api.config import GRPOConfig, load_config
from areal.api.config.engine import TrainEngineConfig
from areal.core.config import CoreGRPOConfig, graph_config, uses_ref
from areal.core.dfg import DataflowGraph, ModelName
from areal.core.generation import GenerationWorker
from areal.core.graphs import ACTOR, CRITIC, REF, TEACHER, graph_from_config, replica_sources
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, build_engine
from areal.core.worker import InProcessWorker
from areal.runtime.publisher import WeightPublisher
from areal.runtime.rl import evaluate, setup_rollout
from areal.runtime.run import init_run
from areal.workflow.filters import DynamicSamplingFilter
from areal.utils.logging import get_logger

logger = get_logger("core")

TIMING = ("n_tokens", "wall_time", "compute_time")


CONFIG = CoreGRPOConfig  # what the launcher validates before starting anything


def engine_specs(cfg: GRPOConfig, ft_spec) -> dict[ModelName, EngineSpec]:
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
        specs[CRITIC] = EngineSpec(
            "ppo_critic", cfg.critic, group_size=g.n_samples, ft_spec=ft_spec
        )
    if uses_ref(cfg):
        specs[REF] = EngineSpec("lm", cfg.ref, temperature=g.temperature)
    if (
        cfg.distill.enabled
    ):  # frozen, at temperature 1 like the student's logprobs (gconfig.temperature=1)
        specs[TEACHER] = EngineSpec("lm", TrainEngineConfig(path=cfg.distill.teacher_path))
    return specs


def start_model_workers(cfg: CoreGRPOConfig, run, graph: DataflowGraph, ft_spec):
    """The model workers and, per trained model, what the script uses as its engine (the engine
    itself in process, a :class:`~areal.core.ray_worker.RayModel` on Ray). A layout replica
    (``core.layouts``) is built like its source model, frozen."""
    specs = engine_specs(cfg, ft_spec)
    specs |= {r: replace(specs[s], ft_spec=None) for r, s in replica_sources(graph).items()}
    if cfg.core.backend == "ray":
        from areal.core.ray_worker import RayModel, attach_ray, ray_cpus, start_ray_workers

        start = (
            time.monotonic()
        )  # Ray's start and the workers' model loads take ~25 s on CPU: said, not silent
        where = (
            f"the Ray cluster at {cfg.core.ray_address}"
            if cfg.core.ray_address
            else "Ray (a local instance unless RAY_ADDRESS names a cluster)"
        )
        logger.info(
            f"core: attaching {where}, then starting {cfg.core.n_workers} model worker(s) as Ray actors ..."
        )
        attach_ray(cfg.core.ray_address, ray_cpus(cfg.core.n_workers, cfg.core.cpus_per_worker))
        logger.info(
            f"core: Ray attached after {time.monotonic() - start:.0f} s; the model workers load "
            f"{', '.join(map(str, specs))} ..."
        )
        workers = start_ray_workers(
            graph, specs, cfg.core.cpus_per_worker, cfg.core.torch_threads, cfg.core.gpus_per_worker
        )
        logger.info(
            f"core: {len(workers)} model worker(s) ready after {time.monotonic() - start:.0f} s"
        )
        return workers, {m: RayModel(workers, m, graph.allocations[m].workers) for m in specs}
    engines = {m: build_engine(spec, run.dist.mesh) for m, spec in specs.items()}
    worker = InProcessWorker(0, engines)
    return [worker], engines


def step_stats(out: dict[str, dict[str, float]]) -> dict[str, float]:
    """The master's per-MFC stats as Lite's names (``loss/*``, ``loss/critic/*``) plus
    ``mfc/<name>/<timing>`` and the reallocations' ``realloc/<model>/{bytes,seconds}``."""
    stats = {f"mfc/{name}/{k}": s[k] for name, s in out.items() for k in TIMING}
    prefix = {"actor_adv": "loss/", "actor_train": "loss/", "critic_train": "loss/critic/"}
    for name, s in out.items():
        stats.update({k: v for k, v in s.items() if k.startswith("realloc/")})
        if name in prefix:
            stats.update({prefix[name] + k: v for k, v in s.items() if k not in TIMING})
    return stats


def close(workers: list, gen: GenerationWorker, engines: dict[ModelName, Any]) -> None:
    gen.close()
    for w in workers:
        w.close()
    for engine in engines.values():
        if hasattr(engine, "destroy"):  # in process: ours to free; Ray workers free their own
            engine.destroy()


def main(argv: list[str]) -> int:
    cfg = load_config(CoreGRPOConfig, argv)
    run = init_run(cfg, cfg.actor.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    side = setup_rollout(cfg, run)
    graph = graph_from_config(graph_config(cfg, cfg.core, "sync_ppo"))
    workers, engines = start_model_workers(cfg, run, graph, data.ft_spec)
    publisher = WeightPublisher(
        cfg.weight_update_mode,
        engines[ACTOR],
        side.rollout,
        side.executor,
        run.dist,
        cfg.weights_dir,
    )
    publisher.connect()
    accept = DynamicSamplingFilter(data.n_train) if cfg.actor.dynamic_sampling else None
    gen = GenerationWorker(graph.n_workers - 1, side, loader, publisher, ACTOR, accept)
    for w in [*workers, gen]:
        if isinstance(w, InProcessWorker):
            w.connect([*workers, gen])
    master = Master(
        graph, [*workers, gen], group_size=cfg.gconfig.n_samples, mfc_timeout=cfg.core.mfc_timeout
    )
    saved = {"actor": engines[ACTOR], **({"critic": engines[CRITIC]} if CRITIC in engines else {})}

    step, state = 0, run.load_recover(saved)
    if state is not None:  # the master counts from the checkpoint's version; servers get it
        step = state["step"]
        loader.load_state_dict(state["dataloader"])
        side.executor.load_state_dict(state["executor"])
        master.set_version(ACTOR, state["version"])
        publisher.publish(state["version"])
    elif valid_loader is not None:  # step 0: the starting model's held-out accuracy
        evaluate(side.executor, valid_loader, side.eval_workflow, run)
        run.commit(0, n_steps, run.tracker.export())
    n_samples = cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    while step < n_steps:
        step, epoch_done = step + 1, (step + 1) % len(loader) == 0
        with run.tracker.timer("step"):
            out = master.step(n_samples)
        run.log_trained(step, [g[0].group_id for g in gen.last_groups])
        stats = {**gen.last_stats, **step_stats(out)}
        if run.saver.check(step, epoch_done) or step == n_steps:
            run.export_hf(engines[ACTOR], step)
        if valid_loader is not None and (run.evaluator.check(step, epoch_done) or step == n_steps):
            gen.push(master.versions[ACTOR])  # eval runs the newest weights
            evaluate(side.executor, valid_loader, side.eval_workflow, run)
        if run.recover_timer.check(step, epoch_done):
            state = {
                "dataloader": loader.state_dict(),
                "executor": side.executor.state_dict(),
                "version": master.versions[ACTOR],
            }
            run.save_recover(step, saved, state)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    close(workers, gen, engines)
    side.close()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
