"""What every served family shares, and the one-line refusal of what the embedded generator does
not serve.

Every family here is a pre-norm decoder: RMSNorm, grouped-query attention with rotary position
embeddings, a SwiGLU MLP (or, in a sparse layer, a routed mixture of SwiGLU experts: Qwen3-MoE),
RMSNorm, a (tied or untied) head, with Hugging Face's weight names
(``model.layers.{i}.self_attn.q_proj.weight``, ...). A family module says how its config.json
spells the few places where families differ (:class:`Architecture`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal.api.config.loader import ConfigError

if TYPE_CHECKING:
    from areal.serving.families.rope import Rope

ADVICE = "serve it with rollout.backend=vllm|sglang"


class UnsupportedModel(ConfigError):
    """A model the embedded generator does not serve: one line naming the value, what is served
    and the advice (``areal serve`` prints it and exits 2, before the weights load)."""

    def __str__(self) -> str:
        return self.problems[0]


def refuse(what: str, served: str) -> UnsupportedModel:
    """The refusal of config.json's ``what``: ``served`` says what would be served instead."""
    line = f"config.json: {what} is not served by areal's embedded generator ({served}); {ADVICE}"
    return UnsupportedModel([line])


@dataclass(frozen=True)
class Experts:
    """The sparse MoE layers of a model (Qwen3-MoE): each token's MLP is the weighted sum of the
    SwiGLU experts its router ranks highest (:mod:`areal.serving.moe`)."""

    n_experts: int  # experts per sparse layer
    top_k: int  # experts each token is routed to
    norm_topk_prob: bool  # the top-k router probabilities are renormalised to sum to 1
    sparse_layers: frozenset[int]  # layers whose MLP is the experts; the others are dense


@dataclass(frozen=True)
class Architecture:
    """How one model departs from the shared decoder, read from its config.json."""

    head_dim: int
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2; attention_bias=true elsewhere)
    o_bias: bool  # o_proj carries a bias (attention_bias=true in Qwen3 and Llama)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    rope: Rope
    experts: Experts | None = None  # the sparse MoE layers (Qwen3-MoE); None: every MLP dense


def check_dense_decoder(config: dict) -> None:
    """Refuse what no family here computes: an activation other than SiLU, sliding-window
    attention (Qwen2/Qwen3's ``use_sliding_window``, any ``layer_types`` entry but full
    attention)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(f"hidden_act {act!r}", "it computes 'silu'")
    if config.get("use_sliding_window"):
        raise refuse("use_sliding_window=true", "it attends over the full context; set it false")
    other = sorted(set(config.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if other:
        raise refuse(f"layer_types {other}", "it serves 'full_attention' layers")


def head_dim(config: dict) -> int:
    """config.json's ``head_dim``, else hidden / heads (transformers' default for Qwen2, Llama
    and Qwen3-MoE; dense Qwen3's default differs)."""
    heads = int(config["num_attention_heads"])
    return int(config.get("head_dim") or int(config["hidden_size"]) // heads)
