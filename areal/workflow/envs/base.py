"""The base of the environment workflows (areal.workflow.envs; docs/environments.md).

``workflow.type`` ``reasoning_gym``, ``openenv`` and ``verifiers`` (the modules beside this one)
each run an environment hub's episodes against the rollout
engine through :class:`~areal.workflow.openai_client.ArealOpenAI`, so every generated token
keeps its weight version and behaviour logprob, and each is an
:class:`~areal.workflow.agent.AgentWorkflow`: ``n_samples`` episodes per item, concatenated into
one trajectory each, the group dropped when any episode fails.

Faults. Every call into the environment (reset, step, a scorer, a rubric) runs under
``workflow.env_timeout`` (a blocking call in a worker thread, a coroutine as it is); one that
raises, runs late or yields a reward that is None or not finite fails its episode: counted
(``agent/env_errors``, ``agent/env_timeouts``, ``agent/env_bad_rewards`` beside
``agent/episodes_failed``), its group dropped, the run goes on; more than
``workflow.agent.max_failure_fraction`` of the last 64 episodes failing stops it. A thread stuck
in a blocking call cannot be killed: it is abandoned (the episode is already dropped).

The hubs' packages are the ``envs`` extra; ``areal.dataset.envs.require`` refuses in one line
without them.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import WorkflowConfig
from areal.api.config.server import GenerationServerConfig
from areal.api.sampling import reward_problems
from areal.dataset.envs import require
from areal.workflow.agent import AgentWorkflow
from areal.workflow.openai_client import DEFAULT_SERVER


class EnvFault(RuntimeError):
    """A call into the environment raised, ran late or gave a bad reward: its episode fails."""


class EnvWorkflow(AgentWorkflow):
    """An :class:`AgentWorkflow` whose agent is :meth:`episode`: one environment episode played
    by the model through ``client`` (an :class:`ArealOpenAI`), returning its reward."""

    kind = "env"

    def __init__(
        self,
        cfg: WorkflowConfig,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        server: GenerationServerConfig = DEFAULT_SERVER,
    ):
        require(self.kind)
        agent = dataclasses.replace(  # one sequence per episode, model turns between env turns
            cfg.agent, path="", command="", trajectory="concat", on_template_mismatch="error"
        )
        super().__init__(agent, gconfig, tokenizer, agent=self.episode, server=server)
        self.cfg = cfg
        self.counts.update(env_errors=0, env_timeouts=0, env_bad_rewards=0)

    @property
    def described(self) -> str:
        return f"workflow.type={self.kind} workflow.env={self.cfg.env!r}"

    @abc.abstractmethod
    async def episode(self, client: Any, item: dict) -> float:
        """Play one episode of ``item`` with ``client``; the episode's reward."""

    async def call_env(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` under ``workflow.env_timeout``: a coroutine function awaited, a
        plain one in a worker thread; a raise or a late answer is an :class:`EnvFault`."""
        call = fn(*args, **kw) if inspect.iscoroutinefunction(fn) else None
        aw = call if call is not None else asyncio.to_thread(fn, *args, **kw)
        try:
            return await asyncio.wait_for(aw, self.cfg.env_timeout)
        except TimeoutError:
            self.counts["env_timeouts"] += 1
            raise EnvFault(
                f"{what} ran past workflow.env_timeout={self.cfg.env_timeout}s"
            ) from None
        except Exception as e:
            self.counts["env_errors"] += 1
            raise EnvFault(f"{what} raised {e!r}") from e

    def checked_reward(self, reward: Any, what: str) -> float:
        """``reward`` as a float; an :class:`EnvFault` (counted) when it is None, not a number,
        or not finite as a float32 (the training dtype). A bool counts as 0/1."""
        reward = float(reward) if isinstance(reward, bool) else reward
        if not reward_problems("reward", reward):
            return float(reward)
        self.counts["env_bad_rewards"] += 1
        raise EnvFault(f"{what} gave the reward {reward!r}; an episode needs a finite number")
