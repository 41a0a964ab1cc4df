"""Pipeline parallelism for :class:`~areal.engine.fsdp.FSDPEngine` (torch.distributed.pipelining).

A model on a mesh with a ``pp`` dimension (``("pp", "dp", "tp")``, from
:func:`areal.runtime.dist.build_mesh`) is cut into ``pp`` stages, one per pp rank:

- **Stages.** Decoder layers are divided in order, ``n // pp`` each, the first ``n % pp`` stages
  one more (:func:`stage_layers`). The first stage also holds the token embedding; the last the
  final norm and the head (``lm_head``, or a value model's ``score``). Parameters keep the HF
  model's names (``model.layers.{i}`` with the global ``i``: the layers sit in a ``ModuleDict``),
  so DCP checkpoints, HF exports and reallocation see the names a plain model has. Inside a
  stage, tensor parallelism (over ``tp``) and FSDP2 (over ``dp``) apply as without pipelining.
- **Loading.** A stage is built on the meta device and reads only its own tensors from the
  checkpoint's safetensors files (opened lazily, one key at a time; :func:`read_stage_weights`).
  ``init_from_scratch`` builds the whole model with the seed first (the same initial weights as
  without pipelining), then drops what the stage does not hold.
- **Tied embeddings** (``tie_word_embeddings``): the first stage's embedding and the last
  stage's head are two copies of one weight. Their gradients are summed over the pp group
  before the optimizer step, so both copies take the same update and stay equal; the grad norm
  counts the weight once.
- **Schedules.** Training runs :class:`~torch.distributed.pipelining.Schedule1F1B`; inference
  (logprobs, values) the forward-only schedule. Every micro-batch of one call is padded to the
  longest (a padding segment attends only to itself), because a stage's receive buffers have one
  shape; the engine's token-budget micro-batches and its shared-prefix layout are kept as they
  are. With fewer micro-batches than stages the engine adds weight-0 copies of the first.
- **Losses** run on the last stage, per micro-batch, on the logits in the plain layout: the
  schedule's ``loss_fn(output, target)`` gets the stage output and the micro-batch's index and
  calls the engine's ``loss_fn(logits, mb)``, scaled as the non-pipelined step scales it. The
  stats, the post-hook outputs of a forward, and a grad norm reach every stage (object
  broadcast, or a sum over the pp group), so every rank returns the same as without pipelining.

Limits: one stage per pp rank (no interleaved or zero-bubble schedules); Qwen2/Llama-style
decoders (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``); no
LoRA; weight updates by disk only (the broadcast path needs the full model on one rank).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from areal.utils.batch import PackedBatch
from areal.utils.comm import all_reduce
from areal.utils.prefix import share_prefixes

if TYPE_CHECKING:  # torch.distributed.pipelining and transformers are imported where a stage is
    # built: the Core master and `areal core graph` import this module for its layer split only
    from torch.distributed.pipelining import PipelineStage
    from transformers import PretrainedConfig, PreTrainedModel

T = TypeVar("T")
HEADS = ("lm_head", "score")  # causal LM head, token-classification (value) head
TIED = ("model.embed_tokens.weight", "lm_head.weight")  # first and last stage's copies


# ------------------------------------------------------------------------------------ meshes


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None, DeviceMesh | None]:
    """``(dp mesh, tp mesh or None, pp mesh or None)`` of an engine's mesh: 1-D (any name) is
    data-parallel only; 2-D must be named ``("dp", "tp")``, 3-D ``("pp", "dp", "tp")``."""
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        return mesh, None, None
    if mesh.ndim == 2 and names == ("dp", "tp"):
        return mesh["dp"], mesh["tp"], None
    if mesh.ndim == 3 and names == ("pp", "dp", "tp"):
        tp = mesh["tp"] if mesh.size(2) > 1 else None
        return mesh["dp"], tp, (mesh["pp"] if mesh.size(0) > 1 else None)
    raise ValueError(
        f"FSDPEngine needs a 1-D data-parallel mesh, a 3-D mesh named ('pp', 'dp', 'tp') or a "
        f"2-D mesh named ('dp', 'tp'), got {mesh.ndim}-D {mesh} with dims {names}; build it with "
        "areal.runtime.dist.build_mesh"
    )


def whole_mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over every rank of ``mesh``: its own group when 1-D, else its
    flattened dimension (named by joining the dims, e.g. ``"pp_dp_tp"``). Flattening is
    collective over the job, so :func:`areal.runtime.dist.build_mesh` does it on every rank;
    here it is looked up, with no communication."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten("_".join(mesh.mesh_dim_names or ())).get_group()


# ------------------------------------------------------------------------------------ stages


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Decoder layers of ``stage`` (0-based) of ``pp``: ``n // pp`` each, the first ``n % pp``
    stages one more (the last stage also runs the head, the costliest matmul)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_pipeline(hf_config: PretrainedConfig, pp: int, path: str) -> None:
    """Raise ``ValueError`` naming the field and the fix when the model at ``path`` cannot be cut
    into ``pp`` stages of at least one decoder layer each."""
    n = getattr(hf_config, "num_hidden_layers", None)
    if n is None or getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"pipeline parallelism (pp={pp}) needs a decoder-only model with num_hidden_layers; "
            f"{path!r} has none; use pp=1 for this model"
        )
    if pp > n:
        raise ValueError(
            f"pp={pp} exceeds num_hidden_layers={n} of the model at {path!r}: every stage needs "
            f"at least one decoder layer; use pp <= {n}"
        )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers ``model.model.layers`` holds, whether a ``ModuleList`` (whole model)
    or a ``ModuleDict`` keyed by global index (a pipeline stage)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no .model.layers; only decoder-only HF models are "
            "supported"
        )
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


@dataclass
class MicroBatchContext:
    """What every stage needs of one micro-batch besides the activations it receives."""

    mb: PackedBatch  # on the device: the loss and post hooks read its fields
    input_ids: torch.Tensor  # [T_pad] row tokens (shared-prefix layout or plain), padded
    position_ids: torch.Tensor  # [1, T_pad]
    segments: list[tuple[int, int, torch.Tensor | None]]  # attention segments of the row
    index: torch.Tensor | None  # [T] plain token -> row position (shared prefix), else None
    weight: float = 0.0  # train: the loss's share of the step's gradient

    def plain(self, out: torch.Tensor) -> torch.Tensor:
        """``out [1, T_pad, ...]`` of the row -> fp32 ``[T, ...]`` in the plain layout."""
        rows = out[0].float()
        return rows[: self.mb.n_tokens] if self.index is None else rows[self.index]


def micro_batch_context(
    mb: PackedBatch, shared_prefix: bool, device: torch.device
) -> MicroBatchContext:
    """``mb`` laid out as one row (shared-prefix layout when it applies), unpadded."""
    row = share_prefixes(mb) if shared_prefix else None
    mb = mb.to(device)
    segments: list[tuple[int, int, torch.Tensor | None]]
    if row is None:
        bounds: list[int] = mb.cu_seqlens.tolist()
        segments = [(s, e, None) for s, e in itertools.pairwise(bounds)]
        return MicroBatchContext(mb, mb["input_ids"], mb.position_ids()[None], segments, None)
    segments = [
        (s, e, None if m is None else m.to(device)) for (s, e), m in zip(row.bounds, row.masks)
    ]
    ids, pos = row.input_ids.to(device), row.position_ids.to(device)[None]
    return MicroBatchContext(mb, ids, pos, segments, row.index.to(device))


def pad_contexts(contexts: list[MicroBatchContext]) -> int:
    """Pad every row to the longest (one extra causal segment of token 0 at positions 0..);
    returns the padded length."""
    n = max(len(c.input_ids) for c in contexts)
    for c in contexts:
        extra = n - len(c.input_ids)
        if extra:
            dev = c.input_ids.device
            c.segments = [*c.segments, (len(c.input_ids), n, None)]
            c.input_ids = torch.cat([c.input_ids, torch.zeros(extra, dtype=torch.long, device=dev)])
            c.position_ids = torch.cat(
                [c.position_ids, torch.arange(extra, device=dev)[None]], dim=1
            )
    return n


def submodule(module: nn.Module, name: str) -> nn.Module:
    """``module``'s child ``name`` (an HF model's parts by the names Qwen2/Llama give them)."""
    child = getattr(module, name)
    if not isinstance(child, nn.Module):
        raise ValueError(
            f"{type(module).__name__}.{name} is not a module; only Qwen2/Llama-style decoders can "
            "be pipelined"
        )
    return child


class StageModule(nn.Module):
    """One pipeline stage of an HF decoder-only model, with the model's own parameter names.

    ``forward(x, mb_index)``: ``x`` is the row's token ids ``[1, T_pad]`` on the first stage, else
    the previous stage's hidden states ``[1, T_pad, H]``; ``mb_index`` ``[1]`` picks the
    micro-batch's :class:`MicroBatchContext` (positions, attention segments). Returns hidden
    states, or the head's output ``[1, T_pad, V]`` on the last stage.
    """

    def __init__(self, hf_model: PreTrainedModel, layers: range, first: bool, last: bool):
        super().__init__()
        self.config: PretrainedConfig = hf_model.config
        self.model = submodule(hf_model, "model")  # the decoder: embed_tokens, layers, norm
        every = submodule(self.model, "layers")
        self.model.layers = nn.ModuleDict({str(i): every.get_submodule(str(i)) for i in layers})
        self.first, self.last = first, last
        self.hf_class = type(hf_model).__name__  # what an export of the whole model loads as
        if not first:
            setattr(self.model, "embed_tokens", None)  # noqa: B010 - a child dropped, not a tensor
        if not last:
            setattr(self.model, "norm", None)  # noqa: B010
        head = next((h for h in HEADS if hasattr(hf_model, h)), None)
        if head is None:
            raise ValueError(f"{type(hf_model).__name__} has no head among {HEADS}")
        self.head_name: str = head
        self.dropout: nn.Module | None = None
        if last:
            setattr(self, head, submodule(hf_model, head))
            self.dropout = getattr(hf_model, "dropout", None)  # a value head's (p=0 here)
        self.contexts: list[MicroBatchContext] = []

    @property
    def head(self) -> nn.Module:
        """The last stage's head (``lm_head`` or ``score``)."""
        return submodule(self, self.head_name)

    def decoder_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order."""
        return list(submodule(self.model, "layers").children())

    def forward(self, x: torch.Tensor, mb_index: torch.Tensor) -> torch.Tensor:
        ctx = self.contexts[int(mb_index.reshape(-1)[0])]
        h = submodule(self.model, "embed_tokens")(x) if self.first else x
        position_embeddings = submodule(self.model, "rotary_emb")(h, ctx.position_ids)
        for layer in self.decoder_layers():
            h = layer(
                h,
                attention_mask=None,
                position_ids=ctx.position_ids,
                position_embeddings=position_embeddings,
                areal_segments=ctx.segments,
            )
        if not self.last:
            return h
        h = submodule(self.model, "norm")(h)
        if self.dropout is not None:
            h = self.dropout(h)
        return self.head(h)


def tied_name(module: StageModule) -> str | None:
    """The name of this stage's copy of a tied embedding (None: untied, or a middle stage)."""
    if not getattr(module.config, "tie_word_embeddings", False) or module.head_name != "lm_head":
        return None
    return TIED[0] if module.first else TIED[1] if module.last else None


