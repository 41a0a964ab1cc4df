"""Training-engine config sections (owned by areal.engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param
from areal.api.config.base import MicroBatchSpec, OptimizerConfig


@dataclass(frozen=True)
class TrainEngineConfig:
    """A model trained by the FSDP2 engine."""

    path: str = param("", help="Hugging Face model dir (config, safetensors, tokenizer).")
    init_from_scratch: bool = param(False, help="Random init from `path`'s config.")
    dtype: Literal["float32", "bfloat16", "float16"] = param(
        "float32", help="Parameter dtype (fp32 on CPU; bf16 on GPU)."
    )
    gradient_checkpointing: bool = param(False, help="Recompute activations in backward.")
    mb_spec: MicroBatchSpec = param(factory=MicroBatchSpec, help="Micro-batch split.")
    optimizer: OptimizerConfig = param(factory=OptimizerConfig, help="Optimizer and schedule.")
