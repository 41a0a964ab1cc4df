"""One agent episode (the :class:`~areal.workflow.openai_client.Call` records of its client) ->
training trajectories. Pure functions, no engine.

Rewards. Call ``k`` of ``K`` (``k`` counts ``create()`` calls; the ``n`` choices of one call
share it) gets the discounted return ``G_k = r_k + gamma * G_{k+1}``, where ``r_k`` is the
reward the agent gave that call (``client.set_reward``, default 0) and the episode reward the
agent returns is added to the last call's ``r_{K-1}``. With no per-call rewards and
``gamma = 1`` every call gets the episode reward; with ``gamma < 1`` earlier calls get less
(``gamma ** (K-1-k)`` of it).

Shapes (``workflow.agent.trajectory``):

* ``per_call``: one trajectory per completion: its prompt, its completion (all trained on),
  reward ``G_k``.
* ``concat``: one trajectory per episode: the first prompt, then every completion with the
  tokens between them (tool results, user turns, template glue) inserted untrained (loss_mask 0,
  logprob 0.0, version -1); reward ``G_0``. This needs each call's prompt to start with the
  previous call's prompt + completion token for token, which holds when the chat template is
  append-only and re-renders the model's tool calls as the model wrote them. Where it does not,
  :class:`TemplateMismatch` names the call and the first differing token, or (with
  ``on_template_mismatch=per_call``) the episode falls back to ``per_call`` trajectories.
"""

from __future__ import annotations

from typing import Any, Literal

from areal.api.io import RolloutStatus, Trajectory
from areal.workflow.openai_client import Call

STATUS = {"stop": RolloutStatus.COMPLETED, "length": RolloutStatus.TRUNCATED}


class TemplateMismatch(ValueError):
    """Call k+1's prompt does not extend call k's prompt + completion (concat impossible)."""


def episode_returns(
    n_turns: int, call_rewards: dict[int, float], episode_reward: float, gamma: float
) -> list[float]:
    """Discounted return ``G_k`` of each of ``n_turns`` calls (module docstring)."""
    if n_turns < 1:
        raise ValueError("episode_returns: the episode made no model call")
    returns = [0.0] * n_turns
    ahead = 0.0
    for k in reversed(range(n_turns)):
        r = call_rewards.get(k, 0.0) + (episode_reward if k == n_turns - 1 else 0.0)
        ahead = r + gamma * ahead
        returns[k] = ahead
    return returns


def per_call_trajectories(
    calls: list[Call], returns: list[float], sample_id: str, group_id: str
) -> list[Trajectory]:
    """One trajectory per completion, reward = its call's return."""
    return [
        Trajectory(
            prompt_ids=c.prompt_ids,
            completion_ids=c.completion_ids,
            logprobs=c.logprobs,
            versions=c.versions,
            loss_mask=[1] * len(c.completion_ids),
            reward=returns[c.turn],
            status=STATUS[c.stop_reason],
            sample_id=f"{sample_id}/call{c.turn}.{c.choice}",
            group_id=group_id,
            server=c.server,
        )
        for c in calls
    ]


def _mismatch(calls: list[Call], k: int, tokenizer: Any) -> str | None:
    """Why call ``k``'s prompt does not extend call ``k-1``'s full sequence, or None."""
    prev = calls[k - 1].prompt_ids + calls[k - 1].completion_ids
    prompt = calls[k].prompt_ids
    if prompt[: len(prev)] == prev:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(prev, prompt)) if a != b), min(len(prev), len(prompt))
    )

    def show(ids: list[int]) -> str:
        return (
            repr(tokenizer.decode(ids[max(0, at - 20) : at + 20]))
            if tokenizer is not None
            else str(ids[at : at + 8])
        )

    return (
        f"call {k}'s prompt does not start with call {k - 1}'s prompt + completion: they differ at "
        f"token {at} (call {k - 1} had {show(prev)}, call {k} has {show(prompt)}); the chat "
        "template re-renders the conversation differently from what the model generated. Use "
        "workflow.agent.trajectory=per_call, or on_template_mismatch=per_call to fall back per "
        "episode"
    )


def concat_trajectory(
    calls: list[Call], returns: list[float], sample_id: str, group_id: str, tokenizer: Any = None
) -> Trajectory:
    """The episode as one sequence, injected tokens masked out; TemplateMismatch when the calls
    do not chain (or a call had n > 1 choices: which one continued is ambiguous)."""
    if any(c.choice > 0 for c in calls):
        raise TemplateMismatch(
            "concat needs one choice per call (n=1); with n > 1 use "
            "workflow.agent.trajectory=per_call"
        )
    completion, logprobs, versions, mask, starts = [], [], [], [], []
    at = len(calls[0].prompt_ids)  # position in the full sequence where the next call's part starts
    for k, c in enumerate(calls):
        if k > 0:
            why = _mismatch(calls, k, tokenizer)
            if why is not None:
                raise TemplateMismatch(why)
            injected = c.prompt_ids[at:]
            completion += injected
            logprobs += [0.0] * len(injected)
            versions += [-1] * len(injected)
            mask += [0] * len(injected)
        # turn k starts with its completion, after the tokens injected before it
        starts.append(len(completion))
        completion += c.completion_ids
        logprobs += c.logprobs
        versions += c.versions
        mask += [1] * len(c.completion_ids)
        at = len(c.prompt_ids) + len(c.completion_ids)
    return Trajectory(
        prompt_ids=list(calls[0].prompt_ids),
        completion_ids=completion,
        logprobs=logprobs,
        versions=versions,
        loss_mask=mask,
        reward=returns[0],
        status=STATUS[calls[-1].stop_reason],
        sample_id=sample_id,
        group_id=group_id,
        server=",".join(dict.fromkeys(s for c in calls for s in c.server.split(",") if s)),
        turn_starts=starts,
    )


def episode_trajectories(
    calls: list[Call], call_rewards: dict[int, float], episode_reward: float, gamma: float,
    shape: Literal["per_call", "concat"], on_mismatch: Literal["error", "per_call"],
    sample_id: str, group_id: str, tokenizer: Any = None,
) -> tuple[list[Trajectory], str | None]:  # fmt: skip
    """(the episode's trajectories, why concat fell back to per_call, or None when it did not)."""
    if not calls:
        raise ValueError("the agent made no model call, so there is nothing to train on")
    returns = episode_returns(calls[-1].turn + 1, call_rewards, episode_reward, gamma)
    if shape == "per_call":
        return per_call_trajectories(calls, returns, sample_id, group_id), None
    try:
        return [concat_trajectory(calls, returns, sample_id, group_id, tokenizer)], None
    except TemplateMismatch as e:
        if on_mismatch == "error":
            raise
        return per_call_trajectories(calls, returns, sample_id, group_id), str(e)
