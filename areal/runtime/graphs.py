"""The training steps as graphs of model function calls (:mod:`areal.api.mfc`): written once,
run in process by :func:`areal.runtime.step.run_step` (Lite's scripts, ``areal replay``) and
distributed by Core's master (:mod:`areal.core.graphs` adds generation, allocations and
layouts).

PPO (:func:`ppo_mfcs`; the proximal-logp, reference, teacher and critic nodes are optional)::

    actor_logp   actor.compute_logp(out="prox_logp")    timer prox_logp
    ref_logp     ref.compute_logp(out="ref_logp")       timer ref_logp
    teacher_logp teacher.compute_logp(out="teacher_logp")  (Core; Lite's workflow scores it)
    critic_values critic.compute_values()               timer values
    actor_adv    actor.compute_advantages()             timer advantages, stats loss/*
    actor_train  actor.ppo_update(logp_out="trainer_logp")  timer train, stats loss/*
    critic_train critic.ppo_update()                    timer train, stats loss/critic/*

The advantages are a node of their own because both trainers read its outputs: the actor its
``advantages``, the critic its ``returns``. A training node steps its engine's learning-rate
schedule after the update. SFT is one node, ``model.train_lm``; the reward model one node,
``model.train_rw``. DPO (:func:`dpo_mfcs`)::

    ref_logp     ref.compute_seq_logp(out="ref_logp")   timer ref_logp  (dpo.ref_logp=online)
    dpo_train    model.train_dpo()                      timer train, stats loss/*
"""

from __future__ import annotations

from areal.api.mfc import MFC, ModelFn, ModelName

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
DPO_KEYS = ("input_ids", "loss_mask")  # pairs at 2k, 2k + 1; loss_mask on the replies
# actor_train adds each token's logprob in the update's own forward (recorded for areal view)
LOGP_OUT = {"logp_out": "trainer_logp"}

ACTOR, CRITIC, REF = ModelName("actor"), ModelName("critic"), ModelName("ref")
TEACHER = ModelName("teacher")  # on-policy distillation's frozen teacher
MODEL = ModelName("model")  # the one model of SFT and reward-model training


# The critic's two nodes: its values before the advantages, its update after the actor's.
CRITIC_VALUES = MFC(
    "critic_values", CRITIC, ModelFn.COMPUTE_VALUES, ("input_ids",), ("values",), timer="values"
)
CRITIC_TRAIN = MFC(
    "critic_train",
    CRITIC,
    ModelFn.PPO_UPDATE,
    ("input_ids", "loss_mask", "values", "returns"),
    timer="train",
    scope="loss/critic",
)


def logp_mfc(name: str, model: ModelName, out: str, timer: str = "") -> MFC:
    """``model.compute_logp(out=out)`` over the batch's ``input_ids``."""
    return MFC(name, model, ModelFn.COMPUTE_LOGP, ("input_ids",), (out,), {"out": out}, timer=timer)


def ppo_mfcs(
    use_critic: bool, use_ref: bool, prox_logp: bool, use_teacher: bool = False
) -> list[MFC]:
    """The PPO step after generation (see the module docstring), in the order it runs."""
    base = ("input_ids", "loss_mask")
    mfcs: list[MFC] = []
    adv_in = [*base, "rewards", "no_eos", "logprobs"]
    train_in = [*base, "logprobs", "advantages"]
    if prox_logp:  # the weights before the update (decoupled PPO)
        mfcs.append(logp_mfc("actor_logp", ACTOR, "prox_logp", "prox_logp"))
        adv_in.append("prox_logp")
        train_in.append("prox_logp")
    if use_ref:  # the KL term's reference
        mfcs.append(logp_mfc("ref_logp", REF, "ref_logp", "ref_logp"))
        adv_in.append("ref_logp")
        train_in.append("ref_logp")
    if use_teacher:  # on-policy distillation: the teacher's logprobs of the student's tokens
        mfcs.append(logp_mfc("teacher_logp", TEACHER, "teacher_logp"))
        adv_in.append("teacher_logp")
    if use_critic:
        mfcs.append(CRITIC_VALUES)
        adv_in.append("values")
    mfcs.append(  # + the teacher's reverse KL when distilling
        MFC(
            "actor_adv",
            ACTOR,
            ModelFn.COMPUTE_ADVANTAGES,
            tuple(adv_in),
            ("advantages", "returns", "token_rewards", "seq_rewards"),
            timer="advantages",
            scope="loss",
        )
    )
    mfcs.append(
        MFC(
            "actor_train",
            ACTOR,
            ModelFn.PPO_UPDATE,
            tuple(train_in),
            ("trainer_logp",),
            LOGP_OUT,
            timer="train",
            scope="loss",
        )
    )
    if use_critic:
        mfcs.append(CRITIC_TRAIN)
    return mfcs


def sft_mfcs() -> list[MFC]:
    """SFT's step: ``model.train_lm`` (token-weighted NLL), stats ``loss/*``."""
    return [MFC("sft_train", MODEL, ModelFn.TRAIN_LM, SFT_KEYS, timer="train", scope="loss")]


def rm_mfcs() -> list[MFC]:
    """Reward-model training's step: ``model.train_rw`` (Bradley-Terry on pairs), stats
    ``loss/*``."""
    return [MFC("rm_train", MODEL, ModelFn.TRAIN_RW, ("input_ids",), timer="train", scope="loss")]


def dpo_mfcs(use_ref: bool, online_ref: bool) -> list[MFC]:
    """DPO's step: with ``online_ref`` the reference scores the batch's pairs first (sequence
    field ``ref_logp``); ``model.train_dpo`` (the preference loss) reads it when ``use_ref``
    (sigmoid, ipo; precomputed ``ref_logp`` comes with the batch), stats ``loss/*``."""
    if online_ref and not use_ref:
        raise ValueError(
            "online_ref=True needs use_ref=True: a reference-free loss (simpo) runs no reference"
        )
    mfcs: list[MFC] = []
    if online_ref:
        mfcs.append(
            MFC(
                "ref_logp",
                REF,
                ModelFn.COMPUTE_SEQ_LOGP,
                DPO_KEYS,
                ("ref_logp",),
                {"out": "ref_logp"},
                timer="ref_logp",
            )
        )
    train_in = (*DPO_KEYS, "ref_logp") if use_ref else DPO_KEYS
    mfcs.append(MFC("dpo_train", MODEL, ModelFn.TRAIN_DPO, train_in, timer="train", scope="loss"))
    return mfcs
