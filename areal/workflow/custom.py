"""A workflow of the user's, named by ``workflow.type: module:Class``: a
:class:`~areal.api.workflow.RolloutWorkflow` subclass built as ``Class(reward, gconfig,
tokenizer)`` (the reward runner, the rollout sampling section, the tokenizer)."""

from __future__ import annotations

from typing import Any

from areal.api.workflow import RolloutWorkflow
from areal.utils.imports import import_by_path


def workflow_class(spec: str) -> type[RolloutWorkflow]:
    """The class ``spec`` names; ValueError naming ``workflow.type`` when it does not import or
    is not a RolloutWorkflow subclass."""
    cls = import_by_path(spec, "workflow.type")
    if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
        raise ValueError(
            f"workflow.type: {spec} is not a subclass of areal.api.workflow.RolloutWorkflow"
        )
    return cls


def make_custom_workflow(spec: str, reward: Any, gconfig: Any, tokenizer: Any) -> RolloutWorkflow:
    """``Class(reward, gconfig, tokenizer)`` for ``workflow.type: module:Class``."""
    return workflow_class(spec)(reward, gconfig, tokenizer)
