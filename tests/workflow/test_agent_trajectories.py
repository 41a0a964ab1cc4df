"""Agent episodes -> trajectories (tier 1): discounted returns, concat masking, per-call shape,
template-mismatch error and fallback, with hand-worked numbers."""

from __future__ import annotations

import pytest

from areal.api.io import RolloutStatus
from areal.workflow.agent_trajectories import (
    TemplateMismatch,
    episode_returns,
    episode_trajectories,
)
from areal.workflow.openai_client import Call


def _calls(second_prompt=(1, 2, 3, 4, 5, 6, 7)):
    """Three calls of one episode: each prompt extends the previous prompt + completion by the
    injected tokens [6, 7] (a tool result) and [9] (a user turn)."""
    return [
        Call(0, 0, "c0", [1, 2, 3], [4, 5], [-0.1, -0.2], [3, 3], "stop", server="a:1"),
        Call(1, 0, "c1", list(second_prompt), [8], [-0.3], [4], "stop", server="a:1"),
        Call(2, 0, "c2", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [-0.4, -0.5], [4, 5], "length",
             server="a:1,b:2"),  # it failed over from a:1 to b:2
    ]  # fmt: skip


def test_episode_reward_is_discounted_back_over_the_calls():
    # R = 1, gamma = 0.5: G2 = 1, G1 = 0.5 * 1 = 0.5, G0 = 0.5 * 0.5 = 0.25
    assert episode_returns(3, {}, 1.0, 0.5) == [0.25, 0.5, 1.0]
    # gamma = 1: every call gets the episode reward
    assert episode_returns(3, {}, 2.0, 1.0) == [2.0, 2.0, 2.0]


def test_per_call_rewards_add_to_the_discounted_return():
    # r0 = 0.2, r1 = -0.1, R = 1 on the last call, gamma = 0.5:
    # G2 = 1; G1 = -0.1 + 0.5 * 1 = 0.4; G0 = 0.2 + 0.5 * 0.4 = 0.4
    assert episode_returns(3, {0: 0.2, 1: -0.1}, 1.0, 0.5) == pytest.approx([0.4, 0.4, 1.0])


def test_concat_masks_injected_tokens_and_keeps_generated_ones():
    trajs, fell_back = episode_trajectories(_calls(), {}, 1.0, 0.5, "concat", "error", "q/0", "q")
    assert not fell_back and len(trajs) == 1
    t = trajs[0]
    assert t.prompt_ids == [1, 2, 3]
    assert t.completion_ids == [4, 5, 6, 7, 8, 9, 10, 11]
    assert t.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert t.versions == [3, 3, -1, -1, 4, -1, 4, 5]
    assert t.reward == 0.25  # G0 of the first test
    assert t.status == RolloutStatus.TRUNCATED  # the last call hit max_tokens
    assert (t.sample_id, t.group_id) == ("q/0", "q")
    assert t.turn_starts == [0, 4, 6]  # after [6, 7] (tool result) and [9] (user turn)
    assert t.server == "a:1,b:2"  # every server that answered, once each


def test_per_call_gives_one_trajectory_per_completion_with_its_return():
    trajs, _ = episode_trajectories(
        _calls(), {0: 0.2, 1: -0.1}, 1.0, 0.5, "per_call", "error", "q/0", "q"
    )
    assert [t.prompt_ids for t in trajs] == [
        [1, 2, 3],
        [1, 2, 3, 4, 5, 6, 7],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
    ]
    assert [t.completion_ids for t in trajs] == [[4, 5], [8], [10, 11]]
    assert [t.loss_mask for t in trajs] == [[1, 1], [1], [1, 1]]
    assert [t.reward for t in trajs] == pytest.approx([0.4, 0.4, 1.0])
    assert [t.status for t in trajs] == [
        RolloutStatus.COMPLETED,
        RolloutStatus.COMPLETED,
        RolloutStatus.TRUNCATED,
    ]
    assert [t.sample_id for t in trajs] == ["q/0/call0.0", "q/0/call1.0", "q/0/call2.0"]


def test_a_prompt_that_does_not_extend_the_previous_call_is_an_error_naming_the_token():
    broken = _calls(second_prompt=(1, 2, 3, 4, 99, 6, 7))  # the template re-rendered token 4
    with pytest.raises(TemplateMismatch, match="call 1's prompt .* differ at token 4"):
        episode_trajectories(broken, {}, 1.0, 1.0, "concat", "error", "q/0", "q")


def test_mismatch_falls_back_to_per_call_when_configured():
    broken = _calls(second_prompt=(1, 2, 3, 4, 99, 6, 7))
    trajs, fell_back = episode_trajectories(broken, {}, 1.0, 1.0, "concat", "per_call", "q/0", "q")
    assert fell_back and [t.completion_ids for t in trajs] == [[4, 5], [8], [10, 11]]
    assert [t.reward for t in trajs] == [1.0, 1.0, 1.0]


def test_concat_refuses_calls_with_several_choices():
    calls = [
        Call(0, 0, "c0", [1], [2], [-0.1], [0], "stop"),
        Call(0, 1, "c0", [1], [3], [-0.2], [0], "stop"),
    ]
    with pytest.raises(TemplateMismatch, match="n=1"):
        episode_trajectories(calls, {}, 1.0, 1.0, "concat", "error", "q/0", "q")
    trajs, _ = episode_trajectories(calls, {}, 1.0, 1.0, "per_call", "error", "q/0", "q")
    assert [t.completion_ids for t in trajs] == [[2], [3]] and [t.reward for t in trajs] == [
        1.0,
        1.0,
    ]


def test_an_episode_without_calls_is_an_error():
    with pytest.raises(ValueError, match="no model call"):
        episode_trajectories([], {}, 1.0, 1.0, "concat", "error", "q/0", "q")
