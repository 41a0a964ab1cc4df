"""Dataset config sections (owned by areal.dataset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param


@dataclass(frozen=True)
class DatasetConfig:
    """Where prompts (or SFT / preference pairs) come from."""

    path: str = param(
        "arithmetic", help="'arithmetic' (built-in synthetic), a .jsonl/.parquet file, or a HF id."
    )
    type: Literal["rl", "sft", "rw"] = param(
        "rl", help="rl: prompt + reference; sft: prompt + completion; rw: prompt + chosen/rejected."
    )
    split: str = param("train", help="Split name for HF datasets and the synthetic generator.")
    batch_size: int = param(8, ge=1, help="Prompts (or pairs) per step, over all DP ranks.")
    shuffle: bool = param(True, help="Shuffle every epoch with a seed derived from the run seed.")
    drop_last: bool = param(True, help="Drop the last incomplete batch of an epoch.")
    max_length: int | None = param(
        None, ge=1, help="Drop prompts longer than this many tokens; null keeps all."
    )
    size: int | None = param(
        None, ge=1, help="Use only the first N items (after loading); null uses all."
    )
