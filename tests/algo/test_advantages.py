"""Tier 1: normalisation, GAE and compute_advantages against hand-worked numbers, a plain GAE
loop, and invariants (group zero mean, leave-one-out excludes self, DP all-reduce)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algo.advantages import compute_advantages, gae, normalize
from areal.api.config.actor import NormSpec, PPOActorConfig
from tests.ranks import context


def _norm(mean="none", std="none", loo=False, unbiased=False, eps=1e-6):
    return NormSpec(mean, std, loo, unbiased, eps)


def _per_seq(x):  # per-sequence values: one "token" per sequence
    return torch.ones_like(x), torch.arange(len(x) + 1)


def test_group_mean_std_hand_worked():
    x = torch.tensor([1.0, 3.0, 2.0, 2.0])  # groups [1, 3] and [2, 2]
    out = normalize(x, *_per_seq(x), _norm("group", "group"), group_size=2)
    # group 1: mean 2, std sqrt(((1-2)^2 + (3-2)^2) / 2) = 1 -> [-1, 1]; group 2: mean 2, std 0
    assert torch.allclose(out, torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def test_unbiased_std_divides_by_n_minus_one():
    x = torch.tensor([1.0, 3.0])
    out = normalize(x, *_per_seq(x), _norm("group", "group", unbiased=True), group_size=2)
    # var = (1 + 1) / (2 - 1) = 2 -> std 1.41421; (1 - 2) / 1.41421 = -0.70711
    assert torch.allclose(out, torch.tensor([-0.707107, 0.707107]), atol=1e-6)


def test_leave_one_out_mean_hand_worked():
    x = torch.tensor([1.0, 2.0, 6.0])
    out = normalize(x, *_per_seq(x), _norm("group", loo=True), group_size=3)
    # baselines: (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> 1-4, 2-3.5, 6-1.5
    assert torch.allclose(out, torch.tensor([-3.0, -1.5, 4.5]))


def test_batch_norm_uses_only_masked_tokens_and_zeroes_the_rest():
    x, mask = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    out = normalize(x, mask, torch.tensor([0, 2, 4]), _norm("batch", "batch"))
    # mean (1+2+3)/3 = 2, std sqrt(2/3) = 0.816497 -> -1/0.8165 = -1.224745
    assert torch.allclose(out, torch.tensor([-1.224745, 0.0, 1.224745, 0.0]), atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(2, 5), st.integers(0, 2**31 - 1))
def test_group_normalised_values_have_zero_mean_per_group(n_groups, group_size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_groups * group_size, generator=g) * 3
    for std_level in ("group", "none"):
        out = normalize(x, *_per_seq(x), _norm("group", std_level, eps=1e-5), group_size)
        assert out.reshape(n_groups, group_size).mean(1).abs().max() < 1e-5


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_leave_one_out_baseline_excludes_the_sample_itself(group_size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(group_size, generator=g)
    norm = _norm("group", loo=True)
    baseline = x - normalize(x, *_per_seq(x), norm, group_size)
    bumped = x.clone()
    bumped[0] += 10.0  # the sample's own value must not move its baseline
    baseline_bumped = bumped - normalize(bumped, *_per_seq(bumped), norm, group_size)
    assert torch.allclose(baseline[0], baseline_bumped[0], atol=1e-5)
    assert torch.allclose(baseline[0], x[1:].mean(), atol=1e-5)


def test_gae_hand_worked_skips_masked_tokens():
    # tokens: prompt, a0, a1, tool (masked), a2; rewards on actions [0, 0, 1]
    mask = torch.tensor([0.0, 1, 1, 0, 1])
    rewards = torch.tensor([0.0, 0, 0, 0, 1])
    values = torch.tensor([9.0, 0.5, 0.6, 9.0, 0.7])  # 9s are off the mask and ignored
    adv, ret = gae(rewards, values, mask, torch.tensor([0, 5]), gamma=1.0, lam=0.5)
    # a2: delta = 1 + 0 - 0.7 = 0.3 -> A = 0.3
    # a1: delta = 0 + 0.7 - 0.6 = 0.1 -> A = 0.1 + 0.5 * 0.3 = 0.25
    # a0: delta = 0 + 0.6 - 0.5 = 0.1 -> A = 0.1 + 0.5 * 0.25 = 0.225
    assert torch.allclose(adv, torch.tensor([0.0, 0.225, 0.25, 0.0, 0.3]))
    assert torch.allclose(ret, torch.tensor([0.0, 0.725, 0.85, 0.0, 1.0]))


def _gae_reference(rewards, values, mask, cu, gamma, lam):
    adv = [0.0] * len(rewards)
    for b in range(len(cu) - 1):
        steps = [t for t in range(int(cu[b]), int(cu[b + 1])) if mask[t] > 0]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[t]) + gamma * next_value - float(values[t])
            running = delta + gamma * lam * running
            adv[t] = running
            next_value = float(values[t])
    return torch.tensor(adv, dtype=torch.float64)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.floats(0, 1),
    st.floats(0, 1),
    st.integers(0, 2**31 - 1),
)
def test_gae_matches_a_plain_loop_on_random_masked_inputs(lens, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lens).cumsum(0)
    n = int(cu[-1])
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    values = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.3).double()
    adv, ret = gae(rewards, values, mask, cu, gamma, lam)
    ref = _gae_reference(rewards, values, mask, cu, gamma, lam)
    assert torch.allclose(adv, ref, atol=1e-6)
    assert torch.allclose(ret, (ref + values) * mask, atol=1e-6)


def test_grpo_broadcasts_the_group_normalised_reward_to_every_trained_token():
    cfg = PPOActorConfig(algorithm="grpo", reward_norm_eps=1e-6)
    cu = torch.tensor([0, 3, 5])
    mask = torch.tensor([0.0, 1, 1, 0, 1])
    out = compute_advantages(torch.tensor([1.0, 0.0]), mask, cu, cfg, group_size=2)
    # group [1, 0]: mean 0.5, std 0.5 -> [1, -1]; gamma = lam = 1, no critic -> broadcast
    assert torch.allclose(out.advantages, torch.tensor([0.0, 1, 1, 0, -1]))
    assert torch.allclose(out.seq_rewards, torch.tensor([1.0, -1.0]))


def test_kl_in_reward_gives_return_to_go_with_penalties():
    cfg = PPOActorConfig(
        algorithm="reinforce_pp", kl_ctl=0.1, adv_norm_mean_level="none", adv_norm_std_level="none"
    )
    mask = torch.tensor([0.0, 1, 1, 1])
    logp, ref = torch.tensor([0.0, -1.0, -1.0, -1.0]), torch.tensor([0.0, -1.5, -1.0, -2.0])
    out = compute_advantages(
        torch.tensor([2.0]), mask, torch.tensor([0, 4]), cfg, logprobs=logp, ref_logp=ref
    )
    # k1 = logp - ref = [., 0.5, 0, 1] -> token rewards -0.1*k1 = [0, -0.05, 0, -0.1] + 2 at end
    assert torch.allclose(out.token_rewards, torch.tensor([0.0, -0.05, 0.0, 1.9]))
    # return-to-go (gamma = 1): [0, -0.05 + 0 + 1.9, 0 + 1.9, 1.9]
    assert torch.allclose(out.advantages, torch.tensor([0.0, 1.85, 1.9, 1.9]))


def test_remax_subtracts_the_greedy_rollout_reward():
    cfg = PPOActorConfig(algorithm="remax", reward_scaling=2.0)
    out = compute_advantages(
        torch.tensor([1.0, 0.0]),
        torch.ones(4),
        torch.tensor([0, 2, 4]),
        cfg,
        baseline_rewards=torch.tensor([0.25, 0.5]),
    )
    # (1 - 0.25) * 2 = 1.5; (0 - 0.5) * 2 = -1
    assert torch.allclose(out.seq_rewards, torch.tensor([1.5, -1.0]))
    with pytest.raises(ValueError, match="remax_baseline"):
        compute_advantages(torch.ones(2), torch.ones(4), torch.tensor([0, 2, 4]), cfg)


def test_ppo_uses_critic_values_and_requires_them():
    cfg = PPOActorConfig(
        algorithm="ppo", gamma=1.0, lam=1.0, adv_norm_mean_level="none", adv_norm_std_level="none"
    )
    cu, mask = torch.tensor([0, 2]), torch.ones(2)
    out = compute_advantages(torch.tensor([1.0]), mask, cu, cfg, values=torch.tensor([0.2, 0.5]))
    # lam = 1: A_t = R - V_t -> [0.8, 0.5]; returns = A + V = [1, 1]
    assert torch.allclose(out.advantages, torch.tensor([0.8, 0.5]))
    assert torch.allclose(out.returns, torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="use_critic"):
        compute_advantages(torch.tensor([1.0]), mask, cu, cfg)


def _dp_rank(rank, world, init_file, x, mask, cu, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = normalize(x, mask, cu, _norm("batch", "batch", eps=1e-5), dp_group=dist.group.WORLD)
        queue.put((rank, out.tolist()))  # plain lists: tensors would be shared-memory handles
    finally:
        dist.destroy_process_group()


def test_batch_statistics_are_all_reduced_over_data_parallel_ranks():
    torch.manual_seed(3)
    x, mask = torch.randn(9), (torch.rand(9) > 0.2).float()
    expected = normalize(x, mask, torch.tensor([0, 4, 6, 9]), _norm("batch", "batch", eps=1e-5))
    shards = [
        (x[:4], mask[:4], torch.tensor([0, 4])),  # rank 0: sequence 0
        (x[4:], mask[4:], torch.tensor([0, 2, 5])),
    ]  # rank 1: sequences 1 and 2
    ctx = context()
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "pg_init")
    procs = [
        ctx.Process(target=_dp_rank, args=(r, 2, init_file, *shards[r], queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert torch.allclose(torch.tensor(got[0] + got[1]), expected, atol=1e-6)
