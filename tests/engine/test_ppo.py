"""PPO actor and critic (tier 2) on the tiny model, driven as a training script would."""

from __future__ import annotations

import pytest
import torch
from test_fsdp import world_mesh

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig, RolloutCorrectionConfig
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.engine.ppo import PPOActor, PPOCritic
from areal.utils.batch import PackedBatch

pytestmark = pytest.mark.slow
GROUP = 2


def rollout_batch(n_groups: int = 3, seed: int = 0) -> PackedBatch:
    """Groups of GROUP samples sharing a 4-token prompt; reward 1 for even samples, 0 for odd."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, behav, rewards = [], [], [], []
    for _ in range(n_groups):
        prompt = torch.randint(0, 256, (4,), generator=g).tolist()
        for k in range(GROUP):
            completion = torch.randint(
                0, 256, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g
            )
            ids.append(prompt + completion.tolist())
            masks.append([0] * 4 + [1] * len(completion))
            behav.append([0.0] * (4 + len(completion)))  # replaced by the trainer's own logp below
            rewards.append(1.0 if k % 2 == 0 else 0.0)
    return PackedBatch.from_sequences(
        {"input_ids": ids, "loss_mask": masks, "logprobs": behav}, {"rewards": rewards}
    )


def actor_config(path, **kw) -> PPOActorConfig:
    return PPOActorConfig(
        path=path,
        algorithm="grpo",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=kw.pop("budget", 1000), granularity=GROUP),
        optimizer=OptimizerConfig(lr=kw.pop("lr", 1e-3), eps=kw.pop("eps", 1e-8)),
        **kw,
    )


def test_grpo_update_raises_logp_of_rewarded_samples(tiny_model_dir):
    actor = PPOActor(
        actor_config(tiny_model_dir, ppo_n_minibatches=2), world_mesh(), group_size=GROUP
    )
    actor.initialize(None)
    batch = rollout_batch()
    logp = actor.compute_logp(batch)[0]["logp"]
    assert logp.shape == (batch.n_tokens,) and (logp[batch.cu_seqlens[:-1]] == 0).all()
    batch = batch.with_fields(tokens={"logprobs": logp, "prox_logp": logp})
    batch, _ = actor.compute_advantages(batch)
    assert set(batch.tokens) >= {"advantages", "returns", "token_rewards"}
    stats = [actor.ppo_update(batch)[1] for _ in range(3)]  # means over 2 minibatches each
    after = actor.compute_logp(batch)[0]["logp"]
    actor.destroy()
    # minibatch 1 runs at ratio 1 exactly, minibatch 2 after one small step
    assert len(stats) == 3 and stats[0]["ratio_mean"] == pytest.approx(1.0, abs=0.05)
    mask, adv = batch["loss_mask"].bool(), batch["advantages"]
    gain = (after - logp)[mask]
    assert gain[adv[mask] > 0].mean() > 0 > gain[adv[mask] < 0].mean()


def test_update_returns_each_tokens_trainer_logp_equal_to_a_forward_before_it(tiny_model_dir):
    # budget 24: the update runs several micro-batches, each scatters its own tokens back
    actor = PPOActor(actor_config(tiny_model_dir, budget=24), world_mesh(), group_size=GROUP)
    actor.initialize(None)
    batch = rollout_batch(n_groups=4)
    logp = actor.compute_logp(batch)[0]["logp"]  # the weights before the update
    batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
    out, stats = actor.ppo_update(batch, logp_out="trainer_logp")
    actor.destroy()
    assert stats["n_mbs"] > 1
    assert set(out.tokens) == set(batch.tokens) | {"trainer_logp"}  # no helper field leaks
    torch.testing.assert_close(out["trainer_logp"], logp, rtol=0, atol=1e-5)


def _upweighted(cfg, logprobs, ratio, advantages):
    """A test's own objective: PPO's surrogate, unclipped, positive advantages counted twice."""
    a = advantages.detach()
    return -a * ratio * torch.where(a > 0, 2.0, 1.0), {"upweighted": a > 0}


@pytest.mark.parametrize(("objective", "pg_loss"), [(None, -11 / 6), (_upweighted, -4.0)])
def test_an_objective_given_to_the_actor_replaces_the_clipped_one(
    tiny_model_dir, objective, pg_loss
):
    # one group: a 4-token prompt, completions of 2 and 3 trained tokens, advantages by hand
    batch = PackedBatch.from_sequences(
        {
            "input_ids": [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9]],
            "loss_mask": [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1]],
        }
    )
    adv = torch.tensor([0.0] * 4 + [1.0, 3.0] + [0.0] * 4 + [2.0, -2.0, 5.0])
    cfg = actor_config(tiny_model_dir)
    actor = PPOActor(cfg, world_mesh(), group_size=GROUP, objective=objective)
    actor.initialize(None)
    logp = actor.compute_logp(batch)[0]["logp"]  # the behaviour policy: ratio 1 in the update
    _, stats = actor.ppo_update(batch.with_fields(tokens={"logprobs": logp, "advantages": adv}))
    actor.destroy()
    # grpo's seq-mean-token-mean of the per-token loss, at ratio 1:
    # clipped (the default), -A: (mean(-1, -3) + mean(-2, 2, -5)) / 2 = (-2 - 5/3) / 2 = -11/6
    # upweighted, -A * (2 if A > 0): (mean(-2, -6) + mean(-4, 2, -10)) / 2 = (-4 - 4) / 2 = -4
    assert cfg.loss_agg_mode == "seq-mean-token-mean"
    assert stats["pg_loss"] == pytest.approx(pg_loss, abs=1e-4)
    flags = {k for k in stats if k.endswith("_frac")}
    if objective is None:
        assert {"clip_low_frac", "clip_high_frac"} <= flags and "upweighted_frac" not in flags
    else:  # the objective's own flag: 4 of the 5 trained tokens have A > 0
        assert stats["upweighted_frac"] == pytest.approx(4 / 5) and "clip_low_frac" not in flags


def _one_step_state(path, budget, **kw) -> dict:
    actor = PPOActor(
        actor_config(path, budget=budget, lr=1e-2, eps=1.0, **kw), world_mesh(), group_size=GROUP
    )
    actor.initialize(None)
    batch = rollout_batch(n_groups=4)
    logp = actor.compute_logp(batch)[0]["logp"]
    batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
    actor.ppo_update(batch)
    state = {k: v.clone() for k, v in actor.full_state_dict().items()}
    actor.destroy()
    return state


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_actor_update_is_independent_of_the_micro_batch_split(tiny_model_dir, mode):
    whole = _one_step_state(tiny_model_dir, budget=1000, loss_agg_mode=mode)
    split = _one_step_state(tiny_model_dir, budget=24, loss_agg_mode=mode)
    worst = max((whole[k] - split[k]).abs().max().item() for k in whole)
    assert worst < 1e-6


def test_critic_values_move_toward_returns(tiny_model_dir):
    cfg = PPOCriticConfig(
        path=tiny_model_dir,
        value_eps_clip=None,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=64),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0),
    )
    critic = PPOCritic(cfg, world_mesh())
    critic.initialize(None)
    batch = rollout_batch()
    values = critic.compute_values(batch)[0]["values"]
    assert values.shape == (batch.n_tokens,) and (values[batch.cu_seqlens[:-1]] == 0).all()
    returns = batch["loss_mask"].float() * 0.5
    batch = batch.with_fields(tokens={"values": values, "returns": returns})
    mask = batch["loss_mask"].bool()
    before = (values - returns)[mask].square().mean()
    for _ in range(8):
        _, stats = critic.ppo_update(batch)
    after_values = critic.compute_values(batch)[0]["values"]
    critic.destroy()
    after = (after_values - returns)[mask].square().mean()
    assert after < 0.6 * before and "value_error" in stats


def test_critic_value_normalizer_survives_a_dcp_round_trip(tiny_model_dir, tmp_path):
    from areal.api.io import SaveLoadMeta
    from areal.engine.ppo import VALUE_NORM_FILE

    def critic(value_norm: bool) -> PPOCritic:
        c = PPOCritic(
            PPOCriticConfig(
                path=tiny_model_dir,
                value_norm=value_norm,
                mb_spec=MicroBatchSpec(max_tokens_per_mb=64),
            ),
            world_mesh(),
        )
        c.initialize(None)
        return c

    a = critic(True)
    batch = rollout_batch()
    returns = batch["loss_mask"].float() * 3.0 + 1.0  # moments far from the initial (0, 1)
    a.ppo_update(a.compute_values(batch)[0].with_fields(tokens={"returns": returns}))
    saved = a.value_normalizer.state_dict()
    assert saved["count"] > 0 and saved["mean"] != 0.0
    meta = SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True)
    a.save(meta)
    assert (tmp_path / "dcp" / VALUE_NORM_FILE).is_file()

    b = critic(True)
    b.load(meta)
    assert b.value_normalizer.state_dict() == saved
    assert torch.equal(a.compute_values(batch)[0]["values"], b.compute_values(batch)[0]["values"])

    plain = critic(False)  # saved without value_norm: loading with it names the missing state
    plain.save(SaveLoadMeta(path=str(tmp_path / "plain"), weight_format="dcp", with_optim=True))
    with pytest.raises(FileNotFoundError, match="value_normalizer.json"):
        b.load(SaveLoadMeta(path=str(tmp_path / "plain"), weight_format="dcp", with_optim=True))
    for engine in (plain, b, a):
        engine.destroy()


def _decoupled_step(path, prox_pass: bool) -> tuple[dict, dict]:
    actor = PPOActor(
        actor_config(
            path,
            lr=1e-2,
            eps=1.0,
            use_decoupled_loss=True,
            rollout_correction=RolloutCorrectionConfig(preset="behav_cap"),
        ),
        world_mesh(),
        group_size=GROUP,
    )
    actor.initialize(None)
    batch = rollout_batch(n_groups=4)
    behav = actor.compute_logp(batch)[0]["logp"] + 0.05 * torch.randn(
        batch.n_tokens, generator=torch.Generator().manual_seed(1)
    )
    batch = batch.with_fields(
        tokens={"logprobs": behav * batch["loss_mask"]}
    )  # a stale behaviour policy
    if prox_pass:
        batch, _ = actor.compute_logp(batch, out="prox_logp")
    batch, _ = actor.compute_advantages(batch)
    _, stats = actor.ppo_update(batch)
    state = {k: v.clone() for k, v in actor.full_state_dict().items()}
    actor.destroy()
    return stats, state


def test_one_minibatch_update_without_the_prox_pass_equals_the_update_with_it(tiny_model_dir):
    with_pass, state_a = _decoupled_step(tiny_model_dir, prox_pass=True)
    without, state_b = _decoupled_step(tiny_model_dir, prox_pass=False)
    for key in ("loss", "pg_loss", "rc_weight_mean", "logp_mismatch", "grad_norm"):
        assert without[key] == pytest.approx(with_pass[key], rel=1e-5, abs=1e-6), key
    assert with_pass["logp_mismatch"] > 0.01  # the behaviour policy really differed
    worst = max((state_a[k] - state_b[k]).abs().max().item() for k in state_a)
    assert worst < 1e-6


def test_the_prox_pass_runs_only_where_needed_or_asked_for(tiny_model_dir):
    def needs(**kw) -> bool:
        return PPOActor(
            actor_config(tiny_model_dir, use_decoupled_loss=True, **kw), world_mesh()
        ).needs_prox_pass

    assert not needs() and needs(prox_logp="recompute_always") and needs(ppo_n_minibatches=2)
    assert not needs(ppo_n_minibatches=2, prox_logp="loglinear")
    assert needs(kl_ctl=0.1, kl_in_reward=True) and not needs(kl_ctl=0.1, kl_in_reward=False)


def test_several_minibatches_demand_the_prox_pass(tiny_model_dir):
    actor = PPOActor(
        actor_config(tiny_model_dir, ppo_n_minibatches=2, use_decoupled_loss=True),
        world_mesh(),
        group_size=GROUP,
    )
    assert actor.needs_prox_pass
    actor.initialize(None)
    batch = rollout_batch()
    batch = batch.with_fields(tokens={"logprobs": actor.compute_logp(batch)[0]["logp"]})
    batch, _ = actor.compute_advantages(batch)
    with pytest.raises(ValueError, match="needs prox_logp"):
        actor.ppo_update(batch)
    actor.destroy()


def _grpo_step(path, shared: bool, budget: int) -> tuple[torch.Tensor, dict, dict]:
    actor = PPOActor(
        actor_config(path, budget=budget, lr=1e-2, eps=1.0, shared_prefix=shared),
        world_mesh(),
        group_size=GROUP,
    )
    actor.initialize(None)
    batch = rollout_batch(n_groups=4).with_fields(
        seqs={"group_index": torch.arange(8) // GROUP, "prompt_lens": torch.full((8,), 4)}
    )
    logp = actor.compute_logp(batch)[0]["logp"]
    batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
    _, stats = actor.ppo_update(batch)
    state = {k: v.clone() for k, v in actor.full_state_dict().items()}
    actor.destroy()
    return logp, stats, state


@pytest.mark.parametrize("budget", [1000, 24])  # one micro-batch; groups split over several
def test_shared_prefix_training_equals_running_every_prompt_per_sample(tiny_model_dir, budget):
    logp_a, stats_a, state_a = _grpo_step(tiny_model_dir, shared=False, budget=budget)
    logp_b, stats_b, state_b = _grpo_step(tiny_model_dir, shared=True, budget=budget)
    assert (logp_a - logp_b).abs().max() < 1e-5
    for key in ("loss", "pg_loss", "grad_norm", "entropy"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-5, abs=1e-6), key
    worst = max((state_a[k] - state_b[k]).abs().max().item() for k in state_a)
    assert worst < 1e-5


def _versioned_step(
    path, prox_logp: str, n_mb: int, lag: int, rc_mode: str = "none"
) -> tuple[dict, dict]:
    """One decoupled update on tokens of version ``actor version - lag``; the behaviour logprobs
    are the trainer's own (so with lag 0 they are exactly the proximal policy's)."""
    actor = PPOActor(
        actor_config(
            path,
            lr=1e-2,
            eps=1.0,
            use_decoupled_loss=True,
            ppo_n_minibatches=n_mb,
            prox_logp=prox_logp,
            rollout_correction=RolloutCorrectionConfig(mode=rc_mode),
        ),
        world_mesh(),
        group_size=GROUP,
    )
    actor.initialize(None)
    actor.set_version(3)
    batch = rollout_batch(n_groups=4)
    behav = actor.compute_logp(batch)[0]["logp"]
    versions = torch.where(batch["loss_mask"].bool(), 3 - lag, -1)
    batch = batch.with_fields(tokens={"logprobs": behav, "versions": versions})
    if actor.needs_prox_pass:
        batch, _ = actor.compute_logp(batch, out="prox_logp")
    batch, _ = actor.compute_advantages(batch)
    _, stats = actor.ppo_update(batch)
    state = {k: v.clone() for k, v in actor.full_state_dict().items()}
    actor.destroy()
    return stats, state


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_approximate_prox_logp_equals_recompute_where_it_is_exact(tiny_model_dir, method):
    # staleness 0 and behaviour = the trainer's proximal logprobs: every minibatch's alpha is 1
    # (first) or 0 (later, on-policy tokens), both exact, so two minibatches update identically
    exact, state_a = _versioned_step(tiny_model_dir, "recompute", n_mb=2, lag=0)
    approx, state_b = _versioned_step(tiny_model_dir, method, n_mb=2, lag=0)
    for key in ("loss", "pg_loss", "grad_norm"):
        assert approx[key] == pytest.approx(exact[key], rel=1e-5, abs=1e-6), key
    worst = max((state_a[k] - state_b[k]).abs().max().item() for k in state_a)
    assert worst < 1e-6


def test_stale_tokens_train_over_four_minibatches_without_the_prox_pass_and_log_their_bucket(
    tiny_model_dir,
):
    stats, _ = _versioned_step(tiny_model_dir, "loglinear", n_mb=4, lag=2, rc_mode="mask")
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert set(stats) >= {
        "mismatch_k1",
        "mismatch_k3",
        "rc_masked_frac",
        "rc_weight_max",
        "mismatch_k3_stale2",
    }
    assert "mismatch_k3_stale0" not in stats  # no token of the current version
    # the per-micro-batch bucket sums are consumed by the buckets, never logged themselves
    assert not [k for k in stats if k.startswith("stale")], sorted(stats)


def test_a_non_finite_reward_skips_every_update_and_stops_the_run_at_max_skipped_steps(
    tiny_model_dir,
):
    from areal.engine.ppo import SkippedUpdatesError

    cfg = actor_config(tiny_model_dir, max_skipped_steps=2)
    actor = PPOActor(cfg, world_mesh(), group_size=GROUP)
    actor.initialize(None)
    batch = rollout_batch()
    rewards = batch["rewards"].clone()
    rewards[1] = torch.tensor(1e308, dtype=torch.float64).float()  # inf as float32
    logp = actor.compute_logp(batch)[0]["logp"]
    batch = batch.with_fields(tokens={"logprobs": logp}, seqs={"rewards": rewards})
    batch, _ = actor.compute_advantages(batch)
    try:
        _, stats = actor.ppo_update(batch)  # skipped: a warning, the run goes on
        assert stats["update_skipped"] == 1.0 and actor.skipped.in_a_row == 1
        with pytest.raises(SkippedUpdatesError, match="2 train steps in a row.*non-finite rewards"):
            actor.ppo_update(batch)
    finally:
        actor.destroy()
