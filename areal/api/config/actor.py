"""RL actor and critic config sections (owned by areal.algo).

``actor.algorithm`` names a preset (ppo, grpo, dapo, ...) that fills the knobs listed in
:data:`PRESETS`; any knob given explicitly (YAML, ``a.b=c`` override, or a keyword in Python)
wins. A frozen dataclass cannot tell "set" from "left at default" once built, so the preset is
applied in ``__init__``: the loader passes only the keys it was given, so those are exactly the
explicit ones. ``PPOActorConfig(algorithm="dapo", eps_clip=0.1)`` is DAPO with eps_clip 0.1.
The plain defaults are the ``ppo`` preset (a test keeps them equal); docs/algorithms.md holds
the preset table. A subclass of PPOActorConfig must wrap its own ``__init__`` with
``_with_preset`` to keep this behaviour. ``actor.rollout_correction.preset`` works the same way
over :data:`CORRECTION_PRESETS`.

Renamed keys (``RENAMED``, read by the loader): the behaviour cap, truncated IS and the
always-on proximal pass were knobs of their own; each old key is refused in one line naming its
value and the new spelling (docs/config.md, "Renamed keys").
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from areal.api.config.engine import ENGINE_RENAMED, TrainEngineConfig
from areal.api.config.loader import Renames, param

Algorithm = Literal[
    "ppo",
    "grpo",
    "dapo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "gspo",
    "cispo",
]
NormLevel = Literal["batch", "group", "none"]
ProxLogp = Literal["recompute", "recompute_always", "loglinear", "linear", "reuse"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


@dataclass(frozen=True)
class NormSpec:
    """One normalisation, read from the flat ``reward_norm_*`` / ``adv_norm_*`` knobs."""

    mean_level: str  # batch | group | none
    std_level: str  # batch | group | none
    leave_one_out: bool
    std_unbiased: bool
    eps: float

    @property
    def enabled(self) -> bool:
        """Whether this normalisation changes anything."""
        return self.mean_level != "none" or self.std_level != "none"


# Each preset sets every key below (a test checks the key sets are equal), so the table in
# docs/algorithms.md is complete and the order in which presets were tried never matters.
def _preset(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "use_critic": False,
        "gamma": 1.0,
        "lam": 1.0,
        "reward_norm_mean_level": "none",
        "reward_norm_std_level": "none",
        "reward_norm_leave_one_out": False,
        "adv_norm_mean_level": "none",
        "adv_norm_std_level": "none",
        "remax_baseline": False,
        "kl_in_reward": False,
        "kl_estimator": "k3",
        "policy_loss_type": "ppo",
        "importance_sampling_level": "token",
        "eps_clip": 0.2,
        "eps_clip_higher": None,
        "loss_agg_mode": "token-mean",
        "overlong_reward_penalty": False,
        "dynamic_sampling": False,
    }
    unknown = set(over) - set(base)
    assert not unknown, f"preset keys {unknown} are not preset-controlled"
    return {**base, **over}


_GROUP_MEAN_STD = {"reward_norm_mean_level": "group", "reward_norm_std_level": "group"}
_GROUP_MEAN = {"reward_norm_mean_level": "group"}
_ADV_BATCH = {"adv_norm_mean_level": "batch", "adv_norm_std_level": "batch"}
_KL_REWARD = {"kl_in_reward": True, "kl_estimator": "k1"}

PRESETS: dict[str, dict[str, Any]] = {
    "ppo": _preset(use_critic=True, lam=0.95, **_ADV_BATCH, **_KL_REWARD),
    "grpo": _preset(**_GROUP_MEAN_STD, loss_agg_mode="seq-mean-token-mean"),
    "dapo": _preset(
        **_GROUP_MEAN_STD, eps_clip_higher=0.28, overlong_reward_penalty=True, dynamic_sampling=True
    ),
    "dr_grpo": _preset(**_GROUP_MEAN, loss_agg_mode="seq-mean-token-sum-norm"),
    "rloo": _preset(**_GROUP_MEAN, reward_norm_leave_one_out=True, **_KL_REWARD),
    "reinforce_pp": _preset(**_ADV_BATCH, **_KL_REWARD),
    "reinforce_pp_baseline": _preset(**_GROUP_MEAN, **_ADV_BATCH),
    "remax": _preset(remax_baseline=True, **_KL_REWARD, loss_agg_mode="seq-mean-token-sum"),
    "gspo": _preset(
        **_GROUP_MEAN_STD,
        importance_sampling_level="sequence",
        eps_clip=3e-4,
        eps_clip_higher=4e-4,
        loss_agg_mode="seq-mean-token-mean",
    ),
    "cispo": _preset(
        **_GROUP_MEAN_STD, policy_loss_type="cispo", eps_clip=1.0, eps_clip_higher=4.0
    ),
}


CorrectionPreset = Literal[
    "none", "behav_cap", "tis", "icepop", "seq_mis", "geo_mask", "any_token_mask"
]
CorrectionMode = Literal["none", "truncate", "mask"]
CorrectionLevel = Literal["token", "sequence", "geometric"]


def _rc_preset(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mode": "none",
        "level": "token",
        "upper": 2.0,
        "lower": None,
        "mask_sequence": False,
    }
    assert not set(over) - set(base), f"rollout-correction preset keys {set(over) - set(base)}"
    return {**base, **over}


# Each sets every key of the section; docs/algorithms.md holds the table and the papers.
CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "none": _rc_preset(),
    "behav_cap": _rc_preset(mode="mask", upper=5.0),  # AReaL's behav_imp_weight_cap: 5
    "tis": _rc_preset(mode="truncate", upper=2.0),  # Yao et al. 2025
    "icepop": _rc_preset(mode="mask", lower=0.5, upper=5.0),  # Ling Team 2025
    "seq_mis": _rc_preset(mode="mask", level="sequence", upper=2.0),  # Liu et al. 2025
    "geo_mask": _rc_preset(mode="mask", level="geometric", lower=0.999, upper=1.001),
    "any_token_mask": _rc_preset(mode="mask", lower=0.5, upper=2.0, mask_sequence=True),
}


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """The importance weight w = pi_train / pi_behav between the trainer's policy and the rollout
    (behaviour) policy, for the gap between the rollout engine's and the trainer's probabilities
    and for stale samples (docs/algorithms.md, "Rollout correction"): truncated or masked, per
    token, sequence or geometric mean. pi_train is the proximal policy with
    actor.use_decoupled_loss=true (decoupled PPO's behaviour weight), else the current one,
    detached (the bypass form).

    ``preset`` fills the other knobs (:data:`CORRECTION_PRESETS`); any knob given explicitly
    wins, as with ``actor.algorithm``."""

    preset: CorrectionPreset = param(
        "none",
        help="Named settings filling the knobs below (docs/algorithms.md); explicit knobs win.",
    )
    mode: CorrectionMode = param(
        "none",
        help="truncate: weight min(w, upper) (TIS); mask: weight w inside [lower, upper], "
        "0 outside (behaviour cap, MIS, IcePop); none: no bound (the decoupled loss keeps its "
        "weight w as is; without it there is no weight).",
    )
    level: CorrectionLevel = param(
        "token",
        help="w per token, per sequence (the product of its token ratios), or per "
        "sequence as their geometric mean.",
    )
    upper: float = param(2.0, gt=0, help="Upper bound of w (truncate and mask).")
    lower: float | None = param(
        None, gt=0, help="mask: lower bound of w (IcePop's two-sided band); null = none."
    )
    mask_sequence: bool = param(
        False,
        help="mask at token level: drop a whole sequence when any of its tokens leaves the band.",
    )

    def check(self) -> Iterator[str]:
        if self.mode == "truncate" and self.lower is not None:
            yield (
                f"lower: {self.lower} with mode=truncate; truncation has no lower bound, set "
                "lower=null"
            )
        if self.lower is not None and self.lower >= self.upper:
            yield f"lower: {self.lower} >= upper={self.upper}; the band must be lower < upper"
        if self.mask_sequence and (self.mode != "mask" or self.level != "token"):
            yield (
                f"mask_sequence: true with mode={self.mode}, level={self.level}; it needs "
                "mode=mask and level=token"
            )
        if self.mode == "none" and self.level == "sequence":
            yield (
                "level: sequence with mode=none; an unbounded product of token ratios "
                "overflows, use mode=truncate or mask, or level=geometric"
            )


# -- renamed keys: old key -> its new spelling, given its value and the actor section as written
def _behav_cap(value: Any, actor: dict) -> list[str]:
    """``C``: ``rollout_correction.mode=mask rollout_correction.upper=C`` (``mode=truncate``
    where ``behav_imp_weight_mode: clamp``); ``null``: delete it."""
    if value is None:  # no cap: the default
        return []
    mode = "truncate" if actor.get("behav_imp_weight_mode") == "clamp" else "mask"
    return [f"rollout_correction.mode={mode}", f"rollout_correction.upper={value}"]


def _behav_mode(value: Any, actor: dict) -> list[str]:
    """With a cap: ``mask``: ``rollout_correction.mode=mask``; ``clamp``:
    ``rollout_correction.mode=truncate``. Without one: delete it."""
    if actor.get("behav_imp_weight_cap") is None:  # a mode without a cap bounded nothing
        return []
    return [f"rollout_correction.mode={'truncate' if value == 'clamp' else 'mask'}"]


def _behav_level(value: Any, actor: dict) -> list[str]:
    """``sequence`` (a geometric mean) with ``use_decoupled_loss: true``:
    ``rollout_correction.level=geometric``; otherwise delete it."""
    decoupled = actor.get("use_decoupled_loss") is True  # the weight existed only there
    return ["rollout_correction.level=geometric"] if value == "sequence" and decoupled else []


def _tis_cap(value: Any, actor: dict) -> list[str]:
    """``C``: ``use_decoupled_loss=true rollout_correction.mode=truncate
    rollout_correction.upper=C`` (TIS against the trainer's proximal logprobs: the ``tis``
    preset with ``upper=C``; the old key weighed only when a caller passed them, which the
    trainer never did); ``null``: delete it."""
    if value is None:
        return []
    upper = f"rollout_correction.upper={value}"
    return ["use_decoupled_loss=true", "rollout_correction.mode=truncate", upper]


def _recompute_prox(value: Any, actor: dict) -> list[str]:
    """``true``: ``prox_logp=recompute_always``; ``false``: delete it."""
    return ["prox_logp=recompute_always"] if value is True else []


def _form(value: Any, actor: dict) -> list[str]:
    """With a correction on: ``decoupled``: ``use_decoupled_loss=true``; ``bypass``:
    ``use_decoupled_loss=false``. With ``mode: none``: delete it."""
    correction = actor.get("rollout_correction")
    mode = correction.get("mode") if isinstance(correction, dict) else None
    if mode in (None, "none"):  # the form mattered only with a correction on
        return []
    return [f"use_decoupled_loss={'false' if value == 'bypass' else 'true'}"]


ACTOR_RENAMED: Renames = {
    **ENGINE_RENAMED,
    "behav_imp_weight_cap": _behav_cap,
    "behav_imp_weight_mode": _behav_mode,
    "behav_imp_weight_level": _behav_level,
    "tis_cap": _tis_cap,
    "recompute_prox_logp": _recompute_prox,
    "rollout_correction.form": _form,
}


@dataclass(frozen=True)
class PPOActorConfig(TrainEngineConfig):
    """The policy trained by PPO-family algorithms: preset, advantages, loss and reward knobs."""

    RENAMED: ClassVar[Renames] = ACTOR_RENAMED

    algorithm: Algorithm = param(
        "ppo", help="Preset filling the knobs listed in docs/algorithms.md; explicit knobs win."
    )
    ppo_n_minibatches: int = param(1, ge=1, help="Optimizer steps per batch (PPO minibatches).")
    max_skipped_steps: int = param(
        3,
        ge=0,
        help="Stop the run after this many train steps in a row whose every optimizer update was "
        "skipped (a non-finite loss or grad norm: NaN/inf rewards, a diverged model), naming "
        "the last reason; each such step is a warning. 0 = never stop.",
    )
    # -- advantages --------------------------------------------------------------------------
    use_critic: bool = param(
        True,
        help="Train a critic (PPOCriticConfig) and use its values in GAE; false = no critic "
        "(values 0).",
    )
    gamma: float = param(1.0, ge=0, le=1, help="Discount factor (GAE and returns).")
    lam: float = param(0.95, ge=0, le=1, help="GAE lambda; 1 with no critic = return-to-go.")
    reward_norm_mean_level: NormLevel = param(
        "none",
        help="Mean subtracted from per-sequence rewards: over the batch (all DP ranks), "
        "the prompt's group, or none.",
    )
    reward_norm_std_level: NormLevel = param(
        "none", help="Std the rewards are divided by: over the batch, the group, or none."
    )
    reward_norm_leave_one_out: bool = param(
        False, help="Reward mean excludes the sequence itself (RLOO baseline); std includes it."
    )
    reward_norm_std_unbiased: bool = param(False, help="Bessel-corrected reward std (n-1).")
    reward_norm_eps: float = param(1e-5, gt=0, help="Added to the reward std before dividing.")
    adv_norm_mean_level: NormLevel = param(
        "batch",
        help="Mean subtracted from advantages (over loss-mask tokens): batch, group, or none.",
    )
    adv_norm_std_level: NormLevel = param(
        "batch", help="Std the advantages are divided by: over the batch, the group, or none."
    )
    adv_norm_leave_one_out: bool = param(
        False, help="Advantage mean excludes the tokens of the token's own sequence."
    )
    adv_norm_std_unbiased: bool = param(False, help="Bessel-corrected advantage std (n-1).")
    adv_norm_eps: float = param(1e-5, gt=0, help="Added to the advantage std before dividing.")
    remax_baseline: bool = param(
        False,
        help="Subtract the reward of a greedy rollout of the same prompt (ReMax); the "
        "workflow supplies it.",
    )
    # -- reward shaping ----------------------------------------------------------------------
    reward_bias: float = param(0.0, help="Added to every reward (before scaling).")
    reward_scaling: float = param(1.0, help="Rewards are multiplied by this (after the bias).")
    reward_clip: float | None = param(
        None, gt=0, help="Clip rewards to [-c, c] after bias and scaling; null = no clip."
    )
    overlong_reward_penalty: bool = param(
        False,
        help="DAPO soft overlong punishment: a penalty linear in tokens beyond "
        "max_new_tokens - overlong_tokens.",
    )
    overlong_tokens: int = param(
        64, ge=1, help="Length of the soft-punishment interval before max_new_tokens (tokens)."
    )
    overlong_penalty_factor: float = param(
        1.0, ge=0, help="Penalty at max_new_tokens; it grows linearly from 0 over the interval."
    )
    mask_no_eos_with_zero: bool = param(
        False, help="Reward 0 for sequences that ended without EOS (truncated)."
    )
    dynamic_sampling: bool = param(
        False,
        help="Reject groups whose rewards are all equal (the rollout executor refills the batch).",
    )
    # -- KL to the reference policy ------------------------------------------------------------
    kl_ctl: float = param(0.0, ge=0, help="KL coefficient beta; 0 = no reference model needed.")
    kl_estimator: Literal["k1", "k2", "k3"] = param(
        "k1", help="KL estimator: k1 = log ratio, k2 = half squared log ratio, k3 = low-variance."
    )
    kl_in_reward: bool = param(
        True,
        help="Per-token -beta*KL in the reward (PPO style); false = beta*KL loss term "
        "(GRPO style).",
    )
    # -- policy loss ---------------------------------------------------------------------------
    policy_loss_type: Literal["ppo", "cispo"] = param(
        "ppo", help="ppo: clipped surrogate; cispo: clipped stop-gradient IS weight times logp."
    )
    importance_sampling_level: Literal["token", "sequence"] = param(
        "token", help="Ratio per token, or per sequence as a geometric mean (GSPO)."
    )
    eps_clip: float = param(0.2, gt=0, le=1, help="Lower clip: the ratio is kept >= 1-eps_clip.")
    eps_clip_higher: float | None = param(
        None,
        gt=0,
        help="Upper clip: ratio <= 1+eps_clip_higher (DAPO clip-higher); null = eps_clip.",
    )
    c_clip: float | None = param(
        None,
        gt=1,
        help="Dual clip: for negative advantages the loss is capped at c_clip*|A|; null = off.",
    )
    loss_agg_mode: LossAggMode = param(
        "token-mean", help="How token losses are averaged; see docs/algorithms.md."
    )
    entropy_coeff: float = param(0.0, ge=0, help="Entropy bonus weight (subtracted from loss).")
    use_decoupled_loss: bool = param(
        False,
        help="Decoupled PPO: ratio against the proximal policy (the weights before this "
        "update), times the behaviour weight pi_prox/pi_behav (bounded by rollout_correction); "
        "false = ratio against the behaviour policy.",
    )
    prox_logp: ProxLogp = param(
        "recompute",
        help="Decoupled loss, proximal logprobs: recompute = exact, a forward pass only where "
        "the update's own forward cannot give them (several PPO minibatches, KL in the reward); "
        "recompute_always = exact, a forward pass every step; loglinear / linear = interpolated "
        "from the behaviour and current logprobs by each token's version distance, in log or "
        "probability space (no extra pass); reuse = the behaviour logprobs.",
    )
    rollout_correction: RolloutCorrectionConfig = param(
        factory=RolloutCorrectionConfig,
        help="The off-policy weighting; decoupled PPO's behaviour cap, TIS, MIS and IcePop are "
        "its presets.",
    )

    @property
    def reward_norm(self) -> NormSpec:
        """The per-sequence reward normalisation."""
        return NormSpec(
            self.reward_norm_mean_level,
            self.reward_norm_std_level,
            self.reward_norm_leave_one_out,
            self.reward_norm_std_unbiased,
            self.reward_norm_eps,
        )

    @property
    def uses_groups(self) -> bool:
        """Whether a normalisation or the sampling filter compares a group's samples."""
        levels = [n.mean_level for n in (self.reward_norm, self.adv_norm)]
        levels += [n.std_level for n in (self.reward_norm, self.adv_norm)]
        return "group" in levels or self.dynamic_sampling

    @property
    def adv_norm(self) -> NormSpec:
        """The per-token advantage normalisation."""
        return NormSpec(
            self.adv_norm_mean_level,
            self.adv_norm_std_level,
            self.adv_norm_leave_one_out,
            self.adv_norm_std_unbiased,
            self.adv_norm_eps,
        )

    def check(self) -> Iterator[str]:
        if self.prox_logp != "recompute" and not self.use_decoupled_loss:
            yield (
                f"prox_logp: {self.prox_logp} sets how the decoupled loss's proximal policy is "
                "found; set use_decoupled_loss=true, or prox_logp=recompute"
            )
        if self.remax_baseline and self.use_critic:
            yield (
                "remax_baseline: true with use_critic=true; ReMax replaces the critic, "
                "set use_critic=false"
            )
        upper = self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher
        if self.policy_loss_type == "ppo" and self.eps_clip >= 1 and upper >= 1:
            yield (
                f"eps_clip: {self.eps_clip} with eps_clip_higher={upper} clips nothing in PPO; "
                "use values below 1 (0.2 is usual)"
            )

    @property
    def approximates_prox(self) -> bool:
        """Whether the proximal logprobs are estimated from the behaviour and current ones (no
        forward pass for them; :func:`areal.algo.correction.approx_prox_logp`)."""
        return self.prox_logp in ("loglinear", "linear", "reuse")

    @property
    def needs_prox_pass(self) -> bool:
        """Whether a step runs the extra proximal-logprob forward (decoupled loss, exact
        proximal logprobs, and the trained weights differ from the proximal ones: several
        minibatches or KL in the advantages; or ``prox_logp=recompute_always``). Core builds its
        graph from it."""
        if not self.use_decoupled_loss or self.prox_logp == "recompute_always":
            return self.use_decoupled_loss
        kl_in_advantages = self.kl_ctl > 0 and self.kl_in_reward
        needed = self.ppo_n_minibatches > 1 or kl_in_advantages
        return self.prox_logp == "recompute" and needed


def _with_preset(presets: dict[str, dict[str, Any]], key: str, default: str):
    """Wrap a dataclass __init__: knobs not passed explicitly come from the preset ``key`` names
    (``default`` when not passed); a bad name fills nothing (the loader reports it)."""

    def wrap(init):
        @functools.wraps(init)
        def __init__(self, **kwargs: Any) -> None:
            init(self, **{**presets.get(kwargs.get(key, default), {}), **kwargs})

        return __init__

    return wrap


# The loader passes only the keys present in YAML/overrides, so "explicitly set" is exactly
# "passed to __init__"; dataclasses.replace() passes every field, so it never re-applies a preset.
_actor_init = _with_preset(PRESETS, "algorithm", "ppo")(PPOActorConfig.__init__)
_correction_init = _with_preset(CORRECTION_PRESETS, "preset", "none")(
    RolloutCorrectionConfig.__init__
)
PPOActorConfig.__init__ = _actor_init  # type: ignore[method-assign]
RolloutCorrectionConfig.__init__ = _correction_init  # type: ignore[method-assign]


@dataclass(frozen=True)
class PPOCriticConfig(TrainEngineConfig):
    """The value model trained alongside a PPO actor (actor.use_critic=true)."""

    ppo_n_minibatches: int = param(1, ge=1, help="Optimizer steps per batch (PPO minibatches).")
    value_eps_clip: float | None = param(
        0.2, gt=0, help="Clip new values to old +- this (clipped value loss); null = unclipped."
    )
    value_norm: bool = param(
        False,
        help="Train on returns normalised by running mean/std; values are de-normalised for GAE.",
    )
    loss_agg_mode: LossAggMode = param("token-mean", help="How token value losses are averaged.")
