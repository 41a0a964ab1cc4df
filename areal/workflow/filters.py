"""Group filters for the rollout executor's ``should_accept`` hook."""

from __future__ import annotations

import threading

import torch

from areal.algo.reward_shaping import uniform_reward_groups
from areal.api.io import Trajectory


class DynamicSamplingFilter:
    """DAPO's dynamic sampling: reject groups whose rewards are all equal (zero advantage).

    Rejected groups are replaced by new prompts, so the batch size stays fixed. If
    ``max_consecutive_rejections`` groups in a row are rejected (e.g. an epoch of prompts: the
    model solves every prompt always or never) the run stops with a message instead of sampling
    forever.
    """

    def __init__(self, max_consecutive_rejections: int):
        if max_consecutive_rejections < 1:
            raise ValueError(
                f"max_consecutive_rejections must be >= 1, got {max_consecutive_rejections}"
            )
        self.limit = max_consecutive_rejections
        self.streak = 0
        self._lock = threading.Lock()

    def __call__(self, group: list[Trajectory]) -> bool:
        rewards = torch.tensor([t.reward for t in group], dtype=torch.float32)
        informative = not bool(uniform_reward_groups(rewards, len(group))[0])
        with self._lock:
            self.streak = 0 if informative else self.streak + 1
            if self.streak >= self.limit:
                last = float(rewards[0])
                why = (  # a reward of 0 or less everywhere: most often the wrong starting model
                    "never: is actor.path a model warmed up for this task?"
                    if last <= 0
                    else "always: use harder data"
                )
                raise RuntimeError(
                    f"dynamic sampling rejected {self.streak} groups in a row (all rewards equal, "
                    f"last {last}): the model solves every prompt {why} Or set "
                    "actor.dynamic_sampling=false"
                )
        return informative
