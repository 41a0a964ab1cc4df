"""Tier 2 on a real local Ray head (2 worker processes, gloo): parameter reallocation between
layouts, end to end through the master.

One graph, one step: the actor trains on dp=1 x tp=2 (workers 0, 1); then its weights move
tp2 -> tp1 (into a replica on worker 0), that replica's move on to tp1 -> tp2 (workers 0, 1) and
tp1 -> dp2 (workers 0, 1), the dp2 replica's to dp2 -> tp2 and dp2 -> dp1 (worker 1), and the
actor's tp2 -> dp2 on workers 1, 0 (another order). A second graph moves an actor trained on
pp=2 to dp=2 and back to pp=2. Each replica starts from other random weights. After the step
every replica holds the trained actor's weights (1e-6; each piece is copied, not recomputed), and
each reallocation's ``realloc/<model>/bytes`` equals the plan ``areal core graph`` prints
(:func:`areal.core.realloc.plan_realloc` over the model's config) exactly."""

from __future__ import annotations

import pytest
from test_master_engines import max_gap, sft_batches
from test_ray_worker import ray_driver  # noqa: F401 - fixture

from areal.api.config.base import OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName, ParamRealloc
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, RayModel, start_ray_workers
from areal.core.realloc import model_shapes, plan_realloc
from areal.runtime.graphs import SFT_KEYS

pytestmark = pytest.mark.slow

ACTOR = ModelName("actor")
TP1, TP2, DP2, DP2_SWAPPED, DP2_TO_TP2, DP1 = (ModelName("actor", i) for i in range(1, 7))
LAYOUTS = {  # model: (layout workers, dp, tp), its weights' source
    ACTOR: (((0, 1), 1, 2), None),
    TP1: (((0,), 1, 1), ACTOR),  # tp2 -> tp1
    TP2: (((0, 1), 1, 2), TP1),  # tp1 -> tp2
    DP2: (((0, 1), 2, 1), TP1),  # tp1 -> dp2
    DP2_SWAPPED: (((1, 0), 2, 1), ACTOR),  # tp2 -> dp2, workers in the other order
    DP2_TO_TP2: (((0, 1), 1, 2), DP2),  # dp2 -> tp2
    DP1: (((1,), 1, 1), DP2),  # dp2 -> dp1 on the second worker
}


def realloc_graph():
    mfcs = [MFC("train", ACTOR, ModelFn.TRAIN_LM, SFT_KEYS)]
    for model, (_, source) in LAYOUTS.items():
        if source is not None:
            out = f"logp_{model.replica}"
            mfcs.append(
                MFC(
                    out,
                    model,
                    ModelFn.COMPUTE_LOGP,
                    ("input_ids",),
                    (out,),
                    {"out": out},
                    hooks=(ParamRealloc(source),),
                )
            )
    allocs = [Allocation(m, w, dp, tp) for m, ((w, dp, tp), _) in LAYOUTS.items()]
    return build_graph("layouts", mfcs, SFT_KEYS, allocs, 2)


def full_weights(workers, graph, model) -> dict:
    """The model's full weights (a collective over its workers, in order with the MFCs)."""
    return RayModel(workers, model, graph.allocations[model].workers).full_state_dict()


def test_tp2_tp1_and_dp_reallocations_move_the_planned_bytes_and_copy_the_weights(
    ray_driver, tiny_model_dir
):
    graph = realloc_graph()
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    specs = {ACTOR: EngineSpec("sft", TrainEngineConfig(path=tiny_model_dir, optimizer=opt))}
    for i, model in enumerate(list(LAYOUTS)[1:]):
        other = TrainEngineConfig(path=tiny_model_dir, init_from_scratch=True, init_seed=7 + i)
        specs[model] = EngineSpec("lm", other)
    workers = start_ray_workers(graph, specs)
    try:
        master = Master(graph, workers, mfc_timeout=300)
        batch = sft_batches()[0]
        master.put_batch(batch)
        stats = master.step(batch.n_seqs)
        weights = {m: full_weights(workers, graph, m) for m in LAYOUTS}
    finally:
        for w in workers:
            w.close()
    shapes = model_shapes(tiny_model_dir)
    for model, (_, source) in list(LAYOUTS.items())[1:]:
        plan = plan_realloc(graph.allocations[source], graph.allocations[model], shapes)
        got = stats[f"logp_{model.replica}"]
        assert got[f"realloc/{model}/bytes"] == plan.moved > 0, model
        assert got[f"realloc/{model}/seconds"] > 0
        assert max_gap(weights[model], weights[ACTOR]) < 1e-6, model
    # tp2 -> tp1: worker 0 already holds half of each cut tensor and every replicated one
    assert plan_realloc(graph.allocations[ACTOR], graph.allocations[TP1], shapes).kept[0] > 0


def test_pp2_to_dp2_and_back_moves_the_planned_bytes_and_copies_the_weights(
    ray_driver, tiny_model_dir
):
    # the actor trains on pp=2 (stage 0 on worker 0: embedding and layers 0-1; stage 1 on worker
    # 1: layers 2-3, norm and the tied head's copy); dp=2 takes the dim-0 halves of everything
    # (each worker lacks the other stage's halves), and pp=2 again takes them back
    dp2, back = ModelName("actor", 1), ModelName("actor", 2)
    layouts = {ACTOR: (((0, 1), 1, 1, 2), None), dp2: (((0, 1), 2, 1, 1), ACTOR)}
    layouts[back] = (((0, 1), 1, 1, 2), dp2)
    mfcs = [MFC("train", ACTOR, ModelFn.TRAIN_LM, SFT_KEYS)]
    mfcs += [
        MFC(f"logp_{m.replica}", m, ModelFn.COMPUTE_LOGP, ("input_ids",), (f"logp_{m.replica}",),
            {"out": f"logp_{m.replica}"}, hooks=(ParamRealloc(src),))
        for m, (_, src) in layouts.items() if src is not None
    ]  # fmt: skip
    allocs = [Allocation(m, w, dp, tp, pp) for m, ((w, dp, tp, pp), _) in layouts.items()]
    graph = build_graph("pp_layouts", mfcs, SFT_KEYS, allocs, 2)
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    specs = {ACTOR: EngineSpec("sft", TrainEngineConfig(path=tiny_model_dir, optimizer=opt))}
    for i, model in enumerate([dp2, back]):
        other = TrainEngineConfig(path=tiny_model_dir, init_from_scratch=True, init_seed=7 + i)
        specs[model] = EngineSpec("lm", other)
    workers = start_ray_workers(graph, specs)
    try:
        master = Master(graph, workers, mfc_timeout=300)
        batch = sft_batches()[0]
        master.put_batch(batch)
        stats = master.step(batch.n_seqs)
        weights = {m: full_weights(workers, graph, m) for m in layouts}
    finally:
        for w in workers:
            w.close()
    shapes = model_shapes(tiny_model_dir)
    for model in (dp2, back):
        source = layouts[model][1]
        plan = plan_realloc(graph.allocations[source], graph.allocations[model], shapes)
        assert stats[f"logp_{model.replica}"][f"realloc/{model}/bytes"] == plan.moved > 0, model
        common = weights[model].keys() & weights[ACTOR].keys()
        assert common >= {n for n in shapes.shapes}
        gap = max(float((weights[model][k] - weights[ACTOR][k]).abs().max()) for k in common)
        assert gap < 1e-6, (model, gap)
