"""Per-sequence reductions on packed token tensors, and the one collective the algorithms use.

A packed tensor ``x`` is ``[T]`` with sequences laid end to end; ``cu_seqlens`` ``[B+1]`` marks
where each starts (see :mod:`areal.utils.batch`). Per-sequence values are ``[B]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal.utils.comm import all_reduce


def seq_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sequence each token belongs to."""
    lens = cu_seqlens.diff()  # [B]
    return torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens.device), lens)


def segment_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] sum of ``x`` [T] over each sequence (differentiable)."""
    n_seqs = len(cu_seqlens) - 1
    out = torch.zeros(n_seqs, dtype=x.dtype, device=x.device)
    return out.index_add(0, seq_ids(cu_seqlens), x)


def seq_mean(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] each token gets the masked mean of ``x`` [T] over its own sequence (differentiable)."""
    m = mask.to(x.dtype)
    means = segment_sum(x * m, cu_seqlens) / segment_sum(m, cu_seqlens).clamp(min=1)  # [B]
    return means[seq_ids(cu_seqlens)]


def last_true_index(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] token index of each sequence's last True in ``mask`` [T], or -1 where it has none."""
    positions = torch.arange(len(mask), device=mask.device)
    candidates = torch.where(mask.bool(), positions, torch.full_like(positions, -1))  # [T]
    out = torch.full((len(cu_seqlens) - 1,), -1, dtype=torch.long, device=mask.device)
    return out.scatter_reduce(0, seq_ids(cu_seqlens), candidates, reduce="amax")


def all_reduce_sum(x: torch.Tensor, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``dp_group``; ``None`` = single process, returned unchanged.

    Not differentiable: callers reduce statistics (counts, sums of detached values) only.
    """
    if dp_group is None:
        return x
    x = x.detach().clone()
    return all_reduce(x, dist.ReduceOp.SUM, dp_group)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached scalar mean of ``x`` over ``mask`` (0 when the mask is empty); for stats."""
    m = mask.to(torch.float32)
    return (x.detach().float() * m).sum() / m.sum().clamp(min=1)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached scalar max of ``x`` over ``mask`` (0 when the mask is empty); for stats."""
    if not mask.any():
        return x.new_zeros((), dtype=torch.float32)
    return x.detach().float()[mask.bool()].max()
