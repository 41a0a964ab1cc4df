"""Tier 3 (GPU): a pipelined Core model on GPU workers, NCCL between the stages.

An SFT step through the master on 2 Ray workers with one GPU each, the model cut into 2 stages
(dp=1 x pp=2: activations and gradients cross by NCCL send/recv, the tied embedding's gradient
and the grad norm by NCCL all-reduce, stats by object broadcast on the gloo side of the group),
equals the same layout on 2 CPU workers (gloo) to 1e-4 (fp32 on both; GPU matmuls sum in another
order), and so do the logprobs the forward-only schedule computes."""

from __future__ import annotations

import pytest
import torch

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, RayModel, start_ray_workers
from areal.runtime.graphs import SFT_KEYS
from areal.utils.batch import PackedBatch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
MODEL = ModelName("model")
BATCH = {
    "input_ids": [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11], [12, 13, 14, 15]],
    "loss_mask": [[0, 1, 1, 1, 1, 1], [0, 1, 1], [0, 1], [0, 1, 1, 1]],
}


def pipelined_sft_step(path: str, gpus: int) -> tuple[float, torch.Tensor, dict]:

    graph = build_graph(
        "sft",
        [MFC("sft_train", MODEL, ModelFn.TRAIN_LM, SFT_KEYS)],
        SFT_KEYS,
        [Allocation(MODEL, (0, 1), dp=1, pp=2)],
        2,
    )
    cfg = TrainEngineConfig(
        path=path,
        param_dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=8),
        optimizer=OptimizerConfig(lr=1e-2, eps=1.0),
    )
    workers = start_ray_workers(graph, {MODEL: EngineSpec("sft", cfg)}, gpus_per_worker=gpus)
    try:
        master = Master(graph, workers, mfc_timeout=300)
        batch = PackedBatch.from_sequences(BATCH)
        master.put_batch(batch)
        loss = master.step(4)["sft_train"]["loss"]
        logps = [w.call(MODEL, "compute_logp", batch) for w in workers]  # both stages join
        logp = [f.result(timeout=300)[0]["logp"].float().cpu() for f in logps][0]
        full = RayModel(workers, MODEL, tuple(range(len(workers)))).full_state_dict()
        return loss, logp, {k: v.float().cpu() for k, v in full.items()}
    finally:
        for w in workers:
            w.close()


def test_a_pipelined_sft_step_on_two_gpu_workers_equals_two_cpu_workers(tiny_model_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 NCCL stages, found {torch.cuda.device_count()}")
    ray = pytest.importorskip("ray", reason="Core's GPU placement runs on Ray")
    ray.init(
        num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False
    )
    try:
        gpu_loss, gpu_logp, gpu_w = pipelined_sft_step(tiny_model_dir, 1)
        cpu_loss, cpu_logp, cpu_w = pipelined_sft_step(tiny_model_dir, 0)
    finally:
        ray.shutdown()
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-4)
    assert (gpu_logp - cpu_logp).abs().max().item() < 1e-4
    assert gpu_w.keys() == cpu_w.keys()
    assert max(float((gpu_w[k] - cpu_w[k]).abs().max()) for k in cpu_w) < 1e-4
