"""Core's entry configs: the ``core`` section (where the model workers run and which models each
hosts), the sync PPO config (``areal core sync-ppo``) and the async PPO config (``areal core
async-ppo``); ``areal core sft``'s is beside its script."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config import GRPOConfig
from areal.api.config.loader import param
from areal.core.graphs import (
    CoreGraphConfig,
    MFCLayoutConfig,
    ModelAllocationConfig,
    allocations_for,
    graph_mfcs,
    pipeline_problems,
    with_layouts,
)


@dataclass(frozen=True)
class CoreWorkersConfig:
    """Where Core's model workers run."""

    backend: Literal["in_process", "ray"] = param(
        "in_process", help="in_process: one worker in this process; ray: n_workers Ray actors."
    )
    n_workers: int = param(1, ge=1, help="Model workers (ray); in_process has exactly one.")
    allocations: list[ModelAllocationConfig] = param(
        factory=list,
        help="Which model workers host each model, and its mesh (docs/core.md); "
        "empty = every model on every worker, dp = n_workers.",
    )
    layouts: list[MFCLayoutConfig] = param(
        factory=list,
        help="sync-ppo/async-ppo: another layout for an MFC of a trained model, e.g. "
        "{mfc: actor_logp, dp: 4} (docs/core.md); empty = every MFC on its model's allocation.",
    )
    ray_address: str = param(
        "",
        help="Ray cluster address (host:port); empty = RAY_ADDRESS, else a "
        "local instance on 127.0.0.1 sized for the workers.",
    )
    cpus_per_worker: float = param(1.0, gt=0, help="Ray CPUs reserved per worker actor.")
    torch_threads: int = param(1, ge=1, help="torch intra-op threads per worker actor.")
    mfc_timeout: float = param(
        600.0,
        gt=0,
        help="Seconds an MFC (generation included) may run before "
        "the step stops naming it and its workers.",
    )
    gpus_per_worker: int = param(
        0,
        ge=0,
        le=1,
        help="GPUs per worker actor (ray): 0 = CPU and gloo; "
        "1 = one GPU each, placed by Ray, NCCL.",
    )
    n_rollout_workers: int = param(
        2,
        ge=1,
        help="Async PPO: rollout worker actors (each runs the "
        "workflow against the generation servers).",
    )
    rollout_worker_restarts: int = param(
        3,
        ge=0,
        help="Async PPO: times Ray restarts a rollout worker "
        "that died (its slots are reclaimed and its work redone).",
    )
    manager_restarts: int = param(
        3,
        ge=0,
        help="Async PPO: times Ray restarts the generation manager "
        "that died or hung (it rebuilds its state from its record in the run dir).",
    )
    health_timeout: float = param(
        60.0,
        gt=0,
        help="Async PPO: seconds a model worker, rollout worker or the manager may leave the "
        "master's probe unanswered before it is named hung and killed (rollout workers and the "
        "manager are restarted; a model worker's loss stops the run).",
    )

    def check(self) -> Iterator[str]:
        if self.backend == "in_process" and self.n_workers != 1:
            yield (
                f"n_workers: in_process has one worker, got {self.n_workers}; set backend=ray "
                "for more"
            )
        if self.backend == "in_process" and self.allocations:
            yield (
                "allocations: in_process hosts every model on its one worker; set backend=ray to "
                "allocate"
            )
        if self.backend == "in_process" and self.layouts:
            yield (
                "layouts: in_process hosts every model on its one worker; set backend=ray for "
                "layouts"
            )


PPOGraph = Literal["sync_ppo", "async_ppo"]


def uses_ref(cfg: GRPOConfig) -> bool:
    """A reference model runs when it is configured and the KL term is on (as in Lite)."""
    return cfg.ref is not None and cfg.actor.kl_ctl > 0


