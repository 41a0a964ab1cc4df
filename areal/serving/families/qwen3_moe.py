"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, biases only with ``attention_bias=true``)
with sparse MoE layers: layer ``i`` routes each token to ``num_experts_per_tok`` of
``num_experts`` SwiGLU experts (their width is their weights') unless ``i`` is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, where it has a dense MLP of
``intermediate_size`` (transformers' rule). ``norm_topk_prob`` renormalises the chosen experts'
probabilities. ``head_dim`` defaults to hidden / heads here (transformers' Qwen3-MoE attention;
not dense Qwen3's 128). The defaults of the MoE fields are transformers'."""

from __future__ import annotations

from areal.serving.families.base import Architecture, Experts, check_dense_decoder, head_dim, refuse
from areal.serving.families.rope import read_rope

MODEL_TYPE = "qwen3_moe"


def read_experts(config: dict) -> Experts:
    """The sparse layers of ``config`` (config.json); transformers 5 writes ``num_experts`` as
    ``num_local_experts``."""
    n_experts = int(config.get("num_local_experts", config.get("num_experts", 128)))
    top_k = int(config.get("num_experts_per_tok", 8))
    step = int(config.get("decoder_sparse_step", 1))
    if step < 1:
        raise refuse(f"decoder_sparse_step {step}", "it reads a step of 1 or more")
    if n_experts > 0 and not 1 <= top_k <= n_experts:
        raise refuse(f"num_experts_per_tok {top_k}", f"it routes to 1..{n_experts} experts")
    dense = set(config.get("mlp_only_layers") or [])
    layers = range(int(config["num_hidden_layers"]))
    return Experts(
        n_experts=n_experts,
        top_k=top_k,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sparse_layers=frozenset(
            i for i in layers if i not in dense and n_experts > 0 and (i + 1) % step == 0
        ),
    )


def architecture(config: dict) -> Architecture:
    """Qwen3-MoE's departures from the shared decoder, read from ``config`` (config.json)."""
    check_dense_decoder(config)
    bias = bool(config.get("attention_bias", False))
    return Architecture(
        head_dim=head_dim(config),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        rope=read_rope(config),
        experts=read_experts(config),
    )
