"""Rollout workflows: one dataset item -> a scored group of trajectories.

* :class:`areal.workflow.rlvr.RLVRWorkflow`: single turn, ``n_samples`` per prompt.
* :class:`areal.workflow.multi_turn.MultiTurnWorkflow`: retry with feedback up to ``max_turns``.
* :class:`areal.workflow.agent.AgentWorkflow`: an agent written with the openai client, run
  through :class:`areal.workflow.openai_client.ArealOpenAI` (docs/agents.md).

The four are importable from the package too; each is imported on first use (PEP 562), so a
process that imports one light module of the package loads only what that module needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal.workflow.agent import AgentWorkflow
    from areal.workflow.multi_turn import MultiTurnWorkflow
    from areal.workflow.openai_client import ArealOpenAI
    from areal.workflow.rlvr import RLVRWorkflow

_HOMES = {
    "AgentWorkflow": "areal.workflow.agent",
    "ArealOpenAI": "areal.workflow.openai_client",
    "MultiTurnWorkflow": "areal.workflow.multi_turn",
    "RLVRWorkflow": "areal.workflow.rlvr",
}
__all__ = ["AgentWorkflow", "ArealOpenAI", "MultiTurnWorkflow", "RLVRWorkflow"]


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'areal.workflow' has no attribute {name!r}")
