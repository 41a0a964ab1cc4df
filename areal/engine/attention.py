"""The packed varlen attention every trainer engine runs, registered with transformers'
``AttentionInterface`` as ``areal_varlen`` on import; models are built with
``attn_implementation=ATTN_IMPL`` (:mod:`areal.engine.fsdp`, :mod:`areal.engine.pipeline`).
No ``[T, T]`` mask is ever built. Two implementations, chosen per forward by its kwargs:

- ``sdpa``: one causal SDPA call per sequence of a packed row (like flash-attention's varlen
  kernel), or per group of the shared-prefix layout with its small block mask.
- ``flex``: one ``flex_attention`` call over the whole row with a document mask (a token sees the
  tokens of its own sequence up to itself) as a :class:`BlockMask` built once per forward from
  the sequence ids (:func:`document_block_mask`); compiled on CUDA (a fused kernel, one launch
  per layer however many sequences), eager on CPU (forward only, materialising the scores:
  tests; torch's FlexAttention has no CPU backward, so training with it on CPU is refused).
  It serves the plain packed layout; the shared-prefix layout's per-group masks run on ``sdpa``.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface

ATTN_IMPL = "areal_varlen"
Attention = Literal["sdpa", "flex"]


def resolve_attention(choice: str, device: torch.device) -> Attention:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` elsewhere; otherwise the choice itself."""
    if choice == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if choice not in ("sdpa", "flex"):
        raise ValueError(f"attention must be auto, sdpa or flex, got {choice!r}")
    return choice


def document_block_mask(cu_seqlens: torch.Tensor, device: torch.device) -> BlockMask:
    """Causal attention within each sequence of a packed row with bounds ``cu_seqlens`` [B+1]."""
    lengths = cu_seqlens.diff().to(device)
    n = int(cu_seqlens[-1])
    seq = torch.arange(len(lengths), device=device)
    doc = torch.repeat_interleave(seq, lengths, output_size=n)  # [T]; output_size: no host sync

    def same_sequence_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return create_block_mask(same_sequence_causal, None, None, n, n, device=device)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def _flex(module, query, key, value, block_mask, dropout, scaling):
    if module.training and not query.is_cuda:
        raise ValueError(
            "attention=flex trains only on CUDA (torch's FlexAttention has no CPU backward); "
            "set attention=sdpa (or auto) for training on CPU"
        )
    if dropout > 0 and module.training:
        raise ValueError(
            f"attention dropout {dropout} is not supported by attention=flex; set "
            "attention=sdpa for a model trained with attention dropout"
        )
    fn = _compiled_flex() if query.is_cuda else flex_attention
    out = fn(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=True)
    assert isinstance(out, torch.Tensor)  # no return_lse / return_aux asked for
    return out.transpose(1, 2).contiguous(), None


def varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """Attention within each segment of one packed row; the layout comes via the forward
    kwargs: ``areal_block_mask`` (flex, the plain layout), ``areal_segments``
    ``[(start, end, mask)]`` (mask ``[n, n]`` bool, or None for causal; the shared-prefix
    layout) or else ``cu_seqlens`` ``[B+1]`` (one causal segment per sequence).

    query ``[1, Hq, T, D]``, key/value ``[1, Hkv, T, D]``; returns ``[1, T, Hq, D]``.
    """
    if kwargs.get("areal_block_mask") is not None:
        return _flex(module, query, key, value, kwargs["areal_block_mask"], dropout, scaling)
    segments, cu_seqlens = kwargs.get("areal_segments"), kwargs.get("cu_seqlens")
    if (segments is None and cu_seqlens is None) or query.shape[0] != 1:
        raise ValueError(
            f"{ATTN_IMPL} attention needs one packed row (got batch {query.shape[0]}) and "
            "areal_segments or cu_seqlens in the forward kwargs; call the model through FSDPEngine"
        )
    return _sdpa_segments(module, query, key, value, segments, cu_seqlens, dropout, scaling)  # pyright: ignore[reportCallIssue]  # torch.compiler.disable is untyped: pyright infers the wrapper's signature wrong


# a compiled block runs this loop eagerly: traced, every new set of sequence lengths would
# recompile the block (the loop unrolls over them)
@torch.compiler.disable
def _sdpa_segments(module, query, key, value, segments, cu_seqlens, dropout, scaling):
    if segments is None:
        bounds = cu_seqlens.tolist()
        segments = [(s, e, None) for s, e in zip(bounds[:-1], bounds[1:])]
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
