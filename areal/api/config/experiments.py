"""Top-level configs, one per entry script: SFT, reward model, DPO, and GRPO / PPO (RL)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from areal.api.config.actor import PRESETS, PPOActorConfig, PPOCriticConfig
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
            yield (
                f"cluster.n_servers: SFT uses no generation servers, got {self.cluster.n_servers}; "
                "set 0"
            )
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
            yield (
                f"train_dataset.type: RM needs 'rw' data, got {self.train_dataset.type!r}; set "
                "train_dataset.type=rw"
            )
        if self.model.mb_spec.granularity % 2:
            yield (
                f"model.mb_spec.granularity: must be even so pairs stay together, got "
                f"{self.model.mb_spec.granularity}; set model.mb_spec.granularity=2"
            )


@dataclass(frozen=True)
class DPOLossConfig:
    """Preference loss of DPO training (areal.algo.dpo: formulas in docs/algorithms.md)."""

    loss_type: Literal["sigmoid", "ipo", "simpo"] = param(
        "sigmoid",
        help="sigmoid: DPO; ipo: squared loss to a finite log-ratio gap; simpo: "
        "length-normalised, reference-free, with margin `gamma`.",
    )
    beta: float = param(
        0.1, gt=0, help="Inverse temperature of the implicit reward (DPO/IPO: 0.01-0.5; SimPO: ~2)."
    )
    label_smoothing: float = param(
        0.0,
        ge=0,
        lt=0.5,
        help="Assumed fraction of flipped labels (conservative DPO); sigmoid "
        "and simpo only; 0 = plain loss.",
    )
    gamma: float = param(0.0, ge=0, help="SimPO's target reward margin (simpo only; ~0.5-1.5).")
    nll_coef: float = param(
        0.0,
        ge=0,
        help="Weight of the chosen replies' mean token NLL added to the loss (the RPO "
        "regulariser; keeps the chosen answers' likelihood from falling); 0 = off.",
    )
    ref_logp: Literal["precompute", "online"] = param(
        "precompute",
        help="precompute: reference logprobs of every pair once before training, "
        "then the reference is freed; online: the reference model stays and runs every step.",
    )

    def check(self) -> Iterator[str]:
        if self.loss_type == "ipo" and self.label_smoothing:
            yield (
                f"label_smoothing: {self.label_smoothing} is not defined for ipo (its target "
                "gap already bounds the loss); set label_smoothing=0"
            )
        if self.loss_type == "simpo" and self.ref_logp == "online":
            yield (
                "ref_logp: online has no effect with loss_type=simpo (reference-free); "
                "leave ref_logp=precompute"
            )
        if self.loss_type != "simpo" and self.gamma:
            yield (
                f"gamma: {self.gamma} is SimPO's margin and has no effect with "
                f"loss_type={self.loss_type}; set gamma=0 or loss_type=simpo"
            )


@dataclass(frozen=True)
class DPOConfig(BaseExperimentConfig):
    """Direct preference optimisation on (chosen, rejected) pairs (examples/dpo.py).

    Data: ``train_dataset.type=rw`` pairs read by :mod:`areal.dataset.preference` (``prompt`` or
    ``messages``, ``chosen``, ``rejected``; HF conversation layouts too)."""

    model: TrainEngineConfig = param(factory=TrainEngineConfig, help="The policy being trained.")
    ref: TrainEngineConfig | None = param(
        None,
        help="Frozen reference policy for sigmoid/ipo; null = a frozen copy of `model` "
        "(same path and settings: the standard DPO reference, the starting policy).",
    )
    dpo: DPOLossConfig = param(
        factory=DPOLossConfig, help="Preference loss and reference logprobs."
    )

    def check(self) -> Iterator[str]:
        yield from super().check()
        if self.cluster.n_servers:
            yield (
                f"cluster.n_servers: DPO uses no generation servers, got {self.cluster.n_servers}; "
                "set 0"
            )
        for name in ("train_dataset", "valid_dataset"):
            data = getattr(self, name)
            if data is not None and data.type != "rw":
                yield (
                    f"{name}.type: DPO needs preference pairs ('rw'), got {data.type!r}; "
                    f"set {name}.type=rw"
                )
        for name in ("model", "ref"):
            engine = getattr(self, name)
            if engine is not None and engine.mb_spec.granularity % 2:
                yield (
                    f"{name}.mb_spec.granularity: must be even so pairs stay together, got "
                    f"{engine.mb_spec.granularity}; set {name}.mb_spec.granularity=2"
                )
        if self.dpo.loss_type == "simpo" and self.ref is not None:
            yield "ref: simpo is reference-free and would not use it; set ref=null"


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation: a teacher's servers score the student's samples, and the per-token
    reverse KL is the advantage (docs/algorithms.md, "On-policy distillation")."""

    teacher_path: str = param(
        "",
        help="Teacher model dir (same tokenizer as actor.path, any size); empty = no distillation.",
    )
    coef: float = param(1.0, ge=0, help="Weight of the advantage log pi_teacher - log pi_student.")
    reward_weight: float = param(
        0.0, ge=0, help="Weight of the task reward's advantage mixed in (0 = pure distillation)."
    )
    n_servers: int = param(
        1,
        ge=0,
        help="Teacher servers the launcher starts (the server section's settings, the "
        "teacher's weights; never updated); 0 with addresses.",
    )
    addresses: list[str] = param(
        factory=list,
        help="host:port of teacher servers started by hand (ours, SGLang); then "
        "n_servers must be 0.",
    )
    timeout: float = param(120.0, gt=0, help="Seconds the teacher may take to score one group.")
    baseline: Literal["none", "others"] = param(
        "none",
        help="'others': subtract from each sequence's log ratio the mean reverse KL of the "
        "other sequences of its rank's batch (unbiased, lower variance); 'none': the raw ratio.",
    )

    @property
    def enabled(self) -> bool:
        """Whether the run distils."""
        return bool(self.teacher_path)

    def check(self) -> Iterator[str]:
        if self.addresses and self.n_servers:
            yield (
                f"n_servers: {self.n_servers} with addresses given; the launcher starts no teacher "
                "server when you name them, set n_servers=0"
            )
        if self.coef == 0 and self.enabled:
            yield "coef: 0 ignores the teacher; set coef > 0, or teacher_path empty"


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
        None,
        help="Frozen reference policy for the KL term; needed when actor.kl_ctl > 0, unless "
        "actor.lora is on (null = the actor's frozen base, adapters disabled).",
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
    reward: RewardConfig = param(
        factory=RewardConfig, help="Reward worker pool and failure policy."
    )
    workflow: WorkflowConfig = param(factory=WorkflowConfig, help="Rollout workflow knobs.")
    reward_fn: str = param(
        "math",
        help="Reward: math (math_reward, answers), code (code_reward, test cases), or "
        "your function by import path 'module:function' (module beside the entry script or on "
        "PYTHONPATH; fn(completion, reference[, prompt]) -> float). eval/accuracy is the mean of "
        "this reward over greedy held-out completions.",
    )
    weight_update_mode: Literal["disk", "distributed", "ipc"] = param(
        "disk",
        help="How new weights reach servers: disk (a versioned HF dir), distributed (the "
        "broadcast: trainer rank 0 sends every tensor over a gloo group on CPU, NCCL on GPU, to "
        "our servers, vLLM's workers and SGLang) or ipc (a server on the trainer's machine and "
        "GPU copies the trainer's tensors through CUDA IPC handles, shared memory on CPU; "
        "rollout.backend=areal, one node, Lite only). docs/serving.md#weight-updates.",
    )
    weight_update_dir: str = param(
        "",
        help="Disk weight updates: where the HF dirs v<version> go (under "
        "EXPERIMENT/TRIAL); empty = RUN_DIR/weights. A tmpfs such as /dev/shm/areal keeps them in "
        "memory, so with the server on the trainer's GPU (cluster.colocate) no update touches the "
        "disk; every server must be able to read it.",
    )
    distill: DistillConfig = param(
        factory=DistillConfig, help="On-policy distillation from a teacher model (off by default)."
    )

    @property
    def served_model_path(self) -> str:
        """Servers start from the actor's initial weights."""
        return self.actor.path

    @property
    def weights_dir(self) -> Path:
        """Where disk weight updates write ``v<version>`` (``weight_update_dir``, else
        RUN_DIR/weights); a generation server the launcher restarts loads the newest."""
        if self.weight_update_dir:
            return (
                Path(self.weight_update_dir).expanduser() / self.experiment_name / self.trial_name
            )
        return super().weights_dir

    def distill_problems(self, scored_by: str = "servers") -> Iterator[str]:
        """Distillation's cross-section rules; ``scored_by``: the teacher's ``servers`` (Lite) or a
        ``teacher`` node on the model workers (Core), which has none."""
        d = self.distill
        if not d.enabled:
            return
        if self.gconfig.temperature != 1.0:
            yield (
                f"gconfig.temperature: {self.gconfig.temperature} with distillation; the teacher "
                "scores at temperature 1, so the student must sample at 1 (set "
                "gconfig.temperature=1)"
            )
        has_servers = bool(d.addresses or d.n_servers)
        if scored_by == "servers" and not has_servers:
            yield (
                "distill.n_servers: 0 and no distill.addresses; the teacher needs a server (set "
                "n_servers=1)"
            )
        if scored_by == "teacher" and has_servers:
            yield (
                "distill.n_servers: Core scores with a teacher node on the model workers; set "
                "distill.n_servers=0 and leave distill.addresses empty"
            )

    def server_restart_blocker(self) -> str:
        """Why a launcher cannot restart a generation server that dies ('' when it can, up to
        ``launcher.server_restarts`` times); the launchers and the trainer's client both ask."""
        if self.rollout.backend != "areal":
            return f"rollout.backend={self.rollout.backend} servers are not restarted"
        if self.weight_update_mode != "disk":
            return (
                "a restarted server cannot join the running weight broadcast group, nor find "
                f"weights on disk (weight_update_mode={self.weight_update_mode})"
            )
        return ""

    def check(self) -> Iterator[str]:
        problem = reward_fn_problem(self.reward_fn)
        if problem:
            yield problem
        yield from super().check()
        yield from self.distill_problems()
        a = self.actor
        if a.uses_groups and self.gconfig.n_samples < 2:
            yield (
                f"gconfig.n_samples: {self.gconfig.n_samples} with group-level normalisation or "
                f"dynamic sampling (actor.algorithm={a.algorithm}) leaves nothing to compare; "
                "set gconfig.n_samples >= 2"
            )
        if a.overlong_reward_penalty and not 0 < a.overlong_tokens < self.gconfig.max_new_tokens:
            yield (
                f"actor.overlong_tokens: {a.overlong_tokens} must be in (0, "
                f"gconfig.max_new_tokens={self.gconfig.max_new_tokens}); lower it or set "
                "actor.overlong_reward_penalty=false"
            )
        # an unknown actor.algorithm is reported by itself: its preset (critic or not) is unknown
        if self.actor.use_critic and self.critic is None and self.actor.algorithm in PRESETS:
            yield (
                f"critic: actor.algorithm={self.actor.algorithm!r} trains a critic "
                "(actor.use_critic=true) and there is no critic section; set "
                "critic.path=MODEL_DIR, or pick a critic-free algorithm, e.g. actor.algorithm=grpo"
            )
        if (
            self.actor.kl_ctl > 0 and self.ref is None and not self.actor.lora.enabled
        ):  # LoRA: its frozen base
            yield (
                f"ref: actor.kl_ctl={self.actor.kl_ctl} needs a reference model; set "
                "ref.path=MODEL_DIR (or train actor.lora adapters: the frozen base is then the "
                "reference)"
            )
        if self.weight_update_mode == "ipc" and (
            self.rollout.backend != "areal" or self.cluster.n_nodes != 1
        ):
            yield (
                f"weight_update_mode: ipc shares the trainer's tensors with our servers on its "
                f"own machine (rollout.backend={self.rollout.backend}, cluster.n_nodes="
                f"{self.cluster.n_nodes}); use weight_update_mode=distributed"
            )
        if self.cluster.n_servers == 0 and not self.rollout.addresses:
            yield (
                "cluster.n_servers: 0 (the default) and no rollout.addresses; RL needs "
                "generation servers: set cluster.n_servers=1 (or more), or "
                "rollout.addresses=[HOST:PORT] of servers started by hand"
            )
        if self.train_dataset.type != "rl":
            yield (
                f"train_dataset.type: RL needs 'rl' data, got {self.train_dataset.type!r}; set "
                "train_dataset.type=rl"
            )
        ranks = self.cluster.trainer_nprocs * self.cluster.n_nodes
        if ranks > 0 and self.train_dataset.batch_size % ranks:
            yield (
                f"train_dataset.batch_size: {self.train_dataset.batch_size} is not divisible by "
                f"the {ranks} trainer ranks (cluster.trainer_nprocs x cluster.n_nodes)"
            )
