"""PPO actor and critic on the FSDP engine; the maths lives in :mod:`areal.algo`.

Batch fields (a :class:`PackedBatch`, one rank's share; groups of ``actor.group_size``
consecutive sequences share a prompt):

- token fields: ``input_ids``, ``loss_mask`` (1 on generated tokens trained on), ``logprobs``
  (behaviour policy, from the rollout; 0 off the mask); optional ``prox_logp`` (set from
  :meth:`PPOActor.compute_logp` before the update; required for ``use_decoupled_loss``),
  ``ref_logp`` (reference model's ``compute_logp``, for KL), ``values`` (critic's
  :meth:`PPOCritic.compute_values`, when ``use_critic``);
- sequence fields: ``rewards`` [B]; optional ``baseline_rewards`` (ReMax) and ``no_eos``;
- :meth:`PPOActor.compute_advantages` adds token fields ``advantages``, ``returns``,
  ``token_rewards`` and sequence field ``seq_rewards``; both ``ppo_update`` methods need them.

Loss normalisation. ``policy_loss``/``value_loss`` are called with each micro-batch's own
normalisers and the engine weights micro-batch ``i`` by its share of the global count (trained
tokens for ``token-mean``, sequences with a trained token otherwise). Summed over micro-batches
and ranks this equals calling them with the global normalisers of ``loss_normalisers``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal.algo.advantages import compute_advantages
from areal.algo.critic import ValueNormalizer, value_loss
from areal.algo.logprob import packed_token_logprobs
from areal.algo.losses import policy_loss
from areal.algo.segments import segment_sum
from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.io import SaveLoadMeta
from areal.engine import checkpoint
from areal.engine.fsdp import FSDPEngine
from areal.utils.batch import PackedBatch, split_microbatches


def loss_weight_for(mode: str):
    """Micro-batch weight matching ``loss_agg_mode``: trained tokens or trained sequences."""

    def weight(mb: PackedBatch) -> float:
        mask = mb["loss_mask"].float()
        if mode == "token-mean":
            return float(mask.sum())
        return float((segment_sum(mask, mb.cu_seqlens) > 0).sum())

    return weight


def minibatches(batch: PackedBatch, n: int, group_size: int) -> list[PackedBatch]:
    """``n`` token-balanced minibatches of whole groups (every rank must get ``n``)."""
    mbs = split_microbatches(batch, n_mbs=n, granularity=group_size).mbs
    if len(mbs) != n:
        raise ValueError(f"ppo_n_minibatches={n} but this rank holds {batch.n_seqs // group_size} "
                         "groups; lower ppo_n_minibatches or raise the batch size")
    return mbs


def shift_to_state_values(head: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] ``values[t] = V(input_ids[:t])`` from head outputs ``[T]`` (row t saw tokens <= t)."""
    values = torch.cat([head.new_zeros(1), head[:-1]])
    values[cu_seqlens[:-1][cu_seqlens.diff() > 0].to(head.device)] = 0.0  # first tokens: no state
    return values


