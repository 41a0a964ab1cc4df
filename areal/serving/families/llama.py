"""Llama (Llama 3, 3.1, 3.2, 3.3): no q/k norms, biases on every attention projection only with
``attention_bias=true`` (false in Llama's checkpoints), usually an untied head
(``tie_word_embeddings``, read by the shared spec), and RoPE of type ``default`` or ``llama3``
(3.1+: low frequencies scaled, :mod:`.rope`). ``mlp_bias=true`` is refused."""

from __future__ import annotations

from areal.serving.families.base import Architecture, check_dense_decoder, head_dim, refuse
from areal.serving.families.rope import read_rope

MODEL_TYPE = "llama"


def architecture(config: dict) -> Architecture:
    """Llama's departures from the shared decoder, read from ``config`` (config.json)."""
    check_dense_decoder(config)
    if config.get("mlp_bias"):
        raise refuse("mlp_bias=true", "its MLP projections carry no bias")
    bias = bool(config.get("attention_bias", False))
    return Architecture(
        head_dim=head_dim(config),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=False,
        rope=read_rope(config),
    )
