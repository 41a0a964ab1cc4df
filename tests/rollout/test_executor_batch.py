"""Tier 1: groups -> PackedBatch fields, and per-batch staleness statistics."""

from __future__ import annotations

import pytest
import torch

from areal.api.io import RolloutStatus, Trajectory
from areal.rollout.trajectory import STATUS_CODES, groups_to_batch, staleness_stats


def _traj(prompt, completion, versions, reward, status=RolloutStatus.COMPLETED, mask=None, **kw):
    n = len(completion)
    return Trajectory(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5 * (i + 1) for i in range(n)],
        versions=versions,
        loss_mask=mask or [1] * n,
        reward=reward,
        status=status,
        **kw,
    )


def test_groups_become_one_packed_batch_with_documented_fields():
    groups = [
        [_traj([1, 2], [3, 4], [0, 1], 1.0), _traj([1, 2], [5], [1], 0.0)],
        [_traj([9], [8, 7, 6], [1, 1, 1], 0.5, status=RolloutStatus.ERROR_REWARD)],
    ]
    b = groups_to_batch(groups)
    assert b.cu_seqlens.tolist() == [0, 4, 7, 11]
    assert b["input_ids"].tolist() == [1, 2, 3, 4, 1, 2, 5, 9, 8, 7, 6]
    assert b["logprobs"].tolist() == [0.0, 0.0, -0.5, -1.0, 0.0, 0.0, -0.5, 0.0, -0.5, -1.0, -1.5]
    assert b["versions"].tolist() == [-1, -1, 0, 1, -1, -1, 1, -1, 1, 1, 1]
    # The error_reward sequence is kept (group structure) but masked out of the loss.
    assert b["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert b["group_index"].tolist() == [0, 0, 1]
    assert b["prompt_lens"].tolist() == [2, 2, 1]
    assert [STATUS_CODES[i] for i in b["status_code"].tolist()] == [
        RolloutStatus.COMPLETED,
        RolloutStatus.COMPLETED,
        RolloutStatus.ERROR_REWARD,
    ]
    assert b["logprobs"].dtype == torch.float32 and b["rewards"].dtype == torch.float32
    assert b["versions"].dtype == torch.int64 and b["loss_mask"].dtype == torch.int64
    assert groups_to_batch(groups, mask_untrainable=False)["loss_mask"][-3:].tolist() == [1, 1, 1]
    assert b["no_eos"].tolist() == [False, False, False]
    truncated = groups_to_batch([[_traj([1], [2, 3], [0, 0], 0.0, status=RolloutStatus.TRUNCATED)]])
    assert truncated["no_eos"].tolist() == [True]  # stopped at max_new_tokens, not EOS


def test_extras_become_sequence_fields_only_when_every_trajectory_has_them():
    g = [
        [
            _traj([1], [2], [0], 1.0, extras={"baseline": 0.25}),
            _traj([1], [3], [0], 0.0, extras={"baseline": 0.5}),
        ]
    ]
    assert groups_to_batch(g)["baseline"].tolist() == [0.25, 0.5]
    g[0][1].extras = {"baseline": [0.5]}  # a list where the first trajectory holds a number
    with pytest.raises(ValueError, match=r"extras\['baseline'\] holds a list but the batch's"):
        groups_to_batch(g)
    g[0][1].extras = {}
    with pytest.raises(ValueError, match="same extras keys"):
        groups_to_batch(g)


def test_per_token_extras_become_token_fields_zero_on_the_prompt():
    g = [
        [
            _traj([1, 2], [3, 4], [0, 0], 1.0, extras={"teacher_logp": [-0.1, -0.2]}),
            _traj([1, 2], [5], [0], 0.0, extras={"teacher_logp": [-0.3]}),
        ]
    ]
    b = groups_to_batch(g)
    assert b["teacher_logp"].tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3])
    assert "teacher_logp" in b.tokens and b["teacher_logp"].dtype == torch.float32
    g[0][1].extras = {"teacher_logp": [-0.3, -0.4]}  # two values for one completion token
    with pytest.raises(ValueError, match="one float per completion token \\(1\\), got list of 2"):
        groups_to_batch(g)


def test_staleness_stats_histogram_and_version_shares():
    # Trainer at version 3. Trained tokens: v3 x2, v2 x1, v1 x1; the masked token and the
    # injected token (version -1) do not count.
    groups = [
        [_traj([1], [5, 6, 7], [3, 3, 2], 1.0)],
        [_traj([1], [5, 6, 7], [1, 0, -1], 0.0, mask=[1, 0, 0])],
    ]
    s = staleness_stats(groups, current_version=3)
    assert s["staleness/n_tokens"] == 4
    assert s["staleness/hist/0"] == 2 and s["staleness/hist/1"] == 1 and s["staleness/hist/2"] == 1
    assert s["staleness/version_share/3"] == 0.5 and s["staleness/version_share/1"] == 0.25
    assert s["staleness/mean"] == (0 + 0 + 1 + 2) / 4 and s["staleness/max"] == 2
    assert "staleness/hist/3" not in s
