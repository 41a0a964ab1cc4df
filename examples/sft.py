"""Supervised fine-tuning, top to bottom.

Run: ``areal launch local examples/sft.py --config examples/sft_arithmetic.yaml`` (or directly:
``python examples/sft.py --config ...``, or ``torchrun --nproc_per_node N examples/sft.py ...``).

Each step: batch of (prompt, completion) items -> token-weighted NLL on completion tokens ->
optimizer step -> LR step -> save (HF) -> evaluate held-out NLL -> recover checkpoint -> stats.
"""

from __future__ import annotations

import sys

from areal.api.config import SFTConfig, load_config
from areal.engine.sft import SFTEngine
from areal.runtime.run import init_run
from areal.utils.batch import PackedBatch

CONFIG = SFTConfig


def to_batch(items: list[dict]) -> PackedBatch:
    """Pack tokenized SFT items (``input_ids``, ``loss_mask``) into one batch."""
    return PackedBatch.from_sequences(
        {
            "input_ids": [it["input_ids"] for it in items],
            "loss_mask": [it["loss_mask"] for it in items],
        }
    )


def evaluate(engine: SFTEngine, valid_loader) -> dict[str, float]:
    """Held-out token-mean NLL over the whole validation set."""
    total, n = 0.0, 0.0
    for items in valid_loader:
        _, out = engine.evaluate_lm(to_batch(items))
        total, n = total + out["loss"] * out["n_tokens"], n + out["n_tokens"]
    return {"eval/loss": total / max(n, 1.0)}


def main(argv: list[str]) -> int:
    cfg = load_config(SFTConfig, argv)
    run = init_run(cfg, cfg.model.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    engine = SFTEngine(cfg.model, run.dist.mesh)
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
            _, stats = engine.train_lm(batch)
            stats = {f"loss/{k}": v for k, v in stats.items()}
            engine.step_lr_scheduler()
        if run.saver.check(step, epoch_done) or step == n_steps:
            run.export_hf(engine, step, "model")
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
