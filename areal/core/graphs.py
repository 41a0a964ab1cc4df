"""The graphs of Core's entry points, as data: sync PPO, async PPO and SFT.

Sync PPO (the reference, critic and proximal-logp nodes are optional)::

    actor_gen (rollout.generate; before it: the actor's weights pushed to the servers)
      -> {ref_logp (ref.compute_logp), critic_values (critic.compute_values),
          actor_logp (actor.compute_logp, out=prox_logp), teacher_logp (teacher.compute_logp)}
      -> actor_adv (actor.compute_advantages)
      -> {actor_train (actor.ppo_update, logp_out=trainer_logp), critic_train (critic.ppo_update)}

``actor_gen`` reads no keys: the generation worker hosting the ``rollout`` model (the Lite
rollout side over the generation servers) draws its prompts from the train dataset, as Lite's
executor does, and its groups become the step's samples. Its ``UpdateServers`` hook pushes the
actor's weights to the servers whenever the actor was trained since the last push. The
advantages are a node of their own (the Lite actor's ``compute_advantages``) because both
trainers read its outputs: the actor its ``advantages``, the critic its ``returns``. Async PPO is
the same graph without ``actor_gen``: its dataset is the rollout stream (the fields of
:func:`areal.rollout.trajectory.groups_to_batch`). SFT is one node, ``model.train_lm``.

Allocations: an empty list puts every model of the graph on every worker with ``dp =
n_workers`` (the graph's models then share workers, as Lite's engines share trainer ranks). The
``rollout`` model of sync PPO lives on one generation worker after the model workers (index
``n_workers``), so its graph has ``n_workers + 1`` workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from areal.api.config.loader import param
from areal.core.dfg import (
    MFC,
    Allocation,
    DataflowGraph,
    ModelFn,
    ModelName,
    UpdateServers,
    build_graph,
)

# What the rollout side hands over: the fields of groups_to_batch.
ROLLOUT_KEYS = (
    "input_ids",
    "loss_mask",
    "logprobs",
    "versions",
    "rewards",
    "no_eos",
    "group_index",
    "prompt_lens",
    "status_code",
)
SFT_KEYS = ("input_ids", "loss_mask")
# actor_train adds each token's logprob in the update's own forward (recorded for areal view)
LOGP_OUT = {"logp_out": "trainer_logp"}

ACTOR, CRITIC, REF = ModelName("actor"), ModelName("critic"), ModelName("ref")
TEACHER = ModelName("teacher")  # on-policy distillation's frozen teacher
ROLLOUT = ModelName("rollout")  # the generation servers, behind a generation worker


@dataclass(frozen=True)
class ModelAllocationConfig:
    """Which model workers host one model, and its mesh over them."""

    model: str = param("actor", help="Model name: ROLE or ROLE@REPLICA (actor, critic, ref, ...).")
    workers: list[int] = param(factory=list, help="Model-worker indices, dp-major; len = dp * tp.")
    dp: int = param(1, ge=1, help="Data-parallel size of this model's mesh.")
    tp: int = param(
        1, ge=1, help="Tensor-parallel size (Qwen2/Llama decoders); workers are dp-major."
    )

    def check(self) -> Iterator[str]:
        try:
            ModelName.parse(self.model)
        except ValueError as e:
            yield f"model: {e}"


@dataclass(frozen=True)
class CoreGraphConfig:
    """Which graph Core runs and where each model lives."""

    graph: Literal["sync_ppo", "async_ppo", "sft"] = param(
        "sync_ppo", help="The entry point's graph."
    )
    n_workers: int = param(1, ge=1, help="Number of model workers.")
    use_critic: bool = param(False, help="PPO: a critic (values node, critic train node).")
    use_ref: bool = param(False, help="PPO: a reference model (ref logp node, for a KL penalty).")
    prox_logp: bool = param(
        False,
        help="PPO: a proximal-logp node before the update (decoupled PPO with several "
        "minibatches or KL in the reward; see PPOActor.needs_prox_pass).",
    )
    use_teacher: bool = param(
        False,
        help="PPO: a teacher model's logp node (on-policy distillation, distill.teacher_path).",
    )
    allocations: list[ModelAllocationConfig] = param(
        factory=list,
        help="One entry per model; empty = every model on every worker, dp = n_workers.",
    )

    def check(self) -> Iterator[str]:
        if self.graph == "sft" and (
            self.use_critic or self.use_ref or self.prox_logp or self.use_teacher
        ):
            yield (
                "graph: sft has no critic, reference, teacher or proximal logp; unset "
                "use_critic/use_ref/use_teacher/prox_logp"
            )


def ppo_mfcs(
    use_critic: bool, use_ref: bool, prox_logp: bool, use_teacher: bool = False
) -> list[MFC]:
    """The PPO nodes after generation: logp, ref logp, teacher logp, values, advantages, trains."""
    base = ("input_ids", "loss_mask")
    mfcs: list[MFC] = []
    adv_in = [*base, "rewards", "no_eos", "logprobs"]
    train_in = [*base, "logprobs", "advantages"]
    if prox_logp:
        mfcs.append(
            MFC(
                "actor_logp",
                ACTOR,
                ModelFn.COMPUTE_LOGP,
                ("input_ids",),
                ("prox_logp",),
                {"out": "prox_logp"},
            )
        )
        adv_in.append("prox_logp")
        train_in.append("prox_logp")
    if use_ref:
        mfcs.append(
            MFC(
                "ref_logp",
                REF,
                ModelFn.COMPUTE_LOGP,
                ("input_ids",),
                ("ref_logp",),
                {"out": "ref_logp"},
            )
        )
        adv_in.append("ref_logp")
        train_in.append("ref_logp")
    if use_teacher:  # on-policy distillation: the teacher's logprobs of the student's tokens
        mfcs.append(
            MFC(
                "teacher_logp",
                TEACHER,
                ModelFn.COMPUTE_LOGP,
                ("input_ids",),
                ("teacher_logp",),
                {"out": "teacher_logp"},
            )
        )
        adv_in.append("teacher_logp")
    if use_critic:
        mfcs.append(
            MFC("critic_values", CRITIC, ModelFn.COMPUTE_VALUES, ("input_ids",), ("values",))
        )
        adv_in.append("values")
    mfcs.append(
        MFC(
            "actor_adv",
            ACTOR,
            ModelFn.COMPUTE_ADVANTAGES,
            tuple(adv_in),
            ("advantages", "returns", "token_rewards", "seq_rewards"),
        )
    )
    mfcs.append(
        MFC("actor_train", ACTOR, ModelFn.PPO_UPDATE, tuple(train_in), ("trainer_logp",), LOGP_OUT)
    )
    if use_critic:
        mfcs.append(MFC("critic_train", CRITIC, ModelFn.PPO_UPDATE, (*base, "values", "returns")))
    return mfcs


def generate_mfc() -> MFC:
    """The actor's rollouts: prompts from the train dataset, scored groups of trajectories
    (packed) out; the actor's newest weights go to the servers first."""
    return MFC(
        "actor_gen", ROLLOUT, ModelFn.GENERATE, (), ROLLOUT_KEYS, hooks=(UpdateServers(ACTOR),)
    )


