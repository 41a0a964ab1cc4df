"""Tier 1: rollout correction (truncate / mask at token, sequence and geometric level; decoupled
and bypass forms) and the proximal-logprob approximation, against hand-worked numbers."""

import math

import pytest
import torch

from areal.algo.correction import approx_prox_logp, rollout_weights, staleness_buckets
from areal.algo.losses import mismatch_kl, policy_loss
from areal.api.config.actor import PPOActorConfig, RolloutCorrectionConfig
from areal.engine.ppo import staleness_means

log = torch.log


def _rc(**kw) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(**kw)


# three trained tokens with w = pi_train / pi_behav = 2, 1, 0.5
TRAIN, BEHAV = log(torch.tensor([0.5, 0.9, 0.3])), log(torch.tensor([0.25, 0.9, 0.6]))
ONE_SEQ, MASK = torch.tensor([0, 3]), torch.ones(3, dtype=torch.bool)


def test_token_truncation_caps_each_weight_at_upper():
    w, rejected = rollout_weights(TRAIN, BEHAV, MASK, ONE_SEQ, _rc(mode="truncate", upper=1.5))
    assert torch.allclose(w, torch.tensor([1.5, 1.0, 0.5])) and not rejected.any()


def test_token_mask_keeps_weights_inside_the_two_sided_band_and_zeroes_the_rest():
    w, rejected = rollout_weights(
        TRAIN, BEHAV, MASK, ONE_SEQ, _rc(mode="mask", lower=0.6, upper=1.5)
    )
    # 2 > 1.5 and 0.5 < 0.6 leave the band (IcePop): weight 0; 1 stays with its weight
    assert rejected.tolist() == [True, False, True]
    assert torch.allclose(w, torch.tensor([0.0, 1.0, 0.0]))


def test_sequence_masking_drops_a_whole_sequence_when_one_token_leaves_the_band():
    two_seqs = torch.tensor([0, 2, 3])  # sequence 0: w = 2, 1; sequence 1: w = 0.5
    w, rejected = rollout_weights(
        TRAIN, BEHAV, MASK, two_seqs, _rc(mode="mask", lower=0.4, upper=1.5, mask_sequence=True)
    )
    assert rejected.tolist() == [True, True, False]
    assert torch.allclose(w, torch.tensor([0.0, 0.0, 0.5]))


def test_sequence_level_is_the_product_and_geometric_level_the_mean_over_trained_tokens():
    mask = torch.tensor([False, True, True])  # the first token is prompt: its w = 2 is ignored
    w, _ = rollout_weights(
        TRAIN, BEHAV, mask, ONE_SEQ, _rc(mode="truncate", level="sequence", upper=10.0)
    )
    assert torch.allclose(w, torch.full((3,), 0.5))  # 1 * 0.5
    w, _ = rollout_weights(
        TRAIN, BEHAV, mask, ONE_SEQ, _rc(mode="truncate", level="geometric", upper=10.0)
    )
    assert torch.allclose(w, torch.full((3,), math.sqrt(0.5)))  # (1 * 0.5) ** (1/2)
    all_tokens, _ = rollout_weights(
        TRAIN, BEHAV, MASK, ONE_SEQ, _rc(mode="mask", level="sequence", upper=0.9)
    )
    assert torch.allclose(all_tokens, torch.zeros(3))  # 2 * 1 * 0.5 = 1 > 0.9: masked


def test_a_long_sequence_product_truncates_or_masks_without_nan():
    n = 2000  # w = e per token: the product e^2000 overflows float32; the cap holds it at upper
    args = (torch.zeros(n), torch.full((n,), -1.0), torch.ones(n, dtype=torch.bool))
    w, _ = rollout_weights(*args, torch.tensor([0, n]), _rc(mode="truncate", level="sequence"))
    assert torch.equal(w, torch.full((n,), 2.0))
    w, rejected = rollout_weights(*args, torch.tensor([0, n]), _rc(mode="mask", level="sequence"))
    assert torch.equal(w, torch.zeros(n)) and rejected.all()


def test_mismatch_kl_estimates_are_zero_on_policy_and_hand_worked_off_it():
    kl = mismatch_kl(TRAIN, BEHAV)
    # k1 = log pi_b - log pi_t = -log w: -log 2, 0, log 2; k3 = (w - 1) - log w
    assert torch.allclose(kl["k1"], torch.tensor([-math.log(2), 0.0, math.log(2)]))
    assert torch.allclose(
        kl["k3"], torch.tensor([1 - math.log(2), 0.0, -0.5 + math.log(2)]), atol=1e-6
    )
    assert torch.allclose(mismatch_kl(TRAIN, TRAIN)["k3"], torch.zeros(3))


def _one_token(rc: RolloutCorrectionConfig, decoupled: bool, cur: float, prox: float, behav: float):
    cfg = PPOActorConfig(use_decoupled_loss=decoupled, rollout_correction=rc, use_critic=False)
    lp = torch.tensor([math.log(cur)], requires_grad=True)
    return policy_loss(
        lp,
        torch.tensor([math.log(prox)]) if decoupled else None,
        torch.tensor([math.log(behav)]),
        torch.tensor([1.0]),
        torch.tensor([1.0]),
        torch.tensor([0, 1]),
        cfg,
    )


