"""Rollout workflows: one dataset item -> a scored group of trajectories.

* :class:`areal.workflow.rlvr.RLVRWorkflow`: single turn, ``n_samples`` per prompt.
* :class:`areal.workflow.multi_turn.MultiTurnWorkflow`: retry with feedback up to ``max_turns``.
* :class:`areal.workflow.agent.AgentWorkflow`: an agent written with the openai client, run
  through :class:`areal.workflow.openai_client.ArealOpenAI` (docs/agents.md).
"""

from areal.workflow.agent import AgentWorkflow
from areal.workflow.multi_turn import MultiTurnWorkflow
from areal.workflow.openai_client import ArealOpenAI
from areal.workflow.rlvr import RLVRWorkflow

__all__ = ["AgentWorkflow", "ArealOpenAI", "MultiTurnWorkflow", "RLVRWorkflow"]
