"""The rollout workflow interface: one episode from one dataset item."""

from __future__ import annotations

import abc
from typing import Any

from areal.api.engine import InferenceEngine
from areal.api.io import Trajectory


class RolloutWorkflow(abc.ABC):
    """Turns one dataset item into a scored group of trajectories."""

    @abc.abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any]
    ) -> list[Trajectory] | None:
        """Run one episode; return the group, or None to reject the item (it is not trained on)."""
