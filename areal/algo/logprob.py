"""Log-probabilities of labels and entropies, in chunks of tokens: from logits, or fused with the
LM head from the hidden states so the logits never exist.

A float32 ``[T, vocab]`` tensor for a long packed batch is the largest thing in an RL step (16k
tokens x 152k vocabulary: 10 GB). The plain ``log_softmax(logits / temperature).gather(...)``
holds it twice (the scaled copy and the log-softmax, both kept for backward).

- :func:`logprobs_and_entropy` takes logits ``[T, V]``: forward keeps only ``[T]`` results
  (logsumexp, label logit, entropy); backward recomputes each chunk's softmax and writes the
  gradient into one ``[T, V]`` buffer. Peak extra memory: one ``[chunk, V]`` chunk.
- :func:`fused_logprobs_and_entropy` takes the hidden states ``[T, H]`` and the head's weight
  ``[V, H]`` (and bias): each chunk's logits ``h @ W^T + b`` are made, reduced to ``[chunk]``
  results and dropped; backward recomputes them and returns the gradients for the hidden states
  and the weight (accumulated over chunks in float32). No ``[T, V]`` tensor exists, in forward or
  backward; peak extra memory is a few ``[chunk, V]`` float32 buffers plus the weight's gradient.

The two agree to float rounding (the same matmul per row, the same float32 softmax maths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from areal.utils.batch import PackedBatch


class TokenLogprobs(NamedTuple):
    """What a loss of token logprobs reads, in the packed convention: ``logp[t] = log p(token t
    | tokens before it)`` and the ``entropy`` of that distribution, both ``[T]``, 0 at each
    sequence's first token."""

    logp: torch.Tensor  # [T]
    entropy: torch.Tensor  # [T]


# A loss over token logprobs: (TokenLogprobs of one micro-batch, the micro-batch) -> (loss, stats)
TokenLossFn = Callable[[TokenLogprobs, PackedBatch], tuple[torch.Tensor, dict[str, float]]]


def _chunk_stats(z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For scaled logits ``z`` [C, V] (fp32): logsumexp [C], label logprob [C], entropy [C]."""
    lse = torch.logsumexp(z, dim=-1)  # [C]
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse  # [C]
    p = torch.exp(z - lse[:, None])  # [C, V]
    entropy = lse - (p * z).sum(-1)  # H = lse - E_p[z]
    return lse, logp, entropy


def _chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    tau: float,
) -> torch.Tensor:
    """d loss / d raw logits [C, V] of one chunk, from scaled logits ``z`` [C, V] (fp32)."""
    p = torch.exp(z - lse[:, None])  # [C, V]
    g = torch.zeros_like(z)
    if grad_logp is not None:  # d logp_y / dz = onehot(y) - p
        g -= p * grad_logp[:, None]
        g.scatter_add_(-1, labels[:, None], grad_logp[:, None])
    if grad_entropy is not None:  # dH/dz = -p * (z - E_p[z])
        mean_z = (p * z).sum(-1, keepdim=True)
        g -= p * (z - mean_z) * grad_entropy[:, None]
    return g / tau


def _grad_slice(grad: torch.Tensor | None, s: int, c: int) -> torch.Tensor | None:
    return None if grad is None else grad[s : s + c]


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """(logits [T, V], labels [T]) -> (logp [T], entropy [T]); see the module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, chunk_size: int):
        n = logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32; fp64 stays
        lse = logits.new_empty(n, dtype=dtype)
        logp, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for s in range(0, n, chunk_size):
            z = logits[s : s + chunk_size].to(dtype) / temperature
            lse[s : s + chunk_size], logp[s : s + chunk_size], entropy[s : s + chunk_size] = (
                _chunk_stats(z, labels[s : s + chunk_size])
            )
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse = ctx.saved_tensors
        tau, c = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], c):
            z = logits[s : s + c].to(lse.dtype) / tau  # [C, V]
            g = _chunk_grad(
                z,
                lse[s : s + c],
                labels[s : s + c],
                _grad_slice(grad_logp, s, c),
                _grad_slice(grad_entropy, s, c),
                tau,
            )
            grad[s : s + c] = g.to(grad.dtype)
        return grad, None, None, None


def _head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """One chunk's logits [C, V] as the LM head makes them (its dtype), then in ``dtype``."""
    return F.linear(hidden, weight, bias).to(dtype)


