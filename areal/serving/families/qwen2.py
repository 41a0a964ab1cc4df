"""Qwen2 and Qwen2.5: biases on q/k/v (none on o_proj), no q/k norms, ``head_dim`` = hidden /
heads unless config.json names one."""

from __future__ import annotations

from areal.serving.families.base import Architecture, check_dense_decoder
from areal.serving.families.rope import read_rope

MODEL_TYPE = "qwen2"


def architecture(config: dict) -> Architecture:
    """Qwen2's departures from the shared decoder, read from ``config`` (config.json)."""
    check_dense_decoder(config)
    heads = int(config["num_attention_heads"])
    return Architecture(
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        qkv_bias=True,
        o_bias=False,
        qk_norm=False,
        rope=read_rope(config),
    )
