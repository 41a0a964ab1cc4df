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
actor's version is the master's count of its updates and is restored with them:
:class:`~areal.core.session.ActorWeights`). What it shares with ``areal core async-ppo`` lives in
:mod:`areal.core.session`.
"""

from __future__ import annotations

import sys

from areal.api.config import load_config
from areal.core.config import CoreGRPOConfig, graph_config
from areal.core.generation import GenerationWorker
from areal.core.graphs import graph_from_config
from areal.core.record import CoreRecorder
from areal.core.session import (
    ActorWeights,
    close_session,
    recorded_master,
    saved_engines,
    start_model_workers,
)
from areal.core.worker import InProcessWorker
from areal.runtime.graphs import ACTOR
from areal.runtime.publisher import WeightPublisher
from areal.runtime.rl import setup_rollout
from areal.runtime.run import init_run
from areal.runtime.step import step_stats
from areal.workflow.filters import DynamicSamplingFilter

CONFIG = CoreGRPOConfig  # what the launcher validates before starting anything


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
    recorder = CoreRecorder(run, [*workers, gen])  # for areal view: timeline, samples
    master = recorded_master(cfg, graph, recorder)
    weights = ActorWeights(master, publisher)  # the master counts the actor's versions

    start = run.resume(
        saved_engines(engines), loader=loader, executor=side.executor, weights=weights
    )
    if start == 0 and valid_loader is not None:  # the starting model's held-out accuracy
        side.evaluate(valid_loader, run)
        run.commit(0, n_steps, run.tracker.export())
    recorder.start(start)
    n_samples = cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    for step, epoch_done in run.steps(start, n_steps, len(loader)):
        with run.tracker.timer("step"), recorder.step(step, master.versions[ACTOR], gen.trained):
            out = master.step(n_samples)
        run.log_trained(step, [g[0].group_id for g in gen.last_groups])
        stats = {**gen.last_stats, **step_stats(graph.mfcs, out)}
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(engines[ACTOR], step)
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            gen.push(master.versions[ACTOR])  # eval runs the newest weights
            side.evaluate(valid_loader, run)
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    gen.close()
    publisher.close()  # the weight dirs of disk updates: the last export holds the weights
    close_session(workers, engines, side, run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
