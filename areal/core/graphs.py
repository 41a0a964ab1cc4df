"""The graphs of Core's entry points, as data: sync PPO, async PPO and SFT, over the steps of
:mod:`areal.runtime.graphs` (the ones Lite runs in process), with Core's generation node,
allocations and layouts.

Sync PPO (the reference, critic and proximal-logp nodes are optional)::

    actor_gen (rollout.generate; before it: the actor's weights pushed to the servers)
      -> {ref_logp (ref.compute_logp), critic_values (critic.compute_values),
          actor_logp (actor.compute_logp, out=prox_logp), teacher_logp (teacher.compute_logp)}
      -> actor_adv (actor.compute_advantages)
      -> {actor_train (actor.ppo_update, logp_out=trainer_logp), critic_train (critic.ppo_update)}

``actor_gen`` reads no keys: the generation worker hosting the ``rollout`` model (the Lite
rollout side over the generation servers) draws its prompts from the train dataset, as Lite's
executor does, and its groups become the step's samples. Its ``UpdateServers`` hook pushes the
actor's weights to the servers whenever the actor was trained since the last push. The
advantages are a node of their own (the Lite actor's ``compute_advantages``) because both
trainers read its outputs: the actor its ``advantages``, the critic its ``returns``. Async PPO is
the same graph without ``actor_gen``: its dataset is the rollout stream (the fields of
:func:`areal.rollout.trajectory.groups_to_batch`). SFT is one node, ``model.train_lm``.

Allocations: an empty list puts every model of the graph on every worker with ``dp =
n_workers`` (the graph's models then share workers, as Lite's engines share trainer ranks). The
``rollout`` model of sync PPO lives on one generation worker after the model workers (index
``n_workers``), so its graph has ``n_workers + 1`` workers.

Layouts (``CoreGraphConfig.layouts``): an inference MFC of a trained model (the actor's
``actor_logp``, the critic's ``critic_values``) may name its own mesh. The graph then runs it on a
replica of the model allocated on that mesh (``actor@1``) with a
:class:`~areal.api.mfc.ParamRealloc` hook from the model, so the trained weights move to the
replica's layout before the call (:mod:`areal.core.realloc` plans which pieces move;
``areal core graph`` prints the plan). No layouts: the graph is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from areal.api.config.loader import param
from areal.api.mfc import (
    MFC,
    ModelFn,
    ModelName,
    ParamRealloc,
    UpdateServers,
    changes_weights,
)
from areal.core.dfg import Allocation, DataflowGraph, GraphError, build_graph, format_graph
from areal.runtime.graphs import ACTOR, CRITIC, ROLLOUT_KEYS, SFT_KEYS, ppo_mfcs, sft_mfcs

if TYPE_CHECKING:  # realloc imports torch: only `areal core graph` needs it, not the configs
    from areal.core.realloc import ModelShapes

ROLLOUT = ModelName("rollout")  # the generation servers, behind a generation worker


@dataclass(frozen=True)
class ModelAllocationConfig:
    """Which model workers host one model, and its mesh over them."""

    model: str = param("actor", help="Model name: ROLE or ROLE@REPLICA (actor, critic, ref, ...).")
    workers: list[int] = param(
        factory=list, help="Model-worker indices, pp-major then dp then tp; len = pp * dp * tp."
    )
    dp: int = param(1, ge=1, help="Data-parallel size of this model's mesh.")
    tp: int = param(
        1, ge=1, help="Tensor-parallel size (Qwen2/Llama decoders); workers are dp-major."
    )
    pp: int = param(1, ge=1, help="Pipeline stages (each a contiguous run of decoder layers).")

    def check(self) -> Iterator[str]:
        try:
            ModelName.parse(self.model)
        except ValueError as e:
            yield f"model: {e}"


@dataclass(frozen=True)
class MFCLayoutConfig:
    """Another layout for one MFC of a trained model (e.g. the actor's logp on a wider dp than
    its training mesh): the graph runs it on a replica of the model on this mesh and moves the
    trained weights there before the call whenever they changed (parameter reallocation)."""

    mfc: str = param("actor_logp", help="The MFC's name (areal core graph lists them).")
    workers: list[int] = param(
        factory=list,
        help="Model-worker indices, pp-major then dp then tp; empty = the model's own workers.",
    )
    dp: int = param(1, ge=1, help="Data-parallel size.")
    tp: int = param(1, ge=1, help="Tensor-parallel size (Qwen2/Llama decoders).")
    pp: int = param(1, ge=1, help="Pipeline stages.")


@dataclass(frozen=True)
class CoreGraphConfig:
    """Which graph Core runs and where each model lives."""

    graph: Literal["sync_ppo", "async_ppo", "sft"] = param(
        "sync_ppo", help="The entry point's graph."
    )
    n_workers: int = param(1, ge=1, help="Number of model workers.")
    use_critic: bool = param(False, help="PPO: a critic (values node, critic train node).")
    use_ref: bool = param(False, help="PPO: a reference model (ref logp node, for a KL penalty).")
    prox_logp: bool = param(
        False,
        help="PPO: a proximal-logp node before the update (decoupled PPO with several "
        "minibatches or KL in the reward; see PPOActor.needs_prox_pass).",
    )
    use_teacher: bool = param(
        False,
        help="PPO: a teacher model's logp node (on-policy distillation, distill.teacher_path).",
    )
    allocations: list[ModelAllocationConfig] = param(
        factory=list,
        help="One entry per model; empty = every model on every worker, dp = n_workers.",
    )
    layouts: list[MFCLayoutConfig] = param(
        factory=list,
        help="Per-MFC layouts of trained models (the weights are reallocated before the MFC); "
        "empty = every MFC on its model's allocation.",
    )
    model_path: str = param(
        "",
        help="areal core graph: an HF model dir whose config.json sizes the printed "
        "reallocations (bytes moved; a critic with a value head); empty = no byte counts.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = param(
        "float32", help="areal core graph: the weights' dtype in the printed byte counts."
    )

    def check(self) -> Iterator[str]:
        if self.graph == "sft" and (
            self.use_critic or self.use_ref or self.prox_logp or self.use_teacher
        ):
            yield (
                "graph: sft has no critic, reference, teacher or proximal logp; unset "
                "use_critic/use_ref/use_teacher/prox_logp"
            )
            return
        try:
            mfcs, _ = graph_mfcs(self)
            allocations = allocations_for(self, mfcs)
        except ValueError:  # a bad model name, reported by its allocation's own check
            return
        yield from with_layouts(self, mfcs, allocations)[2]
        if self.model_path:
            yield from pipeline_problems(self, lambda role: ("model_path", self.model_path))


def generate_mfc() -> MFC:
    """The actor's rollouts: prompts from the train dataset, scored groups of trajectories
    (packed) out; the actor's newest weights go to the servers first."""
    return MFC(
        "actor_gen", ROLLOUT, ModelFn.GENERATE, (), ROLLOUT_KEYS, hooks=(UpdateServers(ACTOR),)
    )


