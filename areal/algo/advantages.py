"""Advantages: normalisation (batch / group / leave-one-out), GAE, and the one entry point
:func:`compute_advantages` that the training engine calls.

Every estimator in the presets is one pipeline with different knobs (docs/algorithms.md):

    seq reward [B] -> shape (bias/scale/clip, overlong, no-EOS) -> minus greedy baseline (ReMax)
      -> reward normalisation (GRPO: group mean/std; Dr.GRPO: group mean; RLOO: leave-one-out)
      -> token rewards [T]: -kl_ctl * KL per token (when kl_in_reward) + seq reward on the last
         loss-mask token
      -> GAE(gamma, lam) over loss-mask tokens, values from the critic or 0
      -> advantage normalisation (PPO, REINFORCE++: batch mean/std)

With no critic and gamma = lam = 1, GAE is the return-to-go, i.e. the outcome reward broadcast
to every token plus the KL penalties still ahead of it.

Departures from the papers: GAE runs over the loss-mask tokens of a sequence only (masked-out
tokens, e.g. tool output in multi-turn episodes, are not actions and are skipped, not treated as
zero-reward steps); the leave-one-out option removes a sample from the mean only, the std still
includes it; with ``std_level`` different from ``mean_level`` the std is taken about the mean of
its own level.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal.algo.kl import kl_estimate
from areal.algo.reward_shaping import scale_rewards, shape_rewards
from areal.algo.segments import all_reduce_sum, last_true_index, segment_sum, seq_ids
from areal.api.config.actor import NormSpec, PPOActorConfig


def _level_sums(
    per_seq: torch.Tensor, level: str, group_size: int, dp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """[B] the sum of ``per_seq`` [B] over the group or batch each sequence belongs to."""
    if level == "group":
        groups = per_seq.reshape(-1, group_size)  # [B/G, G]
        return groups.sum(1, keepdim=True).expand_as(groups).reshape(-1)
    total = all_reduce_sum(per_seq.sum(), dp_group)  # batch level: every DP rank
    return total.expand_as(per_seq)


def normalize(
    x: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    norm: NormSpec,
    group_size: int = 1,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[T] ``(x - mean) / (std + eps)`` with statistics over masked tokens; 0 where masked.

    Levels (``norm.mean_level`` / ``norm.std_level``): ``group`` = the ``group_size``
    consecutive sequences of one prompt (groups never straddle DP ranks); ``batch`` = every
    masked token on every rank of ``dp_group`` (``None`` = this process only); ``none`` = skip.
    For per-sequence values pass ``x`` [B] with ``cu_seqlens = arange(B + 1)``.
    """
    if not norm.enabled:
        return x
    n_seqs = len(cu_seqlens) - 1
    if "group" in (norm.mean_level, norm.std_level) and n_seqs % group_size != 0:
        raise ValueError(
            f"group-level normalisation: {n_seqs} sequences is not a multiple of "
            f"group_size={group_size}; keep whole groups in each batch"
        )
    m = mask.to(x.dtype)
    tok_to_seq = seq_ids(cu_seqlens)  # [T]
    xd = x.detach()
    seq_sum, seq_cnt = segment_sum(xd * m, cu_seqlens), segment_sum(m, cu_seqlens)  # [B], [B]

    def level_mean(level: str, leave_one_out: bool) -> torch.Tensor:  # [B]
        s = _level_sums(seq_sum, level, group_size, dp_group)
        n = _level_sums(seq_cnt, level, group_size, dp_group)
        if leave_one_out:
            s, n = s - seq_sum, n - seq_cnt
        return s / n.clamp(min=1)

    out = x
    if norm.mean_level != "none":
        out = out - level_mean(norm.mean_level, norm.leave_one_out)[tok_to_seq]
    if norm.std_level != "none":
        centre = level_mean(norm.std_level, leave_one_out=False)[tok_to_seq]  # [T]
        sq = segment_sum((xd - centre).square() * m, cu_seqlens)  # [B]
        n = _level_sums(seq_cnt, norm.std_level, group_size, dp_group)
        n = (n - 1 if norm.std_unbiased else n).clamp(min=1)
        std = (_level_sums(sq, norm.std_level, group_size, dp_group) / n).sqrt()  # [B]
        out = out / (std[tok_to_seq] + norm.eps)
    return out * m


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each sequence's loss-mask tokens.

    ``token_rewards``, ``values``, ``loss_mask`` are [T]; ``values[t]`` = V(input_ids[:t]), the
    value before action t. The steps of a sequence are its loss-mask tokens in order; the value
    after the last one is 0 (terminal). Returns ``(advantages, returns)`` [T], 0 off the mask,
    with ``returns = advantages + values``.
    """
    m = loss_mask.bool()
    tok_to_seq = seq_ids(cu_seqlens)  # [T]
    n_seqs = len(cu_seqlens) - 1
    steps = segment_sum(m.long(), cu_seqlens)  # [B] actions per sequence
    # Rank of each action token among its sequence's actions: gather actions into [B, L].
    start_count = torch.cumsum(steps, 0) - steps  # [B] actions before each sequence
    rank = torch.cumsum(m.long(), 0) - 1 - start_count[tok_to_seq]  # [T]
    row, col = tok_to_seq[m], rank[m]
    width = int(steps.max()) if n_seqs else 0
    r_pad = token_rewards.new_zeros(n_seqs, width)  # [B, L]
    v_pad = token_rewards.new_zeros(n_seqs, width)  # [B, L]
    r_pad[row, col] = token_rewards[m].detach()
    v_pad[row, col] = values[m].detach().to(r_pad.dtype)
    adv_pad = torch.zeros_like(r_pad)
    running = r_pad.new_zeros(n_seqs)  # [B]
    next_value = r_pad.new_zeros(n_seqs)  # [B]; 0 after the last action and in the padding
    for j in reversed(range(width)):
        delta = r_pad[:, j] + gamma * next_value - v_pad[:, j]
        running = delta + gamma * lam * running
        adv_pad[:, j] = running
        next_value = v_pad[:, j]
    advantages = torch.zeros_like(token_rewards, dtype=r_pad.dtype)
    advantages[m] = adv_pad[row, col]
    returns = (advantages + values.detach().to(r_pad.dtype)) * m
    return advantages, returns


@dataclass(frozen=True)
class Advantages:
    """What :func:`compute_advantages` returns; all tensors detached."""

    advantages: torch.Tensor  # [T] per-token advantage, 0 off the loss mask
    returns: torch.Tensor  # [T] value targets for the critic (advantage + value before norm)
    token_rewards: torch.Tensor  # [T] per-token rewards fed to GAE (KL penalty + final reward)
    seq_rewards: torch.Tensor  # [B] rewards after shaping, baseline and normalisation


def _token_rewards(seq_rewards, loss_mask, cu_seqlens, cfg: PPOActorConfig, logprobs, ref_logp):
    """[T] -kl_ctl * KL per trained token (when kl_in_reward) + each sequence's reward on its
    last trained token (a sequence with none has nothing to train and its reward is dropped)."""
    m = loss_mask.float()
    token_rewards = torch.zeros_like(m)  # [T]
    if cfg.kl_in_reward and cfg.kl_ctl > 0:
        if logprobs is None or ref_logp is None:
            raise ValueError(
                "actor.kl_in_reward=true with kl_ctl>0 needs logprobs and ref_logp;"
                " pass them, or set kl_ctl=0"
            )
        kl = kl_estimate(logprobs.detach().float(), ref_logp.detach().float(), cfg.kl_estimator)
        token_rewards = -cfg.kl_ctl * kl * m
    last = last_true_index(loss_mask, cu_seqlens)  # [B], -1 = no trained token
    has = last >= 0
    return token_rewards.index_add(0, last[has], seq_rewards[has].to(m.dtype))


def _sequence_rewards(
    rewards: torch.Tensor,
    lens: torch.Tensor,
    cfg: PPOActorConfig,
    baseline_rewards: torch.Tensor | None,
    no_eos: torch.Tensor | None,
    max_new_tokens: int | None,
    group_size: int,
    dp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """[B] rewards shaped (scale, length and no-EOS penalties), less the ReMax baseline when
    ``cfg.remax_baseline``, then normalised by ``cfg.reward_norm`` over sequences with a trained
    token (``lens`` [B] > 0)."""
    seq_rewards = shape_rewards(
        rewards, cfg, completion_lens=lens, no_eos=no_eos, max_new_tokens=max_new_tokens
    )
    if cfg.remax_baseline:
        if baseline_rewards is None:
            raise ValueError(
                "actor.remax_baseline=true needs baseline_rewards [B] (greedy "
                "rollout rewards from the workflow); pass them or use another preset"
            )
        seq_rewards = seq_rewards - scale_rewards(baseline_rewards.float(), cfg)
    seq_cu = torch.arange(len(rewards) + 1, device=rewards.device)  # one "token" per sequence
    return normalize(seq_rewards, (lens > 0).float(), seq_cu, cfg.reward_norm, group_size, dp_group)


def compute_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: PPOActorConfig,
    *,
    values: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    no_eos: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    group_size: int = 1,
    dp_group: dist.ProcessGroup | None = None,
) -> Advantages:
    """Advantages for a packed batch, as configured by ``cfg`` (the engine's entry point).

    Args:
        rewards: [B] one scalar reward per sequence (from the reward function).
        loss_mask: [T] 1 on generated tokens that are trained on.
        cu_seqlens: [B+1] sequence boundaries; consecutive runs of ``group_size`` sequences
            share a prompt (the rollout's ``n_samples``).
        values: [T] critic values, ``values[t]`` = V(input_ids[:t]); required iff
            ``cfg.use_critic``.
        logprobs, ref_logp: [T] policy (behaviour or proximal) and reference logprobs; needed
            for the KL penalty when ``cfg.kl_in_reward`` and ``cfg.kl_ctl > 0``.
        baseline_rewards: [B] reward of a greedy rollout of each sequence's prompt (ReMax).
        no_eos, max_new_tokens: see :func:`areal.algo.reward_shaping.shape_rewards`; generated
            lengths are the per-sequence loss-mask counts.
        dp_group: data-parallel group for batch-level statistics; None = this process only.
    """
    m = loss_mask.float()  # [T]
    lens = segment_sum(m, cu_seqlens)  # [B] generated (trained) tokens
    seq_rewards = _sequence_rewards(
        rewards, lens, cfg, baseline_rewards, no_eos, max_new_tokens, group_size, dp_group
    )
    token_rewards = _token_rewards(seq_rewards, loss_mask, cu_seqlens, cfg, logprobs, ref_logp)
    if cfg.use_critic and values is None:
        raise ValueError(
            f"actor.use_critic=true (algorithm={cfg.algorithm}) needs critic values;"
            " pass values, or set use_critic=false"
        )
    if not cfg.use_critic and values is not None:
        raise ValueError(
            "values were passed but actor.use_critic=false; set use_critic=true to "
            "use the critic in GAE"
        )
    values = torch.zeros_like(m) if values is None else values.detach().float()
    advantages, returns = gae(token_rewards, values, loss_mask, cu_seqlens, cfg.gamma, cfg.lam)
    advantages = normalize(advantages, m, cu_seqlens, cfg.adv_norm, group_size, dp_group)
    return Advantages(advantages, returns, token_rewards, seq_rewards.detach())
