"""Tier 2 on a real local Ray head: parameter reallocation into a tensor-parallel layout.

An actor trained on dp=2 x tp=1 moved into a reference on dp=1 x tp=2 (every tp rank takes its
own pieces of the actor's shards) gives the actor's logprobs (1e-5). PPO steps on tensor-parallel
layouts (dp1 x tp2, dp2 x tp2, and tp beside pp) equal Lite's in tests/core/test_ray_pp.py,
which sets them all up on one shared set of worker actors."""

from __future__ import annotations

import pytest
from test_master_engines import sft_batches
from test_ray_worker import ray_driver  # noqa: F401 - fixture

from areal.api.config.base import OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName, ParamRealloc
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, start_ray_workers
from areal.runtime.graphs import SFT_KEYS

pytestmark = pytest.mark.slow


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
