"""FSDP2 training engine: a Hugging Face model sharded with ``fully_shard`` over a data-parallel
mesh, optionally tensor-parallel too (a 2-D ``("dp", "tp")`` mesh;
:mod:`areal.engine.tensor_parallel`) and pipelined (a 3-D ``("pp", "dp", "tp")`` mesh: this rank
holds one stage; :mod:`areal.engine.pipeline`).

Every rank runs the same calls (SPMD); each data-parallel rank passes its own share of the global
batch (the tp ranks of one dp rank pass the same share).

Packed forward (:mod:`areal.engine.lm_forward`). A micro-batch is one 1-D row of concatenated
sequences with per-sequence position ids and no padding. Attention is restricted to each
sequence by the ``areal_varlen`` attention function (:mod:`areal.engine.attention`: one causal
SDPA call per sequence, like flash-attention's varlen kernel, or one FlexAttention call with a
document mask), so no ``[T, T]`` mask is ever built; it is numerically the same as running each
sequence alone. With ``shared_prefix`` (RL batches whose groups share a
prompt) a group's prompt runs once and its completions attend to it through a small per-group
mask (:mod:`areal.utils.prefix`); the logits are gathered back into the plain layout, so losses
and hooks never see the difference, and a group's ``n`` prompt copies cost one.

Gradient accumulation. ``train_batch`` weights micro-batch ``i`` on rank ``r`` by
``w_ri / sum_{r,i} w_ri`` (``w = loss_weight_fn(mb)``, summed with an all-reduce), so a loss that
is a mean over its weight units (e.g. tokens) gives the gradient of one big batch, whatever the
split and the number of ranks. Ranks first agree on the number of micro-batches (FSDP
collectives must match); a rank with fewer runs its first micro-batch again with weight 0.

Peak memory per micro-batch of ``T`` tokens (fp32, ``L`` layers, hidden ``H``, vocab ``V``):
sharded parameters + gradients + 2 AdamW moments (``16 * N / world`` bytes), one all-gathered
layer at a time, activations ``~ L * T * (c * H)`` (``c`` ~ 20 without gradient checkpointing;
only layer inputs ``L * T * H`` with full ``activation_checkpointing``; :mod:`areal.engine.blocks`),
and for a loss of token logprobs (:meth:`FSDPEngine.train_token_batch`, :meth:`compute_logp`)
with ``fused_logprobs`` a few ``[chunk, V]`` float32 buffers; otherwise the logits ``T * V * 4``
bytes plus their softmax in the loss (with ``shared_prefix`` also the row's own ``S * V * 4``,
``S <= T``). Logits of the whole batch are never held: ``forward`` reduces each micro-batch's
``[T, V]`` logits through ``post_hook`` before the next micro-batch runs.
Mixed precision: float32 master weights and AdamW state (``dtype``), compute in ``param_dtype``
(bf16 on GPU), gradients reduced in ``reduce_dtype`` (fp32); docs/gpus.md#mixed-precision.

LoRA (``config.lora.rank > 0``; :mod:`areal.engine.lora`): the model is wrapped by peft before
sharding, only the adapters (and a value head) require grad and get optimizer state, DCP
checkpoints hold only them, and everything exported (HF dirs, weight updates) is the merged model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from areal.algo.logprob import TokenLogprobs, TokenLossFn
from areal.api.config.engine import TrainEngineConfig
from areal.api.engine import LossFn, LossWeightFn, ModelFnResult, PostHook, TrainEngine
from areal.api.io import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.api.mfc import model_fn
from areal.engine import blocks, checkpoint, lm_forward, lora, pipeline
from areal.engine.attention import ATTN_IMPL, resolve_attention
from areal.engine.lr_schedule import build_lr_scheduler
from areal.engine.tensor_parallel import apply_tensor_parallel
from areal.utils import weight_sync
from areal.utils.batch import MicroBatches, PackedBatch, split_microbatches
from areal.utils.comm import all_reduce


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class FSDPEngine(TrainEngine):
    """FSDP2 engine. ``head="lm"``: causal LM logits ``[T, V]``; ``"value"``: one value ``[T, 1]``.

    ``mesh`` is this engine's device mesh: 1-D data-parallel (from :mod:`areal.runtime.dist`),
    or 2-D ``("dp", "tp")`` (Core allocations with ``tp > 1``): the decoder layers are then
    tensor-parallel over ``tp`` (:mod:`areal.engine.tensor_parallel`) and FSDP shards over
    ``dp``. Every rank of a dp group (its tp ranks) passes the same batch; ``rank`` and
    ``world_size`` are the dp coordinate and size. Every collective runs on the mesh's groups
    (dp for micro-batch agreement, loss normalisers and stats; the whole mesh for checkpoints and
    weight export), never on the default one. ``temperature`` divides the logits in
    :meth:`compute_logp`.
    """

    def __init__(
        self,
        config: TrainEngineConfig,
        mesh: DeviceMesh,
        head: str = "lm",
        temperature: float = 1.0,
    ):
        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        if not config.path:
            raise ValueError("TrainEngineConfig.path is empty; set it to a Hugging Face model dir")
        self.config = config
        self.head = head
        self.temperature = temperature
        self.mesh = mesh
        self.dp_mesh, self.tp_mesh, self.pp_mesh = pipeline.split_mesh(mesh)
        # data-parallel view: batches, loss normalisers and stats are per dp rank (the tp ranks
        # of a dp group hold the same micro-batches); mesh_group spans the whole mesh
        # (checkpoints, exports, weight updates)
        self.group = self.dp_mesh.get_group()
        self.rank, self.world_size = self.dp_mesh.get_local_rank(), self.dp_mesh.size()
        self.mesh_group = self.group if mesh.ndim == 1 else pipeline.whole_mesh_group(mesh)
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError(
                f"this rank ({dist.get_rank()}) is not in the engine's mesh {mesh}; build an "
                "engine only on the ranks of its mesh"
            )
        self.first = all(c == 0 for c in coord)  # the mesh's first rank
        # holds a full state dict: the first rank, or with pp every stage's first (dp, tp) rank
        self.holder = self.first if self.pp_mesh is None else coord[1] == coord[2] == 0
        self.pipe: pipeline.Pipeline | None = None  # set by initialize when pp > 1
        cuda = mesh.device_type == "cuda"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        if config.lora.enabled and mesh.ndim > 1:
            raise ValueError(
                f"lora.rank={config.lora.rank} with tensor or pipeline parallelism (mesh "
                f"{mesh.mesh_dim_names}) is not supported; use a 1-D data-parallel mesh for LoRA"
            )
        if config.cpu_offload and not cuda:
            raise ValueError(
                "cpu_offload=True needs a GPU (backend nccl); set cpu_offload=false on CPU"
            )
        self._model: torch.nn.Module | None = None  # set by initialize, dropped by destroy
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: LambdaLR | None = None
        self.version = 0
        self.global_step = 0  # optimizer steps taken (skipped non-finite steps included)
        self._weight_group: dist.ProcessGroup | None = None
        self.spec = lm_forward.ForwardSpec(
            self.device,
            config.shared_prefix,
            resolve_attention(config.attention, self.device),
            temperature,
            config.logprob_chunk_size,
        )
        self.fused = False  # initialize turns it on where the layout allows

    # ------------------------------------------------------------------------------ setup

    @property
    def model(self) -> torch.nn.Module:
        """The sharded model (a PeftModel under LoRA), from :meth:`initialize` on."""
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call initialize() first")
        return self._model

    def initialize(self, ft_spec: FinetuneSpec | None) -> None:
        """Load and shard the model over the mesh, build AdamW and the LR schedule."""
        model = self._model = self._build_model()
        self._shard(model)
        opt = self.config.optimizer
        self.optimizer = torch.optim.AdamW(  # frozen parameters (LoRA's base) get no state
            [p for p in model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        total = ft_spec.total_train_steps if ft_spec is not None else None
        self.lr_scheduler = build_lr_scheduler(self.optimizer, opt, total)

    def _build_model(self) -> torch.nn.Module:
        cfg = self.config
        hf_config = AutoConfig.from_pretrained(cfg.path)
        if self.head == "value":
            hf_config.num_labels = 1
            hf_config.classifier_dropout = 0.0  # a value/reward head must be deterministic
        hf_config.use_cache = False
        auto = AutoModelForCausalLM if self.head == "lm" else AutoModelForTokenClassification
        kwargs = {"attn_implementation": ATTN_IMPL, "dtype": _dtype(cfg.dtype)}

        def prepared(model: PreTrainedModel) -> PreTrainedModel:
            blocks.apply_checkpointing(model, cfg.activation_checkpointing)
            return model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)  # every rank builds identical weights before sharding
            if self.pp_mesh is not None:  # this rank's stage only
                model = pipeline.build_stage(
                    lambda: prepared(auto.from_config(hf_config, **kwargs)),
                    hf_config,
                    cfg.path,
                    _dtype(cfg.dtype),
                    self.pp_mesh,
                    cfg.init_from_scratch,
                )
            elif cfg.init_from_scratch:
                model = prepared(auto.from_config(hf_config, **kwargs))
            else:
                model = prepared(auto.from_pretrained(cfg.path, config=hf_config, **kwargs))
        self.hf_config = model.config
        # exports say what they hold: a value head loads as ...ForTokenClassification (its score
        # has a bias), not as the causal LM the base checkpoint was
        self.hf_config.architectures = [getattr(model, "hf_class", type(model).__name__)]
        if cfg.lora.enabled:  # before sharding: FSDP shards the adapters with the rest
            model = lora.apply_lora(model, cfg.lora, self.head, cfg.init_seed)
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        compute = self.config.param_dtype
        if compute == "auto":
            compute = "bfloat16" if self.device.type == "cuda" else "float32"
        mp = MixedPrecisionPolicy(
            param_dtype=_dtype(compute), reduce_dtype=_dtype(self.config.reduce_dtype)
        )
        offload = CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy()  # the default
        if not self.config.cpu_offload and self.device.type == "cuda":
            model.to(self.device)
        layers = pipeline.decoder_layers(lora.base_model(model))
        if self.tp_mesh is not None:
            apply_tensor_parallel(model, self.tp_mesh)
        if blocks.resolve_compile(self.config.compile, self.device):
            blocks.compile_blocks(layers)
        for module in [*layers, model]:
            fully_shard(module, mesh=self.dp_mesh, mp_policy=mp, offload_policy=offload)
        # the fused head needs the root's plain (dp-sharded) head weight and the whole model:
        # tp's head is a replicated DTensor and a pp stage sees logits, so both keep the logits
        layout_ok = self.head == "lm" and self.tp_mesh is None and self.pp_mesh is None
        self.fused = self.config.fused_logprobs and layout_ok
        self.fused = self.fused and lm_forward.fused_head_refusal(model) is None
        if self.fused:
            lm_forward.install_fused_head(model)
        if self.pp_mesh is not None:
            assert isinstance(model, pipeline.StageModule)  # _build_model made it
            self.pipe = pipeline.Pipeline(
                model, self.pp_mesh, self.dp_mesh, _dtype(compute), self.config.shared_prefix
            )

    # ------------------------------------------------------------------------------ compute

    def _logits(self, mb: PackedBatch) -> torch.Tensor:
        """Packed forward of one micro-batch: fp32 logits ``[T, V]`` (or values ``[T, 1]``)."""
        return lm_forward.packed_logits(self.model, mb, self.spec)

    def _token_logprobs(self, mb: PackedBatch) -> TokenLogprobs:
        """Token logprobs and entropies of one micro-batch at this engine's temperature."""
        if self.fused:
            return lm_forward.fused_token_logprobs(self.model, mb, self.spec)
        return lm_forward.from_logits(self._logits(mb), mb, self.spec)

    def _split(self, batch: PackedBatch) -> tuple[MicroBatches, int]:
        """Micro-batches of this rank and the number every rank will run (the max over ranks)."""
        if batch.n_seqs == 0:
            raise ValueError("empty batch: every rank needs at least one sequence")
        spec = self.config.mb_spec
        mbs = split_microbatches(batch, spec.n_mbs, spec.max_tokens_per_mb, spec.granularity)
        n = torch.tensor([len(mbs.mbs)], device=self.device)
        all_reduce(n, dist.ReduceOp.MAX, self.group)
        n_run = int(n.item())
        if n_run > len(mbs.mbs):  # more, smaller micro-batches keep this rank's work even
            mbs = split_microbatches(batch, n_run, spec.max_tokens_per_mb, spec.granularity)
        return mbs, n_run

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        all_reduce(t, group=self.group)
        return t.tolist()

    def train_batch(
        self, batch: PackedBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step over ``batch``; returns weighted loss stats, grad_norm, lr,
        skipped."""
        return self._train(batch, loss_fn, loss_weight_fn, self._logits)

    def train_token_batch(
        self, batch: PackedBatch, loss_fn: TokenLossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """:meth:`train_batch` for a loss of the tokens' logprobs and entropies at this engine's
        temperature (:class:`TokenLogprobs`); with ``fused_logprobs`` no logits are built."""
        if self.head != "lm":
            raise ValueError(f"token logprobs need an LM head; this engine has head={self.head!r}")
        if self.pipe is not None:  # the last stage's loss gets logits from the schedule
            on_logits = lambda x, mb: loss_fn(lm_forward.from_logits(x, mb, self.spec), mb)  # noqa: E731
            return self._train(batch, on_logits, loss_weight_fn, self._logits)
        return self._train(batch, loss_fn, loss_weight_fn, self._token_logprobs)

    def _train(self, batch, loss_fn, loss_weight_fn: LossWeightFn, inputs) -> dict[str, float]:
        """One optimizer step: ``loss_fn(inputs(mb), mb)`` per micro-batch (``inputs``: logits or
        token logprobs; with a pipeline ``loss_fn`` takes logits)."""
        self.model.train()
        mbs, n_run = self._split(batch)
        weights = [float(loss_weight_fn(mb)) for mb in mbs.mbs]
        (total,) = self._all_reduce_sum([sum(weights)])
        if not total > 0:
            raise ValueError(
                f"loss_weight_fn sums to {total} over the global batch; "
                "the batch has nothing to train on (check loss_mask)"
            )
        # FSDP averages gradients over ranks; * world_size turns that into the global sum.
        scale = self.world_size / total
        if self.pipe is not None:  # 1F1B runs at least one micro-batch per stage
            n_run = max(n_run, self.pipe.n_stages)
            sums = self.pipe.train(mbs.mbs, n_run, weights, loss_fn, scale)
        else:
            sums = self._accumulate(mbs, n_run, weights, scale, loss_fn, inputs)
        keys = sorted(sums)
        reduced = self._all_reduce_sum([sums[k] for k in keys])
        result = {k: v / total for k, v in zip(keys, reduced)}
        result.update(self._optimizer_step())
        result.update(n_mbs=float(n_run), loss_weight=total)
        return result

    def _accumulate(
        self, mbs: MicroBatches, n_run: int, weights: list[float], scale: float, loss_fn, inputs
    ) -> dict[str, float]:
        """Forward and backward of each micro-batch (weight-0 copies of the first after the
        real ones); the weighted sums of loss and stats."""
        sums: dict[str, float] = defaultdict(float)
        for i in range(n_run):
            real = i < len(mbs.mbs)
            mb = mbs.mbs[i if real else 0]
            w = weights[i] if real else 0.0
            loss, stats = loss_fn(inputs(mb), mb.to(self.device))  # inputs are on the device
            (loss * (w * scale)).backward()
            sums["loss"] += w * float(loss.detach())
            for k, v in stats.items():
                sums[k] += w * float(v)
        return sums

    def _optimizer_step(self) -> dict[str, float]:
        """Clip and step; a non-finite grad norm skips the update (gradients are dropped)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        assert self.optimizer is not None  # initialize() built it with the model
        if self.pipe is not None:
            self.pipe.sync_tied_grads()
        counted = [p for p in params if self.pipe is None or self.pipe.counted(p)]
        grads = [p.grad for p in counted if p.grad is not None]  # all of them (params has grads)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.pipe is not None:  # over the stages
            norm = self.pipe.total_norm(norm)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = bool(torch.isfinite(norm))
        if finite:
            max_norm = self.config.optimizer.gradient_clipping
            if max_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return {"grad_norm": float(norm), "lr": lr, "update_skipped": float(not finite)}

    @torch.no_grad()
    def forward(self, batch: PackedBatch, post_hook: PostHook) -> torch.Tensor:
        """Micro-batched forward; ``post_hook(logits [T_mb, V], mb)`` outputs, in batch order."""
        return self._forward(batch, post_hook, self._logits)

    def _forward(self, batch: PackedBatch, post_hook, inputs) -> torch.Tensor:
        self.model.eval()
        mbs, n_run = self._split(batch)
        if self.pipe is not None:
            outs = self.pipe.forward(mbs.mbs, n_run, post_hook)
            per_seq = [torch.split(o, mb.seqlens.tolist()) for o, mb in zip(outs, mbs.mbs)]
            return torch.cat(mbs.restore_order(per_seq))
        per_seq = []
        for i in range(n_run):
            real = i < len(mbs.mbs)
            mb = mbs.mbs[i if real else 0]
            out = post_hook(inputs(mb), mb.to(self.device))
            if real:
                per_seq.append(torch.split(out, mb.seqlens.tolist()))
        return torch.cat(mbs.restore_order(per_seq))

    @model_fn(named={"out": "logp"})
    @torch.no_grad()
    def compute_logp(self, batch: PackedBatch, out: str = "logp") -> ModelFnResult:
        """``batch`` plus token field ``out`` [T]: logprobs of ``input_ids`` under the current
        weights at this engine's temperature (0 at each sequence's first token)."""
        if self.head != "lm":
            raise ValueError(f"compute_logp needs an LM head; this engine has head={self.head!r}")
        if self.pipe is not None:  # the last stage hooks logits from the schedule
            hook = lambda x, mb: lm_forward.from_logits(x, mb, self.spec).logp  # noqa: E731
            logp = self._forward(batch, hook, self._logits)
        else:
            logp = self._forward(batch, lambda x, mb: x.logp, self._token_logprobs)
        return batch.with_fields(tokens={out: logp}), {}

    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one step."""
        if self.lr_scheduler is None:
            raise RuntimeError(f"{type(self).__name__} has no LR schedule: call initialize() first")
        self.lr_scheduler.step()

    # ------------------------------------------------------------------------------ save / load

    def save(self, meta: SaveLoadMeta) -> None:
        """HF export (``weight_format="hf"``) or sharded DCP checkpoint (``"dcp"``). Collective."""
        if meta.weight_format == "hf":
            tok = meta.tokenizer_path or self.config.path
            raw = self._gathered_state()
            checkpoint.save_hf(
                self._merged(raw),
                self.hf_config,
                meta.path,
                tok,
                {"version": self.version},
                self.mesh_group,
            )
            if self.config.lora.enabled:  # the adapter alone too, in peft's layout
                if self.first:
                    lora.save_adapter(
                        self.model, raw, f"{meta.path}/{lora.ADAPTER_DIR}", self.config.path
                    )
                dist.barrier(group=self.mesh_group)
        elif meta.weight_format == "dcp":
            optim = self.optimizer if meta.with_optim else None
            sched = self.lr_scheduler if meta.with_optim else None
            extra = {"version": self.version, "global_step": self.global_step}
            checkpoint.save_dcp(
                meta.path,
                self.model,
                optim,
                sched,
                extra,
                self.mesh_group,
                trainable_only=self.config.lora.enabled,
                flat_optim=self.pipe is not None,
            )
        else:
            raise ValueError(
                f"SaveLoadMeta.weight_format must be 'hf' or 'dcp', got {meta.weight_format!r}"
            )

    def load(self, meta: SaveLoadMeta) -> None:
        """Load an HF dir (weights only) or a DCP checkpoint saved by :meth:`save`. Collective."""
        if meta.weight_format == "hf":
            if self.config.lora.enabled:
                raise ValueError(
                    f"load(weight_format='hf') of {meta.path!r} would replace the frozen base of a "
                    "LoRA model; set the model's `path` to that HF dir instead"
                )
            if self.pipe is not None:  # each stage reads its own tensors
                pipeline.load_stage_hf(self.model, meta.path, self.hf_config)
            else:
                checkpoint.load_hf_weights(self.model, meta.path, self.hf_config)
        elif meta.weight_format == "dcp":
            optim = self.optimizer if meta.with_optim else None
            sched = self.lr_scheduler if meta.with_optim else None
            extra = checkpoint.load_dcp(
                meta.path,
                self.model,
                optim,
                sched,
                self.mesh_group,
                trainable_only=self.config.lora.enabled,
                flat_optim=self.pipe is not None,
            )
            self.version, self.global_step = extra["version"], extra["global_step"]
        else:
            raise ValueError(
                f"SaveLoadMeta.weight_format must be 'hf' or 'dcp', got {meta.weight_format!r}"
            )

    # ------------------------------------------------------------------------------ weight export

    def init_weight_update_group(self, meta: WeightUpdateMeta, world_size: int) -> None:
        """Trainer rank 0 joins the broadcast group as group rank 0 (servers are ranks 1..N-1).

        Runs concurrently with the client's ``/init_weights_update_group`` calls to the servers.
        """
        if self.first:
            self._weight_group = weight_sync.init_weight_update_group(
                meta.master_address, meta.master_port, 0, world_size, meta.backend,
                meta.timeout, meta.group_name,
            )  # fmt: skip

    def weight_announcement(self) -> dict[str, list]:
        """``names``/``dtypes``/``shapes`` of what :meth:`update_weights` broadcasts, in order.

        The client sends this with ``/update_weights_from_distributed``; no collective.
        """
        return weight_sync.spec_announcement(self._weight_specs())

    def _export_plan(self, state: dict[str, torch.Tensor]) -> dict[str, lora.Source]:
        """HF name -> where it comes from in ``state`` (LoRA: the merged ``W + s * B @ A``)."""
        if self.config.lora.enabled:
            return lora.merge_plan(state)
        return {name: lora.Source(name) for name in state}

    def _weight_specs(self) -> list[weight_sync.TensorSpec]:
        if self.pipe is not None:  # no rank holds the whole model to broadcast
            raise self.pipe.broadcast_refused()
        state = self.model.state_dict()  # DTensors report global shapes
        plan = self._export_plan(state)
        names = checkpoint.export_names(self.hf_config, plan)
        return [
            weight_sync.TensorSpec(n, state[plan[n].base].dtype, tuple(state[plan[n].base].shape))
            for n in names
        ]

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Trainer side of a weight update; telling servers to load/receive is the client's job.

        ``disk``: write an HF dir at ``meta.path`` (atomically; ``areal_meta.json`` holds
        ``meta.version``); the client then calls the servers' ``/update_weights_from_disk``.
        ``distributed``: broadcast every tensor of :meth:`weight_announcement` over the group
        of :meth:`init_weight_update_group` (byte buckets, or per tensor), while the client has
        the servers receive. ``ipc``: share them with ``meta.send_shared``. Full tensors are
        all-gathered one bucket at a time. Collective over trainer ranks.
        """
        if meta.type == "disk":
            if not meta.path:
                raise ValueError(
                    "WeightUpdateMeta.path is empty for type='disk'; set the HF dir to write"
                )
            checkpoint.save_hf(
                self.full_state_dict(),
                self.hf_config,
                meta.path,
                self.config.path,
                {"version": meta.version},
                self.mesh_group,
            )
        elif meta.type in ("distributed", "ipc"):
            self._push_weights(meta)
        else:
            raise ValueError(
                f"WeightUpdateMeta.type must be 'disk', 'distributed' or 'ipc', got {meta.type!r}"
            )

    def _push_weights(self, meta: WeightUpdateMeta) -> None:
        """Full tensors, gathered one bucket at a time, delivered from the first rank by
        :func:`areal.utils.weight_sync.send_weights`. Collective."""
        specs = self._weight_specs()  # refuses a pipelined model first
        state = self.model.state_dict()
        plan = self._export_plan(state)
        scaling = self.config.lora.alpha / max(self.config.lora.rank, 1)
        full = lambda key: self._full_tensor(state[key])  # noqa: E731
        on_host = meta.type == "distributed" and meta.backend == "gloo"
        weight_sync.send_weights(
            specs,
            lambda s: lora.merged_tensor(plan[s.name], full, scaling),
            torch.device("cpu") if on_host else self.device,
            self.first,
            meta.bucket_bytes,
            group=self._weight_group if meta.type == "distributed" else None,
            per_tensor=meta.per_tensor,
            send_shared=meta.send_shared if meta.type == "ipc" else None,
            timeout=meta.timeout,
        )
        dist.barrier(group=self.mesh_group)

    def _full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):  # torch types Tensor.to as -> Tensor; a DTensor's is a DTensor
            return cast(DTensor, t.to(self.device)).full_tensor()
        return t

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict (HF names, tied keys included; LoRA: the merged model) on the
        mesh's first rank; ``{}`` elsewhere. Collective over the mesh."""
        return self._merged(self._gathered_state())

    def _merged(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return lora.merge_state_dict(raw, self.config.lora) if self.config.lora.enabled else raw

    def _gathered_state(self) -> dict[str, torch.Tensor]:
        """The model's own state dict (peft names under LoRA), full, on the first rank."""
        out = {}
        for name, t in self.model.state_dict().items():
            full = self._full_tensor(t)  # all-gather over the mesh, one tensor at a time
            if self.holder:
                out[name] = full.detach().to("cpu", copy=True)
        return out if self.pipe is None else self.pipe.gather_state(out, self.holder)

    def get_version(self) -> int:
        """Version of the current weights."""
        return self.version

    def set_version(self, version: int) -> None:
        """Set the weight version counter."""
        self.version = version

    def destroy(self) -> None:
        """Drop model, optimizer and the weight-update group (the mesh belongs to the caller)."""
        self._model = self.optimizer = self.lr_scheduler = None
        if self._weight_group is not None:  # its name can be joined again in this process
            weight_sync.destroy_weight_update_group(self._weight_group)
        self._weight_group = None
