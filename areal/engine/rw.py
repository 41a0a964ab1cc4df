"""Reward-model training: Bradley-Terry loss on (chosen, rejected) pairs.

A reward model is the backbone with a one-output value head (``head="value"``); the score of a
sequence is the head's output at its last token. Batch layout: sequences come in pairs, chosen
at even index ``2k`` and rejected at ``2k + 1`` (only ``input_ids`` is needed). The config's
``mb_spec.granularity`` must be even so that a pair never straddles two micro-batches.

loss = -mean_k log sigmoid(s(chosen_k) - s(rejected_k)), averaged over the pairs of the global
batch; ``pair_acc`` is the fraction of pairs with s(chosen) > s(rejected).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from areal.api.config.engine import TrainEngineConfig
from areal.api.engine import ModelFnResult
from areal.api.mfc import model_fn
from areal.engine.fsdp import FSDPEngine
from areal.utils.batch import PackedBatch
from areal.utils.comm import all_reduce


def last_token_scores(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] value at each sequence's last token, from per-token values ``[T]`` or ``[T, 1]``."""
    return values.reshape(values.shape[0], -1)[cu_seqlens[1:].to(values.device) - 1, 0]


def bradley_terry_loss(
    logits: torch.Tensor, mb: PackedBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean BT loss over the micro-batch's pairs; ``logits`` are values ``[T, 1]``."""
    scores = last_token_scores(logits, mb.cu_seqlens)  # [B]
    margin = scores[0::2] - scores[1::2]  # [B/2] chosen - rejected
    seen = margin.detach()  # stats only: float() on a tensor that requires grad warns
    stats = {"pair_acc": float((seen > 0).float().mean()), "margin": float(seen.mean())}
    return -F.logsigmoid(margin).mean(), stats


def n_pairs(mb: PackedBatch) -> float:
    """Loss weight of a micro-batch: its number of pairs."""
    return mb.n_seqs / 2


class RWEngine(FSDPEngine):
    """A reward model: backbone + value head trained on preference pairs."""

    def __init__(self, config: TrainEngineConfig, mesh: DeviceMesh):
        if config.mb_spec.granularity % 2:
            raise ValueError(
                f"mb_spec.granularity must be even for pairs, got {config.mb_spec.granularity}; "
                "set mb_spec.granularity=2"
            )
        super().__init__(config, mesh, head="value")

    @model_fn(trains=True)
    def train_rw(self, batch: PackedBatch) -> ModelFnResult:
        """One optimizer step on pairs; stats loss, pair_acc, margin, grad_norm, lr."""
        _check_pairs(batch)
        return batch, self.train_batch(batch, bradley_terry_loss, n_pairs)

    @model_fn("scores")
    @torch.no_grad()
    def score(self, batch: PackedBatch) -> ModelFnResult:
        """``batch`` plus sequence field ``scores`` [B]: the reward of each sequence."""
        values = self.forward(batch, lambda logits, mb: logits[:, 0])  # [T]
        return batch.with_fields(seqs={"scores": last_token_scores(values, batch.cu_seqlens)}), {}

    def evaluate_rw(self, batch: PackedBatch) -> ModelFnResult:
        """Stats: BT loss and pair accuracy of ``batch``, all ranks together (no update)."""
        _check_pairs(batch)
        batch, _ = self.score(batch)
        scores = batch["scores"].double()
        margin = scores[0::2] - scores[1::2]
        sums = torch.stack(
            [
                -F.logsigmoid(margin).sum(),
                (margin > 0).double().sum(),
                torch.tensor(float(len(margin)), dtype=torch.float64, device=margin.device),
            ]
        )
        all_reduce(sums, group=self.group)
        return batch, {"loss": float(sums[0] / sums[2]), "pair_acc": float(sums[1] / sums[2])}


def _check_pairs(batch: PackedBatch) -> None:
    if batch.n_seqs % 2:
        raise ValueError(
            f"reward-model batches hold (chosen, rejected) pairs; got {batch.n_seqs} "
            "sequences, an odd number"
        )