# ------------------------------------------------------------------------------------ loading


def build_stage(
    build: Callable[[], PreTrainedModel],
    hf_config: PretrainedConfig,
    path: str,
    dtype: torch.dtype,
    pp_mesh: DeviceMesh,
    init_from_scratch: bool,
) -> StageModule:
    """This pp rank's stage of the model at ``path`` (``build()`` makes the whole HF model from
    ``hf_config``, prepared: e.g. activation checkpointing on; it runs on the meta device unless
    ``init_from_scratch``). Weights: the stage's own tensors of the checkpoint, or, with
    ``init_from_scratch``, the whole model's seeded init cut to the stage (call under the seed)."""
    pp, stage = pp_mesh.size(), pp_mesh.get_local_rank()
    check_pipeline(hf_config, pp, path)
    layers = stage_layers(hf_config.num_hidden_layers, pp, stage)
    first, last = stage == 0, stage == pp - 1
    if init_from_scratch:
        return StageModule(build(), layers, first, last)
    with torch.device("meta"):
        model = build()
    module = StageModule(model, layers, first, last)
    names = list(module.state_dict())
    # a head the checkpoint lacks (a value head on an LM checkpoint) is initialised as
    # from_pretrained does: HF's init of the module, with the init seed (the caller's)
    head = f"{module.head_name}." if last else None
    state = read_stage_weights(path, names, hf_config, optional=head)
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if head is not None and any(n.startswith(head) and n not in state for n in names):
        module.head.to_empty(device="cpu")
        model._init_weights(module.head)
    rotary: Callable[..., nn.Module] = type(submodule(module.model, "rotary_emb"))
    module.model.rotary_emb = rotary(config=module.config)  # inv_freq is not in the checkpoint
    left = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]
    left += [n for n, b in module.named_buffers() if b.is_meta]
    if left:
        raise ValueError(
            f"stage {stage} of {path!r} has tensors no checkpoint key fills: {left[:5]}; "
            "only Qwen2/Llama-style decoders can be pipelined"
        )
    return module


