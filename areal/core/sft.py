"""Core SFT, top to bottom: ``areal core sft --config YAML [key=value ...]`` (a CoreSFTConfig:
an SFTConfig plus the ``core`` section).

The training step goes through the master: each batch enters its buffer and the SFT graph's one
MFC (``model.train_lm``) runs on the model workers, which host the Lite SFT engine:

- ``core.backend=in_process``: one worker in this process (one trainer rank);
- ``core.backend=ray``: ``core.n_workers`` Ray actors (one process each, gloo), the model
  data-parallel over all of them; ``core.ray_address`` names the cluster (empty: Ray's lookup).

The rest is Lite's SFT script: RUN_DIR layout, stats (plus ``mfc/sft_train/*``), HF export,
held-out NLL and recover checkpoints, which on Ray run on every worker of the model. The batch's
tensors are placed on the workers by this process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal.api.config import ConfigError, SFTConfig, load_config
from areal.api.config.loader import param
from areal.api.io import FinetuneSpec
from areal.core.config import CoreWorkersConfig
from areal.core.dfg import DataflowGraph
from areal.core.graphs import CoreGraphConfig, graph_from_config
from areal.core.master import Master
from areal.core.worker import InProcessWorker, ModelWorker
from areal.engine.sft import SFTEngine
from areal.runtime.run import Run, init_run
from areal.runtime.step import step_stats
from areal.runtime.supervised import evaluate_sft, sft_batch

if TYPE_CHECKING:
    from areal.core.ray_worker import RayModel


@dataclass(frozen=True)
class CoreSFTConfig(SFTConfig):
    """SFT through Core's master (areal core sft)."""

    core: CoreWorkersConfig = param(
        factory=CoreWorkersConfig, help="Core: where the model workers run."
    )


def start_workers(
    cfg: CoreSFTConfig, run: Run, graph: DataflowGraph, ft_spec: FinetuneSpec
) -> tuple[list[ModelWorker], SFTEngine | RayModel]:
    """The workers and what the script uses as the engine (the engine, or a Ray proxy of it)."""
    (mfc,) = graph.mfcs
    if cfg.core.backend == "ray":
        from areal.core.ray_worker import (
            EngineSpec,
            RayModel,
            attach_ray,
            ray_cpus,
            start_ray_workers,
        )

        attach_ray(cfg.core.ray_address, ray_cpus(cfg.core.n_workers, cfg.core.cpus_per_worker))
        spec = EngineSpec("sft", cfg.model, ft_spec=ft_spec)
        workers = start_ray_workers(
            graph,
            {mfc.model: spec},
            cfg.core.cpus_per_worker,
            cfg.core.torch_threads,
            cfg.core.gpus_per_worker,
        )
        return [*workers], RayModel(workers, mfc.model, graph.allocations[mfc.model].workers)
    if run.world_size != 1:
        raise ConfigError(
            [
                f"core.backend=in_process runs one model worker, got {run.world_size} trainer "
                "ranks; run it as one process, or set core.backend=ray"
            ]
        )
    engine = SFTEngine(cfg.model, run.dist.mesh)
    engine.initialize(ft_spec)
    worker = InProcessWorker(0, {mfc.model: engine})
    worker.connect([worker])
    return [worker], engine


def close_workers(workers: list[ModelWorker], engine: SFTEngine | RayModel) -> None:
    """Stop the workers; free the engine when it lives in this process."""
    for w in workers:
        w.close()
    if isinstance(engine, SFTEngine):  # in-process: ours to free; Ray workers free their own
        engine.destroy()


def main(argv: list[str]) -> int:
    cfg = load_config(CoreSFTConfig, argv)
    run = init_run(cfg, cfg.model.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    graph = graph_from_config(
        CoreGraphConfig(graph="sft", n_workers=cfg.core.n_workers, allocations=cfg.core.allocations)
    )
    workers, engine = start_workers(cfg, run, graph, data.ft_spec)
    master = Master(graph, workers, mfc_timeout=cfg.core.mfc_timeout)

    start = run.resume({"model": engine}, loader=loader)
    for step, epoch_done, items in run.batches(loader, n_steps, start):
        batch = sft_batch(items)
        run.tracker.sum("perf/n_tokens", batch.n_tokens)
        with run.tracker.timer("train"):
            master.put_batch(batch)
            stats = step_stats(graph.mfcs, master.step(batch.n_seqs))  # loss/*, mfc/sft_train/*
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(engine, step, "model")
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            with run.tracker.timer("eval"):
                stats.update(evaluate_sft(engine, valid_loader))
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    close_workers(workers, engine)
    run.close()
    model_dir = run.run_dir / "checkpoints" / "model"
    print(f"run finished; logs and outputs in {run.run_dir} (the model: {model_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
