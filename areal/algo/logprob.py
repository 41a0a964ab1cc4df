"""Log-probabilities of labels and entropies from logits, in chunks of tokens.

A float32 ``[T, vocab]`` tensor for a long packed batch is the largest thing in an RL step. The
plain ``log_softmax(logits / temperature).gather(...)`` holds it twice (the scaled copy and the
log-softmax, both kept for backward). Here a custom autograd function walks the tokens in chunks:
forward keeps only ``[T]`` results (logsumexp, label logit, entropy), backward recomputes each
chunk's softmax and writes the gradient straight into one ``[T, vocab]`` buffer. Peak extra
memory is one chunk, ``[chunk_size, vocab]`` in float32.
"""

from __future__ import annotations

import torch


def _chunk_stats(z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For scaled logits ``z`` [C, V] (fp32): logsumexp [C], label logprob [C], entropy [C]."""
    lse = torch.logsumexp(z, dim=-1)  # [C]
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse  # [C]
    p = torch.exp(z - lse[:, None])  # [C, V]
    entropy = lse - (p * z).sum(-1)  # H = lse - E_p[z]
    return lse, logp, entropy


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
            p = torch.exp(z - lse[s : s + c, None])  # [C, V]
            g = torch.zeros_like(z)
            if grad_logp is not None:  # d logp_y / dz = onehot(y) - p
                g_lp = grad_logp[s : s + c, None]
                g -= p * g_lp
                g.scatter_add_(-1, labels[s : s + c, None], g_lp)
            if grad_entropy is not None:  # dH/dz = -p * (z - E_p[z])
                mean_z = (p * z).sum(-1, keepdim=True)
                g -= p * (z - mean_z) * grad_entropy[s : s + c, None]
            grad[s : s + c] = (g / tau).to(grad.dtype)
        return grad, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels[t]) and the entropy of row t of ``softmax(logits / temperature)``.

    ``logits`` [T, V] (any float dtype; maths in float32 or wider), ``labels`` [T] int64.
    Returns two ``[T]`` tensors in that dtype, both differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use 1.0 for raw logits")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
            "must have the same number of rows"
        )
    return _ChunkedLogprobEntropy.apply(logits, labels.long(), float(temperature), chunk_size)


def packed_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropies aligned with the PackedBatch convention.

    ``logits`` [T, V] from a packed forward (row t predicts token t+1 of the same sequence).
    Returns ``logp`` [T] with ``logp[t] = log p(input_ids[t] | input_ids[:t])`` and ``entropy``
    [T] of the distribution token t was drawn from; both are 0 at each sequence's first token.
    """
    labels = torch.roll(input_ids, shifts=-1)  # row t scores token t+1
    logp_next, ent_next = logprobs_and_entropy(logits, labels, temperature, chunk_size)
    not_first = torch.ones_like(input_ids, dtype=torch.bool)
    not_first[cu_seqlens[:-1][cu_seqlens.diff() > 0]] = False  # no prediction for first tokens
    zero = logp_next.new_zeros(1)
    logp = torch.cat([zero, logp_next[:-1]]) * not_first  # [T]
    entropy = torch.cat([zero, ent_next[:-1]]) * not_first  # [T]
    return logp, entropy
