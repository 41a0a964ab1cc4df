"""Policy losses for packed batches, and the one entry point :func:`policy_loss`.

Per-token objectives (``A`` = advantage, ``r`` = importance ratio pi_theta / pi_old):

- PPO clipped surrogate (Schulman et al. 2017): ``max(-A r, -A clip(r, 1-eps, 1+eps_high))``;
  ``eps_high`` != ``eps`` is DAPO's clip-higher. Dual clip (Ye et al. 2020): for ``A < 0`` the
  loss is further capped at ``-c_clip * A``.
- Decoupled PPO (Fu et al. 2025, AReaL): ``pi_old`` is the proximal policy (the trainer's
  weights before this update) and the loss is multiplied by the detached behaviour weight
  ``w = pi_prox / pi_behav`` (pi_behav: the possibly stale policy that generated the tokens),
  bounded by the rollout correction below (AReaL's behaviour cap is its ``mask`` mode).
- GSPO (Zheng et al. 2025): ``r`` = per-sequence geometric mean of token ratios, used through
  ``sg[s] * pi_t / sg[pi_t]`` (the paper's GSPO-token form: value s, gradient of s).
- CISPO (MiniMax 2025): ``-sg[clip(r, 1-eps, 1+eps_high)] * A * log pi_theta``: the IS weight
  is clipped but every token keeps its gradient.
- Rollout correction (``rollout_correction``, :mod:`areal.algo.correction`), the one off-policy
  weighting: ``w = pi_train / pi_behav`` per token, sequence or geometric mean, as is,
  truncated (TIS) or masked, in the decoupled three-policy form or, without the decoupled loss,
  the bypass form (ratio against pi_behav, ``w = sg(pi_theta) / pi_behav``).

Departure: tokens dropped by a mask still count in the loss normaliser, so the engine can
compute it up front.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.distributed as dist

from areal.algo.correction import rollout_weights
from areal.algo.kl import kl_estimate
from areal.algo.segments import all_reduce_sum, masked_max, masked_mean, segment_sum, seq_mean
from areal.api.config.actor import PPOActorConfig


def importance_ratio(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    level: str,
) -> torch.Tensor:
    """[T] pi_theta / pi_old per token, or GSPO's per-sequence geometric mean (token form)."""
    log_ratio = logp - old_logp.detach()  # [T]
    if level == "token":
        return torch.exp(log_ratio)
    seq_log_ratio = seq_mean(log_ratio, mask, cu_seqlens).detach()  # [T] log s_i
    return torch.exp(seq_log_ratio + logp - logp.detach())  # value s_i, gradient s_i*dlogp


