"""Save/load (tier 2): DCP round trip is bitwise; HF export reloads in plain transformers."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.io import FinetuneSpec, SaveLoadMeta
from areal.engine.fsdp import FSDPEngine
from test_fsdp import LENGTHS, n_loss_tokens, nll_loss, random_batch, world_mesh

pytestmark = pytest.mark.slow
SCHEDULE = OptimizerConfig(lr=1e-3, lr_scheduler_type="cosine", warmup_steps_proportion=0.2)


def build(path: str) -> FSDPEngine:
    cfg = TrainEngineConfig(path=path, mb_spec=MicroBatchSpec(max_tokens_per_mb=40), optimizer=SCHEDULE)
    engine = FSDPEngine(cfg, world_mesh())
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1))
    return engine


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_tensors(engine: FSDPEngine) -> list[torch.Tensor]:
    return [local(v) for state in engine.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def test_dcp_round_trip_is_bitwise_and_next_step_identical(tiny_model_dir, tmp_path):
    a = build(tiny_model_dir)
    for seed in range(2):
        a.train_batch(random_batch(seed=seed), nll_loss, n_loss_tokens)
        a.step_lr_scheduler()
    a.set_version(3)
    a.save(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))

    b = build(tiny_model_dir)
    b.load(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    assert b.get_version() == 3 and b.lr_scheduler.state_dict() == a.lr_scheduler.state_dict()
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(local(pa), local(pb)), name
    opt_a, opt_b = optimizer_tensors(a), optimizer_tensors(b)
    assert len(opt_a) == len(opt_b) > 0
    assert all(torch.equal(x, y) for x, y in zip(opt_a, opt_b))

    next_batch = random_batch(seed=7)
    stats_a = a.train_batch(next_batch, nll_loss, n_loss_tokens)
    stats_b = b.train_batch(next_batch, nll_loss, n_loss_tokens)
    assert stats_a == stats_b
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(local(pa), local(pb))
    b.destroy()
    a.destroy()


def test_hf_export_reloads_in_plain_transformers_with_identical_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = build(tiny_model_dir)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    engine.set_version(5)
    out = tmp_path / "hf"
    engine.save(SaveLoadMeta(path=str(out), weight_format="hf"))
    state = engine.full_state_dict()
    batch = random_batch(LENGTHS[:1])
    engine_logits = engine.forward(batch, lambda logits, mb: logits)  # [T, V]
    engine.destroy()

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"][None]).logits[0]
    assert (plain - engine_logits).abs().max().item() < 1e-5
    assert json.loads((out / "areal_meta.json").read_text()) == {"version": 5}
    text = "<|im_start|>user\nhi<|im_end|>"
    assert AutoTokenizer.from_pretrained(out).encode(text) == AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)


def test_hf_load_into_a_fresh_engine_restores_the_weights(tiny_model_dir, tmp_path):
    a = build(tiny_model_dir)
    a.train_batch(random_batch(), nll_loss, n_loss_tokens)
    a.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    saved = a.full_state_dict()
    a.destroy()
    b = build(tiny_model_dir)
    b.load(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    loaded = b.full_state_dict()
    b.destroy()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
