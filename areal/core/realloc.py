"""Parameter reallocation between two layouts of one model: which shard of each parameter every
worker holds, which pieces a destination worker needs that it does not hold, where each comes
from, and how many bytes move. The same plan prints in ``areal core graph`` and runs on the
workers, so the bytes a step logs are the bytes the printout promised.

A layout is an :class:`~areal.core.dfg.Allocation`: a ``pp x dp x tp`` mesh over workers. The
shard a worker holds of a parameter (a box: ``[start, stop)`` per dimension, global indices):

- pipeline stage ``p`` holds whole parameters: the decoder layers of :func:`stage_layers` (an
  even split, the first ``n_layers % pp`` stages one layer more, as
  :mod:`areal.engine.pipeline` splits them), the token embedding on the first stage, the final
  norm, the LM head and a value head on the last (a tied embedding on both: the last stage's
  ``lm_head.weight`` is a copy of it, :func:`canonical`);
- tensor parallelism (:data:`areal.engine.tensor_parallel.LAYER_PLAN`) cuts a column-parallel
  weight or bias along dim 0 and a row-parallel weight along dim 1 into ``tp`` chunks (torch's
  chunk sizes: ``ceil(n / tp)``); everything else is replicated over tp;
- FSDP cuts the tp-local tensor along dim 0 into ``dp`` chunks the same way.

Chunk and stage indices are ranks in the process groups, which torch orders by global rank
(:func:`mesh_ranks`), not positions in the allocation's worker list.

The source layout's distinct boxes of a parameter partition it (replicas of one box sit on
several workers). A destination worker needs its own box; for each source box that overlaps it,
the overlap is already there if the worker holds that source box itself, else it is fetched from
one of the box's holders (chosen by the destination's position, to spread the reads). Only
fetched pieces count as moved bytes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal.api.mfc import ModelName, ParamRealloc
from areal.core.dfg import Allocation, DataflowGraph
from areal.engine import pipeline
from areal.engine.tensor_parallel import LAYER_PLAN

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension, global indices

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_FIRST = ("model.embed_tokens.",)
TIED_EMBEDDING = "model.embed_tokens.weight"  # with a tied head, also on the last stage
_LAST = ("model.norm.", "lm_head.", "score.")


@dataclass(frozen=True)
class ModelShapes:
    """What a plan needs of a model: parameter shapes by name (as ``named_parameters`` gives
    them, a tied head once), the number of decoder layers, whether the head is tied, bytes per
    element."""

    shapes: dict[str, tuple[int, ...]]
    n_layers: int
    tied: bool
    itemsize: int


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` of ``n`` split in ``k`` as ``torch.chunk`` does (every
    chunk ``ceil(n / k)`` long but the last ones, which may be short or empty)."""
    size = -(-n // k)
    return min(i * size, n), min((i + 1) * size, n)


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """The decoder layers of each pipeline stage, as :func:`areal.engine.pipeline.stage_layers`
    cuts them: contiguous, the first ``n_layers % pp`` stages one layer more (e.g. 5 layers over 2
    stages: [0, 1, 2] and [3, 4])."""
    if not 1 <= pp <= n_layers:
        raise ValueError(
            f"pp={pp} stages for a model of {n_layers} decoder layers; use 1..{n_layers}"
        )
    return [pipeline.stage_layers(n_layers, pp, p) for p in range(pp)]  # the engine's own split


def stages_of(name: str, n_layers: int, pp: int, tied: bool) -> set[int]:
    """The pipeline stages holding parameter ``name``."""
    if pp == 1:
        return {0}
    layer = _LAYER.match(name)
    if layer:
        i = int(layer.group(1))
        return {p for p, r in enumerate(stage_layers(n_layers, pp)) if i in r}
    if name.startswith(_FIRST):
        return {0, pp - 1} if tied else {0}
    if name.startswith(_LAST):
        return {pp - 1}
    raise ValueError(
        f"parameter {name!r} belongs to no pipeline stage (decoder layers, embed_tokens, norm, "
        "lm_head, score); pp > 1 supports Qwen2/Llama decoders, use pp=1 for this model"
    )


def tp_dim(name: str) -> int | None:
    """The dimension tensor parallelism cuts ``name`` along (None: replicated over tp)."""
    layer = _LAYER.match(name)
    if not layer or layer.group(2) not in LAYER_PLAN:
        return None
    colwise = LAYER_PLAN[layer.group(2)] == "colwise"
    if layer.group(3) == "bias":
        return 0 if colwise else None  # a row-parallel bias is added after the all-reduce
    return 0 if colwise else 1


def mesh_ranks(layout: Allocation, worker: int) -> tuple[int, int, int]:
    """``worker``'s rank in its pp, dp and tp groups. torch ranks the members of each process
    group of a ``DeviceMesh`` by global rank, whatever their order in the mesh, and FSDP and
    DTensor shard by that rank: in a dp group listed as workers [1, 0], worker 0 holds chunk 0."""
    p, d, t = layout.coordinate(worker)
    groups = (
        [layout.worker_at(q, d, t) for q in range(layout.pp)],
        [layout.worker_at(p, e, t) for e in range(layout.dp)],
        [layout.worker_at(p, d, u) for u in range(layout.tp)],
    )
    stage, dp_rank, tp_rank = (sorted(g).index(worker) for g in groups)
    return stage, dp_rank, tp_rank


def shard_box(
    name: str, shape: tuple[int, ...], layout: Allocation, worker: int, model: ModelShapes
) -> Box | None:
    """The box of ``name`` that ``worker`` holds in ``layout`` (None: not on its stage)."""
    p, d, t = mesh_ranks(layout, worker)
    if p not in stages_of(name, model.n_layers, layout.pp, model.tied):
        return None
    box = [(0, n) for n in shape]
    dim = tp_dim(name) if layout.tp > 1 else None
    if dim is not None:
        box[dim] = chunk(shape[dim], layout.tp, t)
    if box:  # FSDP: dim 0 of the tp-local tensor
        start, stop = box[0]
        lo, hi = chunk(stop - start, layout.dp, d)
        box[0] = (start + lo, start + hi)
    return tuple(box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes (None: empty)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def numel(box: Box) -> int:
    """Elements in ``box``."""
    return math.prod(hi - lo for lo, hi in box)


def relative(box: Box, within: Box) -> tuple[slice, ...]:
    """Slices cutting ``box`` out of a tensor that holds ``within``."""
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, within))


