"""Core SFT, top to bottom: ``areal core sft --config YAML [key=value ...]`` (an SFTConfig).

The training step goes through the master: each batch enters its buffer, and the SFT graph's
one MFC (``model.train_lm``) runs on an in-process model worker hosting the Lite SFT engine. The
rest is Lite's SFT script (RUN_DIR layout, stats, HF export, held-out NLL, recover
checkpoints); the held-out NLL is computed on the engine directly, as in Lite.

What this is not yet: the worker lives in this one process, so the job has one trainer rank
(model workers on Ray, which would give a model several ranks, are not built); the batch's
tensors are placed on the worker by this process.
"""

from __future__ import annotations

import sys

from areal.api.config import ConfigError, SFTConfig, load_config
from areal.core.graphs import CoreGraphConfig, graph_from_config
from areal.core.master import Master
from areal.core.worker import InProcessWorker
from areal.engine.sft import SFTEngine
from areal.runtime.run import init_run
from areal.utils.batch import PackedBatch


def to_batch(items: list[dict]) -> PackedBatch:
    """Pack tokenized SFT items (``input_ids``, ``loss_mask``) into one batch."""
    return PackedBatch.from_sequences(
        {"input_ids": [it["input_ids"] for it in items], "loss_mask": [it["loss_mask"] for it in items]}
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
    if run.world_size != 1:
        raise ConfigError([f"Core SFT runs one in-process model worker, got {run.world_size} trainer "
                           "ranks; run it as one process (model workers on Ray are not built), or "
                           "use examples/sft.py for several ranks"])
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    engine = SFTEngine(cfg.model, run.dist.mesh)
    engine.initialize(data.ft_spec)
    graph = graph_from_config(CoreGraphConfig(graph="sft"))
    (mfc,) = graph.mfcs
    worker = InProcessWorker(0, {mfc.model: engine})
    worker.connect([worker])
    master = Master(graph, [worker])

    step = 0
    state = run.load_recover({"model": engine})
    if state is not None:
        step = state["step"]
        loader.load_state_dict(state["dataloader"])
    for step, epoch_done, items in run.batches(loader, n_steps, step):
        batch = to_batch(items)
        run.tracker.sum("perf/n_tokens", batch.n_tokens)
        with run.tracker.timer("train"):
            master.put_batch(batch)
            out = master.step(batch.n_seqs)[mfc.name]
        timing = {"n_tokens", "wall_time", "compute_time"}
        stats = {f"loss/{k}": v for k, v in out.items() if k not in timing}
        stats.update({f"mfc/{mfc.name}/{k}": out[k] for k in sorted(timing)})
        if run.saver.check(step, epoch_done) or step == n_steps:
            run.export_hf(engine, step, "model")
        if valid_loader is not None and (run.evaluator.check(step, epoch_done) or step == n_steps):
            with run.tracker.timer("eval"):
                stats.update(evaluate(engine, valid_loader))
        if run.recover_timer.check(step, epoch_done):
            run.save_recover(step, {"model": engine}, {"dataloader": loader.state_dict()})
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    worker.close()
    engine.destroy()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