def graph_mfcs(cfg: CoreGraphConfig) -> tuple[list[MFC], tuple[str, ...]]:
    """The MFCs of ``cfg.graph`` and its dataset keys."""
    if cfg.graph == "sft":
        return sft_mfcs(), SFT_KEYS
    ppo = ppo_mfcs(cfg.use_critic, cfg.use_ref, cfg.prox_logp, cfg.use_teacher)
    if cfg.graph == "async_ppo":
        return ppo, ROLLOUT_KEYS
    return [generate_mfc(), *ppo], ()


def allocations_for(cfg: CoreGraphConfig, mfcs: list[MFC]) -> list[Allocation]:
    """The configured allocations, or every model on every worker (dp = n_workers)."""
    given = [
        Allocation(ModelName.parse(a.model), tuple(a.workers), a.dp, a.tp, a.pp)
        for a in cfg.allocations
    ]
    if not given:
        models = sorted({m.model for m in mfcs if m.fn is not ModelFn.GENERATE})
        given = [Allocation(m, tuple(range(cfg.n_workers)), cfg.n_workers) for m in models]
    if any(m.model == ROLLOUT for m in mfcs) and all(a.model != ROLLOUT for a in given):
        given.append(Allocation(ROLLOUT, (cfg.n_workers,), 1))  # the generation worker
    return given


