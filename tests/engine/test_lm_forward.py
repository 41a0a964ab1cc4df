"""The trainer's speed and memory levers (tier 2), each on vs off on the tiny model, in one
process and in a 2-process gloo group: fused LM-head logprobs (``fused_logprobs``),
FlexAttention (``attention=flex``; the forward only on CPU: torch's FlexAttention has no CPU
backward, its training step is tier 3 in test_levers_gpu.py, as is ``compile``, whose CPU
compilation takes minutes) and the activation-checkpointing policies. A GRPO actor step at
temperature 0.7 with an entropy bonus and 16-token logprob chunks (so chunking, temperature
and both gradients are exercised), over micro-batches in the plain and the shared-prefix
layout. Logprobs must agree within 1e-6, loss and grad norm within 1e-5 relative (fp32).

The fused path's memory: a subprocess per path measures the peak RSS a logprob step (forward
and backward) adds on a 32k-vocabulary shape; the fused one must add at most half."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from test_fsdp import set_dist_env, world_mesh
from test_ppo import GROUP, actor_config, rollout_batch

from areal.api.config.engine import LoRAConfig
from areal.engine.ppo import PPOActor
from areal.utils.network import free_port
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
PLAIN = {"fused_logprobs": False, "attention": "sdpa", "activation_checkpointing": "none"}
LEVERS = {
    "fused": {"fused_logprobs": True},
    "flex": {"attention": "flex"},  # forward only on CPU (FlexAttention has no CPU backward)
    "selective": {"activation_checkpointing": "selective"},
}


def _grpo_step(path, mesh, shared: bool, **levers) -> dict:
    """compute_logp, then one update over several micro-batches; logp, stats, weights."""
    cfg = actor_config(
        path,
        budget=24,
        lr=1e-2,
        eps=1.0,
        shared_prefix=shared,
        entropy_coeff=0.01,
        logprob_chunk_size=16,
        compile="off",
        **{**PLAIN, **levers},
    )
    actor = PPOActor(cfg, mesh, temperature=0.7, group_size=GROUP)
    actor.initialize(None)
    seqs = {"group_index": torch.arange(8) // GROUP, "prompt_lens": torch.full((8,), 4)}
    batch = rollout_batch(n_groups=4, seed=dist.get_rank()).with_fields(seqs=seqs)
    logp = actor.compute_logp(batch)[0]["logp"]
    out = {"logp": logp, "fused": actor.fused, "attention": actor.spec.attention}
    if levers.get("attention") != "flex" or actor.device.type == "cuda":
        batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
        out["stats"] = actor.ppo_update(batch)[1]
        out["state"] = actor.full_state_dict()
    actor.destroy()
    return out


def assert_same_step(a: dict, b: dict) -> None:
    assert (a["logp"] - b["logp"]).abs().max() <= 1e-6
    if "stats" not in b:  # flex on CPU: the forward only
        return
    assert a["stats"]["n_mbs"] > 1
    for key in ("loss", "grad_norm", "entropy"):
        assert b["stats"][key] == pytest.approx(a["stats"][key], rel=1e-5, abs=1e-7), key
    if a["state"]:  # the full weights are on the first rank
        worst = max((a["state"][k] - b["state"][k]).abs().max().item() for k in a["state"])
        assert worst < 1e-5


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_each_lever_gives_the_plain_step_in_one_process(tiny_model_dir, lever, shared):
    mesh = world_mesh()
    plain = _grpo_step(tiny_model_dir, mesh, shared)
    on = _grpo_step(tiny_model_dir, mesh, shared, **LEVERS[lever])
    assert not plain["fused"] and on["fused"] == (lever == "fused")
    assert on["attention"] == ("flex" if lever == "flex" else "sdpa")
    assert_same_step(plain, on)


@pytest.mark.parametrize("saved", [[], ["embed_tokens"]])
def test_fused_logprobs_train_lora_adapters_as_the_logits_path(tiny_model_dir, saved):
    lora = LoRAConfig(rank=4, alpha=8.0, modules_to_save=saved)
    plain = _grpo_step(tiny_model_dir, world_mesh(), False, lora=lora)
    fused = _grpo_step(tiny_model_dir, world_mesh(), False, fused_logprobs=True, lora=lora)
    # a fully trained (tied) embedding puts peft's wrapper where the head was: logits path
    assert fused["fused"] == (not saved)
    assert_same_step(plain, fused)


def _levers_run(rank: int, path: str, port: int, out: str) -> None:
    set_dist_env(rank, 2, port)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = world_mesh()
    result = {"plain": _grpo_step(path, mesh, shared=False)}
    for name, levers in LEVERS.items():
        result[name] = _grpo_step(path, mesh, shared=False, **levers)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def test_each_lever_gives_the_plain_step_on_two_gloo_ranks(tiny_model_dir, tmp_path):
    out = str(tmp_path / "levers.pt")
    run_ranks(_levers_run, 2, (tiny_model_dir, free_port(), out), timeout=300)
    for rank in range(2):
        result = torch.load(f"{out}.{rank}")
        for name in LEVERS:
            assert_same_step(result["plain"], result[name])


# A logprob step (forward and backward, temperature 0.7) on 1024 tokens of a 32k vocabulary:
# the logits path holds [T, V] fp32 logits and their gradient (2 x 128 MiB); the fused path a
# few [128, V] chunks (16 MiB each) and the head's gradient (8 MiB).
MEMORY_STEP = """
import json, sys
import torch
from areal.algo.logprob import fused_logprobs_and_entropy, logprobs_and_entropy
torch.manual_seed(0)
T, H, V, fused = 1024, 64, 32768, sys.argv[1] == "fused"
hidden = torch.randn(T, H, requires_grad=True)
weight = (torch.randn(V, H) / 8).requires_grad_()
labels = torch.randint(0, V, (T,))


def kib(field):  # VmRSS (now) or VmHWM (peak since the last reset), KiB
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])


def step(n):
    if fused:
        logp, ent = fused_logprobs_and_entropy(hidden[:n], weight, None, labels[:n], 0.7, 128)
    else:
        logp, ent = logprobs_and_entropy(hidden[:n] @ weight.t(), labels[:n], 0.7, 128)
    (logp.sum() + 0.01 * ent.sum()).backward()
    return logp


step(4)  # warm-up: the kernels' own buffers and thread pools are not the step's
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
before = kib("VmRSS")
logp = step(T)
print(json.dumps({"added_mib": (kib("VmHWM") - before) / 1024, "logp": float(logp.detach().sum())}))
"""


def _peak_added(path: str) -> dict:
    # a fixed mmap threshold: glibc's default one rises as big blocks are freed, after which
    # freed [chunk, V] buffers stay in the heap and peak RSS would count them as live
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_STEP, path],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_fused_logprob_step_adds_at_most_half_the_peak_memory_of_the_logits_path():
    plain, fused = _peak_added("logits"), _peak_added("fused")
    assert fused["logp"] == pytest.approx(plain["logp"], rel=1e-5)  # the same computation
    assert plain["added_mib"] > 256  # the [T, V] logits and their gradient were really held
    assert fused["added_mib"] <= plain["added_mib"] / 2, (fused, plain)
