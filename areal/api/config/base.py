"""Config sections shared by every experiment: run naming, optimizer, micro-batches, generation,
datasets, periodic timers (save / eval / recover) and stats logging.

Conventions (see loader.py): frozen dataclasses, every field a :func:`param` with help text and a
real default, bounds declared on the field, cross-field rules in ``check()`` which yields
``"field: problem with value; fix"`` strings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from areal.api.config.data import DatasetConfig
from areal.api.config.launcher import ClusterConfig, LauncherConfig
from areal.api.config.loader import param


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup and a learning-rate schedule."""

    type: Literal["adamw"] = param("adamw", help="Optimizer; AdamW is the one supported.")
    lr: float = param(1e-5, gt=0, help="Peak learning rate.")
    beta1: float = param(0.9, ge=0, lt=1, help="AdamW beta1.")
    beta2: float = param(0.999, ge=0, lt=1, help="AdamW beta2.")
    eps: float = param(1e-8, gt=0, help="AdamW epsilon.")
    weight_decay: float = param(0.01, ge=0, help="Decoupled weight decay.")
    gradient_clipping: float = param(
        1.0, ge=0, help="Max global grad norm; 0 disables clipping (the norm is still reported)."
    )
    warmup_steps_proportion: float = param(
        0.0, ge=0, le=1, help="Fraction of total optimizer steps spent in linear warmup from 0."
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = param(
        "constant", help="Schedule after warmup: constant, linear decay or cosine decay."
    )
    min_lr_ratio: float = param(
        0.0, ge=0, le=1, help="Final lr as a fraction of lr, for linear and cosine schedules."
    )


@dataclass(frozen=True)
class MicroBatchSpec:
    """How a batch is split into micro-batches for forward/backward."""

    n_mbs: int = param(1, ge=1, help="Minimum number of micro-batches per batch.")
    max_tokens_per_mb: int | None = param(
        None,
        ge=1,
        help="Token budget per micro-batch (packed, no padding); null = no budget, n_mbs only.",
    )
    granularity: int = param(
        1, ge=1, help="Keep runs of this many consecutive sequences (a group) in one micro-batch."
    )


@dataclass(frozen=True)
class GenerationHyperparameters:
    """Sampling settings for rollouts and evaluation."""

    n_samples: int = param(1, ge=1, help="Completions per prompt (the group size in GRPO).")
    max_new_tokens: int = param(256, ge=1, help="Maximum tokens generated per completion.")
    min_new_tokens: int = param(0, ge=0, help="EOS and stop strings are ignored before this many.")
    temperature: float = param(
        1.0, ge=1e-4, le=1e4, help="Sampling temperature (ignored when greedy); the servers' range."
    )
    top_p: float = param(1.0, gt=0, le=1, help="Nucleus sampling mass; 1.0 disables it.")
    top_k: int = param(
        -1, ge=-1, le=2**31 - 1, help="Sample from the k most likely tokens; -1 disables it."
    )
    greedy: bool = param(False, help="Take the argmax token (temperature/top_p/top_k ignored).")
    stop_token_ids: list[int] = param([], help="Token ids that end a completion besides EOS.")
    stop: list[str] = param([], help="Strings that end a completion (the string is kept).")
    ignore_eos: bool = param(False, help="Keep generating past EOS up to max_new_tokens.")
    seed: int | None = param(
        None,
        ge=0,
        le=2**62,
        help="Reproducible rollouts (RLVR workflow): sample k of a prompt draws "
        "from its own generator seeded by this, the prompt id, k and the weight version, whatever "
        "else the server batches; null: the server's shared generator.",
    )
    json_schema: str = param(
        "",
        help="Structured outputs: a JSON schema (as JSON text) every completion must match; the "
        "server masks the tokens it forbids. At most one of json_schema, regex, ebnf; empty = "
        "none. Logprobs are then the masked distribution's (docs/serving.md, Structured outputs).",
    )
    regex: str = param(
        "", help="Structured outputs: a regex every completion must match; empty = none."
    )
    ebnf: str = param(
        "",
        help="Structured outputs: a GBNF or Lark grammar every completion must match; "
        "empty = none.",
    )

    @property
    def grammar(self) -> dict[str, str]:
        """The one structured-output field set, as ``{name: value}`` (empty when none)."""
        return {
            k: v
            for k, v in (
                ("json_schema", self.json_schema),
                ("regex", self.regex),
                ("ebnf", self.ebnf),
            )
            if v
        }

    def check(self) -> Iterator[str]:
        if len(self.grammar) > 1:
            yield (
                "json_schema: set at most one of json_schema, regex and ebnf, "
                f"got {sorted(self.grammar)}; keep one"
            )
        if self.grammar and self.min_new_tokens:
            yield (
                f"min_new_tokens: {self.min_new_tokens} with a grammar "
                f"({next(iter(self.grammar))}); the grammar decides where a completion ends: set "
                "min_new_tokens to 0"
            )
        if self.min_new_tokens > self.max_new_tokens:
            yield (
                f"min_new_tokens: {self.min_new_tokens} exceeds max_new_tokens="
                f"{self.max_new_tokens}; lower min_new_tokens or raise max_new_tokens"
            )


@dataclass(frozen=True)
class TimerConfig:
    """Fire every N epochs, N steps or N seconds, whichever comes first; null disables each."""

    freq_epochs: int | None = param(None, ge=1, help="Fire at the end of every N-th epoch.")
    freq_steps: int | None = param(None, ge=1, help="Fire after every N-th global step.")
    freq_secs: float | None = param(None, gt=0, help="Fire when N seconds passed since the last.")


@dataclass(frozen=True)
class RecoverConfig(TimerConfig):
    """Recover checkpoints (for lossless resume) and automatic relaunch."""

    mode: Literal["disabled", "auto", "resume"] = param(
        "disabled",
        help="disabled: no recover; resume: resume if a checkpoint exists; "
        "auto: resume and relaunch a failed run up to `retries` times.",
    )
    retries: int = param(
        3,
        ge=0,
        help="Relaunches after a failure when mode=auto; a failure whose cause repeats that of "
        "the attempt before is not relaunched.",
    )
    keep: int = param(
        2,
        ge=1,
        help="Recover checkpoints kept on disk, newest first; a resume falls back to an older "
        "one when a newer one is corrupt.",
    )


@dataclass(frozen=True)
class SamplesConfig:
    """Trained samples recorded for ``areal view`` (RUN_DIR/samples/step-<step>-rank<r>.parquet)."""

    enabled: bool = param(
        True,
        help="Record every trained sample of the recorded steps (tokens, text, "
        "reward, advantage, per-token versions and logprobs, staleness).",
    )
    keep_every: int = param(1, ge=1, help="Record the samples of every k-th step (1 = every step).")
    max_bytes: int = param(
        1 << 30,
        ge=0,
        help="Stop recording once RUN_DIR/samples holds this many bytes "
        "(a warning says so; 0 = no limit).",
    )


@dataclass(frozen=True)
class ReplayConfig:
    """Each trained step's trainer inputs and the actor's weight hashes, for ``areal replay``
    (RUN_DIR/replay; docs/viewer.md)."""

    enabled: bool = param(
        False,
        help="Record each step's packed batch, RNG states and actor version, and a "
        "hash of every actor tensor after the step; also turns on "
        "torch.use_deterministic_algorithms so `areal replay` can match bit for bit.",
    )
    keep_weights: bool = param(
        False,
        help="Also keep the actor's full weights after each step "
        "(RUN_DIR/replay/weights-<step>.pt, a model's size per step), so a replay "
        "names the max difference of the first differing tensor, not only its name.",
    )


@dataclass(frozen=True)
class StatsLoggerConfig:
    """Where per-step metrics go."""

    console: bool = param(True, help="Print a table of metrics every step.")
    jsonl: bool = param(True, help="Append one JSON line per step to RUN_DIR/stats.jsonl.")
    tensorboard: bool = param(False, help="Write TensorBoard events to RUN_DIR/tensorboard.")
    wandb: Literal["disabled", "online", "offline"] = param(
        "disabled",
        help=(
            "Weights & Biases mode (needs the wandb extra: `pip install -e '.[wandb]'` in the "
            "areal checkout)."
        ),
    )
    wandb_project: str = param("areal", help="W&B project name.")
    samples: SamplesConfig = param(factory=SamplesConfig, help="Trained samples for `areal view`.")
    replay: ReplayConfig = param(
        factory=ReplayConfig, help="Trainer inputs and weight hashes for `areal replay`."
    )


@dataclass(frozen=True)
class BaseExperimentConfig:
    """Fields every experiment has: naming, seed, data, timers, logging."""

    experiment_name: str = param("areal", help="Experiment name (a folder under fileroot).")
    trial_name: str = param("trial0", help="Trial name (a folder under the experiment).")
    fileroot: str = param("runs", help="Root dir for logs, checkpoints and the resolved config.")
    seed: int = param(1, ge=0, help="Seed for model init, data order and sampling.")
    tokenizer_path: str = param("", help="Tokenizer dir; empty = the model's path.")
    total_train_epochs: int = param(1, ge=1, help="Epochs over the training set.")
    total_train_steps: int | None = param(
        None, ge=1, help="Stop after this many steps even mid-epoch; null = epochs decide."
    )
    train_dataset: DatasetConfig = param(factory=DatasetConfig, help="Training data.")
    valid_dataset: DatasetConfig | None = param(None, help="Held-out data for evaluation.")
    saver: TimerConfig = param(factory=TimerConfig, help="When to export HF checkpoints.")
    evaluator: TimerConfig = param(factory=TimerConfig, help="When to evaluate on valid_dataset.")
    recover: RecoverConfig = param(factory=RecoverConfig, help="Recover checkpoints and relaunch.")
    stats_logger: StatsLoggerConfig = param(factory=StatsLoggerConfig, help="Metric sinks.")
    cluster: ClusterConfig = param(
        factory=ClusterConfig, help="Machines, devices, servers vs trainers."
    )
    launcher: LauncherConfig = param(
        factory=LauncherConfig, help="How `areal launch` runs the processes."
    )

    def check(self) -> Iterator[str]:
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if not re.fullmatch(r"[A-Za-z0-9._-]+", value) or value in (".", ".."):
                yield (
                    f"{name}: {value!r} must be a non-empty folder name of letters, digits, '.', "
                    "'_' or '-' (it names RUN_DIR and the trial's registry keys)"
                )

    @property
    def run_dir(self) -> Path:
        """RUN_DIR = fileroot/experiment_name/trial_name (logs, checkpoints, config.yaml)."""
        return Path(self.fileroot) / self.experiment_name / self.trial_name

    @property
    def weights_dir(self) -> Path:
        """RUN_DIR/weights: the HF dirs ``v<version>`` of disk weight updates; a generation
        server the launcher restarts loads the newest of them."""
        return self.run_dir / "weights"

    @property
    def name_resolve_root(self) -> Path:
        """Root of the trial registry: ``cluster.name_resolve.file_root`` or
        FILEROOT/name_resolve."""
        root = self.cluster.name_resolve.file_root
        return Path(root) if root else Path(self.fileroot) / "name_resolve"

    @property
    def served_model_path(self) -> str:
        """The model generation servers load at launch; experiments with servers override it."""
        return ""
