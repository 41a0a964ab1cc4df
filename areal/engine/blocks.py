"""Per-decoder-block training options: the activation-checkpointing policy and torch.compile.

Activation checkpointing (``activation_checkpointing``), through transformers' per-layer
switch (``activation_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``):

- ``none``: every block keeps its activations for backward (~20 ``T x H`` tensors a block).
- ``full``: every block keeps only its input and recomputes its forward in backward: the least
  memory, about one extra forward of compute.
- ``selective``: every other block (0, 2, 4, ...) is checkpointed: about half the activation
  memory saved for half the recompute, for when ``full`` frees memory that goes unused.

Each policy gives the same numbers as ``none`` (recomputation is deterministic here; tested).

Compile (``compile``): each decoder block's ``forward`` is replaced by ``torch.compile`` of it,
so FSDP2's and checkpointing's module hooks stay outside the compiled code and parameter names
do not change. The per-sequence ``sdpa`` attention graph-breaks on its host loop; ``flex``
attention compiles into the block.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

EVERY_N = {"full": 1, "selective": 2}  # checkpoint blocks 0, n, 2n, ...


def apply_checkpointing(model: PreTrainedModel, policy: str) -> None:
    """Turn on the checkpointing ``policy`` on a Hugging Face model (see the module docstring)."""
    if policy == "none":
        return
    if policy not in EVERY_N:
        raise ValueError(
            f"activation_checkpointing must be none, full or selective, got {policy!r}"
        )
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=EVERY_N[policy])


def resolve_compile(choice: str, device: torch.device) -> bool:
    """``auto`` -> on for CUDA, off elsewhere (CPU compile costs more than it gains here)."""
    if choice == "auto":
        return device.type == "cuda"
    if choice not in ("on", "off"):
        raise ValueError(f"compile must be auto, on or off, got {choice!r}")
    return choice == "on"


def compile_blocks(layers: list[torch.nn.Module]) -> None:
    """Compile each block's ``forward`` in place (dynamic shapes: micro-batch lengths vary)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
