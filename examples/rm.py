"""Reward-model training on preference pairs, top to bottom.

Run: ``areal launch local examples/rm.py --config examples/rm.yaml``.

Each step: batch of (prompt, chosen, rejected) items -> Bradley-Terry loss on the value head's
last-token scores -> optimizer step -> LR step -> save (HF) -> held-out pair accuracy ->
recover checkpoint -> stats.
"""

from __future__ import annotations

import sys

from areal.api.config import RWConfig, load_config
from areal.engine.rw import RWEngine
from areal.runtime.run import init_run
from areal.utils.batch import PackedBatch

CONFIG = RWConfig


def to_batch(items: list[dict]) -> PackedBatch:
    """Pairs as consecutive sequences: chosen at 2k, rejected at 2k+1 (what RWEngine expects)."""
    seqs = [ids for it in items for ids in (it["chosen_ids"], it["rejected_ids"])]
    return PackedBatch.from_sequences({"input_ids": seqs})


def evaluate(engine: RWEngine, valid_loader) -> dict[str, float]:
    """Held-out BT loss and pair accuracy over the whole validation set."""
    sums = {"loss": 0.0, "pair_acc": 0.0}
    n = 0
    for items in valid_loader:
        _, out = engine.evaluate_rw(to_batch(items))
        for k in sums:
            sums[k] += out[k] * len(items)
        n += len(items)
    return {f"eval/{k}": v / max(n, 1) for k, v in sums.items()}


def main(argv: list[str]) -> int:
    cfg = load_config(RWConfig, argv)
    run = init_run(cfg, cfg.model.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    engine = RWEngine(cfg.model, run.dist.mesh)
    engine.initialize(data.ft_spec)

    step = 0
    state = run.load_recover({"model": engine})
    if state is not None:
        step = state["step"]
        loader.load_state_dict(state["dataloader"])
    for step, epoch_done, items in run.batches(loader, n_steps, step):
        batch = to_batch(items)
        run.tracker.sum("perf/n_tokens", batch.n_tokens)
        with run.tracker.timer("train"):
            _, stats = engine.train_rw(batch)
            stats = {f"loss/{k}": v for k, v in stats.items()}
            engine.step_lr_scheduler()
        if run.saver.check(step, epoch_done) or step == n_steps:
            run.export_hf(engine, step, "reward_model")
        if valid_loader is not None and (run.evaluator.check(step, epoch_done) or step == n_steps):
            with run.tracker.timer("eval"):
                stats.update(evaluate(engine, valid_loader))
        if run.recover_timer.check(step, epoch_done):
            run.save_recover(step, {"model": engine}, {"dataloader": loader.state_dict()})
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    engine.destroy()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
