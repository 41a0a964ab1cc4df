"""RL with verifiable rewards (GRPO and every ``actor.algorithm`` preset), top to bottom.

Run: ``areal launch local examples/gsm8k_grpo.py --config examples/gsm8k_grpo.yaml``
(``examples/arithmetic_grpo.yaml`` is the CPU demo; ``examples/arithmetic_ppo.yaml`` adds a
critic). The launcher starts the generation servers; they register in the trial's registry,
where this script finds them.

One step: rollout (``prepare_batch`` keeps rollouts in flight across steps, at most
``rollout.max_staleness`` versions behind; 0 = on-policy) -> proximal logp (decoupled PPO) ->
reference logp (KL) -> values (critic) -> advantages (plus the teacher's reverse KL when
distilling) -> PPO update -> weight update (pause, push,
version bump, resume) -> save -> eval -> recover checkpoint -> stats.
"""

from __future__ import annotations

import sys

from areal.api.config import GRPOConfig, load_config
from areal.api.io import FinetuneSpec
from areal.engine.fsdp import FSDPEngine
from areal.engine.lora import FrozenBase
from areal.engine.ppo import PPOActor, PPOCritic
from areal.rollout.trajectory import groups_to_batch
from areal.runtime.graphs import ACTOR, CRITIC, REF, ppo_mfcs
from areal.runtime.publisher import WeightPublisher
from areal.runtime.rl import setup_rollout
from areal.runtime.run import init_run
from areal.runtime.step import run_step
from areal.workflow.filters import DynamicSamplingFilter

CONFIG = GRPOConfig


def setup_trainers(cfg: GRPOConfig, run, ft_spec: FinetuneSpec):
    """Actor, optional critic and reference, each sharded over the trainer ranks' mesh. The
    group size and the logprob temperature are the rollout's (``gconfig``). A LoRA actor with
    a KL term and no ``ref`` uses its own frozen base (adapters off) as the reference."""
    g, mesh = cfg.gconfig, run.dist.mesh
    actor = PPOActor(
        cfg.actor,
        mesh,
        temperature=g.temperature,
        group_size=g.n_samples,
        max_new_tokens=g.max_new_tokens,
        distill=cfg.distill,
    )
    actor.initialize(ft_spec)
    critic = PPOCritic(cfg.critic, mesh, group_size=g.n_samples) if cfg.actor.use_critic else None
    if critic is not None:
        critic.initialize(ft_spec)
    ref = (
        FSDPEngine(cfg.ref, mesh, temperature=g.temperature)
        if cfg.ref is not None and cfg.actor.kl_ctl > 0
        else None
    )
    if ref is not None:
        ref.initialize(None)
    elif cfg.actor.lora.enabled and cfg.actor.kl_ctl > 0:  # no `ref`: the actor's frozen base is it
        ref = FrozenBase(actor)
    return actor, critic, ref


def train_step(cfg: GRPOConfig, run, actor, critic, ref, batch):
    """The PPO graph (``ppo_mfcs``, areal/runtime/graphs.py): proximal logp -> reference logp ->
    values -> advantages (+ the teacher's reverse KL when distilling) -> PPO update of the actor
    (+ each token's trainer logp), then of the critic, each update followed by its LR step;
    returns the batch with the fields the update used (advantages, ...)."""
    run.tracker.mean("reward/mean", batch["rewards"])
    run.tracker.sum("perf/n_tokens", batch.n_tokens)
    run.tracker.sum("perf/n_trained_tokens", batch["loss_mask"].sum())
    graph = ppo_mfcs(
        use_critic=critic is not None,
        use_ref=ref is not None,
        prox_logp=actor.needs_prox_pass,  # else the update's own forward gives them
    )
    engines = {m: e for m, e in ((ACTOR, actor), (CRITIC, critic), (REF, ref)) if e is not None}
    return run_step(graph, engines, batch, run.tracker)  # each MFC timed, its stats scoped


def main(argv: list[str]) -> int:
    cfg = load_config(GRPOConfig, argv)
    run = init_run(cfg, cfg.actor.path)
    data = run.load_data()
    loader, valid_loader, n_steps = data.loader, data.valid_loader, data.n_steps
    side = setup_rollout(cfg, run)  # rollout client, reward workers, workflows, executor
    executor = side.executor
    actor, critic, ref = setup_trainers(cfg, run, data.ft_spec)
    engines = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    publisher = WeightPublisher(
        cfg.weight_update_mode,
        actor,
        side.rollout,
        executor,
        run.dist,
        cfg.weights_dir,
        colocated=run.env.colocated,
    )
    publisher.connect()

    # a resume gives the servers the checkpoint's weights and version
    start = run.resume(engines, loader=loader, executor=executor, weights=publisher)
    if start == 0 and valid_loader is not None:  # the starting model's held-out accuracy
        side.evaluate(valid_loader, run)
        run.commit(0, n_steps, run.tracker.export())
    # DAPO dynamic sampling (training rollouts only, never eval); stops after an epoch of rejects
    accept = DynamicSamplingFilter(data.n_train) if cfg.actor.dynamic_sampling else None
    for step, epoch_done in run.steps(start, n_steps, len(loader)):
        with run.tracker.timer("rollout"):  # the executor pulls items from the loader
            groups = executor.prepare_batch(loader, side.workflow, accept)
            batch = groups_to_batch(groups)
        run.log_trained(step, [g[0].group_id for g in groups])
        stats = side.batch_stats()  # executor, reward workers, client (and agent) counters
        publisher.yield_device()  # colocated servers give the GPU to the train step
        with run.replay.step(step, batch, actor):  # inputs and weight hashes for `areal replay`
            batch = train_step(cfg, run, actor, critic, ref, batch)
        with run.tracker.timer("record_samples"):  # for `areal view`
            run.samples.record(step, groups, batch, actor.get_version())
        with run.tracker.timer("update_weights"):
            publisher.publish()
        if run.saver.check(step, epoch_done):  # and at the last step (Run.steps)
            run.export_hf(actor, step)
        if valid_loader is not None and run.evaluator.check(step, epoch_done):
            side.evaluate(valid_loader, run)
        if run.recover_timer.check(step, epoch_done):
            run.checkpoint(step)
        run.commit(step, n_steps, {**stats, **run.tracker.export()})
    publisher.close()  # the weight dirs of disk updates: the last export holds the weights
    side.close()
    for engine in (actor, critic, ref):
        if engine is not None:
            engine.destroy()
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
