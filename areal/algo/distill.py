"""On-policy distillation: a teacher scores the student's own samples.

Per completion token the advantage is the negative reverse KL of the sampled token,
``log pi_teacher(y_t) - log pi_student(y_t)`` (``pi_student``: the behaviour logprobs the rollout
returned), scaled by ``coef`` and optionally mixed with the task reward's advantage
(``reward_weight``). Where the teacher likes a token more than the student it is pushed up, and
vice versa; the sum over a sequence is an unbiased one-sample estimate of -KL(student || teacher)
on that prefix. No normalisation: the KL term is already on a natural scale.

Its mean over the student's samples is the KL itself (>= 0), so most sampled tokens get a
negative advantage. ``baseline="others"`` subtracts, from each sequence's tokens, the mean
reverse KL of the *other* sequences' trained tokens in the batch: a baseline that depends on
nothing the sequence sampled, so the gradient stays unbiased and its variance falls.
"""

from __future__ import annotations

import torch

from areal.algo.segments import segment_sum, seq_ids


def distill_advantages(
    task_advantages: torch.Tensor,
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    reward_weight: float,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T] ``reward_weight * task_advantages + coef * (teacher_logp - student_logp - b)`` on
    trained tokens, 0 elsewhere (all inputs [T], PackedBatch-aligned). ``b`` is 0, or with
    ``cu_seqlens`` [B+1] the other sequences' mean reverse KL (:func:`others_mean`)."""
    reverse_kl = (student_logp - teacher_logp).float()  # [T] log pi_s - log pi_t of sampled tokens
    if cu_seqlens is not None:
        reverse_kl = reverse_kl - others_mean(reverse_kl, loss_mask, cu_seqlens)
    adv = reward_weight * task_advantages.float() - coef * reverse_kl
    return adv * loss_mask.to(adv.dtype)


def others_mean(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] each token gets the mean of ``x`` [T] over the masked tokens of every *other*
    sequence (0 when no other sequence has one)."""
    m = mask.to(x.dtype)
    sums, counts = segment_sum(x * m, cu_seqlens), segment_sum(m, cu_seqlens)  # [B]
    means = (sums.sum() - sums) / (counts.sum() - counts).clamp(min=1)  # [B]
    return means[seq_ids(cu_seqlens)]
