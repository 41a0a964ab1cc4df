"""Learning-rate schedules: linear warmup from 0, then constant, linear or cosine decay.

The schedule is a multiplier on the peak lr, stepped once per ``step_lr_scheduler()`` call (not
per ``train_batch``: PPO takes several minibatch steps per RL step). After ``total_steps`` the
multiplier stays at its final value (``min_lr_ratio`` for decaying schedules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areal.api.config.base import OptimizerConfig


@dataclass
class LRSchedule:
    """Callable multiplier for ``torch.optim.lr_scheduler.LambdaLR`` (picklable, stateless)."""

    kind: str  # constant | linear | cosine
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)  # never exactly 0: step 0 still learns
        if self.kind == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR for ``cfg``; ``total_steps=None`` only works for a constant schedule."""
    needs_total = cfg.lr_scheduler_type != "constant" or cfg.warmup_steps_proportion > 0
    if total_steps is None and needs_total:
        raise ValueError(
            f"optimizer.lr_scheduler_type={cfg.lr_scheduler_type!r} with warmup_steps_proportion="
            f"{cfg.warmup_steps_proportion} needs the number of steps; pass a FinetuneSpec to "
            "initialize() or use lr_scheduler_type=constant with warmup_steps_proportion=0"
        )
    total = max(1, total_steps or 1)
    schedule = LRSchedule(
        kind=cfg.lr_scheduler_type,
        total_steps=total,
        warmup_steps=int(cfg.warmup_steps_proportion * total),
        min_lr_ratio=cfg.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
