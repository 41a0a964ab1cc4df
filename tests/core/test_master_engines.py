"""Tier 2: the master over an in-process worker hosting real Lite engines (tiny model, one rank)
does exactly what the Lite script's train_step does: same weights and stats after a PPO step
with actor (decoupled loss, 2 minibatches: a proximal-logp pass), reference (KL in the reward)
and critic, and after SFT steps."""

from __future__ import annotations

import pytest
import torch

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.core.dfg import MFC, Allocation, ModelFn, ModelName, ParamRealloc, build_graph
from areal.core.graphs import ACTOR, CRITIC, REF, ROLLOUT_KEYS, SFT_KEYS, ppo_mfcs
from areal.core.master import Master
from areal.core.worker import InProcessWorker
from areal.engine.fsdp import FSDPEngine
from areal.engine.ppo import PPOActor, PPOCritic
from areal.engine.sft import SFTEngine
from areal.runtime.dist import init_distributed
from areal.utils.batch import PackedBatch

pytestmark = pytest.mark.slow
GROUP = 2


def rollout_batch(n_groups: int = 3, seed: int = 0) -> PackedBatch:
    """Groups of GROUP samples sharing a 4-token prompt, with every rollout-stream field."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, behav = [], [], []
    for _ in range(n_groups):
        prompt = torch.randint(0, 256, (4,), generator=g).tolist()
        for _ in range(GROUP):
            n = int(torch.randint(3, 8, (1,), generator=g))
            ids.append(prompt + torch.randint(0, 256, (n,), generator=g).tolist())
            masks.append([0] * 4 + [1] * n)
            behav.append([0.0] * 4 + (-3.0 - torch.rand(n, generator=g)).tolist())
    n = len(ids)
    return PackedBatch.from_sequences(
        {
            "input_ids": ids,
            "loss_mask": masks,
            "logprobs": behav,
            "versions": [[0] * len(i) for i in ids],
        },
        {
            "rewards": [float(k % 2) for k in range(n)],
            "no_eos": [False] * n,
            "group_index": [k // GROUP for k in range(n)],
            "prompt_lens": [4] * n,
            "status_code": [0] * n,
        },
    )


def ppo_engines(path: str):
    mesh = init_distributed("gloo").mesh
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    mb = MicroBatchSpec(max_tokens_per_mb=40, granularity=GROUP)
    actor = PPOActor(
        PPOActorConfig(
            path=path,
            algorithm="ppo",
            kl_ctl=0.1,
            use_decoupled_loss=True,
            ppo_n_minibatches=2,
            mb_spec=mb,
            optimizer=opt,
        ),
        mesh,
        group_size=GROUP,
        max_new_tokens=8,
    )
    critic = PPOCritic(
        PPOCriticConfig(path=path, mb_spec=mb, optimizer=opt), mesh, group_size=GROUP
    )
    ref = FSDPEngine(TrainEngineConfig(path=path, mb_spec=mb), mesh)
    for e in (actor, critic, ref):
        e.initialize(None)
    return actor, critic, ref


def lite_train_step(actor, critic, ref, batch):
    """examples/gsm8k_grpo.py's train_step, without the tracker."""
    if actor.needs_prox_pass:
        batch, _ = actor.compute_logp(batch, out="prox_logp")
    batch, _ = ref.compute_logp(batch, out="ref_logp")
    batch, _ = critic.compute_values(batch)
    batch, _ = actor.compute_advantages(batch)
    _, actor_stats = actor.ppo_update(batch)
    actor.step_lr_scheduler()
    _, critic_stats = critic.ppo_update(batch)
    critic.step_lr_scheduler()
    return actor_stats, critic_stats


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_core_ppo_step_on_one_in_process_worker_equals_the_lite_step(tiny_model_dir):
    batch = rollout_batch()
    lite = ppo_engines(tiny_model_dir)
    assert lite[0].needs_prox_pass  # the graph gets its actor_logp node
    lite_actor_stats, lite_critic_stats = lite_train_step(*lite, batch)
    lite_weights = [snapshot(lite[0]), snapshot(lite[1])]

    actor, critic, ref = ppo_engines(tiny_model_dir)
    worker = InProcessWorker(0, {ACTOR: actor, CRITIC: critic, REF: ref})
    worker.connect([worker])
    allocs = [Allocation(m, (0,)) for m in (ACTOR, CRITIC, REF)]
    graph = build_graph(
        "async_ppo", ppo_mfcs(True, True, actor.needs_prox_pass), ROLLOUT_KEYS, allocs, 1
    )
    master = Master(graph, [worker], group_size=GROUP)
    master.put_batch(batch)
    stats = master.step(batch.n_seqs)
    worker.close()

    # Not bitwise: the worker computes on its own thread, whose OpenMP reductions may sum in
    # another order (seen: 7e-9 on the weights).
    assert max_gap(snapshot(actor), lite_weights[0]) < 1e-6
    assert max_gap(snapshot(critic), lite_weights[1]) < 1e-6
    for key in ("loss", "grad_norm"):
        assert stats["actor_train"][key] == pytest.approx(lite_actor_stats[key], rel=1e-5, abs=1e-7)
        assert stats["critic_train"][key] == pytest.approx(
            lite_critic_stats[key], rel=1e-5, abs=1e-7
        )
    assert stats["actor_train"]["n_tokens"] == batch.n_tokens
    assert worker._store == {} and len(master.buffer) == 0  # everything released after the step
    for e in (actor, critic, ref, *lite):
        e.destroy()


