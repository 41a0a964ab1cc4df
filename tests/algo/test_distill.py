"""Tier 1: on-policy distillation's advantages against hand-worked numbers."""

import math

import pytest
import torch

from areal.algo.distill import distill_advantages


def test_the_advantage_is_the_teachers_log_ratio_over_the_student_on_trained_tokens():
    student = torch.log(torch.tensor([0.5, 0.5, 0.2, 0.9]))
    teacher = torch.log(torch.tensor([0.5, 0.25, 0.4, 0.1]))
    mask = torch.tensor([0, 1, 1, 1])  # the first token is prompt
    task = torch.tensor([0.0, 1.0, 1.0, 1.0])
    adv = distill_advantages(task, teacher, student, mask, coef=1.0, reward_weight=0.0)
    # log(0.25/0.5) = -log 2 (teacher likes it less: pushed down); log(0.4/0.2) = log 2;
    # log(0.1/0.9)
    assert adv.tolist() == pytest.approx([0.0, -math.log(2), math.log(2), math.log(1 / 9)])
    mixed = distill_advantages(task, teacher, student, mask, coef=0.5, reward_weight=2.0)
    # 2 * task + 0.5 * log ratio
    assert mixed.tolist() == pytest.approx(
        [0.0, 2 - 0.5 * math.log(2), 2 + 0.5 * math.log(2), 2 + 0.5 * math.log(1 / 9)]
    )


def test_a_student_equal_to_its_teacher_gets_no_distillation_signal():
    logp = torch.log(torch.tensor([0.3, 0.7]))
    adv = distill_advantages(torch.zeros(2), logp, logp, torch.ones(2), coef=1.0, reward_weight=0.0)
    assert adv.tolist() == [0.0, 0.0]


def test_the_others_baseline_subtracts_the_other_sequences_mean_reverse_kl():
    # two sequences: [prompt, a] and [b, c]; reverse KLs log pi_s - log pi_t: a log 2,
    # b -log 2, c log 9
    student = torch.log(torch.tensor([0.5, 0.5, 0.2, 0.9]))
    teacher = torch.log(torch.tensor([0.5, 0.25, 0.4, 0.1]))
    mask, cu = torch.tensor([0, 1, 1, 1]), torch.tensor([0, 2, 4])
    adv = distill_advantages(torch.zeros(4), teacher, student, mask, 1.0, 0.0, cu_seqlens=cu)
    # a's baseline: the mean of b and c, (log 9 - log 2) / 2; b's and c's: a's log 2
    assert adv.tolist() == pytest.approx(
        [0.0, -(math.log(2) - math.log(4.5) / 2), 2 * math.log(2), -math.log(4.5)]
    )
    alone = distill_advantages(
        torch.zeros(2), teacher[:2], student[:2], mask[:2], 1.0, 0.0, cu_seqlens=cu[:2]
    )
    assert alone.tolist() == pytest.approx([0.0, -math.log(2)])  # no other sequence: no baseline
