"""Reward-model engine (tier 2): Bradley-Terry training separates a synthetic preference set."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_fsdp import world_mesh

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.engine.rw import RWEngine, bradley_terry_loss
from areal.utils.batch import PackedBatch

pytestmark = pytest.mark.slow


def preference_pairs(n_pairs: int, seed: int) -> PackedBatch:
    """Shared random prompt; chosen answers use tokens < 128, rejected ones tokens >= 128."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(n_pairs):
        prompt = torch.randint(0, 256, (5,), generator=g).tolist()
        for lo in (0, 128):  # chosen first, then rejected
            length = int(torch.randint(3, 9, (1,), generator=g))
            ids.append(prompt + torch.randint(lo, lo + 128, (length,), generator=g).tolist())
    return PackedBatch.from_sequences({"input_ids": ids})


def test_bradley_terry_loss_by_hand():
    # scores 2.0 (chosen) vs 0.0 (rejected): loss = -log sigmoid(2) = log(1 + e^-2) = 0.126928
    values = torch.tensor([[9.0], [2.0], [5.0], [0.0]])  # two sequences of 2 tokens; last tokens
    mb = PackedBatch.from_sequences({"input_ids": [[1, 2], [3, 4]]})
    loss, stats = bradley_terry_loss(values, mb)
    assert loss.item() == pytest.approx(0.126928, abs=1e-6)
    assert stats == {"pair_acc": 1.0, "margin": 2.0}


def test_bradley_terry_stats_of_values_with_grad_raise_no_warning():
    values = torch.tensor([[9.0], [2.0], [5.0], [0.0]], requires_grad=True)
    mb = PackedBatch.from_sequences({"input_ids": [[1, 2], [3, 4]]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, stats = bradley_terry_loss(values, mb)
    loss.backward()  # the loss keeps its graph
    assert stats["margin"] == 2.0 and values.grad[1, 0] < 0 < values.grad[3, 0]


def test_reward_model_reaches_90_percent_pair_accuracy(tiny_model_dir):
    cfg = TrainEngineConfig(
        path=tiny_model_dir,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=128, granularity=2),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
    )
    engine = RWEngine(cfg, world_mesh())
    engine.initialize(None)
    held_out = preference_pairs(32, seed=999)
    for step in range(15):
        engine.train_rw(preference_pairs(8, seed=step))
    _, result = engine.evaluate_rw(held_out)
    scores = engine.score(held_out)[0]["scores"]
    engine.destroy()
    assert result["pair_acc"] > 0.9, result
    assert scores.shape == (64,)


def test_reward_model_needs_even_granularity(tiny_model_dir):
    with pytest.raises(ValueError, match="granularity"):
        RWEngine(
            TrainEngineConfig(path=tiny_model_dir, mb_spec=MicroBatchSpec(granularity=1)),
            world_mesh(),
        )


def test_value_head_gradients_equal_the_unsharded_models_and_fsdp_view_warning_is_gone(
    tiny_model_dir,
):
    """FSDP2 warned that the value model returns a view (an in-place op on it would skip the
    all-gather and give wrong gradients). Nothing modifies it in place: the engine's gradient
    norm equals the plain transformers model's, and the warning is not raised any more."""
    from test_fsdp import random_batch
    from transformers import AutoModelForTokenClassification

    from areal.engine.fsdp import FSDPEngine

    batch = random_batch(seed=3)

    def mean_value(values, mb):
        mask = mb["loss_mask"].float()
        return (values[:, 0] * mask).sum() / mask.sum(), {}

    engine = FSDPEngine(
        TrainEngineConfig(path=tiny_model_dir, optimizer=OptimizerConfig(lr=1e-6)),
        world_mesh(),
        head="value",
    )
    engine.initialize(None)
    start = {k: v.clone() for k, v in engine.full_state_dict().items()}  # incl. the new score head
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = engine.train_batch(batch, mean_value, lambda mb: float(mb["loss_mask"].sum()))
    engine.destroy()
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]
    plain = AutoModelForTokenClassification.from_pretrained(
        tiny_model_dir, num_labels=1, dtype=torch.float32
    )
    plain.eval()  # no dropout, as the engine's value head (classifier_dropout=0)
    plain.load_state_dict(start, strict=False)
    total, n = 0.0, 0
    bounds = batch.cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        mask = batch["loss_mask"][a:b].float()
        values = plain(input_ids=batch["input_ids"][a:b][None]).logits[0, :, 0]
        total = total + (values * mask).sum()
        n += int(mask.sum())
    (total / n).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in plain.parameters() if p.grad is not None))
    assert stats["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
