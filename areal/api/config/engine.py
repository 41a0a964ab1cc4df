"""Training-engine config sections (owned by areal.engine)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.loader import Renames, param


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (``peft``): ``W + (alpha / rank) * B @ A`` on the target linears, the
    base frozen; only the adapters (and a value/score head) train. docs/algorithms.md#lora."""

    rank: int = param(0, ge=0, help="Adapter rank r; 0 = LoRA off (full fine-tuning).")
    alpha: float = param(16.0, gt=0, help="Scale numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = param(0.0, ge=0, lt=1, help="Dropout on the adapter's input (training only).")
    target_modules: list[str] = param(
        ["all-linear"],
        help="Linear layers that get adapters: module-name suffixes (q_proj, "
        "v_proj, ...) or ['all-linear'] (every linear of the decoder; never lm_head or a value "
        "head).",
    )
    modules_to_save: list[str] = param(
        [],
        help="Modules trained in full next to the adapters (peft's modules_to_save), by name "
        "suffix, e.g. [embed_tokens] when the token embeddings must learn (a model trained from "
        "little, new tokens); tied output embeddings (lm_head) stay tied to them.",
    )

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained instead of the whole model."""
        return self.rank > 0

    def check(self) -> Iterator[str]:
        if self.enabled and not self.target_modules:
            yield (
                "target_modules: empty with rank > 0; name the linears (e.g. [q_proj, v_proj]) or "
                "[all-linear]"
            )
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            yield (
                f"target_modules: {self.target_modules} mixes all-linear with names; give "
                "['all-linear'] alone or only module names"
            )
        both = sorted(set(self.modules_to_save) & set(self.target_modules))
        if both:
            yield (
                f"modules_to_save: {both} also in target_modules; a module gets an adapter or "
                "is trained in full, not both"
            )


def _checkpointing(value: Any, section: dict) -> list[str]:
    """``gradient_checkpointing: true|false`` -> ``activation_checkpointing=full|none``."""
    return [f"activation_checkpointing={'full' if value is True else 'none'}"]


ENGINE_RENAMED: Renames = {"gradient_checkpointing": _checkpointing}


@dataclass(frozen=True)
class TrainEngineConfig:
    """A model trained by the FSDP2 engine."""

    RENAMED: ClassVar[Renames] = ENGINE_RENAMED

    path: str = param("", help="Hugging Face model dir (config, safetensors, tokenizer).")
    init_from_scratch: bool = param(
        False, help="Random init (seeded by init_seed) from `path`'s config."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = param(
        "float32",
        help="Dtype of the sharded master parameters and optimizer state (float32 everywhere "
        "unless memory forces otherwise).",
    )
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = param(
        "auto",
        help="Compute dtype FSDP casts parameters to for forward/backward (mixed precision); "
        "auto = float32 on CPU, bfloat16 on GPU.",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = param(
        "float32", help="Dtype gradients are reduce-scattered in."
    )
    cpu_offload: bool = param(
        False,
        help="GPU only: keep sharded parameters, gradients and optimizer state in CPU memory.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = param(
        "none",
        help="Recompute activations in backward: none; full (every decoder block keeps only its "
        "input); selective (every other block: half the saving for half the recompute).",
    )
    compile: Literal["auto", "on", "off"] = param(
        "off",
        help="torch.compile each decoder block's forward; auto = on with CUDA, off on CPU. "
        "Opt-in until measured on a GPU (docs/gpus.md), then auto becomes the default.",
    )
    attention: Literal["auto", "sdpa", "flex"] = param(
        "sdpa",
        help="Packed attention: sdpa (one call per sequence) or flex (one FlexAttention call per "
        "row with a document mask; shared-prefix rows and pipeline stages stay on sdpa); "
        "auto = flex with CUDA, sdpa on CPU. sdpa until flex is measured on a GPU "
        "(docs/gpus.md), then auto becomes the default.",
    )
    fused_logprobs: bool = param(
        True,
        help="Token logprobs fused with the LM head in chunks, so the [tokens, vocab] logits "
        "never exist (losses of token logprobs: PPO, SFT, DPO); off = logits then logprobs. "
        "Tensor- and pipeline-parallel models use the logits path.",
    )
    init_seed: int = param(
        1, ge=0, help="Seed for from-scratch init and new heads (same on every rank)."
    )
    shared_prefix: bool = param(
        True,
        help="Run a group's shared prompt once per forward/backward (RL batches with "
        "group_index/prompt_lens); the same logits and gradients as running it per sample.",
    )
    logprob_chunk_size: int = param(
        1024, ge=1, help="Tokens per chunk when computing logprobs/entropy from logits."
    )
    mb_spec: MicroBatchSpec = param(factory=MicroBatchSpec, help="Micro-batch split.")
    optimizer: OptimizerConfig = param(factory=OptimizerConfig, help="Optimizer and schedule.")
    lora: LoRAConfig = param(
        factory=LoRAConfig,
        help="LoRA adapters instead of full fine-tuning (rank > 0 turns it on); "
        "a value/score head stays fully trainable.",
    )
