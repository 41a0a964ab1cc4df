"""What the supervised entry scripts share: their batches and held-out evaluations.

``examples/sft.py`` and ``areal core sft`` (:mod:`areal.core.sft`) train on :func:`sft_batch`
and evaluate with :func:`evaluate_sft`; ``examples/rm.py`` uses the pair layout of
:func:`rm_batch` and :func:`evaluate_rm`; ``examples/dpo.py`` uses :func:`dpo_batch` and
:func:`evaluate_dpo`. Each held-out figure is a mean over the whole validation set, weighted as
its loss is (tokens for SFT, pairs for RM and DPO).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from areal.api.engine import ModelFnResult
from areal.engine.dpo import DPOEngine, DPOReference, pack_pairs
from areal.engine.rw import RWEngine
from areal.utils.batch import PackedBatch

Items = list[dict]  # one step's items, as the data loader yields them


class LMEvaluator(Protocol):
    """A model with ``evaluate_lm`` (Lite's SFT engine, or Core's ``RayModel`` of it)."""

    def evaluate_lm(self, batch: PackedBatch) -> ModelFnResult:
        """Held-out NLL stats of ``batch``: ``loss`` (token mean) and ``n_tokens``."""
        ...


def sft_batch(items: Items) -> PackedBatch:
    """Pack tokenized SFT items (``input_ids``, ``loss_mask``) into one batch."""
    return PackedBatch.from_sequences(
        {
            "input_ids": [it["input_ids"] for it in items],
            "loss_mask": [it["loss_mask"] for it in items],
        }
    )


def rm_batch(items: Items) -> PackedBatch:
    """Pairs as consecutive sequences: chosen at 2k, rejected at 2k+1 (what RWEngine expects)."""
    seqs = [ids for it in items for ids in (it["chosen_ids"], it["rejected_ids"])]
    return PackedBatch.from_sequences({"input_ids": seqs})


def dpo_batch(items: Items) -> PackedBatch:
    """Pairs as consecutive sequences (chosen at 2k, rejected at 2k+1, what DPOEngine expects),
    with the reference logprobs when the items carry them."""
    batch = pack_pairs(
        [it["chosen_ids"] for it in items],
        [it["rejected_ids"] for it in items],
        [it["prompt_len"] for it in items],
    )
    if "ref_logp" in items[0]:
        batch = batch.with_fields(
            seqs={"ref_logp": torch.tensor([v for it in items for v in it["ref_logp"]])}
        )
    return batch


def held_out(
    valid_loader: Iterable[Items],
    score: Callable[[Items], dict[str, float]],
    keys: tuple[str, ...],
    weight: Callable[[Items, dict[str, float]], float],
) -> dict[str, float]:
    """``eval/<key>`` for each of ``keys``: the mean of ``score``'s values over the whole
    validation set, each batch weighted by ``weight(items, its scores)``."""
    sums, n = dict.fromkeys(keys, 0.0), 0.0
    for items in valid_loader:
        out = score(items)
        w = weight(items, out)
        for k in keys:
            sums[k] += out[k] * w
        n += w
    return {f"eval/{k}": v / max(n, 1.0) for k, v in sums.items()}


def evaluate_sft(engine: LMEvaluator, valid_loader: Iterable[Items]) -> dict[str, float]:
    """Held-out token-mean NLL over the whole validation set (``eval/loss``)."""
    return held_out(
        valid_loader,
        lambda items: engine.evaluate_lm(sft_batch(items))[1],
        ("loss",),
        lambda items, out: out["n_tokens"],
    )


def evaluate_rm(engine: RWEngine, valid_loader: Iterable[Items]) -> dict[str, float]:
    """Held-out BT loss and pair accuracy over the whole validation set."""
    return held_out(
        valid_loader,
        lambda items: engine.evaluate_rw(rm_batch(items))[1],
        ("loss", "pair_acc"),
        lambda items, out: float(len(items)),
    )


def scored(batch: PackedBatch, ref: DPOReference | None) -> PackedBatch:
    """``batch`` with its reference logprobs ``ref_logp`` computed now (DPO's online reference),
    else as it is (precomputed, or a loss without a reference)."""
    return ref.compute_seq_logp(batch, out="ref_logp")[0] if ref is not None else batch


def evaluate_dpo(
    engine: DPOEngine, ref: DPOReference | None, valid_loader: Iterable[Items]
) -> dict[str, float]:
    """Held-out preference loss, reward accuracy and margin over the whole validation set."""
    return held_out(
        valid_loader,
        lambda items: engine.evaluate_dpo(scored(dpo_batch(items), ref))[1],
        ("loss", "reward_acc", "margin"),
        lambda items, out: out["n_pairs"],
    )