@dataclass(frozen=True)
class Piece:
    """One part of a destination's shard: ``box`` of parameter ``name``, from worker ``source``
    (``local``: the destination is that worker, nothing moves)."""

    name: str
    box: Box
    source: int
    local: bool


def pieces_for(
    worker: int, source: Allocation, target: Allocation, model: ModelShapes
) -> list[Piece]:
    """What ``worker`` needs for its shard of every parameter in ``target``, piece by piece."""
    position = target.workers.index(worker)
    out = []
    for name, shape in model.shapes.items():
        need = shard_box(name, shape, target, worker, model)
        if need is None or numel(need) == 0:
            continue
        holders: dict[Box, list[int]] = defaultdict(list)
        for w in source.workers:
            box = shard_box(name, shape, source, w, model)
            if box is not None and numel(box):
                holders[box].append(w)
        for box, ws in holders.items():
            part = intersect(need, box)
            if part is None:
                continue
            local = worker in ws
            out.append(Piece(name, part, worker if local else ws[position % len(ws)], local))
    return out


@dataclass(frozen=True)
class ReallocPlan:
    """The bytes one reallocation moves: ``received[w]`` is what destination worker ``w``
    fetches from other workers; ``kept[w]`` what it already holds; ``sent[w]`` what source
    worker ``w`` sends; ``model_bytes`` the model's size once."""

    source: Allocation
    target: Allocation
    received: dict[int, int]
    kept: dict[int, int]
    sent: dict[int, int]
    model_bytes: int
    senders: dict[int, tuple[int, ...]]  # destination worker -> the workers it reads from

    @property
    def moved(self) -> int:
        """Bytes that cross between workers."""
        return sum(self.received.values())


def plan_realloc(source: Allocation, target: Allocation, model: ModelShapes) -> ReallocPlan:
    """The reallocation of ``model`` from layout ``source`` to layout ``target``."""
    received, kept = dict.fromkeys(target.workers, 0), dict.fromkeys(target.workers, 0)
    sent = dict.fromkeys(source.workers, 0)
    senders: dict[int, tuple[int, ...]] = {}
    for w in target.workers:
        pieces = pieces_for(w, source, target, model)
        senders[w] = tuple(sorted({p.source for p in pieces if not p.local}))
        for piece in pieces:
            n = numel(piece.box) * model.itemsize
            if piece.local:
                kept[w] += n
            else:
                received[w] += n
                sent[piece.source] += n
    total = sum(math.prod(s) for s in model.shapes.values()) * model.itemsize
    return ReallocPlan(source, target, received, kept, sent, total, senders)


