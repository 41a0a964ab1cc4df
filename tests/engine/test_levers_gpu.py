"""Tier 3 (GPU): the trainer's levers on one CUDA device, each against the plain fp32 step there.

A GRPO actor step of the tiny model (``compute_logp``, ``compute_advantages``, ``ppo_update``)
with everything off and float32 compute is the reference. In float32, each lever alone (fused
logprobs, FlexAttention training, which CPU cannot run, torch.compile per block, selective
checkpointing) gives its loss and grad norm within 1e-4 relative and its logprobs within 1e-4
(GPU kernels differ in summation order, not in maths). bf16 compute (FSDP2 mixed precision,
fp32 master weights, optimizer and reduction; the GPU default) with every lever on gives the
reference's loss and grad norm within 2% (bf16 keeps 8 mantissa bits: ~4e-3 relative per
activation, seen as ~2e-3 mean |logp| error, docs/gpus.md#mixed-precision), logprobs within
5e-2 and updated weights within 1e-4 (the update is lr x a gradient 2% off). The steps run in
a fresh process with a ``cpu:gloo,cuda:nccl`` process group (the suite's own is gloo only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PLAIN = {
    "fused_logprobs": False,
    "attention": "sdpa",
    "compile": "off",
    "activation_checkpointing": "none",
    "param_dtype": "float32",
}
RUNS = {
    "plain": {},
    "fused": {"fused_logprobs": True},
    "flex": {"attention": "flex"},
    "compile": {"compile": "on"},
    "selective": {"activation_checkpointing": "selective"},
    "bf16_all": {
        "fused_logprobs": True,
        "attention": "flex",
        "compile": "on",
        "param_dtype": "bfloat16",
    },
}


def _step(path: str, levers: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from areal.api.config.actor import PPOActorConfig
    from areal.api.config.base import OptimizerConfig
    from areal.engine.ppo import PPOActor
    from areal.utils.batch import PackedBatch

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    cfg = PPOActorConfig(
        path=path,
        algorithm="grpo",
        optimizer=OptimizerConfig(lr=1e-2, eps=1.0),
        entropy_coeff=0.01,
        logprob_chunk_size=8,
        **{**PLAIN, **levers},
    )
    ids = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7, 8, 9, 10, 11], [7, 8, 9, 10, 12, 13, 14]]
    masks = [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1]]
    batch = PackedBatch.from_sequences(
        {"input_ids": ids, "loss_mask": masks, "logprobs": [[0.0] * len(i) for i in ids]},
        {"rewards": [1.0, 0.0, 0.0, 1.0]},
    )
    actor = PPOActor(cfg, mesh, temperature=0.7, group_size=2)
    actor.initialize(None)
    logp = actor.compute_logp(batch)[0]["logp"]
    batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
    _, stats = actor.ppo_update(batch)
    weights = {k: v.float().cpu() for k, v in actor.full_state_dict().items()}
    actor.destroy()
    return {
        "stats": {k: stats[k] for k in ("loss", "grad_norm", "entropy")},
        "logp": logp.float().cpu().tolist(),
        "weights": weights,
    }


def test_each_lever_and_bf16_compute_match_the_plain_fp32_step_on_cuda(tiny_model_dir, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    out_path = str(tmp_path / "levers.pt")
    run = subprocess.run(
        [sys.executable, __file__, tiny_model_dir, out_path],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = torch.load(out_path)
    ref = results["plain"]
    for name, got in results.items():
        bf16 = name == "bf16_all"
        rel, logp_tol, w_tol = (2e-2, 5e-2, 1e-4) if bf16 else (1e-4, 1e-4, 1e-5)
        for key, value in ref["stats"].items():
            assert got["stats"][key] == pytest.approx(value, rel=rel), (name, key)
        assert max(abs(a - b) for a, b in zip(ref["logp"], got["logp"])) < logp_tol, name
        worst = max(
            (ref["weights"][k] - got["weights"][k]).abs().max().item() for k in ref["weights"]
        )
        assert worst < w_tol, (name, worst)


if __name__ == "__main__":  # the child: one cpu:gloo,cuda:nccl group on GPU 0
    import torch.distributed as dist

    from areal.utils.network import free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
    )
    os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    torch.save({name: _step(sys.argv[1], levers) for name, levers in RUNS.items()}, sys.argv[2])
    dist.destroy_process_group()
