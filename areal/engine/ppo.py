"""PPO actor and critic on the FSDP engine; the maths lives in :mod:`areal.algo`.

Every model function has one shape: a batch in, the batch with named fields added out, plus a
dict of stats (:data:`~areal.api.engine.ModelFnResult`). Batch fields (a :class:`PackedBatch`,
one rank's share; groups of ``group_size`` (= ``gconfig.n_samples``) consecutive sequences
share a prompt):

- token fields: ``input_ids``, ``loss_mask`` (1 on generated tokens trained on), ``logprobs``
  (behaviour policy, from the rollout; 0 off the mask); optional ``prox_logp`` (the actor's
  ``compute_logp(batch, out="prox_logp")`` before the update; required for
  ``use_decoupled_loss``), ``ref_logp`` (the reference model's ``compute_logp(batch,
  out="ref_logp")``, for KL), ``values`` (critic's
  :meth:`PPOCritic.compute_values`, when ``use_critic``);
- sequence fields: ``rewards`` [B]; optional ``baseline_rewards`` (ReMax) and ``no_eos``;
- :meth:`PPOActor.compute_advantages` adds token fields ``advantages``, ``returns``,
  ``token_rewards`` and sequence field ``seq_rewards``; both ``ppo_update`` methods need them.
- :meth:`PPOActor.ppo_update` with ``logp_out`` adds that token field: the trainer's logprob of
  every token from the update's own forward (detached), for recording (``areal view``).

Loss normalisation. ``policy_loss``/``value_loss`` are called with each micro-batch's own
normalisers and the engine weights micro-batch ``i`` by its share of the global count (trained
tokens for ``token-mean``, sequences with a trained token otherwise). Summed over micro-batches
and ranks this equals calling them with the global normalisers of ``loss_normalisers``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from areal.algo.advantages import compute_advantages
from areal.algo.correction import STALENESS_BUCKETS, approx_prox_logp, staleness_buckets
from areal.algo.critic import ValueNormalizer, value_loss
from areal.algo.distill import distill_advantages
from areal.algo.logprob import TokenLogprobs
from areal.algo.losses import Objective, mismatch_kl, policy_loss
from areal.algo.segments import segment_sum
from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.experiments import DistillConfig
from areal.api.engine import ModelFnResult
from areal.api.io import SaveLoadMeta
from areal.api.mfc import model_fn
from areal.engine import checkpoint
from areal.engine.fsdp import FSDPEngine
from areal.utils.batch import PackedBatch, split_microbatches
from areal.utils.logging import get_logger

logger = get_logger("ppo")
TOKEN_INDEX = "token_index"  # [T] a token's position in ppo_update's batch (for logp_out)


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
        raise ValueError(
            f"ppo_n_minibatches={n} but this rank holds {batch.n_seqs // group_size} "
            "groups; lower ppo_n_minibatches or raise the batch size"
        )
    return mbs


def shift_to_state_values(head: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] ``values[t] = V(input_ids[:t])`` from head outputs ``[T]`` (row t saw tokens <= t)."""
    values = torch.cat([head.new_zeros(1), head[:-1]])
    values[cu_seqlens[:-1][cu_seqlens.diff() > 0].to(head.device)] = 0.0  # first tokens: no state
    return values


