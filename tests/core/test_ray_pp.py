"""Tier 2 on a real local Ray head: pipeline-parallel (pp x dp x tp) allocations of Core models.

A PPO step through the master, with actor, reference and critic all on one layout, equals Lite's
step (``run_step`` of the same graph in one process, test_ray_worker's ``lite_step``): the loss
and grad norm of both training MFCs, every other stat of theirs under the names both log, and
their updated full weights, within 1e-5.
The layouts: dp1 x tp1 x pp2, dp1 x tp2 x pp2, dp2 x tp1 x pp2, and without pp dp1 x tp2 and
dp2 x tp2 (the 4-process tensor-parallel case; dp2 alone is test_ray_worker.py's). Each
layout also checks where the weights are: which stage holds each decoder layer, the embedding
and the head, and a column-parallel weight's placements and local shape on every worker (an
unapplied plan would fail it).

One set of 4 worker actors serves the whole module: each layout sets up its graph on them and
releases it after, which leaves each actor only the job's default process group
(test_ray_worker.py covers freshly started actors). After each setup, every parameter's mesh
holds only this graph's live groups: dp2 x tp2's tp sub-meshes compare equal to dp1 x tp2 x
pp2's, and an actor thread that built both used to hand the later graph the earlier groups on
some ranks only (its weight gather then hung). A layout its model cannot take fails in one line
before any worker is touched.
"""

from __future__ import annotations

import re
import time

import pytest
import test_ray_worker
from test_master_engines import GROUP, LOSS_KEYS, max_gap
from test_ray_worker import specs

from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, RayModel, start_ray_workers, start_worker_actors
from areal.engine.pipeline import stage_layers
from areal.runtime.graphs import ACTOR, CRITIC, REF, ROLLOUT_KEYS, SFT_KEYS, ppo_mfcs
from areal.runtime.step import step_stats

pytestmark = pytest.mark.slow
ray_driver = test_ray_worker.ray_driver  # module fixtures: Ray attached once, Lite's step once
lite_step = test_ray_worker.lite_step
N_LAYERS, HIDDEN = 4, 256  # the tiny model's (areal/utils/tiny_model.py)
Q_PROJ = "model.layers.{}.self_attn.q_proj.weight"  # [HIDDEN, HIDDEN], column-parallel


@pytest.fixture(scope="module")
def pool(ray_driver):
    """4 worker actors shared by every layout of this module."""
    actors = start_worker_actors(4)
    yield actors
    ray_driver.get([a.shutdown.remote() for a in actors], timeout=120)
    for a in actors:
        ray_driver.kill(a, no_restart=True)


def pooled_step(ray, pool, path: str, layout: dict, batch):
    """One master step with actor, critic and reference on ``layout`` (dp, tp, pp over the
    first dp*tp*pp workers): (stats, full weights of actor and critic, each worker's actor
    parameters as (local shape, placements) by name)."""
    n = layout["dp"] * layout["tp"] * layout["pp"]
    allocs = [Allocation(m, tuple(range(n)), **layout) for m in (ACTOR, CRITIC, REF)]
    graph = build_graph("async_ppo", ppo_mfcs(True, True, True), ROLLOUT_KEYS, allocs, n)

    def stale_meshes(actor) -> list[str]:
        """(Run in a worker actor; defined here, as Ray sends it by value.) Its engines'
        parameters whose mesh holds a group that is not live: an earlier graph's mesh, which
        compares equal to this graph's."""
        from torch.distributed.distributed_c10d import _world
        from torch.distributed.tensor import DTensor

        def stale(mesh) -> bool:
            try:  # a destroyed group's name no longer resolves
                return any(g not in _world.pg_map for g in mesh.get_all_groups())
            except RuntimeError:
                return True

        return [
            f"{model}.{name}"
            for model, engine in actor.worker.engines.items()
            for name, p in engine.model.named_parameters()
            if isinstance(p, DTensor) and stale(p.device_mesh)
        ]

    workers = start_ray_workers(graph, specs(path), actors=pool)
    try:
        stale = ray.get([a.__ray_call__.remote(stale_meshes) for a in pool[:n]], timeout=60)
        assert stale == [[]] * n, stale
        master = Master(graph, workers, group_size=GROUP, mfc_timeout=300)
        master.put_batch(batch)
        stats = master.step(batch.n_seqs)
        ranks = tuple(range(n))  # gathered in order with the MFCs, as areal replay does
        got = {m: RayModel(workers, m, ranks).full_state_dict() for m in (ACTOR, CRITIC)}
        params = ray.get([w.handle.parameters.remote(ACTOR) for w in workers], timeout=60)
    finally:
        for w in workers:
            w.release()
    # released, each pooled actor keeps only the job's default group: the next layout's meshes
    # are built anew
    groups = ray.get([a.collective_counts.remote() for a in pool], timeout=60)
    assert [sorted(g) for g in groups] == [[tuple(range(len(pool)))]] * len(pool), groups
    return stats, got, params


