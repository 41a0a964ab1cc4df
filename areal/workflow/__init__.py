"""Rollout workflows: one dataset item -> a scored group of trajectories.

* :class:`areal.workflow.rlvr.RLVRWorkflow`: single turn, ``n_samples`` per prompt.
* :class:`areal.workflow.multi_turn.MultiTurnWorkflow`: retry with feedback up to ``max_turns``.
* :class:`areal.workflow.agent.AgentWorkflow`: an agent written with the openai client, run
  through :class:`areal.workflow.openai_client.ArealOpenAI` (docs/agents.md).

The names above are imported on first use (PEP 562): importing one workflow module does not
import the openai SDK (~0.7 s) for every trainer and rollout worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal.workflow.agent import AgentWorkflow
    from areal.workflow.multi_turn import MultiTurnWorkflow
    from areal.workflow.openai_client import ArealOpenAI
    from areal.workflow.rlvr import RLVRWorkflow

_HOME = {
    "AgentWorkflow": "areal.workflow.agent",
    "ArealOpenAI": "areal.workflow.openai_client",
    "MultiTurnWorkflow": "areal.workflow.multi_turn",
    "RLVRWorkflow": "areal.workflow.rlvr",
}
__all__ = ["AgentWorkflow", "ArealOpenAI", "MultiTurnWorkflow", "RLVRWorkflow"]


def __getattr__(name: str) -> type:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'areal.workflow' has no attribute {name!r}")
