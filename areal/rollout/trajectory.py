"""Rollout groups -> a training :class:`PackedBatch`, and per-batch staleness statistics.

Fields of the batch :func:`groups_to_batch` builds (``T`` tokens, ``B`` sequences; a sequence is
prompt + completion, in group order, groups in the order given):

token fields ``[T]``
  ``input_ids``  int64    prompt ids then completion ids
  ``logprobs``   float32  behaviour logprob of each completion token (log pi_behav(x_t | x_<t));
                          0.0 on prompt tokens
  ``versions``   int64    weight version that produced each completion token; -1 on prompt
                          tokens (and on injected, non-model tokens of multi-turn episodes)
  ``loss_mask``  int64    1 = trained on; 0 on prompt tokens, on injected tokens, and (with
                          ``mask_untrainable=True``) on every token of a sequence whose status
                          is not completed/truncated

sequence fields ``[B]``
  ``rewards``      float32  the trajectory's scalar reward
  ``group_index``  int64    0..G-1: which group (dataset item) of this batch the sequence is from
  ``prompt_lens``  int64    prompt tokens of the sequence (completion = seqlen - prompt_len)
  ``status_code``  int64    index of the trajectory's status in :data:`STATUS_CODES`
  ``no_eos``       bool     the sequence stopped at max_new_tokens, not at EOS / a stop
                            condition (for ``actor.mask_no_eos_with_zero``)
  any key of ``Trajectory.extras`` holding a number (float32), when every trajectory of the
  batch has it

token fields from extras ``[T]``
  any key of ``Trajectory.extras`` holding one float per completion token (a list, e.g. a
  teacher's logprobs of the completion), float32, 0.0 on prompt tokens
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from areal.api.io import RolloutStatus, Trajectory
from areal.utils.batch import PackedBatch

STATUS_CODES: tuple[RolloutStatus, ...] = tuple(RolloutStatus)
TRAINABLE = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)
_BUILTIN_FIELDS = {
    "input_ids",
    "logprobs",
    "versions",
    "loss_mask",
    "rewards",
    "group_index",
    "prompt_lens",
    "status_code",
    "no_eos",
}


def _extras_keys(trajs: list[Trajectory]) -> list[str]:
    keys = set(trajs[0].extras)
    for t in trajs[1:]:
        if set(t.extras) != keys:
            raise ValueError(
                f"trajectory {t.sample_id!r} has extras {sorted(t.extras)} but "
                f"{trajs[0].sample_id!r} has {sorted(keys)}; every trajectory of a batch must "
                "carry the same extras keys (set a default in the workflow)"
            )
    clash = keys & _BUILTIN_FIELDS
    if clash:
        raise ValueError(f"Trajectory.extras keys {sorted(clash)} clash with batch field names")
    return sorted(keys)


def groups_to_batch(
    groups: Sequence[Sequence[Trajectory]], mask_untrainable: bool = True
) -> PackedBatch:
    """Pack rollout groups into one batch with the fields listed in the module docstring."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        raise ValueError("groups_to_batch got no trajectories; wait for at least one group")
    tok: dict[str, list[list]] = {"input_ids": [], "logprobs": [], "versions": [], "loss_mask": []}
    for t in trajs:
        n_prompt = len(t.prompt_ids)
        trainable = t.status in TRAINABLE or not mask_untrainable
        tok["input_ids"].append(list(t.prompt_ids) + list(t.completion_ids))
        tok["logprobs"].append([0.0] * n_prompt + [float(x) for x in t.logprobs])
        tok["versions"].append([-1] * n_prompt + [int(v) for v in t.versions])
        mask = [int(m) if trainable else 0 for m in t.loss_mask]
        tok["loss_mask"].append([0] * n_prompt + mask)
    seqs = {
        "rewards": [float(t.reward) for t in trajs],
        "group_index": [gi for gi, g in enumerate(groups) for _ in g],
        "prompt_lens": [len(t.prompt_ids) for t in trajs],
        "status_code": [STATUS_CODES.index(t.status) for t in trajs],
        "no_eos": [t.status == RolloutStatus.TRUNCATED for t in trajs],  # hit max_new_tokens
    }
    extras = _extras_keys(trajs)
    per_token = {k for k in extras if isinstance(trajs[0].extras[k], (list, tuple))}
    for key in extras:
        if key in per_token:
            tok[key] = [[0.0] * len(t.prompt_ids) + _token_extra(t, key) for t in trajs]
        else:
            seqs[key] = [_seq_extra(t, key) for t in trajs]
    batch = PackedBatch.from_sequences(tok, seqs)
    # from_sequences infers dtype from the first value; pin the documented dtypes.
    return batch.with_fields(
        tokens={
            "logprobs": batch["logprobs"].float(),
            "versions": batch["versions"].long(),
            "loss_mask": batch["loss_mask"].long(),
            **{k: batch[k].float() for k in per_token},
        },
        seqs={k: batch[k].float() for k in ["rewards", *(k for k in extras if k not in per_token)]},
    )


def _seq_extra(t: Trajectory, key: str) -> float:
    value = t.extras[key]
    if isinstance(value, (list, tuple)):
        raise ValueError(
            f"trajectory {t.sample_id!r}: extras[{key!r}] holds a list but the batch's first "
            "trajectory holds a number there; every trajectory must hold the same kind"
        )
    return float(value)


def _token_extra(t: Trajectory, key: str) -> list[float]:
    values = t.extras[key]
    if not isinstance(values, (list, tuple)) or len(values) != len(t.completion_ids):
        raise ValueError(
            f"trajectory {t.sample_id!r}: extras[{key!r}] must hold one float per completion "
            f"token ({len(t.completion_ids)}), got {type(values).__name__} of "
            f"{len(values) if isinstance(values, (list, tuple)) else 1}"
        )
    return [float(v) for v in values]


def staleness_stats(
    groups: Sequence[Sequence[Trajectory]], current_version: int
) -> dict[str, float]:
    """Staleness of the trained tokens of one batch, relative to the trainer's ``current_version``.

    Over completion tokens with loss_mask 1 and a version >= 0:
    ``staleness/hist/<d>`` = tokens whose version is ``current_version - d`` (a count);
    ``staleness/version_share/<v>`` = fraction of tokens produced by weight version ``v``;
    ``staleness/mean``, ``staleness/max``, ``staleness/n_tokens``.
    """
    by_version: Counter[int] = Counter()
    for g in groups:
        for t in g:
            by_version.update(v for v, m in zip(t.versions, t.loss_mask) if m and v >= 0)
    n = sum(by_version.values())
    out: dict[str, float] = {"staleness/n_tokens": float(n)}
    if n == 0:
        return out
    out["staleness/mean"] = sum((current_version - v) * c for v, c in by_version.items()) / n
    out["staleness/max"] = float(max(current_version - v for v in by_version))
    for v, c in sorted(by_version.items()):
        out[f"staleness/hist/{current_version - v}"] = float(c)
        out[f"staleness/version_share/{v}"] = c / n
    return out
