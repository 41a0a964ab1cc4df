"""Actor/critic config: presets load from YAML, explicit knobs win, every field documented,
the docs table matches PRESETS, and every preset gives a finite loss and gradient."""

import dataclasses
from pathlib import Path

import pytest
import torch

from areal.algo.advantages import compute_advantages
from areal.algo.logprob import packed_token_logprobs
from areal.algo.losses import loss_normalisers, policy_loss
from areal.api.config.actor import PRESETS, PPOActorConfig, PPOCriticConfig
from areal.api.config.loader import ConfigError, from_dict, iter_fields, load_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def preset_table_markdown() -> str:
    """The table in docs/algorithms.md, generated from PRESETS (knobs as rows, each named by its
    full override key, so a column pastes as ``key=value`` overrides)."""
    names = list(PRESETS)
    lines = [
        "| knob | " + " | ".join(f"`{n}`" for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for key in PRESETS["ppo"]:
        cells = [
            "null"
            if PRESETS[n][key] is None
            else str(PRESETS[n][key]).lower()
            if isinstance(PRESETS[n][key], bool)
            else str(PRESETS[n][key])
            for n in names
        ]
        lines.append(f"| `actor.{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_every_field_has_a_help_string():
    for cls in (PPOActorConfig, PPOCriticConfig):
        for path, f, _ in iter_fields(cls):
            assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{path} has no help"


def test_every_preset_sets_the_same_knobs_and_defaults_are_the_ppo_preset():
    keys = set(PRESETS["ppo"])
    for name, preset in PRESETS.items():
        assert set(preset) == keys, name
    default = PPOActorConfig()
    assert {k: getattr(default, k) for k in keys} == PRESETS["ppo"]


def test_docs_table_matches_presets():
    assert preset_table_markdown() in DOCS.read_text(), (
        "docs/algorithms.md is out of date; paste tests/api/test_actor_config.py's "
        "preset_table_markdown() output into it"
    )


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_loads_from_yaml_and_fills_its_knobs(tmp_path, name):
    path = tmp_path / "actor.yaml"
    path.write_text(f"algorithm: {name}\n")
    cfg = load_config(PPOActorConfig, ["--config", str(path)])
    assert {k: getattr(cfg, k) for k in PRESETS[name]} == PRESETS[name]


def test_explicit_yaml_and_override_knobs_win_over_the_preset(tmp_path):
    path = tmp_path / "actor.yaml"
    path.write_text("algorithm: dapo\neps_clip_higher: 0.3\nreward_norm_std_level: none\n")
    cfg = load_config(
        PPOActorConfig,
        [
            "--config",
            str(path),
            "loss_agg_mode=seq-mean-token-mean",
            "use_decoupled_loss=true",
            "rollout_correction.preset=behav_cap",
            "rollout_correction.upper=4",
        ],
    )
    assert cfg.eps_clip_higher == 0.3 and cfg.reward_norm_std_level == "none"
    assert cfg.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.dynamic_sampling and cfg.reward_norm_mean_level == "group"  # still from dapo
    assert cfg.use_decoupled_loss and cfg.rollout_correction.mode == "mask"  # from behav_cap
    assert cfg.rollout_correction.upper == 4.0  # explicit: wins over behav_cap's 5
    # an explicit value equal to the ppo default still wins (grpo has kl_in_reward=false)
    grpo = from_dict(PPOActorConfig, {"algorithm": "grpo", "kl_in_reward": True})
    assert grpo.kl_in_reward


def test_replace_and_reload_of_a_saved_config_keep_the_values():
    cfg = PPOActorConfig(algorithm="gspo", eps_clip=0.01)
    assert dataclasses.replace(cfg, ppo_n_minibatches=2).eps_clip == 0.01
    assert from_dict(PPOActorConfig, dataclasses.asdict(cfg)) == cfg


def test_cross_field_errors_name_the_field_and_the_fix():
    with pytest.raises(ConfigError) as e:
        from_dict(PPOActorConfig, {"algorithm": "grpo", "prox_logp": "recompute_always"})
    assert "prox_logp: recompute_always sets how" in str(e.value)
    assert "set use_decoupled_loss=true, or prox_logp=recompute" in str(e.value)
    with pytest.raises(ConfigError, match=r"rollout_correction.upper must be > 0, got 0"):
        from_dict(PPOActorConfig, {"rollout_correction": {"upper": 0}})
    with pytest.raises(ConfigError, match="did you mean 'dapo'"):
        from_dict(PPOActorConfig, {"algorithm": "dapoo"})


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("decoupled", [False, True])
def test_preset_from_yaml_gives_finite_loss_and_gradient_on_a_random_batch(
    tmp_path, name, decoupled
):
    torch.manual_seed(0)
    path = tmp_path / "actor.yaml"
    path.write_text(f"algorithm: {name}\nkl_ctl: 0.05\nentropy_coeff: 0.01\noverlong_tokens: 4\n")
    cap = ["rollout_correction.mode=mask", "rollout_correction.upper=2.0"]
    over = ["use_decoupled_loss=true", *cap] if decoupled else []
    cfg = load_config(PPOActorConfig, ["--config", str(path), *over])
    cu = torch.tensor([0, 6, 11, 19, 24])
    n, vocab = int(cu[-1]), 13
    input_ids = torch.randint(0, vocab, (n,))
    mask = (torch.arange(n) % 6 > 1).float()  # a prompt of 2 tokens per ~6
    logits = torch.randn(n, vocab, requires_grad=True)
    logp, entropy = packed_token_logprobs(logits, input_ids, cu, 1.0, chunk_size=7)
    behav = (logp + 0.1 * torch.randn(n)).detach()
    ref = (logp + 0.1 * torch.randn(n)).detach()
    adv = compute_advantages(
        torch.randn(4),
        mask,
        cu,
        cfg,
        values=torch.randn(n) if cfg.use_critic else None,
        logprobs=behav,
        ref_logp=ref,
        baseline_rewards=torch.randn(4),
        max_new_tokens=8,
        group_size=2,
    )
    n_tok, n_seq = loss_normalisers(mask, cu)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        behav,
        adv.advantages,
        mask,
        cu,
        cfg,
        entropy=entropy,
        ref_logp=ref,
        global_n_tokens=n_tok,
        global_n_seqs=n_seq,
        max_new_tokens=8,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    assert all(torch.isfinite(v) for v in stats.values())
