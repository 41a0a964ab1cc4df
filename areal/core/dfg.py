"""The dataflow graph of Core mode: model function calls (MFCs) placed on model workers, checked
before anything runs.

The MFCs are the step's vocabulary (:mod:`areal.api.mfc`: an :class:`~areal.api.mfc.MFC` names a
model, one of the uniform model functions of the engines, the batch fields it reads and the ones
it adds; the PPO and SFT steps are :mod:`areal.runtime.graphs`). Fields are *keys*: a key
comes from the dataset or from exactly one MFC. :func:`build_graph` turns MFCs, the dataset's
keys and the allocation (which model workers host each model, on which mesh) into a
:class:`DataflowGraph`, or raises one :class:`GraphError` listing every problem, each naming the
MFC and the key (or the model) at fault:

- every input key has exactly one producer or comes from the dataset;
- no two MFCs write one key, and no MFC writes a dataset key;
- no cycles;
- every MFC's outputs are the fields its function adds (``compute_logp(out="ref_logp")`` adds
  ``ref_logp``, as the engine method declares it: :func:`~areal.api.mfc.model_fn`), so the graph
  cannot lie about what a call produces;
- every model an MFC runs on has an allocation whose mesh fits it: ``pp * dp * tp`` workers,
  each a valid worker index, none twice. The workers form a ``pp x dp x tp`` mesh, pp-major then
  dp then tp (``workers[(p * dp + d) * tp + t]`` is pipeline stage ``p``, dp rank ``d``, tp rank
  ``t``; with ``pp = 1`` the dp-major ``dp x tp`` order).
- a ``generate`` MFC reads no keys (it draws prompts from the train dataset); only it may have
  an :class:`~areal.api.mfc.UpdateServers` hook, and its model (the generation servers) is never
  the source or target of a :class:`~areal.api.mfc.ParamRealloc`.

Edges are derived: ``producer -> consumer`` for each key one writes and the other reads. The
MFCs are kept in a topological order (the order given, among ready ones), which is the order a
master considers them for dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.api.mfc import (
    MFC,
    ModelFn,
    ModelName,
    ParamRealloc,
    UpdateServers,
    added_fields,
    fn_name,
)


@dataclass(frozen=True)
class Allocation:
    """Where a model lives (its layout): model-worker indices forming a ``pp x dp x tp`` mesh,
    ``workers[(p * dp + d) * tp + t]`` being pipeline stage ``p``, dp rank ``d``, tp rank ``t``."""

    model: ModelName
    workers: tuple[int, ...]
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def coordinate(self, worker: int) -> tuple[int, int, int]:
        """``(p, d, t)``: the pipeline stage, dp rank and tp rank of ``worker`` in this mesh."""
        i = self.workers.index(worker)
        return i // (self.dp * self.tp), i // self.tp % self.dp, i % self.tp

    def worker_at(self, p: int, d: int, t: int) -> int:
        """The worker at stage ``p``, dp rank ``d``, tp rank ``t``."""
        return self.workers[(p * self.dp + d) * self.tp + t]

    def same_layout(self, other: Allocation) -> bool:
        """Whether ``other`` puts each worker at the same mesh coordinate (model aside)."""
        return (self.workers, self.dp, self.tp, self.pp) == (
            other.workers,
            other.dp,
            other.tp,
            other.pp,
        )

    def describe(self) -> str:
        """``dp=2 x tp=1 x pp=2 on workers [0, 1, 2, 3]`` (pp left out when 1)."""
        mesh = f"dp={self.dp} x tp={self.tp}" + (f" x pp={self.pp}" if self.pp > 1 else "")
        return f"{mesh} on workers {list(self.workers)}"


@dataclass(frozen=True)
class DataflowGraph:
    """A checked graph (build it with :func:`build_graph`)."""

    name: str
    mfcs: tuple[MFC, ...]  # topological order
    dataset_keys: tuple[str, ...]
    allocations: dict[ModelName, Allocation]
    n_workers: int
    producers: dict[str, str]  # key -> name of the MFC writing it (dataset keys absent)
    edges: tuple[tuple[str, str, str], ...]  # (producer MFC, consumer MFC, key)


class GraphError(ValueError):
    """Every problem of one graph, one per line."""

    def __init__(self, name: str, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"graph {name!r} is invalid ({len(problems)} problem(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def import_engines() -> None:
    """Import the engines, whose methods declare the fields each model function adds
    (:func:`~areal.api.mfc.model_fn`); torch comes with them, so only building a graph does it."""
    from areal.engine import lora, ppo, rw, sft  # noqa: F401


def _check_keys(
    mfcs: list[MFC], dataset_keys: tuple[str, ...], problems: list[str]
) -> dict[str, str]:
    """Producers of each key; problems for duplicate writers, dataset overwrites, wrong outputs."""
    import_engines()
    producers: dict[str, str] = {}
    for m in mfcs:
        try:
            added = added_fields(m.fn, m.kwargs)
        except LookupError as e:  # a method name no imported engine declares
            problems.append(f"MFC {m.name!r} runs {m.model}.{fn_name(m.fn)}: {e}")
            added = None
        if added is not None and tuple(sorted(m.outputs)) != tuple(sorted(added)):
            call = f"{fn_name(m.fn)}({', '.join(f'{k}={v!r}' for k, v in m.kwargs.items())})"
            problems.append(
                f"MFC {m.name!r} calls {call}, which adds {list(added)}, but declares "
                f"outputs {list(m.outputs)}; declare exactly {list(added)}"
            )
        if m.fn is ModelFn.GENERATE and m.inputs:
            problems.append(
                f"MFC {m.name!r} (generate) reads {list(m.inputs)}; a generate MFC draws its "
                "prompts from the train dataset itself and reads no keys"
            )
        if m.fn is not ModelFn.GENERATE and "input_ids" not in m.inputs:
            problems.append(
                f"MFC {m.name!r} does not read key 'input_ids'; every model function "
                "takes a packed batch, add 'input_ids' to its inputs"
            )
        for key in m.outputs:
            if key in dataset_keys:
                problems.append(
                    f"MFC {m.name!r} writes key {key!r}, which comes from the dataset; "
                    "rename the output"
                )
            elif key in producers:
                problems.append(
                    f"key {key!r} is written by MFC {producers[key]!r} and by MFC "
                    f"{m.name!r}; each key has one producer, rename one output"
                )
            else:
                producers[key] = m.name
    for m in mfcs:
        for key in m.inputs:
            if key not in producers and key not in dataset_keys:
                problems.append(
                    f"MFC {m.name!r} reads key {key!r}, which no MFC writes and the "
                    f"dataset does not provide (dataset keys: {list(dataset_keys)})"
                )
    return producers


def _find_cycle(names: list[str], deps: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """One cycle among ``names`` as ``[(mfc, key it reads from the next), ...]``."""
    path: list[str] = []
    node = names[0]
    while node not in path:
        path.append(node)
        node = next(p for p in deps[node] if p in names)
    cycle = path[path.index(node) :]
    return [(a, deps[a][b]) for a, b in zip(cycle, cycle[1:] + cycle[:1])]


def _topological(mfcs: list[MFC], producers: dict[str, str], problems: list[str]) -> list[MFC]:
    """Kahn's order, stable in the given order; a problem naming each cycle's MFCs and keys."""
    deps: dict[str, dict[str, str]] = {m.name: {} for m in mfcs}  # consumer -> {producer: key}
    for m in mfcs:
        for key in m.inputs:
            if key in producers:
                deps[m.name].setdefault(producers[key], key)
    order, done = [], set()
    remaining = list(mfcs)
    while remaining:
        ready = [m for m in remaining if set(deps[m.name]) <= done]
        if not ready:
            names = [m.name for m in remaining]
            cycle = _find_cycle([n for n in names if any(p in names for p in deps[n])], deps)
            nxt = [b for b, _ in cycle[1:] + cycle[:1]]
            text = ", ".join(
                f"MFC {a!r} reads key {k!r} from MFC {b!r}" for (a, k), b in zip(cycle, nxt)
            )
            problems.append(
                f"MFCs form a cycle: {text}; break it by reading one of these keys "
                "from the dataset or another MFC"
            )
            return order + remaining
        order.append(ready[0])
        done.add(ready[0].name)
        remaining.remove(ready[0])
    return order


def _check_allocations(
    mfcs: list[MFC], allocations: dict[ModelName, Allocation], n_workers: int, problems: list[str]
) -> None:
    generating = {m.model for m in mfcs if m.fn is ModelFn.GENERATE}
    for m in mfcs:
        if m.model not in allocations:
            problems.append(
                f"MFC {m.name!r} runs on model '{m.model}', which has no allocation; "
                f"allocate it workers (allocated: {sorted(str(a) for a in allocations)})"
            )
        for h in m.hooks:
            if h.source == m.model or h.source not in allocations:
                why = "is its own model" if h.source == m.model else "has no allocation"
                problems.append(
                    f"MFC {m.name!r} takes weights from model '{h.source}', which {why}; "
                    "name another allocated model"
                )
            if isinstance(h, UpdateServers) and m.fn is not ModelFn.GENERATE:
                problems.append(
                    f"MFC {m.name!r} ({fn_name(m.fn)}) has an UpdateServers hook, which only a "
                    "generate MFC can have (its model is the generation servers)"
                )
            if isinstance(h, ParamRealloc) and (m.fn is ModelFn.GENERATE or h.source in generating):
                problems.append(
                    f"MFC {m.name!r}: parameter reallocation to or from a generate MFC's model "
                    "(the generation servers); use an UpdateServers hook"
                )
            if isinstance(h, ParamRealloc) and not 0.0 <= h.ema < 1.0:
                problems.append(f"MFC {m.name!r}: reallocation ema={h.ema} must be in [0, 1)")
    for model, a in sorted(allocations.items()):
        users = [m.name for m in mfcs if model in m.models]
        who = f"model '{model}' (MFCs {users})"
        small = [f"{k}={v}" for k, v in (("dp", a.dp), ("tp", a.tp), ("pp", a.pp)) if v < 1]
        if small:
            problems.append(f"{who}: {', '.join(small)}; each must be >= 1")
        if len(a.workers) != a.dp * a.tp * a.pp:
            problems.append(
                f"{who}: mesh dp={a.dp} x tp={a.tp} x pp={a.pp} needs {a.dp * a.tp * a.pp} "
                f"workers, allocated {len(a.workers)} ({list(a.workers)}); list dp * tp * pp "
                "workers or change the sizes"
            )
        bad = [w for w in a.workers if not 0 <= w < n_workers]
        if bad:
            problems.append(
                f"{who}: workers {bad} do not exist; there are {n_workers} workers "
                f"(0..{n_workers - 1})"
            )
        if len(set(a.workers)) != len(a.workers):
            problems.append(f"{who}: a worker appears twice in {list(a.workers)}; list each once")
        if not users:
            problems.append(
                f"model '{model}' is allocated workers but no MFC runs on it; remove its allocation"
            )


def build_graph(
    name: str,
    mfcs: list[MFC],
    dataset_keys: tuple[str, ...],
    allocations: list[Allocation],
    n_workers: int,
) -> DataflowGraph:
    """Check and build a graph; raises :class:`GraphError` listing every problem at once."""
    problems: list[str] = []
    seen: set[str] = set()
    for m in mfcs:
        if m.name in seen:
            problems.append(f"MFC name {m.name!r} is used twice; give each MFC its own name")
        seen.add(m.name)
    by_model: dict[ModelName, Allocation] = {}
    for a in allocations:
        if a.model in by_model:
            problems.append(f"model '{a.model}' has two allocations; give each model one")
        by_model[a.model] = a
    producers = _check_keys(mfcs, dataset_keys, problems)
    order = _topological(mfcs, producers, problems)
    _check_allocations(mfcs, by_model, n_workers, problems)
    if problems:
        raise GraphError(name, problems)
    edges = tuple((producers[k], m.name, k) for m in order for k in m.inputs if k in producers)
    return DataflowGraph(
        name, tuple(order), tuple(dataset_keys), by_model, n_workers, producers, edges
    )


def format_graph(graph: DataflowGraph) -> str:
    """The graph as text: models and their meshes, nodes in dispatch order, edges."""
    generating = {
        w
        for m in graph.mfcs
        if m.fn is ModelFn.GENERATE
        for w in graph.allocations[m.model].workers
    }
    workers = f"{graph.n_workers - len(generating)} model workers"
    if generating:
        plural = "s" if len(generating) > 1 else ""
        workers += f" + {len(generating)} generation worker{plural} {sorted(generating)}"
    keys = (
        ", ".join(graph.dataset_keys)
        or "none (the generation worker draws prompts from the train dataset)"
    )
    lines = [
        f"graph {graph.name}: {len(graph.mfcs)} MFCs, {len(graph.allocations)} models, {workers}",
        f"dataset keys: {keys}",
        "models:",
    ]
    for model, a in sorted(graph.allocations.items()):
        users = ", ".join(m.name for m in graph.mfcs if m.model == model)
        lines.append(
            f"  {model!s:<12} mesh {a.describe().replace(' on workers', '  workers')}  "
            f"MFCs: {users}"
        )
    lines.append("nodes (dispatch order), each with its in-process timer and its stats' scope:")
    for m in graph.mfcs:
        args = ", ".join(f"{k}={v!r}" for k, v in m.kwargs.items())
        call = f"{m.model!s}.{fn_name(m.fn)}({args})"
        names = "" if m.fn is ModelFn.GENERATE else f"timing/{m.timer or m.name}"
        names += f"  {m.scope}/*" if m.scope else ""
        lines.append(f"  {m.name:<16} {call:<44} {names}".rstrip())
        for h in m.hooks:
            if isinstance(h, UpdateServers):
                lines.append(
                    f"  {'':<16}   before: {h.source}'s weights pushed to the generation servers"
                )
            else:
                lines.append(
                    f"  {'':<16}   before: weights from {h.source}"
                    + (f" (ema {h.ema})" if h.ema else "")
                )
        lines.append(
            f"  {'':<16}   reads {', '.join(m.inputs) or '-'}; adds {', '.join(m.outputs) or '-'}"
        )
    lines.append("edges:")
    grouped: dict[tuple[str, str], list[str]] = {}
    for src, dst, key in graph.edges:
        grouped.setdefault((src, dst), []).append(key)
    for (src, dst), keys in grouped.items():
        lines.append(f"  {src} -> {dst}  [{', '.join(keys)}]")
    for m in graph.mfcs:
        from_data = [k for k in m.inputs if k not in graph.producers]
        if from_data:
            lines.append(f"  dataset -> {m.name}  [{', '.join(from_data)}]")
    return "\n".join(lines)