def test_bypass_form_clips_against_the_behaviour_policy_and_truncates_its_weight():
    # ratio pi_theta / pi_behav = 0.5 / 0.25 = 2 -> clipped to 1.2 (A = 1): max(-2, -1.2) = -1.2;
    # w = sg(pi_theta) / pi_behav = 2, truncated at 1.5: loss -1.2 * 1.5 = -1.8
    loss, stats = _one_token(_rc(mode="truncate", upper=1.5), False, cur=0.5, prox=0.5, behav=0.25)
    assert loss.item() == pytest.approx(-1.8)
    assert (
        stats["rc_weight_max"].item() == pytest.approx(1.5)
        and stats["rc_masked_frac"].item() == 0.0
    )


def test_decoupled_form_weighs_prox_over_behaviour_and_masks_outside_the_band():
    # ratio 0.5 / 0.4 = 1.25 -> 1.2: loss -1.2; w = pi_prox / pi_behav = 0.4 / 0.2 = 2
    loss, _ = _one_token(_rc(mode="truncate", upper=3.0), True, cur=0.5, prox=0.4, behav=0.2)
    assert loss.item() == pytest.approx(-2.4)
    loss, stats = _one_token(_rc(mode="mask", upper=1.5), True, cur=0.5, prox=0.4, behav=0.2)
    assert loss.item() == 0.0 and stats["rc_masked_frac"].item() == 1.0  # w = 2 leaves the band
    assert stats["mismatch_k1"].item() == pytest.approx(math.log(0.2 / 0.4))


def test_loglinear_and_linear_interpolate_by_version_distance():
    behav, cur = log(torch.tensor([0.2])), log(torch.tensor([0.8]))
    # behaviour version 3, proximal 5, minibatch 1 of 2 runs version 5.5: alpha = 2 / 2.5 = 0.8
    got = approx_prox_logp(behav, cur, torch.tensor([3]), 5, 0.5, "loglinear")
    assert got.exp().item() == pytest.approx(0.2 * 4**0.8, rel=1e-5)  # 0.2 * (0.8 / 0.2) ** 0.8
    got = approx_prox_logp(behav, cur, torch.tensor([3]), 5, 0.5, "linear")
    assert got.exp().item() == pytest.approx(0.2 + 0.8 * 0.6, rel=1e-5)
    assert approx_prox_logp(behav, cur, torch.tensor([3]), 5, 0.5, "reuse").item() == pytest.approx(
        behav.item()
    )


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_the_approximation_is_exact_on_the_first_minibatch_and_for_on_policy_tokens(method):
    behav, cur = log(torch.tensor([0.2, 0.3])), log(torch.tensor([0.8, 0.5]))
    versions = torch.tensor([3, 5])
    first = approx_prox_logp(
        behav, cur, versions, 5, 0.0, method
    )  # minibatch 0 runs the prox weights
    assert torch.allclose(first, cur)
    later = approx_prox_logp(behav, cur, versions, 5, 0.5, method)
    assert later[1].item() == pytest.approx(
        behav[1].item()
    )  # version 5 = v_prox: behaviour is proximal


def test_staleness_buckets_and_exact_bucket_means_from_weighted_micro_batch_sums():
    buckets = staleness_buckets(torch.tensor([-1, 5, 4, 3, 1]), 5)
    assert [buckets[b].tolist() for b in ("0", "1", "2", "3+")] == [
        [False, True, False, False, False],
        [False, False, True, False, False],
        [False, False, False, True, False],
        [True, False, False, False, True],
    ]  # -1 is prompt (masked)
    # two minibatches (loss_weight 4 and 2): bucket 0 holds k3 sums 0.4 over 2 tokens and 0.2 over 1
    steps = [
        {"stale0_k3_sum": 0.4 / 4, "stale0_n": 2 / 4, "loss_weight": 4.0},
        {"stale0_k3_sum": 0.2 / 2, "stale0_n": 1 / 2, "loss_weight": 2.0},
    ]
    assert staleness_means(steps) == {"mismatch_k3_stale0": pytest.approx(0.2)}  # 0.6 / 3 tokens
    assert steps[0] == {"loss_weight": 4.0}  # the sums are popped


def test_config_rules_for_rollout_correction_and_the_approximation():
    from areal.api.config import GRPOConfig, load_config
    from areal.api.config.loader import ConfigError

    base = ["actor.use_critic=false", "cluster.n_servers=1"]
    with pytest.raises(ConfigError) as e:
        load_config(
            GRPOConfig,
            [
                *base,
                "actor.rollout_correction.mode=mask",
                "actor.rollout_correction.lower=3",
                "actor.prox_logp=loglinear",
            ],
        )
    text = str(e.value)
    assert "lower: 3.0 >= upper=2.0" in text
    assert "prox_logp: loglinear sets how" in text and "set use_decoupled_loss=true" in text
    ok = load_config(
        GRPOConfig,
        [
            *base,
            "actor.use_decoupled_loss=true",
            "actor.prox_logp=loglinear",
            "actor.rollout_correction.mode=truncate",
        ],
    )
    assert ok.actor.rollout_correction.mode == "truncate"
    with pytest.raises(ConfigError, match="an unbounded product of token ratios"):
        load_config(GRPOConfig, [*base, "actor.rollout_correction.level=sequence"])
