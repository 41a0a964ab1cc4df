"""Supervised fine-tuning, top to bottom.

Run: ``areal launch local examples/sft.py --config examples/sft_arithmetic.yaml`` (or directly:
``python examples/sft.py --config ...``, or ``torchrun --nproc_per_node N examples/sft.py ...``).

Each step: batch of (prompt, completion) items -> token-weighted NLL on completion tokens ->
optimizer step -> LR step -> save (HF) -> evaluate held-out NLL -> recover checkpoint -> stats.
The batch layout and the held-out NLL are :mod:`areal.runtime.supervised`'s (``areal core sft``
uses them too).
"""

from __future__ import annotations

import sys

from areal.api.config import SFTConfig, load_config
from areal.engine.sft import SFTEngine
from areal.runtime.graphs import MODEL, sft_mfcs
from areal.runtime.run import init_run
from areal.runtime.step import run_step
from areal.runtime.supervised import evaluate_sft, sft_batch

CONFIG = SFTConfig
SFT = sft_mfcs()  # one node: model.train_lm, then its LR step


def main(argv: list[str]) -> int:
    cfg = load_config(SFTConfig, argv)
    run = init_run(cfg, cfg.model.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    engine = SFTEngine(cfg.model, run.dist.mesh)
    engine.initialize(data.ft_spec)

    start = run.resume({"model": engine}, loader=loader)
    for step, epoch_done, items in run.batches(loader, n_steps, start):
        batch = sft_batch(items)
        run.tracker.sum("perf/n_tokens", batch.n_tokens)
        run_step(SFT, {MODEL: engine}, batch, run.tracker)  # timer train, stats loss/*
        stats: dict[str, float] = {}
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(engine, step, "model")
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            with run.tracker.timer("eval"):
                stats.update(evaluate_sft(engine, valid_loader))
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    engine.destroy()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
