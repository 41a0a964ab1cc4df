"""Tier 2 on a real local Ray head: tensor-parallel (dp x tp) allocations of Core models.

A PPO step through the master with actor, reference and critic each on a dp=1 x tp=2 mesh over 2
Ray workers equals the same step on dp=2 x tp=1 and Lite's step in one process (weights and
stats, 1e-5); an actor trained on dp=2 x tp=1 moved into a reference on dp=1 x tp=2 (parameter
reallocation: every tp rank cuts its own shards of the full weights) gives the actor's logprobs
(1e-5)."""

from __future__ import annotations

import pytest

from areal.api.config.base import OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.core.dfg import MFC, Allocation, ModelFn, ModelName, ParamRealloc, build_graph
from areal.core.graphs import ACTOR, CRITIC, REF, SFT_KEYS
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, start_ray_workers
from test_master_engines import max_gap, sft_batches
from test_ray_worker import check_equal, core_step, lite_step, ray_driver  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


def test_core_ppo_step_on_dp1_tp2_equals_dp2_tp1_and_the_lite_step(
    ray_driver, tiny_model_dir, lite_step
):
    tp = [Allocation(m, (0, 1), dp=1, tp=2) for m in (ACTOR, CRITIC, REF)]
    dp = [Allocation(m, (0, 1), dp=2, tp=1) for m in (ACTOR, CRITIC, REF)]
    stats_tp, got_tp = core_step(ray_driver, tiny_model_dir, tp, lite_step[0])
    stats_dp, got_dp = core_step(ray_driver, tiny_model_dir, dp, lite_step[0])
    check_equal(stats_tp, got_tp, lite_step)
    for m in (ACTOR, CRITIC):
        assert max_gap(got_tp[m], got_dp[m]) < 1e-5
    for mfc in ("actor_train", "critic_train"):
        for key in ("loss", "grad_norm"):
            assert stats_tp[mfc][key] == pytest.approx(stats_dp[mfc][key], rel=1e-5, abs=1e-6)


def test_reallocation_from_a_dp2_actor_to_a_tp2_reference_gives_equal_logprobs(
    ray_driver, tiny_model_dir
):
    actor, ref = ModelName("actor"), ModelName("ref")
    mfcs = [
        MFC("actor_train", actor, ModelFn.TRAIN_LM, SFT_KEYS),
        MFC(
            "ref_logp",
            ref,
            ModelFn.COMPUTE_LOGP,
            ("input_ids",),
            ("ref_logp",),
            {"out": "ref_logp"},
            hooks=(ParamRealloc(actor),),
        ),
    ]
    allocs = [Allocation(actor, (0, 1), dp=2, tp=1), Allocation(ref, (0, 1), dp=1, tp=2)]
    graph = build_graph("realloc", mfcs, SFT_KEYS, allocs, 2)
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    specs = {
        actor: EngineSpec("sft", TrainEngineConfig(path=tiny_model_dir, optimizer=opt)),
        ref: EngineSpec(
            "lm", TrainEngineConfig(path=tiny_model_dir, init_from_scratch=True, init_seed=7)
        ),
    }
    workers = start_ray_workers(graph, specs)
    try:
        master = Master(graph, workers, mfc_timeout=300)
        batch = sft_batches()[0]
        master.put_batch(batch)
        master.step(batch.n_seqs)
        # collectives: every rank of a mesh gets the same batch (both meshes span workers 0, 1)
        refs = [w.call(ref, "compute_logp", batch) for w in workers]
        ref_logp = [f.result(timeout=300)[0]["logp"] for f in refs]
        actors = [w.call(actor, "compute_logp", batch) for w in workers]
        actor_logp = actors[0].result(timeout=300)[0]["logp"]
        actors[1].result(timeout=300)
    finally:
        for w in workers:
            w.close()
    assert (ref_logp[0] - ref_logp[1]).abs().max() == 0  # both tp ranks hold the full logits
    assert (ref_logp[0] - actor_logp).abs().max() < 1e-5
