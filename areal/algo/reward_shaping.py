"""Per-sequence reward shaping, and the dynamic-sampling test for uninformative groups.

Order applied by :func:`shape_rewards` (each step optional, set by PPOActorConfig):

1. ``(reward + reward_bias) * reward_scaling``, then clip to ``[-reward_clip, reward_clip]``;
2. DAPO soft overlong punishment (Yu et al. 2025, eq. 13) added to it;
3. reward 0 for sequences that ended without EOS (``mask_no_eos_with_zero``); this comes last
   so a truncated sequence carries no signal at all.

Departure from DAPO: the paper's interval ``L_cache`` is ``overlong_tokens`` here and its
penalty is scaled by ``overlong_penalty_factor`` (1.0 reproduces the paper). Lengths beyond
``max_new_tokens`` (which a server should not produce) get the full penalty, as in the paper.
"""

from __future__ import annotations

import torch

from areal.api.config.actor import PPOActorConfig


def scale_rewards(rewards: torch.Tensor, cfg: PPOActorConfig) -> torch.Tensor:
    """[B] ``clip((rewards + bias) * scaling)`` with the config's bias, scaling and clip."""
    out = (rewards + cfg.reward_bias) * cfg.reward_scaling
    if cfg.reward_clip is not None:
        out = out.clamp(-cfg.reward_clip, cfg.reward_clip)
    return out


def overlong_penalty(
    completion_lens: torch.Tensor, max_new_tokens: int, overlong_tokens: int, factor: float
) -> torch.Tensor:
    """[B] DAPO soft overlong penalty, never positive.

    0 up to ``max_new_tokens - overlong_tokens`` generated tokens, then ``-factor`` times the
    fraction of the interval used: ``-factor * min(len - threshold, overlong_tokens) /
    overlong_tokens``.
    """
    if not 0 < overlong_tokens < max_new_tokens:
        raise ValueError(
            f"actor.overlong_tokens={overlong_tokens} must be in (0, max_new_tokens="
            f"{max_new_tokens}); lower overlong_tokens (DAPO used 1/5 of max_new_tokens)"
        )
    threshold = max_new_tokens - overlong_tokens
    excess = (completion_lens.float() - threshold).clamp(0, overlong_tokens)  # [B] tokens
    return -factor * excess / overlong_tokens


def shape_rewards(
    rewards: torch.Tensor,
    cfg: PPOActorConfig,
    *,
    completion_lens: torch.Tensor | None = None,
    no_eos: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """[B] shaped rewards (see the module docstring for the order).

    ``completion_lens`` [B] generated tokens per sequence and ``max_new_tokens`` are needed when
    ``cfg.overlong_reward_penalty``; ``no_eos`` [B] bool (True = stopped by the length limit,
    not EOS) is needed when ``cfg.mask_no_eos_with_zero``.
    """
    out = scale_rewards(rewards.float(), cfg)
    if cfg.overlong_reward_penalty:
        if completion_lens is None or max_new_tokens is None:
            raise ValueError(
                "actor.overlong_reward_penalty=true needs completion_lens and "
                "max_new_tokens; pass them, or set overlong_reward_penalty=false"
            )
        out = out + overlong_penalty(
            completion_lens, max_new_tokens, cfg.overlong_tokens, cfg.overlong_penalty_factor
        )
    if cfg.mask_no_eos_with_zero:
        if no_eos is None:
            raise ValueError(
                "actor.mask_no_eos_with_zero=true needs no_eos [B]; pass it from "
                "the trajectories' stop reason, or set mask_no_eos_with_zero=false"
            )
        out = torch.where(no_eos.bool(), torch.zeros_like(out), out)
    return out


def uniform_reward_groups(
    rewards: torch.Tensor, group_size: int, atol: float = 0.0
) -> torch.Tensor:
    """[B / group_size] True where every reward in the group is equal (within ``atol``).

    Such a group has zero advantage under any group baseline, so DAPO's dynamic sampling
    rejects it and samples more prompts to keep the batch size fixed.
    """
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the {rewards.numel()} rewards; "
            "pass actor.group_size (= n_samples)"
        )
    groups = rewards.reshape(-1, group_size)  # [B/G, G]
    spread = groups.max(dim=1).values - groups.min(dim=1).values
    return spread <= atol
