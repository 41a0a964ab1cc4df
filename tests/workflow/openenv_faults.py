"""OpenEnv environments that misbehave, for tests/workflow/test_env_workflows.py: each plays like
examples/openenv_guess.py's GuessEnv until its one fault (secret digit 0 for every seed)."""

from __future__ import annotations

import time
from typing import Any

from openenv_guess import GuessAction, GuessEnv, GuessObservation


class RaisingEnv(GuessEnv):
    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        raise RuntimeError("the environment crashed")


class HangingEnv(GuessEnv):
    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        time.sleep(2.0)  # past the test's env_timeout (0.2 s); the thread is abandoned
        return super().step(action)


class NaNEnv(GuessEnv):
    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        return GuessObservation(prompt="?", done=True, reward=float("nan"))


class SilentEnv(GuessEnv):
    """Never gives a reward (every observation's reward is None)."""

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        return GuessObservation(prompt="?", done=True, reward=None)