def model_shapes(path: str, head: str = "lm", dtype: str = "float32") -> ModelShapes:
    """The parameter shapes of the Hugging Face model at ``path`` (its ``config.json`` only: the
    model is built on the meta device), with an LM head or a value head (``head="value"``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    if head == "value":
        config.num_labels = 1
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
    with torch.device("meta"):
        module = auto.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    tied = bool(getattr(config, "tie_word_embeddings", False)) and head == "lm"
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return ModelShapes(shapes, config.num_hidden_layers, tied, itemsize)


def format_reallocations(
    graph: DataflowGraph, shapes: Callable[[ModelName], ModelShapes] | None
) -> str:
    """The graph's reallocations as text: where each happens, the two layouts, and (with
    ``shapes``, the :class:`ModelShapes` of a source model) a table of the bytes each
    destination worker receives, already holds, and from which workers."""
    lines = ["reallocations (before the MFC, whenever its source trained since the last move):"]
    for m in graph.mfcs:
        for h in m.hooks:
            if not isinstance(h, ParamRealloc):
                continue
            src, dst = graph.allocations[h.source], graph.allocations[m.model]
            lines.append(f"  {m.name}: {h.source} ({src.describe()})")
            lines.append(f"  {'':<{len(m.name)}}  -> {m.model} ({dst.describe()})")
            if shapes is None:
                lines.append("    bytes: set model_path to an HF model dir to count them")
                continue
            plan = plan_realloc(src, dst, shapes(h.source))
            lines.append(
                f"    moves {format_bytes(plan.moved)} between workers "
                f"(the model: {format_bytes(plan.model_bytes)})"
            )
            lines.append(f"    {'to worker':>9}  {'receives':>10}  {'holds already':>13}  from")
            for w in dst.workers:
                lines.append(
                    f"    {w:>9}  {format_bytes(plan.received[w]):>10}  "
                    f"{format_bytes(plan.kept[w]):>13}  {list(plan.senders[w]) or '-'}"
                )
    return "\n".join(lines) if len(lines) > 1 else "reallocations: none"


def format_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB, three significant figures."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------- on a worker


def engine_shapes(engine) -> ModelShapes:
    """The :class:`ModelShapes` of an initialized engine's own parameters (global shapes; with
    pp, only its stage's)."""
    config = engine.hf_config
    tied = bool(getattr(config, "tie_word_embeddings", False)) and engine.head == "lm"
    params = {canonical(n, tied): p for n, p in engine.model.named_parameters()}
    itemsize = next(iter(params.values())).element_size() if params else 4
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    return ModelShapes(shapes, config.num_hidden_layers, tied, itemsize)


def canonical(name: str, tied: bool) -> str:
    """The plan's name of an engine parameter: a pipeline's last stage keeps its copy of a tied
    embedding as ``lm_head.weight``, which the plan calls ``model.embed_tokens.weight`` (the
    name of the one tensor a model without stages holds)."""
    return TIED_EMBEDDING if tied and name == "lm_head.weight" else name


def own_shards(engine, layout: Allocation, worker: int) -> dict[str, tuple[Box, torch.Tensor]]:
    """Each parameter's box in ``layout`` and the local tensor holding it (views: writing to
    one sets the parameter). Raises when the engine's sharding is not the one the plan assumes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for module in engine.model.modules():  # FSDP keeps the root unsharded after a forward
        if isinstance(module, FSDPModule):
            module.reshard()
    model = engine_shapes(engine)
    out = {}
    for raw, param in engine.model.named_parameters():
        name = canonical(raw, model.tied)
        local = param.to_local() if isinstance(param, DTensor) else param.data
        box = shard_box(name, tuple(param.shape), layout, worker, model)
        if box is None or tuple(hi - lo for lo, hi in box) != tuple(local.shape):
            planned = "no shard" if box is None else f"shape {[hi - lo for lo, hi in box]}"
            raise ValueError(
                f"worker {worker} holds {name!r} as a local tensor of shape {list(local.shape)}, "
                f"but layout {layout.describe()} gives it {planned}; the engine's sharding and "
                "areal/core/realloc.py disagree"
            )
        out[name] = (box, local)
    return out


def cut(
    shards: dict[str, tuple[Box, torch.Tensor]], name: str, box: Box, worker: int
) -> torch.Tensor:
    """``box`` of ``name`` out of a worker's :func:`own_shards` (a view)."""
    if name not in shards:
        raise KeyError(
            f"worker {worker} holds no {name!r} to reallocate; source and target must be the "
            "same architecture"
        )
    own, local = shards[name]
    if intersect(box, own) != box:
        raise ValueError(f"worker {worker} holds {own} of {name!r}, asked for {box}")
    return local[relative(box, own)]


def write_pieces(
    engine,
    layout: Allocation,
    worker: int,
    pieces: list[Piece],
    tensors: list[torch.Tensor],
    ema: float,
) -> None:
    """Set this worker's shards to ``ema * own + (1 - ema) * piece`` piece by piece (device and
    dtype from the engine's parameters); raises unless the pieces cover every shard once."""
    own = own_shards(engine, layout, worker)
    covered: dict[str, int] = defaultdict(int)
    with torch.no_grad():
        for piece, src in zip(pieces, tensors, strict=True):
            box, local = own[piece.name]
            dst = local[relative(piece.box, box)]
            src = src.to(device=dst.device, dtype=dst.dtype)
            dst.copy_(dst * ema + src * (1.0 - ema) if ema else src)
            covered[piece.name] += numel(piece.box)
    short = [n for n, (box, _) in own.items() if covered[n] != numel(box)]
    if short:
        raise ValueError(
            f"worker {worker}: the reallocation covered {short[:3]} partly or twice; the source "
            "layout's shards do not partition these parameters"
        )