class _FusedHeadLogprobEntropy(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], bias [V] or None, labels [T]) -> (logp [T], entropy [T])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature: float, chunk_size: int):
        n = hidden.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        lse = hidden.new_empty(n, dtype=dtype)
        logp, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for s in range(0, n, chunk_size):
            z = _head_logits(hidden[s : s + chunk_size], weight, bias, dtype) / temperature
            lse[s : s + chunk_size], logp[s : s + chunk_size], entropy[s : s + chunk_size] = (
                _chunk_stats(z, labels[s : s + chunk_size])
            )
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        tau, c = ctx.temperature, ctx.chunk_size
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype)  # float32 accumulator [V, H]
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=lse.dtype)
        for s in range(0, hidden.shape[0], c):
            h = hidden[s : s + c]  # [C, H]
            z = _head_logits(h, weight, bias, lse.dtype) / tau  # [C, V]
            g = _chunk_grad(
                z,
                lse[s : s + c],
                labels[s : s + c],
                _grad_slice(grad_logp, s, c),
                _grad_slice(grad_entropy, s, c),
                tau,
            ).to(weight.dtype)  # d loss / d logits, in the head's dtype as its backward would be
            grad_hidden[s : s + c] = (g @ weight).to(hidden.dtype)
            grad_weight += g.t() @ h.to(weight.dtype)
            if grad_bias is not None:
                grad_bias += g.sum(0)
        if bias is not None and grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None


def _check(temperature: float, chunk_size: int, rows: int, labels: torch.Tensor, what: str):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use 1.0 for raw logits")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if (rows,) != tuple(labels.shape):
        raise ValueError(
            f"{what} has {rows} rows and labels {tuple(labels.shape)}; "
            "they must have the same number of rows"
        )


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels[t]) and the entropy of row t of ``softmax(logits / temperature)``.

    ``logits`` [T, V] (any float dtype; maths in float32 or wider), ``labels`` [T] int64.
    Returns two ``[T]`` tensors in that dtype, both differentiable w.r.t. ``logits``.
    """
    _check(temperature, chunk_size, logits.shape[0], labels, f"logits {tuple(logits.shape)}")
    return _ChunkedLogprobEntropy.apply(logits, labels.long(), float(temperature), chunk_size)


def fused_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_and_entropy` of the logits ``hidden @ weight^T + bias``, never built whole.

    ``hidden`` [T, H], ``weight`` [V, H], ``bias`` [V] or None (an LM head), ``labels`` [T].
    Returns ``[T]`` float32 (or wider) logp and entropy, differentiable w.r.t. ``hidden``,
    ``weight`` and ``bias`` (a tied embedding gets its head gradient through ``weight``).
    """
    _check(temperature, chunk_size, hidden.shape[0], labels, f"hidden {tuple(hidden.shape)}")
    return _FusedHeadLogprobEntropy.apply(
        hidden, weight, bias, labels.long(), float(temperature), chunk_size
    )


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Row t of a packed forward scores token t+1: ``input_ids`` rolled left by one [T]."""
    return torch.roll(input_ids, shifts=-1)


def to_packed(
    logp_next: torch.Tensor, ent_next: torch.Tensor, input_ids: torch.Tensor, cu_seqlens
) -> TokenLogprobs:
    """Row-t-predicts-t+1 results [T] -> the packed convention of :class:`TokenLogprobs`."""
    not_first = torch.ones_like(input_ids, dtype=torch.bool)
    not_first[cu_seqlens[:-1][cu_seqlens.diff() > 0]] = False  # no prediction for first tokens
    zero = logp_next.new_zeros(1)
    logp = torch.cat([zero, logp_next[:-1]]) * not_first  # [T]
    entropy = torch.cat([zero, ent_next[:-1]]) * not_first  # [T]
    return TokenLogprobs(logp, entropy)


def packed_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> TokenLogprobs:
    """Logprobs and entropies aligned with the PackedBatch convention.

    ``logits`` [T, V] from a packed forward (row t predicts token t+1 of the same sequence).
    Returns ``logp`` [T] with ``logp[t] = log p(input_ids[t] | input_ids[:t])`` and ``entropy``
    [T] of the distribution token t was drawn from; both are 0 at each sequence's first token.
    """
    labels = next_token_labels(input_ids)
    logp_next, ent_next = logprobs_and_entropy(logits, labels, temperature, chunk_size)
    return to_packed(logp_next, ent_next, input_ids, cu_seqlens)
