"""Critic loss and value normalisation.

The clipped value loss follows the PPO implementation details (Huang et al. 2022):
``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``. Value normalisation keeps
running moments of the returns; the critic learns normalised targets and its outputs are
de-normalised before GAE (a PopArt-style scheme without rescaling the output layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal.algo.losses import aggregate_loss
from areal.algo.segments import all_reduce_sum, masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    value_eps_clip: float | None,
    loss_agg_mode: str = "token-mean",
    *,
    global_n_tokens: int | None = None,
    global_n_seqs: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar (clipped) value loss and stats ``value_clip_frac``, ``value_error``.

    ``values`` [T] with grad, ``old_values`` [T] from before the update, ``returns`` [T] the
    targets (normalised if value normalisation is on). ``value_eps_clip=None`` = unclipped.
    """
    returns = returns.detach()
    err = (values - returns).square()  # [T]
    per_token = 0.5 * err
    clip_frac = torch.zeros(())
    if value_eps_clip is not None:
        old = old_values.detach()
        v_clip = old + (values - old).clamp(-value_eps_clip, value_eps_clip)
        err_clip = (v_clip - returns).square()
        per_token = 0.5 * torch.maximum(err, err_clip)
        clip_frac = masked_mean(err_clip > err, loss_mask)
    loss = aggregate_loss(
        per_token,
        loss_mask,
        cu_seqlens,
        loss_agg_mode,
        global_n_tokens=global_n_tokens,
        global_n_seqs=global_n_seqs,
    )
    return loss, {"value_clip_frac": clip_frac, "value_error": masked_mean(err, loss_mask)}


class ValueNormalizer:
    """Running mean/variance of value targets, merged exactly over batches (Chan et al.).

    State is three numbers; ``update`` all-reduces batch moments over ``dp_group`` so every
    rank holds the same state.
    """

    def __init__(self, eps: float = 1e-5):
        self.mean, self.var, self.count, self.eps = 0.0, 1.0, 0.0, eps

    def update(
        self, x: torch.Tensor, mask: torch.Tensor, dp_group: dist.ProcessGroup | None = None
    ) -> None:
        """Merge the masked values of ``x`` [T] into the running moments."""
        m = mask.double()
        xd = x.detach().double()
        sums = all_reduce_sum(torch.stack([m.sum(), (xd * m).sum()]), dp_group)
        n = float(sums[0])
        if n == 0:
            return
        mean = float(sums[1]) / n
        sq = all_reduce_sum(((xd - mean).square() * m).sum(), dp_group)
        var = float(sq) / n
        total = self.count + n
        delta = mean - self.mean
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / (std + eps)``."""
        return (x - self.mean) / (self.var**0.5 + self.eps)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`normalize`."""
        return x * (self.var**0.5 + self.eps) + self.mean

    def state_dict(self) -> dict[str, float]:
        """Moments for checkpointing."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore moments saved by :meth:`state_dict`."""
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
