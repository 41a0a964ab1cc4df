"""LR schedules (tier 1): warmup then constant / linear / cosine decay to min_lr_ratio."""

from __future__ import annotations

import math

import pytest
import torch

from areal.api.config.base import OptimizerConfig
from areal.engine.lr_schedule import LRSchedule, build_lr_scheduler


def test_warmup_rises_linearly_then_cosine_decays_to_min_ratio():
    s = LRSchedule(kind="cosine", total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    # warmup: (step+1)/(warmup+1) -> 1/3, 2/3
    assert [s(0), s(1)] == pytest.approx([1 / 3, 2 / 3])
    # step 2 starts the decay at 1.0; halfway (step 6 of 8 decay steps -> progress 0.5):
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert s(2) == pytest.approx(1.0)
    assert s(6) == pytest.approx(0.55)
    assert s(10) == pytest.approx(0.1) and s(50) == pytest.approx(0.1)


def test_linear_and_constant_schedules():
    lin = LRSchedule(kind="linear", total_steps=4, warmup_steps=0, min_lr_ratio=0.0)
    assert [lin(i) for i in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    const = LRSchedule(kind="constant", total_steps=4, warmup_steps=0, min_lr_ratio=0.5)
    assert const(3) == 1.0


def test_scheduler_steps_the_optimizer_lr_and_needs_total_steps_for_decay():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    cfg = OptimizerConfig(lr=2.0, lr_scheduler_type="cosine", min_lr_ratio=0.0)
    sched = build_lr_scheduler(opt, cfg, total_steps=2)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(2):
        opt.step()  # no gradient: parameters stay put; the order matches a real training step
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.0, 1.0, 0.0])  # cos(0), cos(pi/2), cos(pi)
    assert math.isclose(sched.state_dict()["lr_lambdas"][0]["min_lr_ratio"], 0.0)
    with pytest.raises(ValueError, match="FinetuneSpec"):
        build_lr_scheduler(opt, cfg, total_steps=None)


def test_schedule_length_is_capped_by_total_train_steps():
    # 100 epochs x 3 steps would be 300 steps; the run stops at 150, so warmup 4% = 6 steps.
    from areal.api.io import FinetuneSpec

    spec = FinetuneSpec(total_train_epochs=100, dataset_size=124, train_batch_size=32)
    assert spec.total_train_steps == 300
    capped = FinetuneSpec(100, 124, 32, max_train_steps=150)
    assert capped.total_train_steps == 150
    assert FinetuneSpec(1, 124, 32, max_train_steps=150).total_train_steps == 3
