"""Train an agent you already wrote with the openai client (``workflow.type: agent``).

The user's agent is ``async def agent(client, item) -> float``: it talks to ``client`` as to
``openai.AsyncOpenAI`` (``client.chat.completions.create(messages=..., tools=..., ...)``, as
many calls and tool rounds as it likes) and returns the episode's reward. For each dataset item
the workflow runs ``gconfig.n_samples`` episodes concurrently, each with its own
:class:`~areal.workflow.openai_client.ArealOpenAI` backed by the rollout engine (so the
executor's staleness bound and concurrency cap hold for agents too), and turns each episode's
recorded calls into trajectories (areal.workflow.agent_trajectories).

Failures. A call the client or the server refuses for what it asks (a sampling field out of
range, a conversation longer than the context) is raised to the agent as openai's
``BadRequestError`` and counted (``agent/calls_rejected``); the agent may catch it and go on.
An episode whose agent raises (a bug, a tool error, a malformed answer it did not handle, a
refused call it did not catch), returns no finite number, makes no model call, runs past
``episode_timeout`` or cannot be concatenated is counted (``agent/episodes_failed``) and
dropped with the rest of its group (GRPO's group normalisation needs whole groups): the item is
rejected and the executor admits another. More than ``max_failure_fraction`` of the last
:data:`WINDOW` episodes failing stops the run (that is a bug, not bad luck), as does any failure
of the inference engine under a call (an infrastructure error, never counted as the agent's) and
an agent program that cannot import its module or framework (:class:`AgentSetupError`, at the
first episode, with Python's own ``ModuleNotFoundError`` line and the fix).
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.api.config.server import GenerationServerConfig
from areal.api.engine import InferenceEngine
from areal.api.io import Trajectory
from areal.api.sampling import reward_problems
from areal.api.workflow import RolloutWorkflow
from areal.utils.imports import import_by_path
from areal.utils.logging import get_logger
from areal.workflow.agent_trajectories import episode_trajectories
from areal.workflow.openai_client import DEFAULT_SERVER, ArealOpenAI, EngineFailure

logger = get_logger("agent")
Agent = Callable[[Any, dict], Awaitable[float]]
WINDOW = 64  # episodes over which max_failure_fraction is judged


class AgentFailureRate(RuntimeError):
    """Too many episodes raised: the agent (or its task) is broken; the run stops."""


class AgentSetupError(RuntimeError):
    """The agent cannot run in this environment at all (its module or its framework does not
    import in the interpreter that runs it): every episode would fail the same way, so the run
    stops at the first, never counted as an episode's bad luck."""


IMPORT_FAILURE = re.compile(r"(ModuleNotFoundError|ImportError): .*")
MISSING_MODULE = re.compile(r"No module named '([^']+)'")


def import_failure(stderr_line: str, interpreter: str, what: str) -> AgentSetupError | None:
    """The :class:`AgentSetupError` of an agent program whose stderr ended with
    ``stderr_line``, when that is Python's import failure (else None); ``interpreter`` is the
    Python that ran it, ``what`` names the agent in the config."""
    if not IMPORT_FAILURE.fullmatch(stderr_line.strip()):
        return None
    missing = MISSING_MODULE.search(stderr_line)
    package = f"the package that provides {missing.group(1).split('.')[0]!r}" if missing else "it"
    return AgentSetupError(
        f"the agent ({what}) cannot import what it needs in {interpreter}: "
        f"{stderr_line.strip()}. Install {package} into that interpreter ({interpreter} -m pip "
        "install ...), or run the agent with a Python that has it: workflow.agent.command="
        "'/path/to/that/python my_agent.py' (fork_server=false: a fork server runs the "
        "trainer's interpreter)"
    )


def load_agent(spec: str) -> Agent:
    """The agent function ``workflow.agent.path`` names; ValueError when it is not a coroutine
    function."""
    fn = import_by_path(spec, "workflow.agent.path")
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(
            f"workflow.agent.path: {spec} is not an async function "
            "`async def agent(client, item) -> float`"
        )
    return fn


