"""Records that cross component boundaries: generation requests/responses, trajectories, weight
update and save/load metadata. Token ids only: text is carried for logging, never for compute.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from areal.api.config import GenerationHyperparameters

StopReason = Literal["stop", "length", "abort"]


@dataclass
class ModelRequest:
    """One completion request (``gconfig.n_samples`` is ignored: a workflow fans out itself)."""

    input_ids: list[int]
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    group_id: str | None = None  # samples of one group are routed to the same server
    seed: int | None = None  # per-request sampling seed (reproducible sampling)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelResponse:
    """Generated tokens with their behaviour logprobs and the weight version of each token.

    ``output_logprobs[i]`` is log pi(output_ids[i] | prefix) under the sampling distribution the
    server documents (ours: temperature-scaled logits before top-p/top-k truncation).
    """

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0  # seconds, request submitted -> last token
    ttft: float = 0.0  # seconds, request submitted -> first token
    # host:port of the server that generated the tokens; several, comma-separated, in order,
    # when the request failed over or a re-submission went elsewhere
    server: str = ""

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if not (len(self.output_logprobs) == n == len(self.output_versions)):
            raise ValueError(
                f"ModelResponse fields disagree: {n} output_ids, {len(self.output_logprobs)} "
                f"logprobs, {len(self.output_versions)} versions"
            )


class RolloutStatus(str, enum.Enum):
    """Why a trajectory ended. Only completed/truncated ones are trained on by default."""

    COMPLETED = "completed"  # ended with EOS or a stop condition
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # generation aborted and not resumed
    ERROR_REWARD = "error_reward"  # reward function crashed or missed its deadline (reward 0)


@dataclass
class Trajectory:
    """One sampled sequence with everything training needs.

    Per-token lists cover the completion only (``len == len(completion_ids)``). In multi-turn
    episodes the completion interleaves model tokens (loss_mask 1) with injected tokens such as
    feedback messages (loss_mask 0, logprob 0.0, version -1).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour policy log pi_behav per completion token
    versions: list[int]  # weight version that produced each completion token
    loss_mask: list[int]  # 1 = trained on
    reward: float
    status: RolloutStatus
    sample_id: str = ""  # stable id of the dataset item (plus sample index) for logging/recover
    group_id: str = ""
    prompt_text: str = ""  # for logging only
    completion_text: str = ""  # for logging only
    reference: str = ""  # the item's reference answer as text, for logging only (areal view)
    # where it came from, for logging (``areal view``): the generation server(s)
    # (ModelResponse.server; several comma-separated) and the rollout worker that ran the
    # episode (Lite: the trainer rank's executor, "rank<r>"; Core: "worker<i>")
    server: str = ""
    worker: str = ""
    # multi-turn and agent episodes: the completion position of each model turn's first token
    # (the tokens injected after turn k, before turn k+1, count with turn k); [] = one turn
    turn_starts: list[int] = field(default_factory=list)
    # a number per sequence (e.g. ReMax's greedy-baseline reward) or a list of one float per
    # completion token (e.g. a teacher's logprobs): batch fields of the same name
    extras: dict[str, float | list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        lens = (len(self.logprobs), len(self.versions), len(self.loss_mask))
        if any(k != n for k in lens):
            raise ValueError(
                f"Trajectory {self.sample_id!r}: {n} completion tokens but "
                f"logprobs/versions/loss_mask lengths {lens}"
            )
        self.status = RolloutStatus(self.status)


@dataclass
class WeightUpdateMeta:
    """How new weights reach the inference servers: ``disk`` (an HF dir), ``distributed`` (a
    broadcast over a group; byte buckets, or one tensor at a time for SGLang) or ``ipc`` (shared
    tensors handed to a server on the trainer's machine and device)."""

    type: Literal["disk", "distributed", "ipc"]
    path: str | None = None  # disk: HF dir the servers load
    version: int = 0  # the version the servers report after the update
    group_name: str = "areal_weight_update"  # distributed: torch.distributed group name
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: int = 256 << 20  # distributed: max bytes per broadcast bucket
    per_tensor: bool = False  # distributed: one broadcast per tensor (SGLang's layout)
    timeout: float = 300.0  # distributed: seconds to join, and for each collective after
    # ipc, trainer's first rank: hands the shared tensors' handles to the servers and returns
    # once they copied them (the trainer frees the tensors after)
    send_shared: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    shared: dict[str, Any] | None = field(default=None, repr=False)  # ipc: the handles sent


@dataclass
class SaveLoadMeta:
    """What to save/load and where."""

    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer_path: str | None = None


@dataclass
class FinetuneSpec:
    """Sizes the LR schedule needs."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int
    max_train_steps: int | None = None  # the config's total_train_steps cap, if any

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        """Epochs x steps per epoch, capped by ``max_train_steps`` (what the run will do)."""
        n = self.total_train_epochs * self.steps_per_epoch
        return min(n, self.max_train_steps) if self.max_train_steps else n
