"""Tier 1: KL estimators against hand-worked numbers."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algo.kl import K3_MAX, kl_estimate


def test_estimators_match_hand_worked_values():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    # log_ratio = -1 - (-2) = 1
    assert kl_estimate(logp, ref, "k1").item() == 1.0
    assert kl_estimate(logp, ref, "k2").item() == 0.5  # 1^2 / 2
    # k3 = exp(-1) - 1 + 1 = 0.36788
    assert math.isclose(kl_estimate(logp, ref, "k3").item(), math.exp(-1), rel_tol=1e-6)


def test_k3_is_clamped_for_extreme_log_ratios():
    # log_ratio = -30 -> clamped to -20 -> exp(20) - 21, far above the cap of 10
    out = kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "k3")
    assert out.item() == K3_MAX


def test_unknown_estimator_names_the_choices():
    try:
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    except ValueError as e:
        assert "k1" in str(e) and "k4" in str(e)
    else:
        raise AssertionError("expected ValueError")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=20))
def test_k2_and_k3_are_non_negative_and_zero_at_equal_policies(log_ratios):
    logp = torch.tensor(log_ratios)
    for est in ("k2", "k3"):
        assert (kl_estimate(logp, torch.zeros_like(logp), est) >= -1e-7).all()
        assert kl_estimate(logp, logp, est).abs().max() == 0
