"""Tier 1: DPO / IPO / SimPO losses and implicit-reward stats against hand-worked numbers."""

import pytest
import torch

from areal.algo.dpo import PairLogps, preference_loss, reward_stats


def _pairs(**kw) -> PairLogps:
    return PairLogps(**{k: torch.tensor(v, dtype=torch.float64) for k, v in kw.items()})


# Two pairs. Pair 0: log-ratios chosen -2 - (-3) = +1, rejected -5 - (-4) = -1 (gap +2).
# Pair 1: the policy equals the reference on both sides (gap 0).
TWO = dict(
    logp_c=[-2.0, -4.0],
    logp_r=[-5.0, -6.0],
    ref_c=[-3.0, -4.0],
    ref_r=[-4.0, -6.0],
    len_c=[2.0, 2.0],
    len_r=[3.0, 3.0],
)


def test_sigmoid_dpo_by_hand():
    losses, chosen, rejected = preference_loss(_pairs(**TWO), "sigmoid", beta=0.5)
    # pair 0: h = 0.5 * (1 - (-1)) = 1 -> -log sigmoid(1) = log(1 + e^-1) = 0.313262
    # pair 1: h = 0 -> log 2 = 0.693147
    assert losses.tolist() == pytest.approx([0.313262, 0.693147], abs=1e-6)
    assert chosen.tolist() == [0.5, 0.0] and rejected.tolist() == [-0.5, 0.0]  # beta * log-ratio


def test_conservative_dpo_label_smoothing_by_hand():
    losses, _, _ = preference_loss(_pairs(**TWO), "sigmoid", beta=0.5, label_smoothing=0.1)
    # pair 0: 0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1) = 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262
    # pair 1: h = 0: both terms are log 2, so smoothing changes nothing: 0.693147
    assert losses.tolist() == pytest.approx([0.413262, 0.693147], abs=1e-6)


def test_ipo_by_hand():
    losses, chosen, rejected = preference_loss(_pairs(**TWO), "ipo", beta=0.25)
    # target gap 1 / (2 * 0.25) = 2. pair 0: (2 - 2)^2 = 0; pair 1: (0 - 2)^2 = 4
    assert losses.tolist() == pytest.approx([0.0, 4.0])
    assert chosen.tolist() == [0.25, 0.0] and rejected.tolist() == [-0.25, 0.0]


def test_simpo_by_hand_uses_average_logprob_and_margin_and_no_reference():
    pairs = _pairs(logp_c=[-2.0], logp_r=[-6.0], len_c=[2.0], len_r=[3.0])  # no ref_c / ref_r
    losses, chosen, rejected = preference_loss(pairs, "simpo", beta=2.0, gamma=0.5)
    # averages: chosen -2/2 = -1, rejected -6/3 = -2; rewards 2 * avg = -2 and -4
    # h = -2 - (-4) - 0.5 = 1.5 -> log(1 + e^-1.5) = 0.201413
    assert losses.tolist() == pytest.approx([0.201413], abs=1e-6)
    assert chosen.tolist() == [-2.0] and rejected.tolist() == [-4.0]
    smoothed, _, _ = preference_loss(pairs, "simpo", beta=2.0, gamma=0.5, label_smoothing=0.2)
    # 0.8 * 0.201413 + 0.2 * log(1 + e^1.5) = 0.161131 + 0.2 * 1.701413 = 0.501413
    assert smoothed.tolist() == pytest.approx([0.501413], abs=1e-6)


def test_nll_term_adds_the_chosen_mean_token_nll_by_hand():
    losses, chosen, rejected = preference_loss(_pairs(**TWO), "sigmoid", beta=0.5, nll_coef=0.5)
    # chosen mean token NLL: pair 0: -(-2) / 2 = 1; pair 1: -(-4) / 2 = 2; times 0.5 -> 0.5, 1.0
    # added to the sigmoid losses above: 0.313262 + 0.5, 0.693147 + 1.0
    assert losses.tolist() == pytest.approx([0.813262, 1.693147], abs=1e-6)
    assert chosen.tolist() == [0.5, 0.0] and rejected.tolist() == [-0.5, 0.0]  # rewards unchanged
    simpo = _pairs(logp_c=[-2.0], logp_r=[-6.0], len_c=[2.0], len_r=[3.0])
    losses, _, _ = preference_loss(simpo, "simpo", beta=2.0, gamma=0.5, nll_coef=2.0)
    assert losses.tolist() == pytest.approx([0.201413 + 2.0 * 1.0], abs=1e-6)  # NLL -(-2) / 2 = 1
    # its gradient on logp_c is -nll_coef / len_c on top of the preference part (0 here: IPO at
    # its target)
    logp_c = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    at_target = PairLogps(
        logp_c,
        torch.tensor([-5.0]),
        torch.tensor([2.0]),
        torch.tensor([3.0]),
        torch.tensor([-3.0]),
        torch.tensor([-4.0]),
    )  # gap 2 = 1 / (2 * 0.25)
    preference_loss(at_target, "ipo", beta=0.25, nll_coef=0.4)[0].sum().backward()
    assert logp_c.grad.item() == pytest.approx(-0.2)


def test_reward_stats_by_hand():
    stats = reward_stats(torch.tensor([0.5, 0.0, -1.0]), torch.tensor([-0.5, 0.0, 1.0]))
    # chosen > rejected only for the first pair (a tie is not a win); margins 1, 0, -2
    assert stats == pytest.approx(
        {"reward_acc": 1 / 3, "margin": -1 / 3, "chosen_reward": -1 / 6, "rejected_reward": 1 / 6}
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_gradient_raises_chosen_and_lowers_rejected_logprob(loss_type):
    logp_c = torch.tensor([-3.0], requires_grad=True)
    logp_r = torch.tensor([-3.0], requires_grad=True)
    ref = torch.tensor([-3.0]) if loss_type != "simpo" else None
    pairs = PairLogps(logp_c, logp_r, torch.tensor([2.0]), torch.tensor([2.0]), ref, ref)
    losses, _, _ = preference_loss(pairs, loss_type, beta=0.5)
    losses.sum().backward()
    assert logp_c.grad.item() < 0 < logp_r.grad.item()  # gradient descent: chosen up, rejected down


def test_bad_knobs_name_the_value_and_the_fix():
    pairs = _pairs(**TWO)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        preference_loss(pairs, "hinge", beta=0.1)
    with pytest.raises(ValueError, match="beta must be > 0, got 0"):
        preference_loss(pairs, "sigmoid", beta=0.0)
    with pytest.raises(ValueError, match="not defined for ipo"):
        preference_loss(pairs, "ipo", beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\), got 0.5"):
        preference_loss(pairs, "sigmoid", beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="nll_coef must be >= 0, got -1"):
        preference_loss(pairs, "sigmoid", beta=0.1, nll_coef=-1.0)
    with pytest.raises(ValueError, match="SimPO's margin"):
        preference_loss(pairs, "sigmoid", beta=0.1, gamma=1.0)
    no_ref = _pairs(logp_c=[-1.0], logp_r=[-2.0], len_c=[1.0], len_r=[1.0])
    with pytest.raises(ValueError, match="needs reference logprobs"):
        preference_loss(no_ref, "sigmoid", beta=0.1)
