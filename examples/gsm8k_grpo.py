"""RL with verifiable rewards (GRPO and every ``actor.algorithm`` preset), top to bottom.

Run: ``areal launch local examples/gsm8k_grpo.py --config examples/gsm8k_grpo.yaml``
(``examples/arithmetic_grpo.yaml`` is the CPU demo; ``examples/arithmetic_ppo.yaml`` adds a
critic). The launcher starts the generation servers and passes their addresses.

One step: rollout (``rollout_batch`` when ``rollout.max_staleness=0``, else ``prepare_batch``,
which keeps rollouts in flight across steps) -> proximal logp (decoupled PPO) -> reference logp
(KL) -> values (critic) -> advantages -> PPO update -> pause, weight update, version bump,
resume -> save -> eval -> recover checkpoint -> stats.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys

import torch

from areal.algo.logprob import packed_token_logprobs
from areal.api.config import GRPOConfig, load_config
from areal.api.io import FinetuneSpec, WeightUpdateMeta
from areal.rollout.executor import WorkflowExecutor
from areal.engine.fsdp import FSDPEngine
from areal.engine.ppo import PPOActor, PPOCritic
from areal.rollout.remote import RemoteInferenceEngine
from areal.rollout.trajectory import groups_to_batch
from areal.runtime.run import init_run
from areal.utils.network import free_port
from areal.reward.code import code_reward
from areal.reward.math import math_reward
from areal.reward.runner import RewardRunner
from areal.workflow.filters import DynamicSamplingFilter
from areal.workflow.rlvr import RLVRWorkflow

CONFIG = GRPOConfig


def push_weights(cfg, run, actor, rollout, executor, version: int, dist_meta: WeightUpdateMeta | None) -> None:
    """Pause rollouts, hand ``actor``'s weights to every server as ``version``, resume."""
    executor.pause()
    if cfg.weight_update_mode == "disk":
        path = run.run_dir / "weights" / f"v{version}"
        meta = WeightUpdateMeta("disk", path=str(path), version=version)
        actor.update_weights(meta)  # collective: writes the HF dir
        if run.rank == 0:
            rollout.update_weights(meta)
            shutil.rmtree(path.parent / f"v{version - 2}", ignore_errors=True)  # keep two
    else:
        meta = dataclasses.replace(dist_meta, version=version)
        future = rollout.update_weights_async(meta, actor.weight_announcement()) if run.rank == 0 else None
        actor.update_weights(meta)  # collective: broadcast in buckets from rank 0
        if future is not None:
            future.result(cfg.rollout.weight_update_timeout + 10)
    run.barrier()
    actor.set_version(version)
    rollout.set_version(version)
    executor.resume()


def evaluate(executor, valid_loader, workflow, run) -> None:
    """Record held-out accuracy (mean reward of ``eval_gconfig`` samples); not staleness-bound."""
    with run.tracker.timer("eval"):
        for items in valid_loader:
            for group in executor.rollout_batch(items, workflow):
                run.tracker.mean("eval/accuracy", torch.tensor([t.reward for t in group]))


def setup_rollout(cfg: GRPOConfig, run):
    """Client to the servers (started by the launcher), reward workers, workflows, executor."""
    rollout = RemoteInferenceEngine(cfg.rollout)
    rollout.initialize()
    reward = RewardRunner(math_reward if cfg.reward_fn == "math" else code_reward, cfg.reward)
    workflow = RLVRWorkflow(reward, cfg.gconfig, run.tokenizer, cfg.workflow, run.run_dir / "rollouts",
                            greedy_baseline=cfg.actor.remax_baseline)
    eval_workflow = RLVRWorkflow(reward, cfg.eval_gconfig, run.tokenizer)
    per_rank_batch = cfg.train_dataset.batch_size // run.world_size
    executor = WorkflowExecutor(cfg.rollout, rollout, consumer_batch_size=per_rank_batch)
    executor.initialize()
    return rollout, reward, workflow, eval_workflow, executor


def setup_trainers(cfg: GRPOConfig, run, rollout, ft_spec: FinetuneSpec):
    """Actor, optional critic and reference (FSDP2 over the trainer ranks); weight-sync group."""
    actor = PPOActor(cfg.actor, max_new_tokens=cfg.gconfig.max_new_tokens)
    actor.initialize(ft_spec)
    critic = PPOCritic(cfg.critic) if cfg.actor.use_critic else None
    if critic is not None:
        critic.initialize(ft_spec)
    ref = FSDPEngine(cfg.ref) if cfg.ref is not None and cfg.actor.kl_ctl > 0 else None
    if ref is not None:
        ref.initialize(None)
    dist_meta = None
    if cfg.weight_update_mode == "distributed":
        dist_meta = WeightUpdateMeta("distributed", master_port=free_port() if run.rank == 0 else 0)
        future = rollout.init_weights_update_group_async(dist_meta) if run.rank == 0 else None
        actor.init_weight_update_group(dist_meta, rollout.weight_group_size)
        if future is not None:
            future.result(cfg.rollout.setup_timeout)
    return actor, critic, ref, dist_meta


