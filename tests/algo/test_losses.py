"""Tier 1: policy losses and aggregation against hand-worked numbers, and their invariants
(ratio 1 = unclipped, decoupled = PPO when behaviour = proximal, GSPO = PPO on length 1)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algo.losses import (
    aggregate_loss,
    cispo_loss,
    importance_ratio,
    loss_normalisers,
    policy_loss,
    ppo_clip_loss,
)
from areal.api.config.actor import PPOActorConfig, RolloutCorrectionConfig


def test_ppo_clip_hand_worked_asymmetric():
    ratio = torch.tensor([0.5, 1.5, 1.1, 0.7])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, flags = ppo_clip_loss(ratio, adv, eps_low=0.2, eps_high=0.28, c_clip=None)
    # t0: max(-0.5, -0.8) = -0.5 (unclipped);   t1: max(-1.5, -1.28) = -1.28 (clip high)
    # t2: max(1.1, 1.1) = 1.1;                   t3: max(0.7, 0.8) = 0.8 (clip low)
    assert torch.allclose(loss, torch.tensor([-0.5, -1.28, 1.1, 0.8]))
    assert flags["clip_high"].tolist() == [False, True, False, False]
    assert flags["clip_low"].tolist() == [False, False, False, True]


def test_dual_clip_caps_the_loss_for_negative_advantages():
    ratio, adv = torch.tensor([5.0, 5.0]), torch.tensor([-1.0, 1.0])
    loss, flags = ppo_clip_loss(ratio, adv, 0.2, 0.2, c_clip=3.0)
    # t0: max(5, 1.2) = 5 -> capped at 3 * |A| = 3;  t1: A > 0: max(-5, -1.2) = -1.2
    assert torch.allclose(loss, torch.tensor([3.0, -1.2]))
    assert flags["dual_clip"].tolist() == [True, False]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=1, max_size=10), st.floats(0.01, 0.5), st.floats(0.01, 0.5)
)
def test_clipped_loss_equals_unclipped_at_ratio_one(advs, eps_low, eps_high):
    adv = torch.tensor(advs)
    logp = torch.zeros(len(advs), requires_grad=True)
    ratio = torch.exp(logp - logp.detach())  # value 1, gradient d ratio / d logp = 1
    loss, _ = ppo_clip_loss(ratio, adv, eps_low, eps_high, c_clip=3.0)
    assert torch.allclose(loss, -adv)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(grad, -adv)  # the policy gradient, untouched by the clip


def test_cispo_keeps_gradient_of_clipped_tokens():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ratio = torch.tensor([3.0, 0.5])
    loss, flags = cispo_loss(logp, ratio, torch.tensor([1.0, 2.0]), eps_low=1.0, eps_high=1.0)
    # weights clip(3, 0, 2) = 2, clip(0.5, 0, 2) = 0.5 -> loss = [-2*1*-1, -0.5*2*-2] = [2, 2]
    assert torch.allclose(loss, torch.tensor([2.0, 2.0]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(grad, torch.tensor([-2.0, -1.0]))  # -w * A, nonzero though clipped
    assert flags["clip_high"].tolist() == [True, False]


def test_gspo_ratio_is_the_sequence_geometric_mean():
    logp = torch.tensor([0.1, 0.3, 0.5], requires_grad=True)
    old = torch.zeros(3)
    ratio = importance_ratio(logp, old, torch.ones(3), torch.tensor([0, 2, 3]), "sequence")
    # seq 0: exp((0.1 + 0.3) / 2) = exp(0.2); seq 1: exp(0.5)
    expected = torch.tensor([math.exp(0.2), math.exp(0.2), math.exp(0.5)])
    assert torch.allclose(ratio, expected)
    (grad,) = torch.autograd.grad(ratio.sum(), logp)
    assert torch.allclose(grad, expected)  # d(sg[s] * pi/sg[pi]) / d logp = s


def test_aggregation_modes_hand_worked():
    per_token, mask = torch.tensor([1.0, 2, 3, 4, 5, 99]), torch.tensor([1.0, 1, 1, 1, 1, 0])
    cu = torch.tensor([0, 3, 6])  # seq 0: [1, 2, 3]; seq 1: [4, 5] (+ a masked 99)
    agg = lambda mode, **kw: aggregate_loss(per_token, mask, cu, mode, **kw).item()  # noqa: E731
    assert agg("token-mean") == 3.0  # 15 / 5
    assert agg("token-mean", global_n_tokens=10) == 1.5  # 15 / 10 (other ranks' tokens)
    assert agg("seq-mean-token-mean") == 3.25  # (6/3 + 9/2) / 2 = (2 + 4.5) / 2
    assert agg("seq-mean-token-sum") == 7.5  # (6 + 9) / 2
    assert agg("seq-mean-token-sum-norm", max_new_tokens=10) == 0.75  # 15 / (2 * 10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        agg("seq-mean-token-sum-norm")


def _random_batch(seed, lens=(3, 5, 1, 4)):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor((0,) + lens).cumsum(0)
    n = int(cu[-1])
    old = -torch.rand(n, generator=g) * 2
    logp = (old + 0.3 * torch.randn(n, generator=g)).requires_grad_()
    return dict(
        logp=logp,
        old=old,
        adv=torch.randn(n, generator=g),
        cu=cu,
        mask=(torch.rand(n, generator=g) > 0.2).float(),
        behav=old + 0.5 * torch.randn(n, generator=g),
    )


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_micro_batch_losses_with_global_normalisers_sum_to_the_full_batch_loss(mode):
    b = _random_batch(0)
    cfg = PPOActorConfig(loss_agg_mode=mode)
    full, _ = policy_loss(
        b["logp"], b["old"], None, b["adv"], b["mask"], b["cu"], cfg, max_new_tokens=8
    )
    n_tok, n_seq = loss_normalisers(b["mask"], b["cu"])
    parts = []
    for lo, hi in ((0, 2), (2, 4)):  # two micro-batches of two sequences
        t0, t1 = int(b["cu"][lo]), int(b["cu"][hi])
        sl = slice(t0, t1)
        loss, _ = policy_loss(
            b["logp"][sl],
            b["old"][sl],
            None,
            b["adv"][sl],
            b["mask"][sl],
            b["cu"][lo : hi + 1] - t0,
            cfg,
            global_n_tokens=n_tok,
            global_n_seqs=n_seq,
            max_new_tokens=8,
        )
        parts.append(loss)
    assert torch.allclose(sum(parts), full, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["ppo", "gspo", "cispo", "dapo"]))
def test_decoupled_loss_equals_standard_ppo_when_behaviour_is_proximal(seed, algorithm):
    b = _random_batch(seed)
    base = dict(algorithm=algorithm)
    plain = PPOActorConfig(**base)
    decoupled = PPOActorConfig(
        **base,
        use_decoupled_loss=True,
        rollout_correction=RolloutCorrectionConfig(mode="mask", upper=2.0),
    )
    l1, _ = policy_loss(b["logp"], b["old"], None, b["adv"], b["mask"], b["cu"], plain)
    l2, s2 = policy_loss(b["logp"], b["old"], b["old"], b["adv"], b["mask"], b["cu"], decoupled)
    assert torch.allclose(l1, l2, atol=1e-6)
    assert s2["rc_weight_mean"] == 1.0 and s2["rc_masked_frac"] == 0.0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_gspo_equals_token_ppo_for_length_one_sequences(seed):
    b = _random_batch(seed, lens=(1,) * 6)
    token = PPOActorConfig(eps_clip=0.1)
    seq = PPOActorConfig(eps_clip=0.1, importance_sampling_level="sequence")
    l1, _ = policy_loss(b["logp"], b["old"], None, b["adv"], b["mask"], b["cu"], token)
    l2, _ = policy_loss(b["logp"], b["old"], None, b["adv"], b["mask"], b["cu"], seq)
    g1 = torch.autograd.grad(l1, b["logp"])[0]
    g2 = torch.autograd.grad(l2, b["logp"])[0]
    assert torch.allclose(l1, l2, atol=1e-6) and torch.allclose(g1, g2, atol=1e-6)


def test_kl_loss_term_and_entropy_bonus_hand_worked():
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    entropy = torch.tensor([0.5, 1.5])
    cfg = PPOActorConfig(kl_in_reward=False, kl_ctl=0.1, kl_estimator="k2", entropy_coeff=0.01)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        None,
        torch.zeros(2),
        torch.ones(2),
        torch.tensor([0, 2]),
        cfg,
        entropy=entropy,
        ref_logp=ref,
    )
    # pg = 0 (A = 0); k2 = [0.5 * 1^2, 0] -> mean 0.25 -> +0.025; entropy mean 1 -> -0.01
    assert torch.allclose(loss, torch.tensor(0.015))
    assert torch.isclose(stats["kl_ref"], torch.tensor(0.25))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(
            logp,
            logp.detach(),
            None,
            torch.zeros(2),
            torch.ones(2),
            torch.tensor([0, 2]),
            cfg,
            entropy=entropy,
        )


def test_an_objective_given_to_policy_loss_replaces_the_clipped_one_hand_worked():
    logp = torch.log(torch.tensor([1.5, 0.5])).requires_grad_()  # old = 0 -> ratios 1.5, 0.5
    args = (logp, torch.zeros(2), None, torch.ones(2), torch.ones(2), torch.tensor([0, 2]))
    cfg = PPOActorConfig(eps_clip=0.2)  # token-mean

    def squared(cfg, logprobs, ratio, advantages):
        """-A r^2, unclipped; flag: r > 1."""
        return -advantages * ratio**2, {"above_one": ratio > 1}

    default, _ = policy_loss(*args, cfg)
    # clipped, A = 1: t0 max(-1.5, -1.2) = -1.2, t1 max(-0.5, -0.8) = -0.5 -> mean -0.85
    assert torch.isclose(default, torch.tensor(-0.85))
    loss, stats = policy_loss(*args, cfg, objective=squared)
    # -r^2: -2.25, -0.25 -> mean -1.25; d/dlogp = -2 r^2 / 2 tokens = -2.25, -0.25
    assert torch.isclose(loss, torch.tensor(-1.25))
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, torch.tensor([-2.25, -0.25]))
    assert stats["above_one_frac"] == 0.5 and "clip_high_frac" not in stats


def test_stats_report_clip_fractions_and_approx_kl():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))  # old = 0 -> ratios 1.5, 0.5, 1
    cfg = PPOActorConfig(c_clip=2.0)
    _, stats = policy_loss(
        logp,
        torch.zeros(3),
        None,
        torch.tensor([1.0, -1.0, 1.0]),
        torch.ones(3),
        torch.tensor([0, 3]),
        cfg,
    )
    assert stats["clip_high_frac"] == pytest.approx(1 / 3)  # ratio 1.5, A > 0
    assert stats["clip_low_frac"] == pytest.approx(1 / 3)  # ratio 0.5, A < 0
    assert stats["dual_clip_frac"] == 0.0
    assert stats["ratio_max"] == pytest.approx(1.5)
    # approx KL(old || new) per token, k3 with log_ratio = old - new = -log r: r - 1 - log r
    expected = (0.5 - math.log(1.5) + -0.5 - math.log(0.5) + 0.0) / 3
    assert stats["approx_kl"] == pytest.approx(expected, rel=1e-5)