def mean_stats(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of the stats of several optimizer steps."""
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}


def staleness_sums(
    train_logp: torch.Tensor, mb: PackedBatch, version: int, weight: float
) -> dict[str, float]:
    """Per staleness bucket, the mismatch k3 summed over trained tokens and their count, each
    divided by the micro-batch's loss ``weight``: ``train_batch`` sums stats weighted by it, so
    :func:`staleness_means` turns its result back into exact per-bucket means."""
    mask = mb["loss_mask"].bool()
    k3 = mismatch_kl(train_logp, mb["logprobs"].to(train_logp.device))["k3"]
    buckets = staleness_buckets(mb["versions"].to(mask.device), version)
    sums = torch.stack(
        [
            torch.stack([(k3 * (sel & mask)).sum(), (sel & mask).sum().to(k3.dtype)])
            for sel in buckets.values()
        ]
    )  # [bucket, (k3 sum, tokens)]
    values = (sums / weight if weight else torch.zeros_like(sums)).tolist()  # one device sync
    out = {}
    for name, (k3_sum, n) in zip(buckets, values):
        out[f"stale{name}_k3_sum"], out[f"stale{name}_n"] = k3_sum, n
    return out


def staleness_means(steps: list[dict[str, float]]) -> dict[str, float]:
    """Pop the bucket sums of :func:`staleness_sums` out of each ``train_batch`` result and return
    ``mismatch_k3_stale<bucket>`` over all of them (buckets with no token left out)."""
    out = {}
    for name in STALENESS_BUCKETS:
        total = sum(s.pop(f"stale{name}_k3_sum", 0.0) * s["loss_weight"] for s in steps)
        count = sum(s.pop(f"stale{name}_n", 0.0) * s["loss_weight"] for s in steps)
        if count > 0.5:  # a whole token: the sums are floats of integer counts
            out[f"mismatch_k3_stale{name}"] = total / count
    return out


class SkippedUpdatesError(RuntimeError):
    """``actor.max_skipped_steps`` train steps in a row skipped every optimizer update."""


class SkippedSteps:
    """Counts train steps in a row whose every optimizer update was skipped (the engine skips an
    update whose grad norm is not finite: a NaN/inf loss, reward or weight): each such step is a
    warning; ``limit`` in a row (``actor.max_skipped_steps``; 0 = never) stop the run with
    :class:`SkippedUpdatesError` naming the last reason. Every rank sees the same skips (the
    grad norm is all-reduced), so every rank stops at the same step."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0  # train steps, the last one included

    def observe(self, steps: list[dict[str, float]], batch: PackedBatch) -> None:
        """After one ``ppo_update`` of ``batch`` whose optimizer steps returned ``steps``."""
        if not steps or not all(s["update_skipped"] for s in steps):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        why = skip_reason(steps[-1], batch)
        if self.limit and self.in_a_row >= self.limit:
            raise SkippedUpdatesError(
                f"{self.in_a_row} train steps in a row skipped every optimizer update "
                f"(actor.max_skipped_steps={self.limit}); the last: {why}"
            )
        stop = f"stops at {self.limit}" if self.limit else "never stops: max_skipped_steps=0"
        logger.warning(
            f"this train step skipped every optimizer update ({self.in_a_row} in a row; the run "
            f"{stop}): {why}"
        )


def skip_reason(last: dict[str, float], batch: PackedBatch) -> str:
    """Why an update was skipped: its grad norm and loss, and the batch's non-finite inputs."""
    parts = [f"grad norm {last['grad_norm']:.3g}, loss {last.get('loss', float('nan')):.3g}"]
    for key in ("rewards", "advantages", "logprobs"):
        if key in batch:
            n_bad = int((~torch.isfinite(batch[key].float())).sum())
            if n_bad:
                parts.append(f"{n_bad} non-finite {key} in the batch")
    if len(parts) == 1:
        parts.append("the batch's rewards and advantages are finite: the model diverged")
    elif "rewards" in parts[1]:
        parts.append("a reward that is NaN or inf as float32: see reward.non_finite")
    return "; ".join(parts)


class PPOActor(FSDPEngine):
    """The policy: logprobs, advantages and the clipped-surrogate update (PPO family).

    ``temperature``, ``group_size`` and ``max_new_tokens`` come from the rollout's sampling
    settings (``gconfig``), so the importance ratio uses the behaviour policy's temperature.
    ``objective``: the per-token objective of the update (:class:`~areal.algo.losses.Objective`,
    e.g. a script's own loss); None: the library's clipped one, by ``policy_loss_type``.
    """

    def __init__(
        self,
        config: PPOActorConfig,
        mesh: DeviceMesh,
        *,
        temperature: float = 1.0,
        group_size: int = 1,
        max_new_tokens: int | None = None,
        distill: DistillConfig | None = None,
        objective: Objective | None = None,
    ):
        super().__init__(config, mesh, head="lm", temperature=temperature)
        self.config: PPOActorConfig = config
        self.objective = objective
        self.distill = distill if distill is not None and distill.enabled else None
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens  # for overlong penalty / seq-mean-token-sum-norm
        self._progress = 0.0  # minibatch k of n of the running ppo_update: k / n
        self._kept_logp: torch.Tensor | None = None  # [T] ppo_update's logp_out, being filled
        self.skipped = SkippedSteps(config.max_skipped_steps)

    def _dp_group(self):
        return self.group if self.world_size > 1 else None

    @property
    def needs_prox_pass(self) -> bool:
        """Whether ``prox_logp`` needs its own forward before the update.

        The proximal policy is the weights before this step's update. With one PPO minibatch
        every micro-batch's training forward still runs those weights (the optimizer steps once,
        after all of them), so the loss takes the proximal logprobs from its own forward,
        detached, and the separate pass is redundant. It is needed with several minibatches
        (later ones run updated weights), when the advantages' KL-in-reward uses them, and
        with ``prox_logp=recompute_always``.
        """
        return self.config.needs_prox_pass

    @model_fn("advantages", "returns", "token_rewards", "seq_rewards")
    @torch.no_grad()
    def compute_advantages(self, batch: PackedBatch) -> ModelFnResult:
        """``batch`` plus ``advantages``/``returns``/``token_rewards`` [T] and ``seq_rewards`` [B];
        when distilling, the advantages mix in the teacher's reverse KL (:mod:`areal.algo.distill`)
        and the stats hold its mean ``distill_reverse_kl``."""
        old_logp = batch["prox_logp"] if "prox_logp" in batch else batch["logprobs"]
        optional = {
            k: batch[k] for k in ("values", "ref_logp", "baseline_rewards", "no_eos") if k in batch
        }
        adv = compute_advantages(
            batch["rewards"].float(),
            batch["loss_mask"],
            batch.cu_seqlens,
            self.config,
            values=optional.get("values") if self.config.use_critic else None,
            logprobs=old_logp,
            ref_logp=optional.get("ref_logp"),
            baseline_rewards=optional.get("baseline_rewards"),
            no_eos=optional.get("no_eos"),
            max_new_tokens=self.max_new_tokens,
            group_size=self.group_size,
            dp_group=self._dp_group(),
        )
        advantages, stats = adv.advantages, {}
        if self.distill is not None:  # on-policy distillation: the teacher's per-token reverse KL
            if "teacher_logp" not in batch:
                raise ValueError(
                    "distillation needs token field 'teacher_logp' (the teacher's logprobs of "
                    "each completion token: its servers' scores, or Core's teacher_logp node)"
                )
            d, mask = self.distill, batch["loss_mask"]
            advantages = distill_advantages(
                adv.advantages,
                batch["teacher_logp"],
                batch["logprobs"],
                mask,
                d.coef,
                d.reward_weight,
                batch.cu_seqlens if d.baseline == "others" else None,
            )
            reverse_kl = (batch["logprobs"] - batch["teacher_logp"]).float() * mask
            stats["distill_reverse_kl"] = float(reverse_kl.sum() / mask.sum().clamp(min=1))
        return batch.with_fields(
            tokens={
                "advantages": advantages,
                "returns": adv.returns,
                "token_rewards": adv.token_rewards,
            },
            seqs={"seq_rewards": adv.seq_rewards},
        ), stats

    def _loss(
        self, tokens: TokenLogprobs, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        logp, entropy = tokens  # [T] each, at this engine's temperature
        if "prox_logp" in mb:
            prox = mb["prox_logp"]
        elif cfg.use_decoupled_loss and cfg.approximates_prox:  # no forward pass for it
            prox = approx_prox_logp(
                mb["logprobs"],
                logp,
                mb["versions"],
                self.get_version(),
                self._progress,
                cfg.prox_logp,
            )
        else:  # one minibatch: these weights are the proximal policy (see needs_prox_pass)
            if self.needs_prox_pass:
                raise ValueError(
                    "the decoupled loss with several minibatches, KL in the reward or "
                    "prox_logp=recompute_always needs prox_logp; call "
                    "compute_logp(batch, out='prox_logp') first"
                )
            prox = logp.detach()
        if self._kept_logp is not None:  # logp_out: scattered to the batch's tokens, on device
            self._kept_logp[mb[TOKEN_INDEX].to(logp.device)] = logp.detach()
        loss, stats = policy_loss(
            logp,
            prox if cfg.use_decoupled_loss else None,
            mb["logprobs"],
            mb["advantages"],
            mb["loss_mask"],
            mb.cu_seqlens,
            cfg,
            entropy=entropy,
            ref_logp=mb["ref_logp"] if "ref_logp" in mb else None,
            max_new_tokens=self.max_new_tokens,
            objective=self.objective,
        )
        mask = mb["loss_mask"].to(
            prox.device, prox.dtype
        )  # trainer's proximal vs server's logprobs
        gap = ((prox - mb["logprobs"].to(prox.device)).abs() * mask).sum() / mask.sum().clamp(min=1)
        out = {**{k: float(v) for k, v in stats.items()}, "logp_mismatch": float(gap)}
        if "versions" in mb:
            weight = loss_weight_for(cfg.loss_agg_mode)(mb)
            out.update(
                staleness_sums(
                    prox if cfg.use_decoupled_loss else logp, mb, self.get_version(), weight
                )
            )
        return loss, out

    @model_fn(named={"logp_out": None}, trains=True)
    def ppo_update(self, batch: PackedBatch, logp_out: str | None = None) -> ModelFnResult:
        """``ppo_n_minibatches`` optimizer steps over ``batch``; stats are means over the steps.
        ``logp_out``: the batch is returned with that token field added, [T] float32 on this
        engine's device: each token's logprob in the update's own forward, detached (the weights
        before this step's update with one minibatch; minibatch k's weights with several). It
        costs no forward and no host transfer: one scatter per micro-batch."""
        if "advantages" not in batch.tokens:
            raise ValueError(
                "ppo_update needs token field 'advantages'; call compute_advantages first"
            )
        if self.config.approximates_prox and "versions" not in batch.tokens:
            raise ValueError(
                f"actor.prox_logp={self.config.prox_logp} needs token field 'versions' "
                "(the weight version of each token, from the rollout)"
            )
        weight = loss_weight_for(self.config.loss_agg_mode)
        indexed = batch
        if logp_out is not None:
            indexed = batch.with_fields(tokens={TOKEN_INDEX: torch.arange(batch.n_tokens)})
            self._kept_logp = torch.zeros(batch.n_tokens, device=self.device)
        parts = minibatches(indexed, self.config.ppo_n_minibatches, self.group_size)
        steps = []
        try:
            for k, mb in enumerate(parts):
                self._progress = k / len(parts)  # current weights' version: get_version() + this
                steps.append(self.train_token_batch(mb, self._loss, weight))
        finally:
            kept, self._kept_logp = self._kept_logp, None
        if kept is not None and self.pipe is not None:  # the losses ran on the last stage
            kept = self.pipe.from_last_stage(kept)
        self.skipped.observe(steps, batch)  # warns; stops the run at actor.max_skipped_steps
        buckets = staleness_means(steps)  # first: it pops the bucket sums mean_stats must not see
        stats = {**mean_stats(steps), **buckets}
        if logp_out is None:
            return batch, stats
        assert kept is not None  # filled by the losses whenever logp_out is set
        return batch.with_fields(tokens={logp_out: kept}), stats


VALUE_NORM_FILE = "value_normalizer.json"  # inside a DCP checkpoint dir, when value_norm


class PPOCritic(FSDPEngine):
    """The value model: backbone + one-output head, clipped value loss."""

    def __init__(self, config: PPOCriticConfig, mesh: DeviceMesh, group_size: int = 1):
        super().__init__(config, mesh, head="value")
        self.config: PPOCriticConfig = config
        self.group_size = group_size  # minibatches keep whole groups, as the actor's do
        self.value_normalizer = ValueNormalizer() if config.value_norm else None

    @model_fn("values")
    @torch.no_grad()
    def compute_values(self, batch: PackedBatch) -> ModelFnResult:
        """``batch`` plus token field ``values`` [T]: ``values[t] = V(input_ids[:t])``
        (de-normalised), 0 at each first token."""
        head = self.forward(batch, lambda logits, mb: logits[:, 0])  # [T]
        if self.value_normalizer is not None:
            head = self.value_normalizer.denormalize(head)
        return batch.with_fields(
            tokens={"values": shift_to_state_values(head, batch.cu_seqlens)}
        ), {}

    def _loss(self, logits: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        values = shift_to_state_values(logits[:, 0], mb.cu_seqlens)  # [T], with grad
        old, returns = mb["values"], mb["returns"]
        if self.value_normalizer is not None:  # the head learns normalised targets
            old, returns = (
                self.value_normalizer.normalize(old),
                self.value_normalizer.normalize(returns),
            )
        loss, stats = value_loss(
            values,
            old,
            returns,
            mb["loss_mask"],
            mb.cu_seqlens,
            self.config.value_eps_clip,
            self.config.loss_agg_mode,
        )
        return loss, {k: float(v) for k, v in stats.items()}

    def save(self, meta: SaveLoadMeta) -> None:
        """The engine's save; a DCP checkpoint also keeps the value normaliser's moments."""
        super().save(meta)
        if meta.weight_format == "dcp" and self.value_normalizer is not None:
            checkpoint.save_replicated_state(
                meta.path, VALUE_NORM_FILE, self.value_normalizer.state_dict(), self.group
            )

    def load(self, meta: SaveLoadMeta) -> None:
        """The engine's load; from a DCP checkpoint also the value normaliser's moments."""
        super().load(meta)
        if meta.weight_format == "dcp" and self.value_normalizer is not None:
            state = checkpoint.load_replicated_state(meta.path, VALUE_NORM_FILE)
            self.value_normalizer.load_state_dict(state)

    @model_fn(trains=True)
    def ppo_update(self, batch: PackedBatch) -> ModelFnResult:
        """``ppo_n_minibatches`` steps regressing ``values`` toward ``returns``; mean stats."""
        for key in ("values", "returns"):
            if key not in batch.tokens:
                raise ValueError(
                    f"critic ppo_update needs token field {key!r}; set values from "
                    "compute_values and returns from the actor's compute_advantages"
                )
        if self.value_normalizer is not None:
            group = self.group if self.world_size > 1 else None
            self.value_normalizer.update(batch["returns"], batch["loss_mask"], group)
        weight = loss_weight_for(self.config.loss_agg_mode)
        parts = minibatches(batch, self.config.ppo_n_minibatches, self.group_size)
        return batch, mean_stats([self.train_batch(mb, self._loss, weight) for mb in parts])