def train_step(cfg: GRPOConfig, run, actor, critic, ref, batch) -> None:
    """Proximal logp -> reference logp -> values -> advantages -> PPO update (actor, critic)."""
    run.tracker.mean("reward/mean", batch["rewards"])
    run.tracker.sum("perf/n_tokens", batch.n_tokens)
    run.tracker.sum("perf/n_trained_tokens", batch["loss_mask"].sum())
    with run.tracker.timer("prox_logp"):
        prox_logp = actor.compute_logp(batch)  # [T] current weights, before the update
        run.tracker.mean("rollout/logp_mismatch", (prox_logp - batch["logprobs"]).abs(), batch["loss_mask"])
        if cfg.actor.use_decoupled_loss:
            batch = batch.with_fields(tokens={"prox_logp": prox_logp})
    if ref is not None:
        with run.tracker.timer("ref_logp"):
            hook = lambda logits, mb: packed_token_logprobs(  # noqa: E731
                logits, mb["input_ids"], mb.cu_seqlens, cfg.actor.temperature, cfg.actor.logprob_chunk_size)[0]
            batch = batch.with_fields(tokens={"ref_logp": ref.forward(batch, hook)})
    if critic is not None:
        with run.tracker.timer("values"):
            batch = batch.with_fields(tokens={"values": critic.compute_values(batch)})
    with run.tracker.timer("advantages"):
        batch = actor.compute_advantages(batch)
    with run.tracker.timer("train"), run.tracker.scope("loss"):  # means over PPO minibatches
        for stats in actor.ppo_update(batch):
            run.tracker.scalars(**stats)
        actor.step_lr_scheduler()
        if critic is not None:
            with run.tracker.scope("critic"):
                for stats in critic.ppo_update(batch, cfg.actor.group_size):
                    run.tracker.scalars(**stats)
            critic.step_lr_scheduler()


def main(argv: list[str]) -> int:
    cfg = load_config(GRPOConfig, argv)
    run = init_run(cfg, cfg.actor.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    rollout, reward, workflow, eval_workflow, executor = setup_rollout(cfg, run)
    actor, critic, ref, dist_meta = setup_trainers(cfg, run, rollout, data.ft_spec)
    engines = {"actor": actor, **({"critic": critic} if critic is not None else {})}

    step, state = 0, run.load_recover(engines)
    if state is not None:  # servers get the checkpoint's weights and version
        step = state["step"]
        loader.load_state_dict(state["dataloader"])
        executor.load_state_dict(state["executor"])
        push_weights(cfg, run, actor, rollout, executor, state["version"], dist_meta)
    elif valid_loader is not None:  # step 0: the starting model's held-out accuracy
        evaluate(executor, valid_loader, eval_workflow, run)
        run.commit(0, n_steps, run.tracker.export())
    sync = cfg.rollout.max_staleness == 0
    # DAPO dynamic sampling (training rollouts only, never eval); stops after an epoch of rejects
    accept = DynamicSamplingFilter(data.n_train) if cfg.actor.dynamic_sampling else None
    batches = run.batches(loader, n_steps, step) if sync else None  # sync: we feed rollout_batch
    while step < n_steps:
        with run.tracker.timer("rollout"):
            if sync:
                step, epoch_done, items = next(batches)
                groups = executor.rollout_batch(items, workflow, accept)
            else:  # async: the executor pulls from the loader, rollouts stay in flight
                step, epoch_done = step + 1, (step + 1) % len(loader) == 0
                groups = executor.prepare_batch(loader, workflow, accept)
            batch = groups_to_batch(groups)
        run.log_trained(step, [g[0].group_id for g in groups])
        stats = {**executor.last_batch_stats, **reward.commit_batch(), **rollout.stats()}
        train_step(cfg, run, actor, critic, ref, batch)
        with run.tracker.timer("update_weights"):
            push_weights(cfg, run, actor, rollout, executor, step, dist_meta)
        if run.saver.check(step, epoch_done) or step == n_steps:
            run.export_hf(actor, step)
        if valid_loader is not None and (run.evaluator.check(step, epoch_done) or step == n_steps):
            evaluate(executor, valid_loader, eval_workflow, run)
        if run.recover_timer.check(step, epoch_done):
            state = {"dataloader": loader.state_dict(), "executor": executor.state_dict(), "version": step}
            run.save_recover(step, engines, state)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    run.close()
    executor.destroy()
    rollout.destroy()
    reward.close()
    for engine in (actor, critic, ref):
        if engine is not None:
            engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