def _layout_refusal(mfc: MFC | None, name: str, cfg: CoreGraphConfig, trained: set) -> str | None:
    """Why the MFC named ``name`` cannot take a layout of its own (None: it can)."""
    if mfc is None:
        return f"{name!r} is no MFC of graph {cfg.graph}; name one that areal core graph lists"
    if mfc.fn is ModelFn.GENERATE:
        return (
            f"{name!r} generates on the generation servers (cluster.n_servers sizes them), "
            "not on model workers; remove this layout"
        )
    if changes_weights(mfc.fn):
        return (
            f"{name!r} trains model {mfc.model}, so its layout is the model's own; set it "
            f"under allocations (model: {mfc.model.role})"
        )
    if mfc.fn is ModelFn.COMPUTE_ADVANTAGES:
        return f"{name!r} uses no weights and runs where {mfc.model} trains; remove this layout"
    if mfc.model not in trained:
        return (
            f"{name!r} runs on {mfc.model}, which no MFC trains (nothing to reallocate); give "
            f"{mfc.model.role} this layout under allocations"
        )
    return None


def _layout_of(
    i: int, home: Allocation, cfg: CoreGraphConfig, problems: list[str]
) -> Allocation | None:
    """``layouts[i]`` as an allocation of ``home``'s model (None, with a problem, if invalid)."""
    lay = cfg.layouts[i]
    workers = tuple(lay.workers) or home.workers
    bad = [w for w in workers if not 0 <= w < cfg.n_workers]
    if bad:
        problems.append(
            f"layouts[{i}].workers: {bad} are not model workers (0..{cfg.n_workers - 1}); "
            "list model-worker indices"
        )
        return None
    n, sizes = lay.dp * lay.tp * lay.pp, f"dp={lay.dp} x tp={lay.tp} x pp={lay.pp}"
    if len(workers) != n:
        problems.append(
            f"layouts[{i}].workers: {list(workers)} are {len(workers)} workers, but {sizes} "
            f"needs {n}; list {n} workers or change the sizes"
            if lay.workers
            else f"layouts[{i}]: {sizes} needs {n} workers, and {home.model}'s own are "
            f"{list(workers)}; list {n} workers or change the sizes"
        )
        return None
    return Allocation(home.model, workers, lay.dp, lay.tp, lay.pp)


def with_layouts(
    cfg: CoreGraphConfig, mfcs: list[MFC], allocations: list[Allocation]
) -> tuple[list[MFC], list[Allocation], list[str]]:
    """The MFCs and allocations with ``cfg.layouts`` applied, and the layouts' problems (each
    naming its field). An MFC given a layout other than its model's runs on a replica of the
    model allocated there (``ROLE@1``, ``ROLE@2``, ...: one per distinct layout), with a
    :class:`ParamRealloc` hook from the model before it. No layouts: the same graph."""
    by_model = {a.model: a for a in allocations}
    trained = {m.model for m in mfcs if changes_weights(m.fn)}
    names = {m.name: m for m in mfcs}
    mfcs, allocations = list(mfcs), list(allocations)
    problems: list[str] = []
    placed: dict[str, int] = {}
    replicas: dict[tuple, ModelName] = {}
    for i, lay in enumerate(cfg.layouts):
        mfc = names.get(lay.mfc)
        why = _layout_refusal(mfc, lay.mfc, cfg, trained)
        if why is None and lay.mfc in placed:
            why = f"{lay.mfc!r} has a layout already (layouts[{placed[lay.mfc]}]); keep one"
        if why is not None or mfc is None:
            problems.append(f"layouts[{i}].mfc: {why}")
            continue
        placed[lay.mfc] = i
        home = by_model.get(mfc.model)
        if home is None:
            continue  # build_graph names the MFC whose model has no allocation
        layout = _layout_of(i, home, cfg, problems)
        if layout is None or layout.same_layout(home):
            continue  # a bad layout (named), or nothing to move
        key = (layout.model, layout.workers, layout.dp, layout.tp, layout.pp)
        if key not in replicas:
            role = mfc.model.role
            replicas[key] = ModelName(
                role, 1 + max(a.model.replica for a in allocations if a.model.role == role)
            )
            allocations.append(replace(layout, model=replicas[key]))
        mfcs[mfcs.index(mfc)] = replace(
            mfc, model=replicas[key], hooks=(*mfc.hooks, ParamRealloc(mfc.model))
        )
    return mfcs, allocations, problems