def ppo_clip_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    c_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[T] PPO clipped-surrogate loss (asymmetric, optional dual clip) and [T] bool flags
    ``clip_low``, ``clip_high``, ``dual_clip`` (the branch that set each token's loss)."""
    a = advantages.detach()
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    flags = {
        "clip_low": clip_active & (ratio < 1.0 - eps_low),
        "clip_high": clip_active & (ratio > 1.0 + eps_high),
    }
    if c_clip is not None:
        dual = (a < 0) & (loss > -c_clip * a)
        loss = torch.where(dual, (-c_clip * a).expand_as(loss), loss)
        flags["dual_clip"] = dual
    return loss, flags


def cispo_loss(
    logp: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[T] CISPO loss ``-sg[clip(r)] * A * logp`` and [T] flags ``clip_low``, ``clip_high``."""
    r = ratio.detach()
    weight = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    flags = {"clip_low": r < 1.0 - eps_low, "clip_high": r > 1.0 + eps_high}
    return -weight * advantages.detach() * logp, flags


class Objective(Protocol):
    """A per-token policy objective, what :func:`policy_loss` minimises before the off-policy
    weight, the aggregation and the KL and entropy terms (all the library's):
    ``(cfg, logprobs, ratio, advantages) -> (loss [T], flags)``.

    ``logprobs`` [T] are the current policy's (with grad), ``ratio`` [T] pi_theta / pi_old
    (token or GSPO sequence level, with grad), ``advantages`` [T]; ``flags`` maps names to [T]
    bool tensors, each logged as ``loss/<name>_frac`` (its mean over trained tokens).
    :func:`clipped_objective` (PPO or CISPO, by ``cfg.policy_loss_type``) is the default; pass
    another as ``PPOActor(..., objective=...)``.
    """

    def __call__(
        self,
        cfg: PPOActorConfig,
        logprobs: torch.Tensor,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def loss_normalisers(
    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, dp_group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """(tokens, sequences) with a trained token, summed over ``dp_group``.

    The engine calls this once per minibatch (before the micro-batch loop) and passes the
    results to :func:`policy_loss` as ``global_n_tokens`` / ``global_n_seqs``, so that summing
    micro-batch losses over micro-batches and ranks gives the minibatch's loss.
    """
    m = loss_mask.float()
    counts = torch.stack([m.sum(), (segment_sum(m, cu_seqlens) > 0).float().sum()])
    counts = all_reduce_sum(counts, dp_group)
    return int(counts[0].item()), int(counts[1].item())


def aggregate_loss(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str,
    *,
    global_n_tokens: int | None = None,
    global_n_seqs: int | None = None,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Scalar loss from per-token losses [T] over the loss mask.

    - ``token-mean``: sum / global_n_tokens (every token weighs the same, DAPO);
    - ``seq-mean-token-mean``: each sequence's token mean, summed, / global_n_seqs (GRPO);
    - ``seq-mean-token-sum``: each sequence's token sum, summed, / global_n_seqs;
    - ``seq-mean-token-sum-norm``: token sum / (global_n_seqs * max_new_tokens) (Dr.GRPO's
      constant normaliser).

    ``global_n_*`` default to this micro-batch's own counts (one micro-batch, one rank).
    """
    m = loss_mask.to(per_token.dtype)
    if mode == "token-mean":
        n_tokens = m.sum() if global_n_tokens is None else torch.tensor(float(global_n_tokens))
        return (per_token * m).sum() / n_tokens.clamp(min=1)
    seq_sum = segment_sum(per_token * m, cu_seqlens)  # [B]
    seq_cnt = segment_sum(m, cu_seqlens)  # [B]
    n_seqs = (seq_cnt > 0).sum() if global_n_seqs is None else torch.tensor(global_n_seqs)
    n_seqs = n_seqs.clamp(min=1).to(per_token.dtype)
    if mode == "seq-mean-token-mean":
        return (seq_sum / seq_cnt.clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(
                f"loss_agg_mode=seq-mean-token-sum-norm needs max_new_tokens >= 1, "
                f"got {max_new_tokens}; pass gconfig.max_new_tokens"
            )
        return seq_sum.sum() / (n_seqs * max_new_tokens)
    raise ValueError(
        f"loss_agg_mode: got {mode!r}; use token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum or seq-mean-token-sum-norm"
    )


def _off_policy_weight(cfg: PPOActorConfig, logprobs, prox_logp, behav_logp, mask, cu_seqlens):
    """(old_logp, weight [T] or None, rejected [T]): the ratio's old policy and the rollout
    correction's weight (:func:`~areal.algo.correction.rollout_weights`).

    Decoupled: the ratio is against pi_prox and w = pi_prox / pi_behav, bounded by the correction
    (``mode=none``: as is). Otherwise, with a correction on (the bypass form), the ratio is
    against pi_behav and w = sg(pi_theta) / pi_behav; with none, no weight and the ratio is
    against ``prox_logp`` when given, else pi_behav."""
    rc = cfg.rollout_correction
    if cfg.use_decoupled_loss:
        if prox_logp is None or behav_logp is None:
            raise ValueError(
                "actor.use_decoupled_loss=true needs prox_logp (the trainer's proximal "
                "logprobs) and behav_logp (from the rollout); pass both"
            )
        weight, rejected = rollout_weights(prox_logp, behav_logp, mask, cu_seqlens, rc)
        return prox_logp, weight, rejected
    if rc.mode != "none":
        if behav_logp is None:
            raise ValueError(
                f"actor.rollout_correction.mode={rc.mode} needs behav_logp (the rollout's "
                "logprobs); pass it"
            )
        weight, rejected = rollout_weights(logprobs, behav_logp, mask, cu_seqlens, rc)
        return behav_logp, weight, rejected
    old_logp = prox_logp if prox_logp is not None else behav_logp
    if old_logp is None:
        raise ValueError("policy_loss needs prox_logp or behav_logp as the old policy; got None")
    return old_logp, None, torch.zeros_like(mask, dtype=torch.bool)


def mismatch_kl(train_logp: torch.Tensor, behav_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """[T] per-token estimates of KL(pi_behav || pi_train) on the rollout's own samples: k1
    (log pi_behav - log pi_train) and k3 ((r - 1) - log r, r = pi_train / pi_behav)."""
    train, behav = train_logp.detach().float(), behav_logp.detach().float()
    return {"k1": behav - train, "k3": kl_estimate(behav, train, "k3")}


def _policy_stats(pg_loss, logprobs, old_logp, behav_logp, ratio, flags, weight, rejected, mask):
    """Detached scalar stats of the policy-gradient term (see :func:`policy_loss`)."""
    approx_kl = kl_estimate(old_logp.detach(), logprobs.detach(), "k3")  # KL(old || new)
    stats = {
        "pg_loss": pg_loss.detach(),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "approx_kl": masked_mean(approx_kl, mask),
    }
    stats.update({f"{k}_frac": masked_mean(v, mask) for k, v in flags.items()})
    if behav_logp is not None:  # the trainer's policy (proximal, else current) vs the rollout's
        train = old_logp if old_logp is not behav_logp else logprobs
        stats.update(
            {
                f"mismatch_{k}": masked_mean(v, mask)
                for k, v in mismatch_kl(train, behav_logp).items()
            }
        )
    if weight is not None:
        stats.update(
            rc_weight_mean=masked_mean(weight, mask),
            rc_weight_max=masked_max(weight, mask),
            rc_masked_frac=masked_mean(rejected, mask),
        )
    return stats


def policy_loss(
    logprobs: torch.Tensor,
    prox_logp: torch.Tensor | None,
    behav_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: PPOActorConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    global_n_tokens: int | None = None,
    global_n_seqs: int | None = None,
    max_new_tokens: int | None = None,
    objective: Objective | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar actor loss for one micro-batch and detached scalar stats (the engine's entry point).

    Args:
        logprobs: [T] current policy logprobs (with grad), PackedBatch-aligned.
        prox_logp: [T] proximal policy logprobs (the trainer's, before this update); the old
            policy of the ratio. May be None off the decoupled path (behav_logp is used).
        behav_logp: [T] logprobs from the rollout (behaviour policy), or None.
        advantages: [T] from :func:`areal.algo.advantages.compute_advantages`.
        loss_mask, cu_seqlens: [T], [B+1].
        cfg: dispatches PPO / CISPO, token / sequence ratio (GSPO), the off-policy weight
            (decoupled loss, rollout correction), KL loss term, entropy bonus and aggregation.
        entropy: [T] (with grad) needed when ``cfg.entropy_coeff > 0``; logged when given.
        ref_logp: [T] reference logprobs, needed for the KL loss term (kl_in_reward=false).
        global_n_tokens, global_n_seqs: normalisers from :func:`loss_normalisers`, all-reduced
            over DP ranks and the minibatch's micro-batches by the engine; default = local.
        max_new_tokens: the constant normaliser of ``seq-mean-token-sum-norm``.
        objective: the per-token objective (:class:`Objective`); None: :func:`clipped_objective`.
    Stats: pg_loss, ratio_mean/max, approx_kl, clip_frac_low/high, dual_clip_frac,
    mismatch_k1/k3 (KL(pi_behav || pi_train), when behav_logp is given), rc_weight_mean/max and
    rc_masked_frac (the off-policy weight: decoupled loss or rollout correction), kl_ref,
    entropy. All are means over this micro-batch's loss-mask tokens.
    """
    mask = loss_mask.bool()
    old_logp, weight, rejected = _off_policy_weight(
        cfg, logprobs, prox_logp, behav_logp, mask, cu_seqlens
    )
    ratio = importance_ratio(logprobs, old_logp, mask, cu_seqlens, cfg.importance_sampling_level)
    per_token, flags = (objective or clipped_objective)(cfg, logprobs, ratio, advantages)
    if weight is not None:
        per_token = per_token * weight
    agg = functools.partial(
        aggregate_loss,
        loss_mask=mask,
        cu_seqlens=cu_seqlens,
        mode=cfg.loss_agg_mode,
        global_n_tokens=global_n_tokens,
        global_n_seqs=global_n_seqs,
        max_new_tokens=max_new_tokens,
    )
    loss = agg(per_token)
    stats = _policy_stats(
        loss, logprobs, old_logp, behav_logp, ratio, flags, weight, rejected, mask
    )
    return _add_kl_and_entropy(loss, stats, agg, cfg, logprobs, ref_logp, entropy, mask)


def clipped_objective(
    cfg: PPOActorConfig, logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default :class:`Objective`: the per-token clipped objective [T] of
    ``cfg.policy_loss_type`` (PPO or CISPO) and its clip flags; the upper clip is
    ``eps_clip_higher`` when set (DAPO's clip-higher)."""
    eps_high = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    if cfg.policy_loss_type == "cispo":
        return cispo_loss(logprobs, ratio, advantages, cfg.eps_clip, eps_high)
    return ppo_clip_loss(ratio, advantages, cfg.eps_clip, eps_high, cfg.c_clip)


def _add_kl_and_entropy(loss, stats, agg, cfg: PPOActorConfig, logprobs, ref_logp, entropy, mask):
    """``loss + kl_ctl * KL(ref) - entropy_coeff * entropy`` (each when configured), and stats."""
    if not cfg.kl_in_reward and cfg.kl_ctl > 0:
        if ref_logp is None:
            raise ValueError(
                "actor.kl_in_reward=false with kl_ctl>0 adds a KL loss term and "
                "needs ref_logp; pass it, or set kl_ctl=0"
            )
        kl = kl_estimate(logprobs, ref_logp.detach(), cfg.kl_estimator)  # [T]
        loss = loss + cfg.kl_ctl * agg(kl)
        stats["kl_ref"] = masked_mean(kl, mask)
    if cfg.entropy_coeff > 0:
        if entropy is None:
            raise ValueError(
                "actor.entropy_coeff>0 needs entropy [T] (logprob."
                "packed_token_logprobs returns it); pass it, or set entropy_coeff=0"
            )
        loss = loss - cfg.entropy_coeff * agg(entropy)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy, mask)
    return loss, stats
