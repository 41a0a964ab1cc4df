"""Top-level configs, one per entry script: SFT, reward model, and GRPO / PPO (RL)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.base import BaseExperimentConfig, GenerationHyperparameters
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.loader import param
from areal.api.config.reward import RewardConfig, WorkflowConfig, reward_fn_problem
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.config.server import GenerationServerConfig


def _greedy() -> GenerationHyperparameters:
    return GenerationHyperparameters(n_samples=1, greedy=True)


@dataclass(frozen=True)
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning (examples/sft.py)."""

    model: TrainEngineConfig = param(factory=TrainEngineConfig, help="The model being trained.")

    def check(self) -> Iterator[str]:
        yield from super().check()
        if self.cluster.n_servers:
            yield f"cluster.n_servers: SFT uses no generation servers, got {self.cluster.n_servers}; set 0"
        if self.train_dataset.type != "sft":
            yield (
                f"train_dataset.type: SFT needs 'sft' data, got {self.train_dataset.type!r}; "
                "set train_dataset.type=sft"
            )


@dataclass(frozen=True)
class RWConfig(BaseExperimentConfig):
    """Reward-model training on preference pairs (examples/rm.py)."""

    model: TrainEngineConfig = param(factory=TrainEngineConfig, help="Backbone + value head.")

    def check(self) -> Iterator[str]:
        yield from super().check()
        if self.train_dataset.type != "rw":
            yield f"train_dataset.type: RM needs 'rw' data, got {self.train_dataset.type!r}; set train_dataset.type=rw"
        if self.model.mb_spec.granularity % 2:
            yield (
                f"model.mb_spec.granularity: must be even so pairs stay together, got "
                f"{self.model.mb_spec.granularity}; set model.mb_spec.granularity=2"
            )


@dataclass(frozen=True)
class GRPOConfig(BaseExperimentConfig):
    """RL with verifiable rewards: GRPO and every preset of ``actor.algorithm`` (PPO with a
    critic when ``actor.use_critic``), synchronous (``rollout.max_staleness=0``) or async.

    Derived, never set twice: the group size is ``gconfig.n_samples``; the temperature of the
    trainer's logprobs is ``gconfig.temperature`` (the behaviour policy's); groups per batch on
    each rank are ``train_dataset.batch_size / (cluster.trainer_nprocs * cluster.n_nodes)``.
    """

    actor: PPOActorConfig = param(factory=PPOActorConfig, help="The policy being trained.")
    critic: PPOCriticConfig | None = param(None, help="Value model; needed when actor.use_critic.")
    ref: TrainEngineConfig | None = param(
        None, help="Frozen reference policy for the KL term; needed when actor.kl_ctl > 0."
    )
    gconfig: GenerationHyperparameters = param(
        factory=GenerationHyperparameters, help="Sampling for training rollouts."
    )
    eval_gconfig: GenerationHyperparameters = param(
        factory=_greedy, help="Sampling for held-out evaluation (greedy by default)."
    )
    rollout: InferenceEngineConfig = param(
        factory=InferenceEngineConfig, help="Inference client and staleness control."
    )
    server: GenerationServerConfig = param(
        factory=GenerationServerConfig, help="Our generation server (launcher-started)."
    )
    reward: RewardConfig = param(factory=RewardConfig, help="Reward worker pool and failure policy.")
    workflow: WorkflowConfig = param(factory=WorkflowConfig, help="Rollout workflow knobs.")
    reward_fn: str = param(
        "math", help="Reward: math (math_reward, answers), code (code_reward, test cases), or "
        "your function by import path 'module:function' (module beside the entry script or on "
        "PYTHONPATH; fn(completion, reference[, prompt]) -> float). eval/accuracy is the mean of "
        "this reward over greedy held-out completions."
    )
    weight_update_mode: Literal["disk", "distributed"] = param(
        "disk", help="How new weights reach servers: a versioned HF dir, or a gloo/NCCL broadcast."
    )

    @property
    def served_model_path(self) -> str:
        """Servers start from the actor's initial weights."""
        return self.actor.path

    def check(self) -> Iterator[str]:
        problem = reward_fn_problem(self.reward_fn)
        if problem:
            yield problem
        yield from super().check()
        a = self.actor
        if a.uses_groups and self.gconfig.n_samples < 2:
            yield (
                f"gconfig.n_samples: {self.gconfig.n_samples} with group-level normalisation or "
                f"dynamic sampling (actor.algorithm={a.algorithm}) leaves nothing to compare; "
                "set gconfig.n_samples >= 2"
            )
        if a.overlong_reward_penalty and not 0 < a.overlong_tokens < self.gconfig.max_new_tokens:
            yield (
                f"actor.overlong_tokens: {a.overlong_tokens} must be in (0, gconfig.max_new_tokens="
                f"{self.gconfig.max_new_tokens}); lower it or set actor.overlong_reward_penalty=false"
            )
        if self.actor.use_critic and self.critic is None:
            yield "critic: actor.use_critic=true needs a critic section; set critic.path=MODEL_DIR"
        if self.actor.kl_ctl > 0 and self.ref is None:
            yield f"ref: actor.kl_ctl={self.actor.kl_ctl} needs a reference model; set ref.path=MODEL_DIR"
        if self.cluster.n_servers == 0 and not self.rollout.addresses:
            yield "cluster.n_servers: 0 and no rollout.addresses; RL needs servers (set 1 or more)"
        if self.train_dataset.type != "rl":
            yield f"train_dataset.type: RL needs 'rl' data, got {self.train_dataset.type!r}; set train_dataset.type=rl"
        ranks = self.cluster.trainer_nprocs * self.cluster.n_nodes
        if ranks > 0 and self.train_dataset.batch_size % ranks:
            yield (
                f"train_dataset.batch_size: {self.train_dataset.batch_size} is not divisible by the "
                f"{ranks} trainer ranks (cluster.trainer_nprocs x cluster.n_nodes)"
            )
