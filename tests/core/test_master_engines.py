"""Tier 2: one graph, run two ways on real engines (tiny model, one rank): ``run_step`` in this
process (Lite's scripts and ``areal replay``) and the master over an in-process worker (Core)
give the same weights and the same stats under the same names, for the PPO graph (actor with
the decoupled loss and 2 minibatches: a proximal-logp pass; reference, KL in the reward;
critic) and the SFT graph; and the master's reallocation hooks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName, ParamRealloc
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.worker import InProcessWorker
from areal.engine.fsdp import FSDPEngine
from areal.engine.ppo import PPOActor, PPOCritic
from areal.engine.sft import SFTEngine
from areal.runtime.dist import init_distributed
from areal.runtime.graphs import (
    ACTOR,
    CRITIC,
    MODEL,
    REF,
    ROLLOUT_KEYS,
    SFT_KEYS,
    ppo_mfcs,
    sft_mfcs,
)
from areal.runtime.step import run_step, step_stats
from areal.utils.batch import PackedBatch
from areal.utils.stats import StatsTracker

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


def in_process_step(engines: dict, graph: list[MFC], batch: PackedBatch):
    """run_step over ``graph`` on ``engines`` in this process: (the stats it logs, by Lite's
    names, and the batch out)."""
    tracker = StatsTracker()
    out = run_step(graph, engines, batch, tracker)
    return tracker.export(), out


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


LOSS_KEYS = ("loss/loss", "loss/grad_norm", "loss/critic/loss", "loss/critic/grad_norm")
TIMERS = {f"timing/{t}" for t in ("prox_logp", "ref_logp", "values", "advantages", "train")}


def test_run_step_equals_the_master_over_an_in_process_worker_on_the_ppo_graph(tiny_model_dir):
    batch, graph = rollout_batch(), ppo_mfcs(True, True, True)
    here = dict(zip((ACTOR, CRITIC, REF), ppo_engines(tiny_model_dir)))
    assert here[ACTOR].needs_prox_pass  # the graph's actor_logp node runs
    logged, _ = in_process_step(here, graph, batch)
    assert TIMERS <= set(logged)  # each MFC in its timer, as the Lite script logs them

    engines = dict(zip((ACTOR, CRITIC, REF), ppo_engines(tiny_model_dir)))
    worker = InProcessWorker(0, engines)
    worker.connect([worker])
    allocs = [Allocation(m, (0,)) for m in (ACTOR, CRITIC, REF)]
    dfg = build_graph("async_ppo", graph, ROLLOUT_KEYS, allocs, 1)  # the same MFCs, placed
    master = Master(dfg, [worker], group_size=GROUP)
    master.put_batch(batch)
    out = master.step(batch.n_seqs)
    worker.close()

    # Not bitwise: the worker computes on its own thread, whose OpenMP reductions may sum in
    # another order (seen: 7e-9 on the weights).
    assert max_gap(snapshot(engines[ACTOR]), snapshot(here[ACTOR])) < 1e-6
    assert max_gap(snapshot(engines[CRITIC]), snapshot(here[CRITIC])) < 1e-6
    core = step_stats(dfg.mfcs, out)  # the master's stats under the names run_step logs
    for key in LOSS_KEYS:
        assert core[key] == pytest.approx(logged[key], rel=1e-5, abs=1e-7), key
    assert out["actor_train"]["n_tokens"] == batch.n_tokens
    assert worker._store == {} and len(master.buffer) == 0  # everything released after the step

    # Each MFC given only its keys, on a thread of its own: what a worker does, bit for bit
    # (Core's replay).
    alike = dict(zip((ACTOR, CRITIC, REF), ppo_engines(tiny_model_dir)))
    with ThreadPoolExecutor(1) as thread:
        args = (graph, alike, batch, StatsTracker(), True)
        thread.submit(run_step, *args).result()
    assert max_gap(snapshot(alike[ACTOR]), snapshot(engines[ACTOR])) == 0.0
    assert max_gap(snapshot(alike[CRITIC]), snapshot(engines[CRITIC])) == 0.0
    for e in (*engines.values(), *here.values(), *alike.values()):
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


def test_run_step_equals_the_master_over_an_in_process_worker_on_the_sft_graph(tiny_model_dir):
    mesh = init_distributed("gloo").mesh
    cfg = TrainEngineConfig(path=tiny_model_dir, optimizer=OptimizerConfig(lr=1e-2, eps=1.0))
    here, core = SFTEngine(cfg, mesh), SFTEngine(cfg, mesh)
    here.initialize(None)
    core.initialize(None)
    graph = sft_mfcs()
    logged = [in_process_step({MODEL: here}, graph, b)[0]["loss/loss"] for b in sft_batches()]

    dfg = build_graph("sft", graph, SFT_KEYS, [Allocation(MODEL, (0,))], 1)
    worker = InProcessWorker(0, {MODEL: core})
    worker.connect([worker])
    master = Master(dfg, [worker])
    core_losses = []
    for batch in sft_batches():
        master.put_batch(batch)
        core_losses.append(step_stats(dfg.mfcs, master.step(batch.n_seqs))["loss/loss"])
    worker.close()
    assert core_losses == pytest.approx(logged, rel=1e-6)
    assert max_gap(snapshot(core), snapshot(here)) < 1e-6
    here.destroy()
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
