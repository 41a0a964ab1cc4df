"""Tier 3 (GPU): Core model workers placed on GPUs by Ray, NCCL between them.

A PPO-free check of the placement and the backend: an SFT step through the master on 2 Ray
workers with one GPU each (dp=2, NCCL) equals the same step on 2 CPU workers (gloo) to 1e-4
(fp32 on both; GPU matmuls sum in another order)."""

from __future__ import annotations

import pytest
import torch

from areal.api.config.base import OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, RayModel, start_ray_workers
from areal.runtime.graphs import SFT_KEYS
from areal.utils.batch import PackedBatch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
MODEL = ModelName("model")


def sft_step(path: str, gpus: int) -> tuple[float, dict[str, torch.Tensor]]:

    graph = build_graph(
        "sft",
        [MFC("sft_train", MODEL, ModelFn.TRAIN_LM, SFT_KEYS)],
        SFT_KEYS,
        [Allocation(MODEL, (0, 1), dp=2)],
        2,
    )
    cfg = TrainEngineConfig(path=path, optimizer=OptimizerConfig(lr=1e-2, eps=1.0))
    workers = start_ray_workers(graph, {MODEL: EngineSpec("sft", cfg)}, gpus_per_worker=gpus)
    try:
        master = Master(graph, workers, mfc_timeout=300)
        master.put_batch(
            PackedBatch.from_sequences(
                {
                    "input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]],
                    "loss_mask": [[0, 1, 1, 1], [0, 1, 1], [0, 1], [0, 1, 1]],
                }
            )
        )
        loss = master.step(4)["sft_train"]["loss"]
        full = RayModel(workers, MODEL, tuple(range(len(workers)))).full_state_dict()
        return loss, {k: v.float().cpu() for k, v in full.items()}
    finally:
        for w in workers:
            w.close()


def test_an_sft_step_on_two_gpu_workers_with_nccl_equals_two_cpu_workers(tiny_model_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 NCCL workers, found {torch.cuda.device_count()}")
    ray = pytest.importorskip("ray", reason="Core's GPU placement runs on Ray")
    ray.init(
        num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False
    )
    try:
        gpu_loss, gpu_w = sft_step(tiny_model_dir, 1)
        cpu_loss, cpu_w = sft_step(tiny_model_dir, 0)
    finally:
        ray.shutdown()
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-4)
    assert max(float((gpu_w[k] - cpu_w[k]).abs().max()) for k in cpu_w) < 1e-4