def read_stage_weights(
    path: str, names: list[str], hf_config: PretrainedConfig, optional: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the HF dir ``path``: each file's header is read, then only those
    tensors (``safe_open``, one key at a time), so a stage never loads another stage's layers.
    A tied ``lm_head.weight`` comes from ``model.embed_tokens.weight`` when not stored; names
    starting with ``optional`` may be absent (left out of the result)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}; point path at an HF model dir")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            where.update(dict.fromkeys(sf.keys(), f))
    source = {n: n for n in names}
    tied = getattr(hf_config, "tie_word_embeddings", False)
    if tied and TIED[1] in source and TIED[1] not in where:
        source[TIED[1]] = TIED[0]
    absent = {n for n, s in source.items() if s not in where}
    missing = sorted(n for n in absent if optional is None or not n.startswith(optional))
    if missing:
        raise ValueError(
            f"weights in {path!r} lack {missing[:5]}; load a checkpoint of the same architecture"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        todo = {n: s for n, s in source.items() if n not in absent and where[s] == f}
        if todo:
            with safe_open(str(f), "pt") as sf:
                out.update({n: sf.get_tensor(s) for n, s in todo.items()})
    return out


# ------------------------------------------------------------------------------------ running


class _Reduced(nn.Module):
    """The last stage of a forward-only pass: each micro-batch's output goes through the post
    hook at once (kept in ``outputs``), so no call holds the logits of more than one."""

    def __init__(
        self,
        stage: StageModule,
        post_hook: Callable[[torch.Tensor, PackedBatch], torch.Tensor],
        outputs: dict[int, torch.Tensor],
    ):
        super().__init__()
        self.stage, self.post_hook, self.outputs = stage, post_hook, outputs

    def forward(self, x: torch.Tensor, mb_index: torch.Tensor) -> torch.Tensor:
        i = int(mb_index.reshape(-1)[0])
        ctx = self.stage.contexts[i]
        self.outputs[i] = self.post_hook(ctx.plain(self.stage(x, mb_index)), ctx.mb)
        return torch.zeros(1, 1, device=x.device)


class Pipeline:
    """This rank's stage at run time: a schedule per call, and what crosses the stages besides
    activations (stats, forward outputs, tied-embedding gradients, the grad norm)."""

    def __init__(
        self,
        module: StageModule,
        pp_mesh: DeviceMesh,
        dp_mesh: DeviceMesh,
        compute_dtype: torch.dtype,
        shared_prefix: bool,
    ):
        self.module, self.compute_dtype, self.shared_prefix = module, compute_dtype, shared_prefix
        cuda = pp_mesh.device_type == "cuda"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        self.group = pp_mesh.get_group()
        self.stage, self.n_stages = pp_mesh.get_local_rank(), pp_mesh.size()
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.last_rank = dist.get_global_rank(self.group, self.n_stages - 1)
        cfg = module.config
        self.tied = (
            bool(getattr(cfg, "tie_word_embeddings", False)) and module.head_name == "lm_head"
        )
        name = tied_name(module)
        params = dict(module.named_parameters())
        self.tied_param = params[name] if name is not None else None
        # this rank's FSDP shard of the tied weight (dim 0 cut as torch.chunk cuts it), which the
        # middle stages, holding no copy, need to take part in the gradient sum
        rows = -(-cfg.vocab_size // dp_mesh.size())
        mine = max(0, min(rows, cfg.vocab_size - dp_mesh.get_local_rank() * rows))
        self.tied_shape = (mine, cfg.hidden_size)

    def _stage(
        self, submodule: nn.Module, n_tokens: int, width: int, training: bool
    ) -> PipelineStage:
        """A stage whose activations are ``[1, n_tokens, hidden]`` (metadata given: no shape
        inference pass; in training they carry gradients back); ``width`` is the last stage's
        output width."""
        hidden = (1, n_tokens, self.module.config.hidden_size)
        meta = {"dtype": self.compute_dtype, "device": "meta", "requires_grad": training}
        if self.first:
            inputs = torch.empty(1, n_tokens, dtype=torch.long, device="meta")
        else:
            inputs = torch.empty(hidden, **meta)
        outputs = torch.empty((1, n_tokens, width) if self.last else hidden, **meta)
        from torch.distributed.pipelining import PipelineStage

        return PipelineStage(
            submodule,
            self.stage,
            self.n_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )

    def _step(self, schedule, contexts: list[MicroBatchContext], training: bool) -> None:
        ids = torch.arange(len(contexts))  # [M]: the schedule hands each stage one per chunk
        args = (torch.stack([c.input_ids for c in contexts]),) if self.first else ()  # [M, T]
        target = ids if training and self.last else None
        self.module.contexts = contexts
        try:
            with warnings.catch_warnings():
                # FSDP2 warns that a stage's output is a view (the tp plan's local outputs), on
                # which an in-place op would skip its backward all-gather; nothing here modifies
                # it in place, and the gradients equal the plain engine's (tests/engine/
                # test_pipeline.py, tests/core/test_ray_pp.py)
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
                schedule.step(*args, mb_index=ids, target=target, return_outputs=False)
        finally:
            self.module.contexts = []

    def train(
        self,
        mbs: list[PackedBatch],
        n_run: int,
        weights: list[float],
        loss_fn: Callable[[torch.Tensor, PackedBatch], tuple[torch.Tensor, dict[str, float]]],
        scale: float,
    ) -> dict[str, float]:
        """Forward and backward of ``n_run`` micro-batches (``mbs``, then weight-0 copies of the
        first; 1F1B needs at least one per stage), 1F1B; on the last stage ``loss_fn(logits
        [T, V] fp32, mb)`` scaled by ``weight * scale``. Returns the weighted sums of ``loss``
        and the loss's stats, the same on every stage. Gradients are left in the parameters."""
        contexts = micro_batch_contexts(mbs, n_run, self.shared_prefix, self.device, weights)
        sums: dict[str, float] = defaultdict(float)

        def stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            ctx = contexts[int(target.reshape(-1)[0])]
            loss, stats = loss_fn(ctx.plain(output), ctx.mb)
            sums["loss"] += ctx.weight * float(loss.detach())
            for k, v in stats.items():
                sums[k] += ctx.weight * float(v)
            return loss * (ctx.weight * scale)

        n = pad_contexts(contexts)
        head = self.module.head if self.last else None
        width = head.out_features if isinstance(head, nn.Linear) else 0  # logits or values
        stage = self._stage(self.module, n, width, training=True)
        from torch.distributed.pipelining import Schedule1F1B

        schedule = Schedule1F1B(stage, len(contexts), loss_fn=stage_loss, scale_grads=False)
        self._step(schedule, contexts, training=True)
        return self.from_last(dict(sums))

    def forward(
        self,
        mbs: list[PackedBatch],
        n_run: int,
        post_hook: Callable[[torch.Tensor, PackedBatch], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Forward-only pass over ``n_run`` micro-batches (``mbs``, then copies of the first);
        ``post_hook(logits [T, V] fp32, mb)`` of each of ``mbs``, on every stage."""
        n_real = len(mbs)
        contexts = micro_batch_contexts(mbs, n_run, self.shared_prefix, self.device)
        outputs: dict[int, torch.Tensor] = {}
        n = pad_contexts(contexts)
        submodule = _Reduced(self.module, post_hook, outputs) if self.last else self.module
        stage = self._stage(submodule, n, 1, training=False)
        from torch.distributed.pipelining.schedules import _ScheduleForwardOnly

        self._step(_ScheduleForwardOnly(stage, len(contexts)), contexts, training=False)
        sizes = [contexts[i].mb.n_tokens for i in range(n_real)]
        # the hook's output dtype and trailing shape: known on the last stage only
        head = (outputs[0].dtype, tuple(outputs[0].shape[1:])) if self.last else (torch.float32, ())
        dtype, tail = self.from_last(head)
        width = math.prod(tail)
        if self.last:
            flat = torch.cat([outputs[i].reshape(-1) for i in range(n_real)])
        else:
            flat = torch.zeros(sum(sizes) * width, dtype=dtype, device=self.device)
        all_reduce(flat, group=self.group)  # + zeros: the last stage's values, exactly
        chunks = flat.split([s * width for s in sizes])
        return [c.reshape(s, *tail) for c, s in zip(chunks, sizes)]

    def broadcast_refused(self) -> ValueError:
        """The error for a weight broadcast to servers (it needs the whole model on one rank)."""
        return ValueError(
            f"weight_update_mode=distributed with pipeline parallelism (pp={self.n_stages}): "
            "no rank holds the whole model to broadcast; use weight_update_mode=disk"
        )

    def from_last_stage(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as the last stage filled them, on every stage (the others hold zeros: a
        sum over the pp group); in place, returned."""
        return all_reduce(values, group=self.group)

    def from_last(self, obj: T) -> T:
        """``obj`` as the last stage has it, on every stage (object broadcast over the pp group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the tied embedding's two copies (first and last stage) over the pp
        group, so both take the same step; middle stages add zeros."""
        if not self.tied:
            return
        grad = None if self.tied_param is None else self.tied_param.grad
        if grad is None:
            dtype = next(self.module.parameters()).dtype  # the sharded (master) parameters'
            local = torch.zeros(self.tied_shape, dtype=dtype, device=self.device)
        else:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
        all_reduce(local, group=self.group)

    def counted(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` counts in the grad norm (the tied head's copy does not: the
        embedding's does)."""
        return not (self.tied and self.last and param is self.tied_param)

    def total_norm(self, stage_norm: torch.Tensor) -> torch.Tensor:
        """The model's grad norm from each stage's (of its counted parameters)."""
        sq = stage_norm.detach().double().reshape(1).to(self.device) ** 2
        all_reduce(sq, group=self.group)
        return sq.sqrt().to(stage_norm.dtype).reshape(())

    def gather_state(self, own: dict[str, torch.Tensor], holder: bool) -> dict[str, torch.Tensor]:
        """Each stage's full state dict (``own``, on its first rank: ``holder``) merged on the
        first stage's; ``{}`` elsewhere. Collective over the holders' pp group."""
        if not holder:
            return {}
        parts: list[dict[str, torch.Tensor]] = [{}] * self.n_stages
        dst = dist.get_global_rank(self.group, 0)
        dist.gather_object(own, parts if self.first else None, dst=dst, group=self.group)
        return {k: v for part in parts for k, v in part.items()} if self.first else {}


def micro_batch_contexts(
    mbs: list[PackedBatch],
    n_run: int,
    shared_prefix: bool,
    device: torch.device,
    weights: list[float] | None = None,
) -> list[MicroBatchContext]:
    """One context per micro-batch to run: ``mbs`` (with their loss ``weights``), then weight-0
    copies of the first up to ``n_run`` (every rank of a stage runs as many as the others)."""
    out = []
    for i in range(n_run):
        real = i < len(mbs)
        ctx = micro_batch_context(mbs[i if real else 0], shared_prefix, device)
        ctx.weight = weights[i] if weights is not None and real else 0.0
        out.append(ctx)
    return out


def load_stage_hf(model: nn.Module, path: str, hf_config: PretrainedConfig) -> None:
    """Load the stage's tensors of the HF dir ``path`` into the sharded stage (every rank reads
    its own stage's; no communication)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        ValueType,
        set_model_state_dict,
    )

    state: dict[str, ValueType] = {}
    state.update(read_stage_weights(path, list(model.state_dict()), hf_config))
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