def sft_batches() -> list[PackedBatch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        lens = torch.randint(4, 10, (4,), generator=g).tolist()
        ids = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
        out.append(
            PackedBatch.from_sequences(
                {"input_ids": ids, "loss_mask": [[0, 0] + [1] * (n - 2) for n in lens]}
            )
        )
    return out


def test_core_sft_steps_equal_lite_sft_steps(tiny_model_dir):
    mesh = init_distributed("gloo").mesh
    cfg = TrainEngineConfig(path=tiny_model_dir, optimizer=OptimizerConfig(lr=1e-2, eps=1.0))
    lite, core = SFTEngine(cfg, mesh), SFTEngine(cfg, mesh)
    lite.initialize(None)
    core.initialize(None)
    lite_losses = []
    for batch in sft_batches():
        lite_losses.append(lite.train_lm(batch)[1]["loss"])
        lite.step_lr_scheduler()

    model = ModelName("model")
    graph = build_graph(
        "sft",
        [MFC("sft_train", model, ModelFn.TRAIN_LM, SFT_KEYS)],
        SFT_KEYS,
        [Allocation(model, (0,))],
        1,
    )
    worker = InProcessWorker(0, {model: core})
    worker.connect([worker])
    master = Master(graph, [worker])
    core_losses = []
    for batch in sft_batches():
        master.put_batch(batch)
        core_losses.append(master.step(batch.n_seqs)["sft_train"]["loss"])
    worker.close()
    assert core_losses == pytest.approx(lite_losses, rel=1e-6)
    assert max_gap(snapshot(core), snapshot(lite)) < 1e-6
    lite.destroy()
    core.destroy()


def realloc_graph(ema: float, actor_workers=(0,), ref_workers=(0,), n_workers=1):
    """actor trains (SFT); then the reference, its weights first moved from the actor, computes
    logp."""
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
            hooks=(ParamRealloc(actor, ema=ema),),
        ),
    ]
    allocs = [
        Allocation(actor, actor_workers, dp=len(actor_workers)),
        Allocation(ref, ref_workers, dp=len(ref_workers)),
    ]
    return build_graph("realloc", mfcs, SFT_KEYS, allocs, n_workers)


@pytest.mark.parametrize("ema", [0.0, 0.5])
def test_reallocation_hook_moves_the_trained_actor_into_the_reference(tiny_model_dir, ema):
    mesh = init_distributed("gloo").mesh
    actor = SFTEngine(
        TrainEngineConfig(path=tiny_model_dir, optimizer=OptimizerConfig(lr=1e-2, eps=1.0)), mesh
    )
    ref = FSDPEngine(
        TrainEngineConfig(path=tiny_model_dir, init_from_scratch=True, init_seed=7), mesh
    )
    actor.initialize(None)
    ref.initialize(None)
    ref_before = snapshot(ref)
    worker = InProcessWorker(0, {ModelName("actor"): actor, ModelName("ref"): ref})
    worker.connect([worker])
    master = Master(realloc_graph(ema), [worker])
    batch = sft_batches()[0]
    master.put_batch(batch)
    master.step(batch.n_seqs)
    worker.close()
    trained, moved = snapshot(actor), snapshot(ref)
    assert max_gap(trained, snapshot_of_start(tiny_model_dir, mesh)) > 1e-4  # the actor did train
    want = {k: ema * ref_before[k] + (1 - ema) * trained[k] for k in moved}
    assert max_gap(moved, want) < 1e-6
    if ema == 0.0:  # the target's logprobs are the source's
        gap = (
            (ref.compute_logp(batch)[0]["logp"] - actor.compute_logp(batch)[0]["logp"]).abs().max()
        )
        assert gap < 1e-5
    assert worker._published == {}  # the shards are dropped after their last reader
    actor.destroy()
    ref.destroy()


def snapshot_of_start(path: str, mesh) -> dict[str, torch.Tensor]:
    engine = FSDPEngine(TrainEngineConfig(path=path), mesh)
    engine.initialize(None)
    out = snapshot(engine)
    engine.destroy()
    return out
