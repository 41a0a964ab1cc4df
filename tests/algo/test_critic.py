"""Tier 1: clipped value loss and running value normalisation."""

import torch

from areal.algo.critic import ValueNormalizer, value_loss


def test_clipped_value_loss_hand_worked():
    values = torch.tensor([1.5, 1.9], requires_grad=True)
    old, returns = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0])
    loss, stats = value_loss(values, old, returns, torch.ones(2), torch.tensor([0, 2]), 0.2)
    # t0: (1.5-2)^2 = 0.25; clipped 1.0 + 0.2 = 1.2 -> (1.2-2)^2 = 0.64 -> 0.5 * 0.64 = 0.32
    # t1: (1.9-2)^2 = 0.01; clipped 1.9 (within 0.2 of 2.0) -> 0.01 -> 0.005
    assert torch.allclose(loss, torch.tensor((0.32 + 0.005) / 2))
    assert stats["value_clip_frac"] == 0.5
    (grad,) = torch.autograd.grad(loss, values)
    assert grad[0] == 0  # the clipped branch is flat in V
    unclipped, _ = value_loss(values, old, returns, torch.ones(2), torch.tensor([0, 2]), None)
    assert torch.allclose(unclipped, torch.tensor((0.125 + 0.005) / 2))


def test_value_normalizer_merges_batches_exactly_and_round_trips():
    torch.manual_seed(0)
    a, b = torch.randn(7) * 3 + 1, torch.randn(5) * 2 - 4
    norm = ValueNormalizer()
    norm.update(a, torch.ones(7))
    norm.update(torch.cat([b, torch.tensor([1e6])]), torch.tensor([1.0] * 5 + [0.0]))  # masked
    both = torch.cat([a, b]).double()
    assert abs(norm.mean - both.mean().item()) < 1e-9
    assert abs(norm.var - both.var(unbiased=False).item()) < 1e-9
    x = torch.tensor([0.3, -2.0], dtype=torch.float64)
    assert torch.allclose(norm.denormalize(norm.normalize(x)), x)
    restored = ValueNormalizer()
    restored.load_state_dict(norm.state_dict())
    assert restored.state_dict() == norm.state_dict()
