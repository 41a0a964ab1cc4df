"""Qwen2 and Qwen2.5: biases on q/k/v (none on o_proj), no q/k norms, ``head_dim`` = hidden /
heads unless config.json names one."""

from __future__ import annotations

from areal.serving.families.base import Architecture, check_dense_decoder, head_dim
from areal.serving.families.rope import read_rope

MODEL_TYPE = "qwen2"


def architecture(config: dict) -> Architecture:
    """Qwen2's departures from the shared decoder, read from ``config`` (config.json)."""
    check_dense_decoder(config)
    return Architecture(
        head_dim=head_dim(config),
        qkv_bias=True,
        o_bias=False,
        qk_norm=False,
        rope=read_rope(config),
    )
