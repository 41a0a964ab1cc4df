"""Rollout correction and the proximal-logprob approximation (docs/algorithms.md).

**Rollout correction**, the one off-policy weighting. The rollout policy pi_behav (the server's
probabilities, possibly of older weights) differs from the trainer's pi_train (the proximal
policy with the decoupled loss, else the current one: the bypass form). The weight
``w = pi_train / pi_behav`` is taken per token, per sequence (the product of its token ratios)
or per sequence as their geometric mean, then

- ``none``: ``w`` as is (decoupled PPO's behaviour weight, Fu et al. 2025);
- ``truncate`` (TIS, Yao et al. 2025): ``min(w, upper)``;
- ``mask`` (AReaL's behaviour cap; MIS; IcePop, Ling Team 2025, with a two-sided band): ``w``
  inside ``[lower, upper]``, 0 outside; with ``mask_sequence`` a token outside the band drops
  its whole sequence (the sequence-masking variant of Liu et al. 2025).

Departure: a masked token still counts in the loss normaliser (the engine fixes normalisers
before the micro-batch loop, and the band is known only in the loss); ``rc_masked_frac`` says
how many.

**Proximal logprobs without a forward pass.** With several minibatches or stale samples the
decoupled loss needs the proximal policy pi_prox (the weights of version v_prox, before this
step's update). Each token was sampled by version v_b <= v_prox, and minibatch k of n runs the
current weights, which are v_prox + k/n on the same scale. ``loglinear`` interpolates in log
space, ``log pi_prox ~ log pi_behav + alpha (log pi_cur - log pi_behav)`` with
``alpha = (v_prox - v_b) / (v_prox + k/n - v_b)``; ``linear`` does the same with
probabilities. Exact where the versions say so: at k = 0 (alpha = 1: the current weights are
the proximal ones) and for on-policy tokens (alpha = 0: v_b = v_prox, the behaviour policy is
the proximal one up to the engines' mismatch).
"""

from __future__ import annotations

import torch

from areal.algo.segments import segment_sum, seq_ids, seq_mean
from areal.api.config.actor import ProxLogp, RolloutCorrectionConfig

STALENESS_BUCKETS = ("0", "1", "2", "3+")


def rollout_weights(
    train_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rc: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached weight [T] and [T] bool ``rejected`` (mask mode: outside the band, weight 0)."""
    log_w = (train_logp - behav_logp).detach().float()  # [T] log pi_train / pi_behav
    if rc.level == "sequence":
        log_w = segment_sum(log_w * mask.float(), cu_seqlens)[seq_ids(cu_seqlens)]
    elif rc.level == "geometric":
        log_w = seq_mean(log_w, mask, cu_seqlens)
    # a long sequence product may overflow to inf: truncation turns it into upper, a mask into 0
    weight = torch.exp(log_w)
    kept = torch.zeros_like(mask, dtype=torch.bool)
    if rc.mode == "none":
        return weight, kept
    if rc.mode == "truncate":
        return weight.clamp(max=rc.upper), kept
    rejected = weight > rc.upper
    if rc.lower is not None:
        rejected |= weight < rc.lower
    if rc.mask_sequence:
        rejected = (segment_sum((rejected & mask.bool()).float(), cu_seqlens) > 0)[
            seq_ids(cu_seqlens)
        ]
    return torch.where(rejected, torch.zeros_like(weight), weight), rejected


def staleness_buckets(versions: torch.Tensor, version: int) -> dict[str, torch.Tensor]:
    """[T] bool per bucket of ``version - versions`` (0, 1, 2, 3 or more)."""
    lag = version - versions
    return {"0": lag == 0, "1": lag == 1, "2": lag == 2, "3+": lag >= 3}


def approx_prox_logp(
    behav_logp: torch.Tensor,
    cur_logp: torch.Tensor,
    versions: torch.Tensor,
    prox_version: int,
    progress: float,
    method: ProxLogp,
) -> torch.Tensor:
    """[T] proximal logprobs estimated from the behaviour logprobs (token versions ``versions``)
    and the current ones (version ``prox_version + progress``, ``progress`` = k/n for
    minibatch k of n); detached. See the module docstring."""
    behav, cur = behav_logp.detach().float(), cur_logp.detach().float()
    if method == "reuse":
        return behav
    v_b = versions.float()
    span = prox_version + progress - v_b  # distance behaviour -> current, in versions
    alpha = torch.where(
        span > 0, (prox_version - v_b) / span.clamp(min=1e-9), torch.ones_like(span)
    )
    alpha = alpha.clamp(0.0, 1.0)
    if method == "loglinear":
        return behav + alpha * (cur - behav)
    if method == "linear":
        p = behav.exp() + alpha * (cur.exp() - behav.exp())
        return p.clamp(min=torch.finfo(p.dtype).tiny).log()
    raise ValueError(f"prox_logp: got {method!r}; approximations are loglinear, linear or reuse")