def graph_mfcs(cfg: CoreGraphConfig) -> tuple[list[MFC], tuple[str, ...]]:
    """The MFCs of ``cfg.graph`` and its dataset keys."""
    if cfg.graph == "sft":
        return [MFC("sft_train", ModelName("model"), ModelFn.TRAIN_LM, SFT_KEYS)], SFT_KEYS
    ppo = ppo_mfcs(cfg.use_critic, cfg.use_ref, cfg.prox_logp, cfg.use_teacher)
    if cfg.graph == "async_ppo":
        return ppo, ROLLOUT_KEYS
    return [generate_mfc(), *ppo], ()


def allocations_for(cfg: CoreGraphConfig, mfcs: list[MFC]) -> list[Allocation]:
    """The configured allocations, or every model on every worker (dp = n_workers)."""
    given = [
        Allocation(ModelName.parse(a.model), tuple(a.workers), a.dp, a.tp) for a in cfg.allocations
    ]
    if not given:
        models = sorted({m.model for m in mfcs if m.fn is not ModelFn.GENERATE})
        given = [Allocation(m, tuple(range(cfg.n_workers)), cfg.n_workers) for m in models]
    if any(m.model == ROLLOUT for m in mfcs) and all(a.model != ROLLOUT for a in given):
        given.append(Allocation(ROLLOUT, (cfg.n_workers,), 1))  # the generation worker
    return given


def graph_from_config(cfg: CoreGraphConfig) -> DataflowGraph:
    """The checked graph ``cfg`` describes (raises GraphError listing every problem); sync PPO
    counts its generation worker among the workers."""
    mfcs, keys = graph_mfcs(cfg)
    n_generation = int(any(m.fn is ModelFn.GENERATE for m in mfcs))
    return build_graph(
        cfg.graph, mfcs, keys, allocations_for(cfg, mfcs), cfg.n_workers + n_generation
    )
