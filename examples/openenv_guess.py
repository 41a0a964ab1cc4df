"""A small OpenEnv environment for ``workflow.type: openenv`` (examples/openenv_grpo.yaml,
docs/environments.md): guess a secret digit in up to three tries, told "higher" or "lower" after
each wrong guess. Built from openenv-core's own classes (``Environment``, ``Action``,
``Observation``, ``State``), so it also serves over HTTP as any OpenEnv environment does::

    python -c "import uvicorn; from openenv.core.env_server import create_app; \\
        from openenv_guess import GuessEnv, GuessAction, GuessObservation; \\
        uvicorn.run(create_app(GuessEnv, GuessAction, GuessObservation), port=8011)"

Reward: 1.0 for the step that names the digit (the first digit in the reply), else 0.0; the
episode ends at the right guess or after three.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

MAX_TRIES = 3


class GuessAction(Action):
    message: str = ""


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess the secret digit (0-9) in up to three tries."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._secret = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._secret = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="Guess my digit (0-9). Reply with one digit.")

    def step(self, action: GuessAction, **kwargs: Any) -> GuessObservation:  # (timeout_s=...)
        self._state.step_count += 1
        found = re.search(r"\d", action.message)
        guess = int(found.group()) if found else None
        if guess == self._secret:
            return GuessObservation(prompt="Right.", done=True, reward=1.0)
        hint = (
            "no digit in your reply"
            if guess is None
            else ("higher" if guess < self._secret else "lower")
        )
        done = self._state.step_count >= MAX_TRIES
        return GuessObservation(prompt=f"Wrong: {hint}. Guess again.", done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
