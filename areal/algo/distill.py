"""On-policy distillation: a teacher scores the student's own samples.

Per completion token the advantage is the negative reverse KL of the sampled token,
``log pi_teacher(y_t) - log pi_student(y_t)`` (``pi_student``: the behaviour logprobs the rollout
returned), scaled by ``coef`` and optionally mixed with the task reward's advantage
(``reward_weight``). Where the teacher likes a token more than the student it is pushed up, and
vice versa; the sum over a sequence is an unbiased one-sample estimate of -KL(student || teacher)
on that prefix. No normalisation: the KL term is already on a natural scale.
"""

from __future__ import annotations

import torch


def distill_advantages(
    task_advantages: torch.Tensor,
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    reward_weight: float,
) -> torch.Tensor:
    """[T] ``reward_weight * task_advantages + coef * (teacher_logp - student_logp)`` on trained
    tokens, 0 elsewhere (all inputs [T], PackedBatch-aligned)."""
    reverse_kl = (student_logp - teacher_logp).float()  # [T] log pi_s - log pi_t of sampled tokens
    adv = reward_weight * task_advantages.float() - coef * reverse_kl
    return adv * loss_mask.to(adv.dtype)
