"""The packed varlen attention every trainer engine runs: one causal SDPA call per sequence of a
packed row (like flash-attention's varlen kernel), or per group of the shared-prefix layout
with its small block mask, so no ``[T, T]`` mask is ever built. Registered with transformers'
``AttentionInterface`` as ``areal_varlen`` on import; models are built with
``attn_implementation=ATTN_IMPL`` (:mod:`areal.engine.fsdp`, :mod:`areal.engine.pipeline`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPL = "areal_varlen"


def varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """Attention within each segment of one packed row; the segments come via the forward
    kwargs: ``areal_segments`` ``[(start, end, mask)]`` (mask ``[n, n]`` bool, or None for
    causal; the shared-prefix layout) or else ``cu_seqlens`` ``[B+1]`` (one causal segment per
    sequence).

    query ``[1, Hq, T, D]``, key/value ``[1, Hkv, T, D]``; returns ``[1, T, Hq, D]``.
    """
    segments = kwargs.get("areal_segments")
    if segments is None and kwargs.get("cu_seqlens") is not None:
        bounds = kwargs["cu_seqlens"].tolist()
        segments = [(s, e, None) for s, e in zip(bounds[:-1], bounds[1:])]
    if segments is None or query.shape[0] != 1:
        raise ValueError(
            f"{ATTN_IMPL} attention needs one packed row (got batch {query.shape[0]}) and "
            "areal_segments or cu_seqlens in the forward kwargs; call the model through FSDPEngine"
        )
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            dropout_p=dropout if module.training else 0.0,
            enable_gqa=True,
        )
        for s, e, mask in segments
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPL, varlen_attention)
