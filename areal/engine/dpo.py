"""DPO training: a policy LM trained on (chosen, rejected) pairs with the losses of
:mod:`areal.algo.dpo` (sigmoid DPO, IPO, SimPO).

Batch layout (as the reward model's, :mod:`areal.engine.rw`): pairs are consecutive sequences,
chosen at ``2k`` and rejected at ``2k + 1``; ``mb_spec.granularity`` must be even so a pair never
straddles two micro-batches, and both sides of a pair run in the same packed forward. Fields:
token ``input_ids`` and ``loss_mask`` (1 on the reply tokens DPO scores), sequence
``group_index`` (the pair index) and ``prompt_lens``; with ``shared_prefix`` (on by default) the
pair's common prompt then runs once per forward and backward. Reference-based losses (sigmoid,
ipo) also need sequence field ``ref_logp`` [B]: the reference's summed reply logprob of each
sequence (:meth:`DPOReference.compute_seq_logp`, run once before training or every step).

The loss is a mean over the pairs of the global batch: each micro-batch's mean is weighted by
its pair count over the all-reduced total.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from areal.algo.dpo import PairLogps, preference_loss, reward_stats
from areal.algo.logprob import TokenLogprobs
from areal.algo.segments import segment_sum
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.experiments import DPOLossConfig
from areal.api.engine import ModelFnResult
from areal.api.mfc import model_fn
from areal.engine.fsdp import FSDPEngine
from areal.utils.batch import PackedBatch
from areal.utils.comm import all_reduce


def pack_pairs(
    chosen: list[list[int]], rejected: list[list[int]], prompt_lens: list[int]
) -> PackedBatch:
    """Pairs as consecutive sequences (chosen at 2k, rejected at 2k+1) with ``loss_mask`` on the
    tokens after each pair's prompt and the fields of the shared-prefix layout."""
    seqs, masks = [], []
    for c, r, p in zip(chosen, rejected, prompt_lens, strict=True):
        if not 0 < p < min(len(c), len(r)) or c[:p] != r[:p]:
            raise ValueError(
                f"a pair's two sides must share their first prompt_len={p} tokens and "
                f"each have a reply after them (lengths {len(c)}, {len(r)})"
            )
        for ids in (c, r):
            seqs.append(ids)
            masks.append([0] * p + [1] * (len(ids) - p))
    pair = torch.arange(len(prompt_lens)).repeat_interleave(2)  # [B] pair index of each sequence
    return PackedBatch.from_sequences(
        {"input_ids": seqs, "loss_mask": masks},
        {"group_index": pair, "prompt_lens": torch.tensor(prompt_lens).repeat_interleave(2)},
    )


