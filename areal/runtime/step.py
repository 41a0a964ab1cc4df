"""One training step in process: a graph of model function calls (:mod:`areal.runtime.graphs`)
run on the engines of this process, and the stats names a step logs.

:func:`run_step` is the step of Lite's scripts and of ``areal replay``: each MFC in the graph's
order (topological: every input is in the batch or written by an earlier MFC, checked before the
first call), in the tracker's timer ``mfc.timer``, its stats under ``mfc.scope``. Each call is
:func:`call_mfc`, which Core's model workers make too (:mod:`areal.core.worker`), so an MFC does
the same thing in process and on a worker. One difference: in process each MFC gets the whole
batch so far (Lite), on a worker only the keys it reads (``run_step(..., only_inputs=True)``
does that too: Core's replay). Core's master logs the same stats under the same scopes
(:func:`step_stats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from areal.api.engine import ModelFnResult
from areal.api.mfc import MFC, ModelFn, ModelName, changes_weights, declared, fn_name
from areal.utils.batch import PackedBatch
from areal.utils.stats import StatsTracker

TIMING = ("n_tokens", "wall_time", "compute_time")  # what Core's master adds to each MFC's stats


def call_mfc(engine: Any, mfc: MFC, batch: PackedBatch) -> ModelFnResult:
    """``engine.<mfc.fn>(batch, **mfc.kwargs)`` under the MFC's micro-batch split (if it names
    one), then, for a function that changes weights (:func:`~areal.api.mfc.changes_weights`),
    the engine's learning-rate step (as Lite's scripts always did after an update). Raises when
    the call added other keys than the MFC declares."""
    method = getattr(engine, fn_name(mfc.fn))
    if mfc.mb_spec is None:
        out, stats = method(batch, **mfc.kwargs)
    else:
        own = engine.config  # this call only: the MFC's micro-batch split
        engine.config = dataclasses.replace(own, mb_spec=mfc.mb_spec)
        try:
            out, stats = method(batch, **mfc.kwargs)
        finally:
            engine.config = own
    if changes_weights(mfc.fn):
        engine.step_lr_scheduler()
    (before_t, before_s), (after_t, after_s) = batch.keys(), out.keys()
    added = (after_t - before_t) | (after_s - before_s)
    if added != set(mfc.outputs):
        raise ValueError(
            f"MFC {mfc.name!r} ({mfc.model}.{fn_name(mfc.fn)}) added keys "
            f"{sorted(added)} but the graph declares {sorted(mfc.outputs)}"
        )
    return out, stats


def _problems(graph: Sequence[MFC], engines: Mapping[ModelName, Any], batch: PackedBatch):
    """Why ``graph`` cannot run in process on ``engines`` and ``batch``, one line each."""
    have = set().union(*batch.keys())
    for m in graph:
        if m.fn is ModelFn.GENERATE or m.hooks:
            yield (
                f"MFC {m.name!r}: generation and weight-moving hooks run only under Core's "
                "master; in process the rollout side makes the batch"
            )
        engine, name = engines.get(m.model), fn_name(m.fn)
        unmarked = isinstance(m.fn, str) and declared(m.fn) is None  # a script's method
        if unmarked or not callable(getattr(engine, name, None)):
            yield (
                f"MFC {m.name!r} runs {m.model}.{name}, but the engines given "
                f"({sorted(map(str, engines))}) have no such model function (a method "
                "marked @model_fn)"
            )
        missing = [k for k in m.inputs if k not in have]
        if missing:
            yield (
                f"MFC {m.name!r} reads {missing}, which neither the batch nor an earlier MFC "
                "provides; add them to the batch or order the graph"
            )
        have |= set(m.outputs)


def _inputs(batch: PackedBatch, keys: tuple[str, ...]) -> PackedBatch:
    """``batch`` with only the fields ``keys`` (what a Core worker hands an MFC)."""
    return PackedBatch(
        batch.cu_seqlens,
        {k: v for k, v in batch.tokens.items() if k in keys},
        {k: v for k, v in batch.seqs.items() if k in keys},
    )


def run_step(
    graph: Sequence[MFC],
    engines: Mapping[ModelName, Any],
    batch: PackedBatch,
    tracker: StatsTracker,
    only_inputs: bool = False,
) -> PackedBatch:
    """Run ``graph``'s MFCs in order on ``engines`` (by model name) over ``batch``; returns the
    batch with every field the MFCs added. Each call runs in ``tracker.timer(mfc.timer or
    mfc.name)``; its stats are recorded as scalars under ``mfc.scope`` (none: not recorded).

    Each MFC gets the whole batch so far (Lite), or with ``only_inputs`` only the keys it reads,
    as Core's workers hand them (Core's replay): an engine may act on a field no MFC declares
    (``prompt_lens`` and ``group_index`` turn on the shared-prefix layout, ``versions`` the
    staleness stats)."""
    problems = list(_problems(graph, engines, batch))
    if problems:
        raise ValueError("the step cannot run:\n" + "\n".join(f"  - {p}" for p in problems))
    for mfc in graph:
        with tracker.timer(mfc.timer or mfc.name):
            if only_inputs:  # the MFC's outputs join the batch, as a worker stores them
                out, stats = call_mfc(engines[mfc.model], mfc, _inputs(batch, mfc.inputs))
                batch = batch.with_fields(
                    {k: v for k, v in out.tokens.items() if k in mfc.outputs},
                    {k: v for k, v in out.seqs.items() if k in mfc.outputs},
                )
            else:
                batch, stats = call_mfc(engines[mfc.model], mfc, batch)
            if mfc.scope:
                with tracker.scope(mfc.scope):
                    tracker.scalars(**stats)
    return batch


def step_stats(graph: Sequence[MFC], out: dict[str, dict[str, float]]) -> dict[str, float]:
    """Core's master's per-MFC stats (``out``) under the names a step in process logs (each
    MFC's ``scope``: ``loss/*``, ``loss/critic/*``), plus ``mfc/<name>/<timing>`` and the
    reallocations' ``realloc/<model>/{bytes,seconds}``."""
    stats = {f"mfc/{name}/{k}": s[k] for name, s in out.items() for k in TIMING}
    scopes = {m.name: m.scope for m in graph if m.scope}
    for name, s in out.items():
        stats.update({k: v for k, v in s.items() if k.startswith("realloc/")})
        if name in scopes:
            stats.update({f"{scopes[name]}/{k}": v for k, v in s.items() if k not in TIMING})
    return stats