def replica_sources(graph: DataflowGraph) -> dict[ModelName, ModelName]:
    """Each layout replica of ``graph`` and the model whose weights it takes."""
    return {
        m.model: h.source
        for m in graph.mfcs
        for h in m.hooks
        if isinstance(h, ParamRealloc) and h.source.role == m.model.role
    }


def pipeline_problems(
    cfg: CoreGraphConfig, path_of: Callable[[str], tuple[str, str] | None]
) -> Iterator[str]:
    """A pp a model cannot be split into (more stages than decoder layers), for each allocation
    and layout; ``path_of(role)`` is ``(field, HF model dir)`` of the role's model (None: not
    known here, unchecked)."""
    mfcs = {m.name: m.model.role for m in graph_mfcs(cfg)[0]}
    meshes = [
        (f"allocations[{i}].pp", a.pp, ModelName.parse(a.model).role)
        for i, a in enumerate(cfg.allocations)
    ]
    meshes += [(f"layouts[{i}].pp", a.pp, mfcs.get(a.mfc)) for i, a in enumerate(cfg.layouts)]
    layers: dict[str, int | None] = {}
    for where, pp, role in meshes:
        found = path_of(role) if pp > 1 and role else None
        if found is None:
            continue
        field, path = found
        if path not in layers:
            layers[path] = _n_layers(path)
        n = layers[path]
        if n is None:
            yield f"{field}: {path!r} has no readable config.json to check {where}={pp} against"
        elif pp > n:
            yield (
                f"{where}: {pp} stages for a model of {n} decoder layers ({field}={path}); "
                f"use pp <= {n}"
            )


def _n_layers(path: str) -> int | None:
    """The decoder layers of the HF model at ``path`` (None: no readable config)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path).num_hidden_layers
    except (OSError, ValueError):
        return None


def graph_from_config(cfg: CoreGraphConfig) -> DataflowGraph:
    """The checked graph ``cfg`` describes (raises GraphError listing every problem); sync PPO
    counts its generation worker among the workers."""
    mfcs, keys = graph_mfcs(cfg)
    mfcs, allocations, problems = with_layouts(cfg, mfcs, allocations_for(cfg, mfcs))
    if problems:
        raise GraphError(cfg.graph, problems)
    n_generation = int(any(m.fn is ModelFn.GENERATE for m in mfcs))
    return build_graph(cfg.graph, mfcs, keys, allocations, cfg.n_workers + n_generation)


def describe_graph(cfg: CoreGraphConfig) -> str:
    """What ``areal core graph`` prints: the graph and its reallocations (with ``model_path``,
    the bytes each moves)."""
    from areal.core.realloc import format_reallocations, model_shapes

    graph = graph_from_config(cfg)
    cache: dict[str, ModelShapes] = {}

    def shapes(model: ModelName) -> ModelShapes:
        head = "value" if model.role == CRITIC.role else "lm"
        if head not in cache:
            cache[head] = model_shapes(cfg.model_path, head, cfg.dtype)
        return cache[head]

    sized = shapes if cfg.model_path else None
    return format_graph(graph) + "\n" + format_reallocations(graph, sized)
