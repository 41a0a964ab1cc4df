"""Tier 2 on a real local Ray head: model workers as Ray actors (2 processes, gloo).

The PPO graph with actor + reference + critic on a dp=2 mesh over 2 Ray workers (the master)
equals ``run_step`` of the same graph on the whole batch in one process, Lite's step (weights and
stats under the same names, 1e-5): the engines' gradient
accumulation makes the step independent of the split, so this checks the master, the workers'
peer-to-peer fields and the sub-meshes, not a coincidence of layouts. One PPO minibatch: with
several, each rank cuts its own share into minibatches, so their composition (and the update)
depends on the number of ranks, in Lite as in Core. KL in the reward still needs the proximal
pass, so every node of the graph runs."""

from __future__ import annotations

import pytest
from test_master_engines import (
    GROUP,
    LOSS_KEYS,
    in_process_step,
    max_gap,
    rollout_batch,
    snapshot,
)

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.ray_worker import EngineSpec, RayModel, build_engine, start_ray_workers
from areal.runtime.dist import init_distributed
from areal.runtime.graphs import ACTOR, CRITIC, REF, ROLLOUT_KEYS, SFT_KEYS, ppo_mfcs
from areal.runtime.step import step_stats
from areal.utils.batch import PackedBatch

pytestmark = pytest.mark.slow


def specs(path: str) -> dict:
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    mb = MicroBatchSpec(max_tokens_per_mb=40, granularity=GROUP)
    actor = PPOActorConfig(
        path=path, algorithm="ppo", kl_ctl=0.1, use_decoupled_loss=True, mb_spec=mb, optimizer=opt
    )
    return {
        ACTOR: EngineSpec("ppo_actor", actor, group_size=GROUP, max_new_tokens=8),
        CRITIC: EngineSpec(
            "ppo_critic", PPOCriticConfig(path=path, mb_spec=mb, optimizer=opt), group_size=GROUP
        ),
        REF: EngineSpec("lm", TrainEngineConfig(path=path, mb_spec=mb)),
    }


