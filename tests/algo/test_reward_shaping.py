"""Tier 1: reward shaping and the dynamic-sampling group test."""

import pytest
import torch

from areal.algo.reward_shaping import overlong_penalty, shape_rewards, uniform_reward_groups
from areal.api.config.actor import PPOActorConfig


def test_bias_then_scaling_then_clip():
    cfg = PPOActorConfig(reward_bias=-0.5, reward_scaling=4.0, reward_clip=1.5)
    # (1 - 0.5) * 4 = 2 -> clipped to 1.5; (0 - 0.5) * 4 = -2 -> -1.5; (0.6 - 0.5) * 4 = 0.4
    out = shape_rewards(torch.tensor([1.0, 0.0, 0.6]), cfg)
    assert torch.allclose(out, torch.tensor([1.5, -1.5, 0.4]))


def test_overlong_penalty_is_linear_in_the_interval_and_never_positive():
    # max_new_tokens 100, interval 20 -> threshold 80; factor 0.5
    lens = torch.tensor([50, 80, 85, 100, 120])
    out = overlong_penalty(lens, max_new_tokens=100, overlong_tokens=20, factor=0.5)
    # 50, 80: 0; 85: -0.5 * 5/20 = -0.125; 100: -0.5 * 20/20 = -0.5; 120: capped at -0.5
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -0.125, -0.5, -0.5]))
    assert (out <= 0).all()


def test_overlong_interval_longer_than_max_new_tokens_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="overlong_tokens=64"):
        overlong_penalty(torch.tensor([1]), max_new_tokens=32, overlong_tokens=64, factor=1.0)


def test_no_eos_sequences_get_zero_after_all_other_shaping():
    cfg = PPOActorConfig(
        reward_bias=1.0, mask_no_eos_with_zero=True, overlong_reward_penalty=True, overlong_tokens=2
    )
    rewards, lens = torch.tensor([1.0, 1.0]), torch.tensor([3, 4])
    out = shape_rewards(
        rewards, cfg, completion_lens=lens, no_eos=torch.tensor([False, True]), max_new_tokens=4
    )
    # seq 0: 1 + 1 = 2, len 3 is 1 token past threshold 2 -> 2 - 1/2 = 1.5; seq 1: no EOS -> 0
    assert torch.allclose(out, torch.tensor([1.5, 0.0]))


def test_missing_inputs_name_the_config_field():
    with pytest.raises(ValueError, match="mask_no_eos_with_zero"):
        shape_rewards(torch.ones(2), PPOActorConfig(mask_no_eos_with_zero=True))
    with pytest.raises(ValueError, match="overlong_reward_penalty"):
        shape_rewards(torch.ones(2), PPOActorConfig(overlong_reward_penalty=True))


def test_uniform_reward_groups_flags_groups_with_all_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups of 2: equal, mixed, equal
    assert uniform_reward_groups(rewards, 2).tolist() == [True, False, True]
    assert uniform_reward_groups(torch.tensor([0.5, 0.5001]), 2, atol=1e-3).tolist() == [True]
    with pytest.raises(ValueError, match="group_size=4"):
        uniform_reward_groups(rewards, 4)
