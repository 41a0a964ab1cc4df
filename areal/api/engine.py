"""Engine interfaces. Implementations live in ``areal.engine``.

``InferenceEngine`` is deliberately small (agenerate, update_weights, version, pause, resume):
batching and submission policy live in the workflow executor, not here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from areal.api.io import FinetuneSpec, ModelRequest, ModelResponse, WeightUpdateMeta
from areal.api.protocols import Persistent, WeightSource
from areal.utils.batch import PackedBatch

# loss_fn(logits [T, V], micro_batch) -> (scalar loss, stats); the engine weights each micro-batch's
# loss by loss_weight_fn(micro_batch) / global sum of weights, so accumulation equals one big batch.
LossFn = Callable[[torch.Tensor, PackedBatch], tuple[torch.Tensor, dict[str, float]]]
LossWeightFn = Callable[[PackedBatch], float]
# post_hook(logits [T, V], micro_batch) -> per-token tensor [T, ...] (logprobs, values, entropy)
PostHook = Callable[[torch.Tensor, PackedBatch], torch.Tensor]
# What every model function returns (compute_logp, compute_values, compute_advantages,
# ppo_update, train_lm, ...): the input batch with its named fields added, and stats. This
# uniform shape is what a dataflow graph of model function calls (Core mode) names.
ModelFnResult = tuple[PackedBatch, dict[str, float]]


class InferenceEngine(abc.ABC):
    """Generates tokens; its weights can be replaced while it runs."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion for ``req`` (re-submitting after interruptions)."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Load new weights on every server; returns when all servers report ``meta.version``."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The weight version new tokens are generated with."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the version (after a weight update or on resume)."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop generating: in-flight requests are aborted and re-submitted after resume()."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Accept and continue work again."""


class TokenScorer(abc.ABC):
    """Scores given tokens under a served model (a distillation teacher); no sampling."""

    @abc.abstractmethod
    async def ascore(self, input_ids: list[int], start: int) -> list[float]:
        """``log p(input_ids[t] | input_ids[:t])`` for ``t`` in ``start..len(input_ids)-1``."""


class TrainEngine(WeightSource, Persistent, abc.ABC):
    """A sharded model with an optimizer; every rank calls the same methods (SPMD). It is the
    weight source of a weight update and saves/loads itself (:mod:`areal.api.protocols`)."""

    @abc.abstractmethod
    def initialize(self, ft_spec: FinetuneSpec | None) -> None:
        """Load/shard the model and build optimizer and LR schedule (sized by ``ft_spec``)."""

    @abc.abstractmethod
    def train_batch(
        self, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (micro-batched); returns loss stats, grad norm, lr."""

    @abc.abstractmethod
    @torch.no_grad()
    def forward(self, batch: PackedBatch, post_hook: PostHook) -> torch.Tensor:
        """Gradient-free micro-batched forward; concatenates ``post_hook`` outputs, shape
        [T, ...]."""

    @abc.abstractmethod
    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one step (decoupled from train_batch)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Free the model and process groups."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict on CPU, HF names, for in-process handoff to a generator."""