class PPOActor(FSDPEngine):
    """The policy: logprobs, advantages and the clipped-surrogate update (PPO family)."""

    def __init__(self, config: PPOActorConfig, max_new_tokens: int | None = None):
        super().__init__(config, head="lm")
        self.config: PPOActorConfig = config
        self.max_new_tokens = max_new_tokens  # for overlong penalty / seq-mean-token-sum-norm

    def _dp_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if dist.get_world_size() > 1 else None

    @torch.no_grad()
    def compute_logp(self, batch: PackedBatch) -> torch.Tensor:
        """[T] logprobs of ``input_ids`` under the current weights at ``actor.temperature``."""
        cfg = self.config

        def hook(logits: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
            return packed_token_logprobs(logits, mb["input_ids"], mb.cu_seqlens, cfg.temperature,
                                         cfg.logprob_chunk_size)[0]

        return self.forward(batch, hook)

    @torch.no_grad()
    def compute_advantages(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` plus ``advantages``/``returns``/``token_rewards`` [T] and ``seq_rewards`` [B]."""
        old_logp = batch["prox_logp"] if "prox_logp" in batch else batch["logprobs"]
        optional = {k: batch[k] for k in ("values", "ref_logp", "baseline_rewards", "no_eos") if k in batch}
        adv = compute_advantages(
            batch["rewards"].float(), batch["loss_mask"], batch.cu_seqlens, self.config,
            values=optional.get("values") if self.config.use_critic else None,
            logprobs=old_logp, ref_logp=optional.get("ref_logp"),
            baseline_rewards=optional.get("baseline_rewards"), no_eos=optional.get("no_eos"),
            max_new_tokens=self.max_new_tokens, dp_group=self._dp_group(),
        )
        return batch.with_fields(
            tokens={"advantages": adv.advantages, "returns": adv.returns, "token_rewards": adv.token_rewards},
            seqs={"seq_rewards": adv.seq_rewards},
        )

    def _loss(self, logits: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        logp, entropy = packed_token_logprobs(logits, mb["input_ids"], mb.cu_seqlens,
                                              cfg.temperature, cfg.logprob_chunk_size)
        loss, stats = policy_loss(
            logp, mb["prox_logp"] if "prox_logp" in mb else None, mb["logprobs"], mb["advantages"],
            mb["loss_mask"], mb.cu_seqlens, cfg, entropy=entropy,
            ref_logp=mb["ref_logp"] if "ref_logp" in mb else None, max_new_tokens=self.max_new_tokens,
        )
        return loss, {k: float(v) for k, v in stats.items()}

    def ppo_update(self, batch: PackedBatch) -> list[dict[str, float]]:
        """``ppo_n_minibatches`` optimizer steps over ``batch``; stats of each step."""
        if "advantages" not in batch.tokens:
            raise ValueError("ppo_update needs token field 'advantages'; call compute_advantages first")
        weight = loss_weight_for(self.config.loss_agg_mode)
        parts = minibatches(batch, self.config.ppo_n_minibatches, self.config.group_size)
        return [self.train_batch(mb, self._loss, weight) for mb in parts]


VALUE_NORM_FILE = "value_normalizer.json"  # inside a DCP checkpoint dir, when value_norm


class PPOCritic(FSDPEngine):
    """The value model: backbone + one-output head, clipped value loss."""

    def __init__(self, config: PPOCriticConfig):
        super().__init__(config, head="value")
        self.config: PPOCriticConfig = config
        self.value_normalizer = ValueNormalizer() if config.value_norm else None

    @torch.no_grad()
    def compute_values(self, batch: PackedBatch) -> torch.Tensor:
        """[T] ``values[t] = V(input_ids[:t])`` (de-normalised), 0 at each first token."""
        head = self.forward(batch, lambda logits, mb: logits[:, 0])  # [T]
        if self.value_normalizer is not None:
            head = self.value_normalizer.denormalize(head)
        return shift_to_state_values(head, batch.cu_seqlens)

    def _loss(self, logits: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        values = shift_to_state_values(logits[:, 0], mb.cu_seqlens)  # [T], with grad
        old, returns = mb["values"], mb["returns"]
        if self.value_normalizer is not None:  # the head learns normalised targets
            old, returns = self.value_normalizer.normalize(old), self.value_normalizer.normalize(returns)
        loss, stats = value_loss(values, old, returns, mb["loss_mask"], mb.cu_seqlens,
                                 self.config.value_eps_clip, self.config.loss_agg_mode)
        return loss, {k: float(v) for k, v in stats.items()}

    def save(self, meta: SaveLoadMeta) -> None:
        """The engine's save; a DCP checkpoint also keeps the value normaliser's moments."""
        super().save(meta)
        if meta.weight_format == "dcp" and self.value_normalizer is not None:
            checkpoint.save_replicated_state(meta.path, VALUE_NORM_FILE, self.value_normalizer.state_dict())

    def load(self, meta: SaveLoadMeta) -> None:
        """The engine's load; from a DCP checkpoint also the value normaliser's moments."""
        super().load(meta)
        if meta.weight_format == "dcp" and self.value_normalizer is not None:
            state = checkpoint.load_replicated_state(meta.path, VALUE_NORM_FILE)
            self.value_normalizer.load_state_dict(state)

    def ppo_update(self, batch: PackedBatch, group_size: int = 1) -> list[dict[str, float]]:
        """``ppo_n_minibatches`` steps regressing ``values`` toward ``returns``; stats per step."""
        for key in ("values", "returns"):
            if key not in batch.tokens:
                raise ValueError(f"critic ppo_update needs token field {key!r}; set values from "
                                 "compute_values and returns from the actor's compute_advantages")
        if self.value_normalizer is not None:
            group = dist.group.WORLD if dist.get_world_size() > 1 else None
            self.value_normalizer.update(batch["returns"], batch["loss_mask"], group)
        weight = loss_weight_for(self.config.loss_agg_mode)
        parts = minibatches(batch, self.config.ppo_n_minibatches, group_size)
        return [self.train_batch(mb, self._loss, weight) for mb in parts]