def graph_config(cfg: GRPOConfig, core: CoreWorkersConfig, graph: PPOGraph) -> CoreGraphConfig:
    """The :class:`CoreGraphConfig` a PPO entry config runs (``graph``: sync_ppo or async_ppo)."""
    return CoreGraphConfig(
        graph=graph,
        n_workers=core.n_workers,
        use_critic=cfg.actor.use_critic,
        use_ref=uses_ref(cfg),
        prox_logp=cfg.actor.needs_prox_pass,
        use_teacher=cfg.distill.enabled,
        allocations=core.allocations,
        layouts=core.layouts,
    )


def layout_problems(cfg: GRPOConfig, core: CoreWorkersConfig, graph: PPOGraph) -> Iterator[str]:
    """``core.layouts`` problems against the graph the config runs, and pp sizes its models'
    layer counts cannot take, each naming its ``core.`` field."""
    if core.backend != "ray" or not (core.layouts or core.allocations):
        return
    g = graph_config(cfg, core, graph)
    try:
        mfcs = graph_mfcs(g)[0]
        problems = with_layouts(g, mfcs, allocations_for(g, mfcs))[2]
    except ValueError:  # a bad model name, reported by its allocation's own check
        return
    paths = {"actor": ("actor.path", cfg.actor.path)}
    if cfg.actor.use_critic and cfg.critic is not None:
        paths["critic"] = ("critic.path", cfg.critic.path)
    if cfg.ref is not None:
        paths["ref"] = ("ref.path", cfg.ref.path)
    for p in [*problems, *pipeline_problems(g, paths.get)]:
        yield f"core.{p}"


def one_master(cluster) -> Iterator[str]:
    """Core's master is one process: the trainer launch of one rank on one node."""
    if cluster.trainer_nprocs != 1 or cluster.n_nodes != 1:
        yield (
            f"cluster.trainer_nprocs: the Core master is one process (got trainer_nprocs="
            f"{cluster.trainer_nprocs}, n_nodes={cluster.n_nodes}); set both to 1 and size the "
            "workers with core.n_workers (and core.n_rollout_workers)"
        )


@dataclass(frozen=True)
class CoreGRPOConfig(GRPOConfig):
    """Sync PPO / GRPO through Core's master (areal core sync-ppo)."""

    core: CoreWorkersConfig = param(
        factory=CoreWorkersConfig, help="Core: where the model workers run."
    )

    def distill_problems(self, scored_by: str = "teacher") -> Iterator[str]:
        """Core scores with a teacher node (see :meth:`GRPOConfig.distill_problems`)."""
        return super().distill_problems(scored_by)

    def check(self) -> Iterator[str]:
        yield from super().check()
        if self.rollout.max_staleness != 0:
            yield (
                f"rollout.max_staleness: {self.rollout.max_staleness}; sync PPO generates every "
                "batch with the current weights, set rollout.max_staleness=0"
            )
        if self.stats_logger.replay.enabled:
            yield (
                "stats_logger.replay.enabled: true; areal replay replays Lite runs and Core async "
                "PPO, not Core sync PPO: set stats_logger.replay.enabled=false"
            )
        yield from one_master(self.cluster)
        yield from layout_problems(self, self.core, "sync_ppo")


@dataclass(frozen=True)
class CoreAsyncGRPOConfig(GRPOConfig):
    """Async PPO / GRPO through Core: rollout workers and the generation manager on Ray feed the
    master's graph (areal core async-ppo)."""

    core: CoreWorkersConfig = param(
        factory=lambda: CoreWorkersConfig(backend="ray", n_workers=2),
        help="Core: model workers, rollout workers.",
    )

    def distill_problems(self, scored_by: str = "teacher") -> Iterator[str]:
        """Core scores with a teacher node (see :meth:`GRPOConfig.distill_problems`)."""
        return super().distill_problems(scored_by)

    def check(self) -> Iterator[str]:
        yield from super().check()
        if self.core.backend != "ray":
            yield (
                f"core.backend: {self.core.backend!r}; async PPO runs its rollout workers and "
                "manager as Ray actors, set core.backend=ray"
            )
        yield from one_master(self.cluster)
        yield from layout_problems(self, self.core, "async_ppo")