@pytest.fixture(scope="module")
def ray_driver(ray_head):
    import ray

    ray.init(address=ray_head.address, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def lite_step(tiny_model_dir):
    """The PPO graph's ``run_step`` on the whole batch in this process, Lite's step: (batch, the
    stats it logs, by Lite's names, weights)."""
    batch = rollout_batch(n_groups=4)
    mesh = init_distributed("gloo").mesh
    lite = {m: build_engine(s, mesh) for m, s in specs(tiny_model_dir).items()}
    assert lite[ACTOR].needs_prox_pass
    logged, _ = in_process_step(lite, ppo_mfcs(True, True, True), batch)
    weights = {m: snapshot(lite[m]) for m in (ACTOR, CRITIC)}
    for e in lite.values():
        e.destroy()
    return batch, logged, weights


def core_step(ray, path: str, allocs: list[Allocation], batch):
    """One master step over the allocation's Ray workers: (stats, full weights of actor and
    critic)."""
    n_workers = 1 + max(w for a in allocs for w in a.workers)
    graph = build_graph("async_ppo", ppo_mfcs(True, True, True), ROLLOUT_KEYS, allocs, n_workers)
    workers = start_ray_workers(graph, specs(path))
    try:
        master = Master(graph, workers, group_size=GROUP, mfc_timeout=300)
        master.put_batch(batch)
        before = ray.get([w.handle.collective_counts.remote() for w in workers], timeout=60)
        stats = master.step(batch.n_seqs)
        after = ray.get([w.handle.collective_counts.remote() for w in workers], timeout=60)
        for w, (was, now) in enumerate(zip(before, after)):  # no collective crossed a sub-mesh
            meshes = [set(a.workers) for a in allocs if w in a.workers]
            used = [ranks for ranks, n in now.items() if n != was.get(ranks, 0)]
            assert used, f"worker {w} ran no collective"
            crossing = [r for r in used if not any(set(r) <= m for m in meshes)]
            assert not crossing, (
                f"worker {w}'s collectives spanned {crossing}, beyond its models' meshes {meshes}"
            )
        got = {  # collective over the model's ranks, in order with the MFCs
            m: RayModel(workers, m, graph.allocations[m].workers).full_state_dict()
            for m in (ACTOR, CRITIC)
        }
        for w in workers:  # every field released after its last reader: sample 0 is gone
            with pytest.raises(ray.exceptions.RayTaskError, match="holds no"):
                ray.get(w.handle.get.remote((0,), ("input_ids",)), timeout=60)
    finally:
        for w in workers:
            w.close()
    return stats, got


def check_equal(stats, got, lite) -> None:
    batch, logged, weights = lite
    for m in (ACTOR, CRITIC):
        assert max_gap(got[m], weights[m]) < 1e-5
    named = step_stats(ppo_mfcs(True, True, True), stats)  # the master's, by run_step's names
    for key in LOSS_KEYS:
        assert named[key] == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key
    assert stats["actor_train"]["n_tokens"] == batch.n_tokens


def test_the_master_on_two_ray_workers_equals_run_step_on_the_ppo_graph(
    ray_driver, tiny_model_dir, lite_step
):
    allocs = [Allocation(m, (0, 1), dp=2) for m in (ACTOR, CRITIC, REF)]
    check_equal(*core_step(ray_driver, tiny_model_dir, allocs, lite_step[0]), lite_step)


@pytest.mark.parametrize(
    "allocs",
    [
        [Allocation(ACTOR, (0, 1), dp=2), Allocation(REF, (0,)), Allocation(CRITIC, (1,))],
        [Allocation(ACTOR, (0, 1), dp=2), Allocation(REF, (2,)), Allocation(CRITIC, (3,))],
    ],
    ids=["2-workers", "4-workers"],
)
def test_models_on_disjoint_sub_meshes_run_at_once_without_crossing(
    ray_driver, tiny_model_dir, lite_step, allocs
):
    # ref alone on one worker and critic alone on another run their calls at the same time; a
    # collective of either on a group wider than its own sub-mesh would pair with the other's
    # different call (or wait for a worker that makes none) and hang or corrupt, and the result
    # would not equal Lite's. core_step also checks each worker's process groups: the only ones
    # whose collective count moved during the step lie inside the meshes of its own models.
    check_equal(*core_step(ray_driver, tiny_model_dir, allocs, lite_step[0]), lite_step)


def sft_on_two_workers(path: str):
    """(model, graph, workers): one SFT model on dp=2 over 2 fresh Ray workers."""
    model = ModelName("model")
    graph = build_graph(
        "sft",
        [MFC("sft_train", model, ModelFn.TRAIN_LM, SFT_KEYS)],
        SFT_KEYS,
        [Allocation(model, (0, 1), dp=2)],
        2,
    )
    workers = start_ray_workers(graph, {model: EngineSpec("sft", TrainEngineConfig(path=path))})
    return model, graph, workers


def test_a_dead_ray_worker_stops_the_step_naming_the_mfc_and_the_worker(ray_driver, tiny_model_dir):
    model, graph, workers = sft_on_two_workers(tiny_model_dir)
    try:
        master = Master(graph, workers, mfc_timeout=120)
        batch = {"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [0, 1]]}
        master.put_batch(PackedBatch.from_sequences(batch))
        ray_driver.kill(workers[1].handle, no_restart=True)
        with pytest.raises(
            RuntimeError,
            match=r"MFC 'sft_train' \(model@0.train_lm\) failed on worker 1: .*"
            r"(actor died|ActorDiedError|RayActorError)",
        ):
            master.step(2)
    finally:
        ray_driver.kill(workers[0].handle, no_restart=True)


def test_a_collective_one_rank_never_joins_times_out_naming_where_each_rank_waits(
    ray_driver, tiny_model_dir, monkeypatch
):
    from areal.core import ray_worker

    model, _, workers = sft_on_two_workers(tiny_model_dir)
    try:
        monkeypatch.setattr(ray_worker, "RPC_TIMEOUT", 3.0)
        with pytest.raises(TimeoutError) as hung:  # rank 0 gathers; rank 1 is never asked
            RayModel(workers, model, (0,)).full_state_dict()
        message = str(hung.value)
        assert message.startswith(f"{model}.full_state_dict on workers (0,): no answer")
        assert "worker 0 (no answer), model thread at:" in message
        assert "in full_state_dict" in message and "_full_tensor" in message, message
        monkeypatch.setattr(ray_worker, "RPC_TIMEOUT", 120.0)
        assert RayModel(workers, model, (1,)).full_state_dict() == {}  # joins: both finish
        assert "(no model thread" not in workers[0].model_thread_stack()
    finally:
        for w in workers:
            w.close()
