"""Tier 3 (GPU): the FSDP engines on one CUDA device (bf16 compute, NCCL) against the same steps
on CPU (fp32, gloo): an SFT step (``train_lm``) and a GRPO actor step (``compute_logp``,
``compute_advantages``, ``ppo_update``) of the tiny model give the CPU step's loss and grad norm
(bf16 logits: 1% apart) and its updated weights (1e-4). The steps run in a fresh process with a
``cpu:gloo,cuda:nccl`` process group (the suite's own is gloo only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _steps(path: str, device: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from areal.api.config.actor import PPOActorConfig
    from areal.api.config.base import OptimizerConfig
    from areal.api.config.engine import TrainEngineConfig
    from areal.engine.ppo import PPOActor
    from areal.engine.sft import SFTEngine
    from areal.utils.batch import PackedBatch

    mesh = init_device_mesh(device, (1,), mesh_dim_names=("dp",))
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    ids = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7, 8, 9, 10, 11], [7, 8, 9, 10, 12, 13, 14]]
    masks = [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1]]
    sft = SFTEngine(TrainEngineConfig(path=path, optimizer=opt), mesh)
    sft.initialize(None)
    _, s = sft.train_lm(PackedBatch.from_sequences({"input_ids": ids, "loss_mask": masks}))
    sft_w = {k: v.float().cpu() for k, v in sft.full_state_dict().items()}
    sft.destroy()
    actor = PPOActor(PPOActorConfig(path=path, algorithm="grpo", optimizer=opt), mesh, group_size=2)
    actor.initialize(None)
    batch = PackedBatch.from_sequences(
        {"input_ids": ids, "loss_mask": masks, "logprobs": [[0.0] * len(i) for i in ids]},
        {"rewards": [1.0, 0.0, 0.0, 1.0]},
    )
    logp = actor.compute_logp(batch)[0]["logp"]
    batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
    _, p = actor.ppo_update(batch)
    ppo_w = {k: v.float().cpu() for k, v in actor.full_state_dict().items()}
    actor.destroy()
    torch.save({"sft_w": sft_w, "ppo_w": ppo_w}, os.environ["AREAL_GPU_OUT"] + f".{device}.pt")
    return {
        "sft": {k: s[k] for k in ("loss", "grad_norm")},
        "ppo": {k: p[k] for k in ("loss", "grad_norm")},
        "logp": logp.float().cpu().tolist(),
    }


def test_sft_and_grpo_steps_on_cuda_match_cpu(tiny_model_dir, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
    env = {
        **os.environ,
        "AREAL_GPU_OUT": str(tmp_path / "w"),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    out = subprocess.run(
        [sys.executable, __file__, tiny_model_dir],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    cpu, cuda = r["cpu"], r["cuda"]
    for step in ("sft", "ppo"):
        for k in ("loss", "grad_norm"):
            assert cuda[step][k] == pytest.approx(cpu[step][k], rel=1e-2), (
                step,
                k,
                cpu[step],
                cuda[step],
            )
    assert max(abs(a - b) for a, b in zip(cpu["logp"], cuda["logp"])) < 5e-2  # bf16 logits
    wc, wg = torch.load(str(tmp_path / "w.cpu.pt")), torch.load(str(tmp_path / "w.cuda.pt"))
    for key in ("sft_w", "ppo_w"):
        worst = max((wc[key][k] - wg[key][k]).abs().max().item() for k in wc[key])
        assert worst < 1e-4, (key, worst)


if __name__ == "__main__":  # the child: both devices over one cpu:gloo,cuda:nccl group
    import torch.distributed as dist

    from areal.utils.network import free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    result = {device: _steps(sys.argv[1], device) for device in ("cpu", "cuda")}
    dist.destroy_process_group()
    print(json.dumps(result))
