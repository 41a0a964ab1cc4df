"""Rollout workflows: one dataset item -> a scored group of trajectories.

* :class:`areal.workflow.rlvr.RLVRWorkflow`: single turn, ``n_samples`` per prompt.
* :class:`areal.workflow.multi_turn.MultiTurnWorkflow`: retry with feedback up to ``max_turns``.
"""

from areal.workflow.multi_turn import MultiTurnWorkflow
from areal.workflow.rlvr import RLVRWorkflow

__all__ = ["MultiTurnWorkflow", "RLVRWorkflow"]