def check_placement(layout: dict, params: list[dict]) -> None:
    """Every worker holds its stage's layers (and the embedding first, the head last), each
    column-parallel weight cut over tp, then over dp."""
    dp, tp, pp = layout["dp"], layout["tp"], layout["pp"]
    alloc = Allocation(ACTOR, tuple(range(len(params))), dp=dp, tp=tp, pp=pp)
    for worker, held in enumerate(params):
        p, _, _ = alloc.coordinate(worker)  # workers in order: the stage is the pp group rank
        layers = sorted({int(k.split(".")[2]) for k in held if k.startswith("model.layers.")})
        assert layers == list(stage_layers(N_LAYERS, pp, p)), f"worker {worker} (stage {p})"
        assert ("model.embed_tokens.weight" in held) == (p == 0)
        assert ("model.norm.weight" in held) == (p == pp - 1)
        assert ("lm_head.weight" in held) == (pp > 1 and p == pp - 1)  # tied: one name when pp=1
        shape, placements = held[Q_PROJ.format(layers[0])]
        assert shape == (HIDDEN // tp // dp, HIDDEN), f"worker {worker}: {shape}"
        if tp > 1:  # the tp plan's column cut, and FSDP's over dp on top of it
            assert placements.endswith("Shard(dim=0))") and "Shard" in placements.split(",")[0]
        else:
            assert placements == "(Shard(dim=0),)"


LAYOUTS = {
    "dp1_tp1_pp2": {"dp": 1, "tp": 1, "pp": 2},
    "dp1_tp2_pp2": {"dp": 1, "tp": 2, "pp": 2},
    "dp2_tp1_pp2": {"dp": 2, "tp": 1, "pp": 2},
    "dp1_tp2_pp1": {"dp": 1, "tp": 2, "pp": 1},
    "dp2_tp2_pp1": {"dp": 2, "tp": 2, "pp": 1},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_ppo_step_on_the_layout_equals_run_step_in_process(
    ray_driver, pool, tiny_model_dir, lite_step, name
):
    batch, logged, weights = lite_step
    start = time.monotonic()
    stats, got, params = pooled_step(ray_driver, pool, tiny_model_dir, LAYOUTS[name], batch)
    print(f"{name}: step through the master on pooled workers {time.monotonic() - start:.1f} s")
    named = step_stats(ppo_mfcs(True, True, True), stats)  # by the names run_step logs
    # n_mbs counts the micro-batches one rank ran (it depends on dp and pp); the in-process
    # step's staleness buckets need token field `versions`, which Core's actor_train does not
    # read
    compared = {
        k
        for k in logged
        if k.startswith("loss/") and k.rsplit("/", 1)[1] != "n_mbs" and "mismatch_k3_stale" not in k
    }
    assert compared <= set(named) and set(LOSS_KEYS) <= compared
    for key in sorted(compared):
        assert named[key] == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key
    worst = max(abs(named[k] - logged[k]) / max(abs(logged[k]), 1e-6) for k in compared)
    print(f"{name}: loss stats, max relative gap to the in-process step {worst:.1e}")
    assert stats["actor_train"]["n_tokens"] == batch.n_tokens
    gaps = {m: max_gap(got[m], weights[m]) for m in (ACTOR, CRITIC)}
    print(f"{name}: max weight gap to Lite {gaps}")
    assert max(gaps.values()) < 1e-5
    check_placement(LAYOUTS[name], params)


@pytest.mark.parametrize(
    "layout, why",
    [
        ({"pp": 8}, "pp=8 exceeds num_hidden_layers=4 of the model at .*; use pp <= 4$"),
        ({"tp": 4, "dp": 2}, "qwen2 model: num_key_value_heads=2 not divisible by tp=4; choose"),
    ],
    ids=["pp_above_layers", "tp_not_dividing_heads"],
)
def test_a_layout_its_model_cannot_take_fails_in_one_line_before_any_worker(
    tiny_model_dir, layout, why
):
    # no Ray cluster here: the layout is refused from the model's config.json, before actors
    model = ModelName("model")
    alloc = Allocation(model, tuple(range(8)), **layout)
    mfc = MFC("sft_train", model, ModelFn.TRAIN_LM, SFT_KEYS)
    graph = build_graph("sft", [mfc], SFT_KEYS, [alloc], 8)
    spec = EngineSpec("sft", TrainEngineConfig(path=tiny_model_dir))
    prefix = re.escape(f"model 'model@0' ({alloc.describe()}): ")
    with pytest.raises(ValueError, match=f"^{prefix}{why}") as e:
        start_ray_workers(graph, {model: spec})
    assert "\n" not in str(e.value)
