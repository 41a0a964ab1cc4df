"""Qwen3 (dense): an RMSNorm over each head of q and of k before RoPE (``q_norm``, ``k_norm``,
one ``[head_dim]`` weight each, shared by the heads), an explicit ``head_dim`` (128 when
config.json leaves it out, as transformers defaults it: not hidden / heads), and biases on every
attention projection only with ``attention_bias=true`` (false in Qwen3's checkpoints)."""

from __future__ import annotations

from areal.serving.families.base import Architecture, check_dense_decoder
from areal.serving.families.rope import read_rope

MODEL_TYPE = "qwen3"


def architecture(config: dict) -> Architecture:
    """Qwen3's departures from the shared decoder, read from ``config`` (config.json)."""
    check_dense_decoder(config)
    bias = bool(config.get("attention_bias", False))
    return Architecture(
        head_dim=int(config.get("head_dim") or 128),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        rope=read_rope(config),
    )
