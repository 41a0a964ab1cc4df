"""Direct preference optimisation on (chosen, rejected) pairs, top to bottom.

Run: ``areal launch local examples/dpo.py --config examples/dpo_arithmetic.yaml model.path=SFT_DIR``
(the demo's pairs first: ``areal dpo-pairs --model SFT_DIR --out runs/dpo-pairs``).

Before training, with a reference-based loss (sigmoid, ipo) and ``dpo.ref_logp=precompute``: the
reference scores every training and held-out pair once (ranks score disjoint shares and share
the results), then it is freed, so training holds one model. With ``online`` the reference stays
and scores each batch; SimPO needs no reference. Each step: batch of pairs -> the step's graph
(:func:`areal.runtime.graphs.dpo_mfcs`: [reference logp] -> preference loss on chosen and
rejected packed in one forward -> optimizer step -> LR step) -> save (HF) -> held-out loss,
reward accuracy and margin -> recover checkpoint -> stats.

Held-out greedy accuracy of an exported model on the arithmetic task:
``areal eval --model RUN_DIR/checkpoints/model/stepN --config examples/arithmetic_grpo.yaml``.
"""

from __future__ import annotations

import math
import sys

import torch.distributed as dist

from areal.api.config import DPOConfig, load_config
from areal.api.io import FinetuneSpec
from areal.dataset import ItemDataset, create_dataloader
from areal.dataset.preference import load_preferences
from areal.engine.dpo import DPOEngine, DPOReference
from areal.runtime.graphs import MODEL, REF, dpo_mfcs
from areal.runtime.run import Run, init_run, total_steps
from areal.runtime.step import run_step
from areal.runtime.supervised import dpo_batch, evaluate_dpo

CONFIG = DPOConfig


def precompute_ref_logp(
    run: Run, ref: DPOReference, dataset: ItemDataset, pairs_per_call: int
) -> ItemDataset:
    """``dataset`` with each pair's reference logprobs ``ref_logp`` = [chosen, rejected]."""
    items, rank, world = dataset.items, run.rank, run.world_size
    mine = list(range(rank, len(items), world))
    by_item: dict[int, list[float]] = {}
    for start in range(0, math.ceil(len(items) / world), pairs_per_call):
        # every rank runs the same number of forwards
        idx = mine[start : start + pairs_per_call] or [0]
        batch, _ = ref.compute_seq_logp(dpo_batch([items[i] for i in idx]), out="ref_logp")
        by_item.update(
            {i: batch["ref_logp"][2 * k : 2 * k + 2].tolist() for k, i in enumerate(idx)}
        )
    shares = [by_item]
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, by_item, group=run.dist.mesh.get_group())
    merged = {i: v for share in shares for i, v in share.items()}
    return ItemDataset([{**it, "ref_logp": merged[i]} for i, it in enumerate(items)], dataset.name)


def reference(cfg: DPOConfig, run: Run, train: ItemDataset, valid: ItemDataset | None):
    """(train, valid, the reference engine kept for online scoring or None)."""
    if cfg.dpo.loss_type == "simpo":
        return train, valid, None
    ref = DPOReference(cfg.ref or cfg.model, run.dist.mesh)  # null ref: a frozen copy of model
    ref.initialize(None)
    if cfg.dpo.ref_logp == "online":
        return train, valid, ref
    with run.tracker.timer("ref_logp_precompute"):
        n = cfg.train_dataset.batch_size
        train = precompute_ref_logp(run, ref, train, n)
        valid = precompute_ref_logp(run, ref, valid, n) if valid is not None else None
    ref.destroy()
    return train, valid, None


def main(argv: list[str]) -> int:
    cfg = load_config(DPOConfig, argv)
    run = init_run(cfg, cfg.model.path)
    train = load_preferences(cfg.train_dataset, run.tokenizer, cfg.seed)
    valid = (
        load_preferences(cfg.valid_dataset, run.tokenizer, cfg.seed) if cfg.valid_dataset else None
    )
    train, valid, ref = reference(cfg, run, train, valid)
    loader = create_dataloader(train, cfg.train_dataset, cfg.seed, run.rank, run.world_size)
    valid_loader = None
    if valid is not None:
        valid_loader = create_dataloader(
            valid, cfg.valid_dataset, cfg.seed, run.rank, run.world_size
        )
    n_steps = total_steps(cfg, len(loader))
    engine = DPOEngine(cfg.model, run.dist.mesh, cfg.dpo)
    engine.initialize(
        FinetuneSpec(
            cfg.total_train_epochs, len(train), cfg.train_dataset.batch_size, cfg.total_train_steps
        )
    )

    # [ref.compute_seq_logp (online reference)] -> model.train_dpo, then its LR step
    graph = dpo_mfcs(use_ref=engine.needs_ref, online_ref=ref is not None)
    engines = {MODEL: engine} if ref is None else {MODEL: engine, REF: ref}
    start = run.resume({"model": engine}, loader=loader)
    for step, epoch_done, items in run.batches(loader, n_steps, start):
        batch = dpo_batch(items)
        run.tracker.sum("perf/n_tokens", batch.n_tokens)
        run_step(graph, engines, batch, run.tracker)  # timers [ref_logp,] train; stats loss/*
        stats: dict[str, float] = {}
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(engine, step, "model")
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            with run.tracker.timer("eval"):
                stats.update(evaluate_dpo(engine, ref, valid_loader))
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    engine.destroy()
    if ref is not None:
        ref.destroy()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
