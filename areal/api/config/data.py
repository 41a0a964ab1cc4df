"""Dataset config sections (owned by areal.dataset)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the built-in synthetic arithmetic data (areal.dataset.arithmetic)."""

    min_digits: int = param(1, ge=1, le=9, help="Fewest digits of an operand.")
    max_digits: int = param(2, ge=1, le=9, help="Most digits of an operand.")
    operators: str = param("+-", help="Operators to draw from, any of '+-*'.")
    min_steps: int = param(1, ge=1, le=8, help="Fewest operations per problem (1 = 'a + b').")
    max_steps: int = param(1, ge=1, le=8, help="Most operations per problem.")
    allow_negative: bool = param(
        False, help="Allow negative intermediate results; false redraws such problems."
    )
    worked_steps: bool = param(
        False, help="Keep a step-by-step solution ('12 + 7 = 19', ...) in each item for SFT."
    )
    n_train: int = param(2000, ge=1, help="Problems in the 'train' split.")
    n_test: int = param(200, ge=1, help="Problems in the held-out 'test' split.")
    test_percent: int = param(
        10, ge=1, le=90, help="Percent of the problem space reserved for 'test' (by hash)."
    )

    def check(self) -> Iterator[str]:
        if self.min_digits > self.max_digits:
            yield f"min_digits: {self.min_digits} > max_digits {self.max_digits}; swap them"
        if self.min_steps > self.max_steps:
            yield f"min_steps: {self.min_steps} > max_steps {self.max_steps}; swap them"
        bad = sorted(set(self.operators) - set("+-*"))
        if bad or not self.operators:
            yield (
                f"operators: {self.operators!r} has {bad or 'no operators'}; use a subset of '+-*'"
            )


@dataclass(frozen=True)
class DatasetConfig:
    """Where prompts (or SFT / preference pairs) come from."""

    path: str = param(
        "arithmetic", help="'arithmetic' (built-in synthetic), a .jsonl/.parquet file, or a HF id."
    )
    format: Literal["auto", "arithmetic", "gsm8k", "jsonl"] = param(
        "auto",
        help="auto: 'arithmetic' path -> synthetic, a path or id containing 'gsm8k' -> GSM8K "
        "(question/answer fields), other .jsonl -> generic jsonl of `type`.",
    )
    type: Literal["rl", "sft", "rw"] = param(
        "rl", help="rl: prompt + reference; sft: prompt + completion; rw: prompt + chosen/rejected."
    )
    split: str = param("train", help="Split name for HF datasets and the synthetic generator.")
    batch_size: int = param(8, ge=1, help="Prompts (or pairs) per step, over all DP ranks.")
    shuffle: bool = param(True, help="Shuffle every epoch with a seed derived from the run seed.")
    drop_last: bool = param(
        True,
        help="Drop the last incomplete batch of an epoch; kept, it is padded with the epoch's "
        "first items so every rank gets a full share (not for a held-out rl set, whose items are "
        "each scored once).",
    )
    max_length: int | None = param(
        None, ge=1, help="Drop prompts longer than this many tokens; null keeps all."
    )
    size: int | None = param(
        None, ge=1, help="Use only the first N items (after loading); null uses all."
    )
    instruction: str = param(
        "", help="Text appended to each RL prompt; empty = the dataset's default instruction."
    )
    arithmetic: ArithmeticConfig = param(
        factory=ArithmeticConfig, help="Synthetic arithmetic knobs (used when path=arithmetic)."
    )
