"""Reward-model training on preference pairs, top to bottom.

Run: ``areal launch local examples/rm.py --config examples/rm.yaml``.

Each step: batch of (prompt, chosen, rejected) items -> Bradley-Terry loss on the value head's
last-token scores -> optimizer step -> LR step -> save (HF) -> held-out pair accuracy ->
recover checkpoint -> stats. The pair layout and the held-out figures are
:mod:`areal.runtime.supervised`'s.
"""

from __future__ import annotations

import sys

from areal.api.config import RWConfig, load_config
from areal.engine.rw import RWEngine
from areal.runtime.graphs import MODEL, rm_mfcs
from areal.runtime.run import init_run
from areal.runtime.step import run_step
from areal.runtime.supervised import evaluate_rm, rm_batch

CONFIG = RWConfig
RM = rm_mfcs()  # one node: model.train_rw (Bradley-Terry), then its LR step


def main(argv: list[str]) -> int:
    cfg = load_config(RWConfig, argv)
    run = init_run(cfg, cfg.model.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    engine = RWEngine(cfg.model, run.dist.mesh)
    engine.initialize(data.ft_spec)

    start = run.resume({"model": engine}, loader=loader)
    for step, epoch_done, items in run.batches(loader, n_steps, start):
        batch = rm_batch(items)
        run.tracker.sum("perf/n_tokens", batch.n_tokens)
        run_step(RM, {MODEL: engine}, batch, run.tracker)  # timer train, stats loss/*
        stats: dict[str, float] = {}
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(engine, step, "reward_model")
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            with run.tracker.timer("eval"):
                stats.update(evaluate_rm(engine, valid_loader))
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    engine.destroy()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