def sequence_logp(logp: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """[B] sum of token logprobs ``logp`` [T] over each sequence's ``loss_mask`` tokens."""
    mask = batch["loss_mask"].to(logp.device, logp.dtype)
    return segment_sum(logp * mask, batch.cu_seqlens.to(logp.device))


def pair_logps(seq_logp: torch.Tensor, batch: PackedBatch, with_ref: bool) -> PairLogps:
    """Split per-sequence values [B] of a pair batch into chosen (even) and rejected (odd)."""
    lens = segment_sum(
        batch["loss_mask"].to(seq_logp.device, seq_logp.dtype), batch.cu_seqlens.to(seq_logp.device)
    )
    ref = batch["ref_logp"].to(seq_logp.device, seq_logp.dtype) if with_ref else None
    return PairLogps(
        seq_logp[0::2],
        seq_logp[1::2],
        lens[0::2],
        lens[1::2],
        ref[0::2] if ref is not None else None,
        ref[1::2] if ref is not None else None,
    )


class DPOReference(FSDPEngine):
    """DPO's frozen reference: an LM that scores each sequence's reply, never trained."""

    @model_fn(named={"out": "seq_logp"})
    def compute_seq_logp(self, batch: PackedBatch, out: str = "seq_logp") -> ModelFnResult:
        """``batch`` plus sequence field ``out`` [B]: the sum of each sequence's token logprobs
        over its ``loss_mask`` tokens (the reply), summed in float64, kept as float32 on CPU."""
        scored, _ = self.compute_logp(batch, out="token_logp")
        seq = sequence_logp(scored["token_logp"].double(), batch).float()  # [B]
        return batch.with_fields(seqs={out: seq.cpu()}), {}


class DPOEngine(FSDPEngine):
    """A policy LM trained on preference pairs (see the module docstring)."""

    def __init__(self, config: TrainEngineConfig, mesh: DeviceMesh, loss: DPOLossConfig):
        if config.mb_spec.granularity % 2:
            raise ValueError(
                f"mb_spec.granularity must be even for pairs, got {config.mb_spec.granularity}; "
                "set mb_spec.granularity=2"
            )
        super().__init__(config, mesh, head="lm")
        self.loss = loss
        self.needs_ref = loss.loss_type != "simpo"

    def _pair_loss(
        self, tokens: TokenLogprobs, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean preference loss over the micro-batch's pairs (token logprobs at temperature 1)."""
        logp = tokens.logp  # [T]
        pairs = pair_logps(sequence_logp(logp, mb), mb, self.needs_ref)
        cfg = self.loss
        losses, chosen, rejected = preference_loss(
            pairs, cfg.loss_type, cfg.beta, cfg.label_smoothing, cfg.gamma, cfg.nll_coef
        )
        stats = reward_stats(chosen, rejected)
        stats["chosen_logp"] = float(pairs.logp_c.detach().mean())
        stats["rejected_logp"] = float(pairs.logp_r.detach().mean())
        return losses.mean(), stats

    @model_fn(trains=True)
    def train_dpo(self, batch: PackedBatch) -> ModelFnResult:
        """One optimizer step on pairs; stats loss, reward_acc, margin, chosen/rejected reward
        and logp (means over the global batch's pairs), grad_norm, lr."""
        self._check(batch)
        return batch, self.train_token_batch(batch, self._pair_loss, lambda mb: mb.n_seqs / 2)

    def evaluate_dpo(self, batch: PackedBatch) -> ModelFnResult:
        """Stats ``loss``, ``reward_acc``, ``margin`` and ``n_pairs`` of ``batch`` under the
        current weights, all ranks together (no update); ``batch`` gains token field ``logp``."""
        self._check(batch)
        batch, _ = self.compute_logp(batch)
        pairs = pair_logps(sequence_logp(batch["logp"].double(), batch), batch, self.needs_ref)
        cfg = self.loss
        losses, chosen, rejected = preference_loss(
            pairs, cfg.loss_type, cfg.beta, cfg.label_smoothing, cfg.gamma, cfg.nll_coef
        )
        sums = torch.stack(
            [
                losses.sum(),
                (chosen > rejected).double().sum(),
                (chosen - rejected).sum(),
                torch.tensor(float(len(losses)), dtype=torch.float64, device=losses.device),
            ]
        )
        all_reduce(sums, group=self.group)
        n = float(sums[3])
        return batch, {
            "loss": float(sums[0]) / n,
            "reward_acc": float(sums[1]) / n,
            "margin": float(sums[2]) / n,
            "n_pairs": n,
        }

    def _check(self, batch: PackedBatch) -> None:
        if batch.n_seqs % 2:
            raise ValueError(
                f"DPO batches hold (chosen, rejected) pairs; got {batch.n_seqs} sequences, "
                "an odd number"
            )
        if "loss_mask" not in batch.tokens:
            raise ValueError(
                f"DPO batches need token field 'loss_mask' (1 on reply tokens), got "
                f"{sorted(batch.tokens)}"
            )
        if self.needs_ref and "ref_logp" not in batch.seqs:
            raise ValueError(
                f"loss_type={self.loss.loss_type} needs sequence field 'ref_logp'; add it "
                "with DPOReference.compute_seq_logp(batch, out='ref_logp')"
            )
