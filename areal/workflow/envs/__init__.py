"""Environments other people wrote, trained as rollout workflows (docs/environments.md).

``workflow.type`` ``reasoning_gym`` (:mod:`.reasoning_gym`), ``openenv`` (:mod:`.openenv`) and
``verifiers`` (:mod:`.verifiers`), each an :class:`~areal.workflow.envs.base.EnvWorkflow` (an
agent workflow whose agent plays one environment episode; faults and counters there), built by
:func:`make_env_workflow`. The hubs' packages are imported by the episodes, not here.
"""

from __future__ import annotations

from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import WorkflowConfig
from areal.api.config.server import GenerationServerConfig
from areal.dataset.envs import missing_extra, require
from areal.utils.imports import import_by_path
from areal.workflow.envs.base import EnvWorkflow
from areal.workflow.envs.openenv import OpenEnvWorkflow
from areal.workflow.envs.reasoning_gym import ReasoningGymWorkflow
from areal.workflow.envs.verifiers import VerifiersWorkflow
from areal.workflow.openai_client import DEFAULT_SERVER


def make_env_workflow(
    cfg: WorkflowConfig,
    gconfig: GenerationHyperparameters,
    tokenizer: Any,
    server: GenerationServerConfig = DEFAULT_SERVER,
) -> EnvWorkflow:
    """The workflow of ``cfg.type`` (one of ``ENV_WORKFLOWS``); ImportError naming the envs
    extra when its package is missing."""
    require(cfg.type)
    if cfg.type == "reasoning_gym":
        return ReasoningGymWorkflow(cfg, gconfig, tokenizer, server)
    if cfg.type == "openenv":
        return OpenEnvWorkflow(cfg, gconfig, tokenizer, server)
    if cfg.type == "verifiers":
        return VerifiersWorkflow(cfg, gconfig, tokenizer, server)
    raise ValueError(f"workflow.type: {cfg.type!r} is not an environment workflow")


# the dataset path each type's items come from (areal.dataset.envs)
DATASET_PREFIX = {
    "reasoning_gym": "reasoning_gym:",
    "openenv": "openenv",
    "verifiers": "verifiers:",
}


def env_problems(cfg: WorkflowConfig, train_path: str = "") -> list[str]:
    """What stops ``cfg.type``'s environment from running here, before anything starts: its
    package missing (one line naming the envs extra), ``workflow.env`` not importing, or a
    training dataset (``train_path``) that is not the environment's."""
    problem = missing_extra(cfg.type)
    if problem:
        return [problem]
    problems = []
    prefix = DATASET_PREFIX[cfg.type]
    if train_path and not train_path.startswith(prefix):
        problems.append(
            f"train_dataset.path: {train_path!r} does not hold workflow.type={cfg.type} items; "
            f"use {prefix}... (docs/environments.md)"
        )
    local = not cfg.env.startswith(("http://", "https://"))  # a server is reached at an episode
    if cfg.type in ("openenv", "verifiers") and local:
        try:
            import_by_path(cfg.env, "workflow.env")
        except ValueError as e:
            problems.append(str(e))
    return problems
