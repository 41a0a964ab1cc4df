"""Supervised fine-tuning: next-token NLL on the tokens marked by ``loss_mask``.

Batch fields: token ``input_ids`` and ``loss_mask`` (1 where ``input_ids[t]`` is a target
predicted from the tokens before it; a sequence's first token is never one). The loss is a mean
over all loss-mask tokens of the *global* batch: each micro-batch's mean is weighted by its
token count over the all-reduced total, so the split into micro-batches and ranks does not
change it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from areal.algo.logprob import TokenLogprobs
from areal.api.config.engine import TrainEngineConfig
from areal.api.engine import ModelFnResult
from areal.api.mfc import model_fn
from areal.engine.fsdp import FSDPEngine
from areal.utils.batch import PackedBatch
from areal.utils.comm import all_reduce


def sft_loss(tokens: TokenLogprobs, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean NLL over the micro-batch's loss-mask tokens (their logprobs at temperature 1)."""
    logp = tokens.logp  # [T]
    mask = mb["loss_mask"].to(logp.dtype)
    return -(logp * mask).sum() / mask.sum().clamp(min=1), {}


def n_target_tokens(mb: PackedBatch) -> float:
    """Loss weight of a micro-batch: its number of loss-mask tokens."""
    return float(mb["loss_mask"].sum())


class SFTEngine(FSDPEngine):
    """An LM trained on NLL of loss-mask tokens."""

    def __init__(self, config: TrainEngineConfig, mesh: DeviceMesh):
        super().__init__(config, mesh, head="lm")

    @model_fn(trains=True)
    def train_lm(self, batch: PackedBatch) -> ModelFnResult:
        """One optimizer step; stat ``loss`` is the token-mean NLL of the global batch."""
        _check_fields(batch)
        return batch, self.train_token_batch(batch, sft_loss, n_target_tokens)

    @model_fn("logp")
    def evaluate_lm(self, batch: PackedBatch) -> ModelFnResult:
        """Stats ``loss`` (token-mean NLL over loss-mask tokens, all ranks together) and
        ``n_tokens``; ``batch`` gains token field ``logp``. No update."""
        _check_fields(batch)
        batch, _ = self.compute_logp(batch)
        logp = batch["logp"]  # [T]
        mask = batch["loss_mask"].to(logp.device, torch.float64)
        sums = torch.stack([-(logp.double() * mask).sum(), mask.sum()])
        all_reduce(sums, group=self.group)
        return batch, {"loss": float(sums[0] / sums[1].clamp(min=1)), "n_tokens": float(sums[1])}


def _check_fields(batch: PackedBatch) -> None:
    if "loss_mask" not in batch.tokens:
        raise ValueError(
            f"SFT batches need token field 'loss_mask', got {sorted(batch.tokens)}; "
            "mark the completion tokens with 1"
        )
