"""The packed forward of one micro-batch, as the engines run it: the model's inputs (plain or
shared-prefix layout, ``sdpa`` or ``flex`` attention), then either its logits ``[T, V]`` or,
fused with the LM head, the tokens' logprobs and entropies without the logits.

The fused path. FSDP2 all-gathers the root module's parameters (token embedding, final norm, LM
head; one tensor when tied) only inside a forward of the root. :func:`install_fused_head` gives
the sharded root a second forward method, registered with FSDP2
(``register_fsdp_forward_method``), that runs the decoder to the hidden states ``[S, H]`` and
:func:`~areal.algo.logprob.fused_logprobs_and_entropy` with the head's weight, so the weight is
unsharded while it is used, its gradient (for a tied head, the embedding's, summed with the
input side's) goes through FSDP's reduce-scatter like any other, and no ``[T, V]`` tensor
exists in forward or backward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import register_fsdp_forward_method
from transformers import PreTrainedModel

from areal.algo.logprob import (
    TokenLogprobs,
    fused_logprobs_and_entropy,
    next_token_labels,
    packed_token_logprobs,
    to_packed,
)
from areal.engine import lora
from areal.engine.attention import Attention, document_block_mask
from areal.utils.batch import PackedBatch
from areal.utils.logging import get_logger
from areal.utils.prefix import share_prefixes

FUSED_METHOD = "areal_token_logprobs"
logger = get_logger("lm_forward")


@dataclass(frozen=True)
class ForwardSpec:
    """How an engine runs its packed forward."""

    device: torch.device
    shared_prefix: bool  # lay out a group's shared prompt once (areal.utils.prefix)
    attention: Attention
    temperature: float  # divides the logits of the fused path
    chunk_size: int  # tokens per chunk of the logprob computation


def model_inputs(mb: PackedBatch, spec: ForwardSpec) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The forward kwargs of ``mb`` (a row of ``S`` tokens) and, for the shared-prefix layout,
    the index ``[T]`` that maps each plain-layout token to its row position."""
    row = share_prefixes(mb) if spec.shared_prefix else None
    if row is None:
        kwargs: dict[str, Any] = {
            "input_ids": mb["input_ids"].to(spec.device)[None],
            "position_ids": mb.position_ids().to(spec.device)[None],
        }
        if spec.attention == "flex":
            kwargs["areal_block_mask"] = document_block_mask(mb.cu_seqlens, spec.device)
        else:
            kwargs["cu_seqlens"] = mb.cu_seqlens.cpu()
        return kwargs, None
    segments = [
        (s, e, None if m is None else m.to(spec.device)) for (s, e), m in zip(row.bounds, row.masks)
    ]
    kwargs = {
        "input_ids": row.input_ids.to(spec.device)[None],
        "position_ids": row.position_ids.to(spec.device)[None],
        "areal_segments": segments,  # per-group masks: sdpa, whatever spec.attention says
    }
    return kwargs, row.index.to(spec.device)


def packed_logits(model: torch.nn.Module, mb: PackedBatch, spec: ForwardSpec) -> torch.Tensor:
    """fp32 logits ``[T, V]`` of ``mb`` (or values ``[T, 1]`` of a value head), plain layout."""
    kwargs, index = model_inputs(mb, spec)
    with warnings.catch_warnings():
        # FSDP2 warns that the value model's output is a view, on which an in-place op would
        # skip the backward all-gather. Nothing here modifies it in place (indexing, .float()),
        # and its gradients equal the unsharded model's (tests/engine/test_rw.py).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        out = model(**kwargs, use_cache=False)
    logits = out.logits[0].float()
    return logits if index is None else logits[index]


def _hf(model: torch.nn.Module) -> PreTrainedModel:
    hf = lora.base_model(model)
    assert isinstance(hf, PreTrainedModel)  # the engines build transformers models
    return hf


def fused_head_refusal(model: torch.nn.Module) -> str | None:
    """Why the fused path cannot serve ``model`` (None: it can), also logged once."""
    head = _hf(model).get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        return None
    why = f"the output head is {type(head).__name__}, not a Linear (e.g. peft's modules_to_save)"
    logger.info(f"fused_logprobs: {why}; this model computes logits then logprobs")
    return why


def install_fused_head(model: torch.nn.Module) -> None:
    """Give the sharded root ``model`` the forward method :data:`FUSED_METHOD`:
    ``(labels [S], temperature, chunk_size, index, **model kwargs) -> (logp, entropy)`` of the
    row's tokens (gathered by ``index`` [T] when given), row t scoring ``labels[t]``."""
    hf = _hf(model)
    decoder = hf.get_decoder()

    def token_logprobs(labels, temperature, chunk_size, index=None, **kwargs):
        hidden = decoder(**kwargs, use_cache=False).last_hidden_state[0]  # [S, H]
        if index is not None:
            hidden = hidden[index]  # [T, H]; backward sums a shared prompt's gradients
        head = hf.get_output_embeddings()  # read now: FSDP swapped in the unsharded weight
        assert isinstance(head, torch.nn.Linear)  # fused_head_refusal said so
        return fused_logprobs_and_entropy(
            hidden, head.weight, head.bias, labels, temperature, chunk_size
        )

    setattr(model, FUSED_METHOD, token_logprobs)
    register_fsdp_forward_method(model, FUSED_METHOD)


def fused_token_logprobs(
    model: torch.nn.Module, mb: PackedBatch, spec: ForwardSpec
) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``mb`` through :func:`install_fused_head`'s method."""
    kwargs, index = model_inputs(mb, spec)
    input_ids = mb["input_ids"].to(spec.device)
    logp, entropy = getattr(model, FUSED_METHOD)(
        next_token_labels(input_ids), spec.temperature, spec.chunk_size, index, **kwargs
    )
    return to_packed(logp, entropy, input_ids, mb.cu_seqlens.to(spec.device))


def from_logits(logits: torch.Tensor, mb: PackedBatch, spec: ForwardSpec) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``mb`` from its logits ``[T, V]`` (the unfused path)."""
    mb = mb.to(logits.device)
    return packed_token_logprobs(
        logits, mb["input_ids"], mb.cu_seqlens, spec.temperature, spec.chunk_size
    )