class AgentWorkflow(RolloutWorkflow):
    """``n_samples`` episodes of an openai-client agent per item -> one trajectory group."""

    def __init__(
        self,
        config: AgentConfig,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        agent: Agent | None = None,
        server: GenerationServerConfig = DEFAULT_SERVER,
    ):
        per_call = config.trajectory == "per_call" or config.on_template_mismatch == "per_call"
        if per_call and gconfig.n_samples > 1:
            raise ValueError(
                f"workflow.agent: trajectory={config.trajectory}, "
                f"on_template_mismatch={config.on_template_mismatch} give a varying number of "
                f"trajectories per episode, but gconfig.n_samples={gconfig.n_samples} groups must "
                "hold n_samples sequences each; use trajectory=concat with "
                "on_template_mismatch=error, or gconfig.n_samples=1"
            )
        self.config = config
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.server = server  # the run's server limits, which the clients check calls against
        self.agent = agent if agent is not None or config.command else load_agent(config.path)
        self.counts = {
            "episodes": 0,
            "episodes_failed": 0,
            "groups_dropped": 0,
            "template_fallbacks": 0,
            "calls": 0,
            "calls_rejected": 0,
        }
        self._recent: deque[bool] = deque(maxlen=WINDOW)  # True = that episode failed

    @property
    def described(self) -> str:
        """The agent as the config names it, for errors."""
        if self.config.command:
            return f"workflow.agent.command={self.config.command!r}"
        if self.config.path:
            return f"workflow.agent.path={self.config.path}"
        return getattr(self.agent, "__qualname__", repr(self.agent))

    def stats(self) -> dict[str, float]:
        """Counters since the start, for the step's log (``agent/...``)."""
        out = {f"agent/{k}": float(v) for k, v in self.counts.items()}
        done = self.counts["episodes"] - self.counts["episodes_failed"]
        out["agent/calls_per_episode"] = self.counts["calls"] / max(1, done)  # of the episodes kept
        return out

    async def _run_agent(
        self, engine: InferenceEngine, item: dict, group_id: str, index: int
    ) -> tuple[ArealOpenAI, Any]:
        """Run one episode of the agent: (its client, what it returned as the reward)."""
        client = ArealOpenAI(
            engine, self.tokenizer, self.gconfig, group_id=group_id, server=self.server
        )
        try:
            reward = await asyncio.wait_for(self.agent(client, item), self.config.episode_timeout)
        finally:  # the engine, not the agent, failed (even if the agent caught it): stop the run
            self.counts["calls_rejected"] += client.n_rejected
            if client.engine_failure is not None:
                raise client.engine_failure
        return client, reward

    async def _episode(
        self, engine: InferenceEngine, item: dict, group_id: str, index: int
    ) -> list[Trajectory]:
        client, reward = await self._run_agent(engine, item, group_id, index)
        if reward_problems("reward", reward):  # never trained on: 1e308 is inf in float32
            raise TypeError(
                f"the agent returned {str(reward)[:80]}; it must return the episode reward "
                "(a finite float)"
            )
        self.counts["calls"] += len({c.turn for c in client.calls})
        trajs, fell_back = episode_trajectories(
            client.calls,
            client.call_rewards,
            float(reward),
            self.config.gamma,
            self.config.trajectory,
            self.config.on_template_mismatch,
            f"{group_id}/{index}",
            group_id,
            self.tokenizer,
        )
        self.counts["template_fallbacks"] += int(bool(fell_back))
        if fell_back and self.counts["template_fallbacks"] == 1:  # say once why concat did not run
            logger.warning(
                "episode %s/%d fell back to per-call trajectories: %s", group_id, index, fell_back
            )
        return trajs

    def _record(self, failed: bool, item_id: str, error: BaseException | None) -> None:
        self.counts["episodes"] += 1
        self._recent.append(failed)
        if not failed:
            return
        self.counts["episodes_failed"] += 1
        logger.warning("agent episode on item %s failed and is dropped: %r", item_id, error)
        if (
            len(self._recent) == WINDOW
            and sum(self._recent) > self.config.max_failure_fraction * WINDOW
        ):
            raise AgentFailureRate(
                f"{sum(self._recent)} of the last {WINDOW} agent episodes raised (more than "
                f"workflow.agent.max_failure_fraction={self.config.max_failure_fraction}); the "
                f"last: {error!r}. Fix the agent ({self.described}) or raise the fraction"
            )

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any]
    ) -> list[Trajectory] | None:
        """The group of ``n_samples`` episodes, or None (item rejected) when any of them failed."""
        group_id = str(item.get("id", "")) if isinstance(item, dict) else ""
        outcomes = await asyncio.gather(
            *(self._episode(engine, item, group_id, i) for i in range(self.gconfig.n_samples)),
            return_exceptions=True,
        )
        for (
            out
        ) in outcomes:  # cancellation and engine failures stop the run, never count as the agent's
            if isinstance(out, BaseException) and not _agent_failure(out):
                raise out
        group: list[Trajectory] = []
        for out in outcomes:
            failed = isinstance(out, Exception)
            self._record(failed, group_id, out if failed else None)
            group += [] if failed else out
        if any(isinstance(out, Exception) for out in outcomes):
            self.counts["groups_dropped"] += 1
            return None
        return group


def _agent_failure(out: BaseException) -> bool:
    """An exception the agent's episode raised (counted, dropped), as opposed to an engine
    failure, a cancellation or an agent that cannot run here at all (which propagate)."""
    return isinstance(out, Exception) and not isinstance(out, (EngineFailure, AgentSetupError))
