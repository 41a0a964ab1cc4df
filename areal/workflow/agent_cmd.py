"""Train an agent that runs as its own program (``workflow.type: agent_cmd``; docs/agents.md,
"Bring your own agent").

Per episode the workflow opens a session on the agent proxy (areal.workflow.agent_proxy, a role
the launchers start; through its control API,
:class:`~areal.workflow.agent_control.ProxyClient`) and starts ``workflow.agent.command`` with
``OPENAI_BASE_URL`` (the proxy's ``/v1``) and ``OPENAI_API_KEY`` (the session's key) in its
environment (the trainer's, without the run's variables and secrets: no control token, no admin
key; areal.api.launch.agent_env) and the dataset item as one JSON object on its stdin: a process
of its own, or forked from a fork server that imported the script once (``fork_server``,
areal.workflow.agent_fork), or inside the code sandbox's namespaces (``sandbox``,
areal.reward.agent_sandbox). When the session ends the proxy answers its record. The agent makes
its calls with whatever client it likes; each is recorded in tokens by the same code as the
in-process path (:class:`AgentWorkflow`, whose failure accounting and trajectory building this
class inherits). The episode ends:

* when the agent POSTs ``{"reward": r}`` to ``$OPENAI_BASE_URL/reward`` (the process is given
  :data:`EXIT_GRACE` seconds to exit, then killed);
* when it exits with code 0 without posting, if ``workflow.agent.reward_path`` names
  ``reward(item, stdout) -> float``: that is the reward;
* otherwise as a failure, counted and dropped with its group: an exit without a reward (a
  crash, a kill: the session ends with the process, other sessions go on), or the deadline
  ``workflow.agent.episode_timeout`` passing (the process group is killed; counted apart as
  ``agent/deadline_drops`` and logged with the episode's name).

Each agent's stderr goes to ``<log_dir>/agent_stderr.log``, every line prefixed with its
episode's name (at most :data:`STDERR_LIMIT` bytes per episode).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.api.engine import InferenceEngine
from areal.api.launch import agent_env
from areal.api.sampling import reward_problems
from areal.reward.agent_sandbox import sandbox_argv, sandbox_problem
from areal.utils.imports import import_by_path
from areal.utils.logging import get_logger
from areal.utils.process import parent_death_signal
from areal.workflow.agent import AgentWorkflow, import_failure
from areal.workflow.agent_control import ProxyClient, SessionRecord
from areal.workflow.agent_fork import ForkServer, fork_script
from areal.workflow.openai_client import EngineFailure

logger = get_logger("agent_cmd")
EXIT_GRACE = 5.0  # seconds an agent may take to exit after posting its reward
STDERR_LIMIT = 65536  # bytes of one agent's stderr kept in the log
STDOUT_LIMIT = 1 << 20  # bytes of one agent's stdout kept for the reward function
SESSION_GRACE = 60.0  # seconds past the episode deadline the proxy keeps an unclosed session


def command_argv(command: str) -> list[str]:
    """``command`` split as a shell would; a leading ``python`` is this process's interpreter
    (the trainer's environment, whatever is first on PATH)."""
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def command_problems(config: AgentConfig) -> list[str]:
    """What keeps ``workflow.agent.command`` (and ``reward_path``) from running, checked before
    the run starts: a program not found, a reward function that does not import."""
    problems = []
    argv = command_argv(config.command)
    if argv and shutil.which(argv[0]) is None:
        problems.append(
            f"workflow.agent.command: program {argv[0]!r} is not found (not a file, not on "
            "PATH); give its path, e.g. 'python my_agent.py'"
        )
    if config.sandbox and config.fork_server:
        problems.append(
            "workflow.agent: sandbox and fork_server exclude each other (a fork server's episodes "
            "would share one sandbox); set one of them to false"
        )
    elif config.sandbox and (why := sandbox_problem(sys.executable)):
        problems.append(f"workflow.agent.sandbox: {why}")
    if config.fork_server and not problems:
        try:
            fork_script(argv)
        except ValueError as e:
            problems.append(str(e))
    if config.reward_path:
        try:
            import_by_path(config.reward_path, "workflow.agent.reward_path")
        except ValueError as e:
            problems.append(str(e))
    return problems


class AgentEpisodeError(RuntimeError):
    """The agent process ended its episode without a reward (exit, crash, kill, deadline)."""


@dataclass
class _Outcome:
    """How an agent process's run ended, before its session's record is read."""

    deadline: bool  # killed at workflow.agent.episode_timeout
    code: int | None  # its exit code (None: killed by us)
    stdout: bytes
    stderr_tail: str = ""  # the last line it wrote to stderr


class AgentCommandWorkflow(AgentWorkflow):
    """``n_samples`` episodes of an agent program per item, through the agent proxy."""

    def __init__(
        self,
        config: AgentConfig,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        proxy: ProxyClient,
        log_dir: Path | None = None,
    ):
        if not config.command.strip():
            raise ValueError(
                "workflow.agent.command: empty; name the agent program, e.g. 'python my_agent.py'"
            )
        super().__init__(config, gconfig, tokenizer)
        problems = command_problems(config)
        if problems:
            raise ValueError("; ".join(problems))
        self.argv = command_argv(config.command)
        self.reward_fn = (
            import_by_path(config.reward_path, "workflow.agent.reward_path")
            if config.reward_path
            else None
        )
        self.log_path = None if log_dir is None else Path(log_dir) / "agent_stderr.log"
        self.counts["deadline_drops"] = 0
        self.proxy = proxy
        self.open_sessions = 0
        self._slots: asyncio.Semaphore | None = None
        self.forks = ForkServer(self.argv) if config.fork_server else None
        self._forks_ready: asyncio.Future | None = None

    def stats(self) -> dict[str, float]:
        """The agent counters, plus this workflow's sessions open right now."""
        return {**super().stats(), "agent/open_sessions": float(self.open_sessions)}

    async def aclose(self) -> None:
        """Close the control connection and stop the fork server (on the loop that used them)."""
        await self.proxy.aclose()
        if self.forks is not None:
            await self.forks.aclose()

    async def _spawn(self, key: str) -> Any:
        """The episode's process (forked by the fork server when configured), with its
        session's ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` and none of the run's secrets."""
        session = {"OPENAI_BASE_URL": self.proxy.base_url, "OPENAI_API_KEY": key}
        if self.forks is not None:
            if self._forks_ready is None:  # started once, by the first episode
                sink = functools.partial(self._log_stderr, name="fork-server")
                self._forks_ready = asyncio.ensure_future(self.forks.start(sink, self.described))
            await asyncio.shield(self._forks_ready)
            return await self.forks.spawn(self.argv, session)
        argv = sandbox_argv(self.argv, session) if self.config.sandbox else self.argv
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=agent_env(session),
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGKILL),
        )

    async def _run_agent(
        self, engine: InferenceEngine, item: dict, group_id: str, index: int
    ) -> tuple[SessionRecord, Any]:
        if self._slots is None and self.config.max_agents:  # on the loop that runs episodes
            self._slots = asyncio.Semaphore(self.config.max_agents)
        if self._slots is None:
            return await self._session(engine, item, group_id, index)
        async with self._slots:
            return await self._session(engine, item, group_id, index)

    async def _session(
        self, engine: InferenceEngine, item: dict, group_id: str, index: int
    ) -> tuple[SessionRecord, Any]:
        """Open the episode's session, run the agent, take the record; the reward is the one
        posted, else the one the exit earns (module docstring)."""
        name = f"{group_id}/{index}"
        sid, key = await self.proxy.open(
            group_id, name, self.gconfig, engine.get_version(),
            self.config.episode_timeout + SESSION_GRACE,
        )  # fmt: skip
        self.open_sessions += 1
        try:
            outcome = await self._supervise(sid, key, item, name)
        finally:
            self.open_sessions -= 1
            record = await self.proxy.close(sid)
            self.counts["calls_rejected"] += record.rejected
        if record.engine_failure is not None:  # infrastructure: stops the run
            raise EngineFailure(record.engine_failure)
        if record.reward is not None:
            return record, record.reward
        if outcome.deadline:
            self.counts["deadline_drops"] += 1
            logger.warning(
                "agent %s passed its deadline (workflow.agent.episode_timeout=%s s): killed, "
                "dropped", name, self.config.episode_timeout,
            )  # fmt: skip
            raise AgentEpisodeError(
                f"agent {name} posted no reward within workflow.agent.episode_timeout="
                f"{self.config.episode_timeout} s; killed and dropped"
            )
        return record, await self._exit_reward(outcome, item, name)

    async def _supervise(self, sid: str, key: str, item: dict, name: str) -> _Outcome:
        """Run the agent until its session ends (a posted reward: it then has
        :data:`EXIT_GRACE` s to exit), it exits, or its deadline passes; kill what is left."""
        proc = await self._spawn(key)
        pipes = asyncio.gather(
            _read(proc.stdout, STDOUT_LIMIT), self._log_stderr(proc.stderr, name)
        )
        try:
            proc.stdin.write(json.dumps(item, default=str).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent exited before reading its item: judged by its exit below
        ended = asyncio.ensure_future(self.proxy.wait_ended(sid, self.config.episode_timeout))
        exited = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait(
                [ended, exited],
                timeout=self.config.episode_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if ended.done() and ended.exception() is not None:
                raise ended.exception()  # the proxy is gone: infrastructure
            if ended.done() and ended.result():
                await asyncio.wait([exited], timeout=EXIT_GRACE)
            if not exited.done():
                return _Outcome(not ended.done() or not ended.result(), None, b"")
            stdout, tail = await pipes
            return _Outcome(False, proc.returncode, stdout, tail)
        finally:
            _kill(proc)
            ended.cancel()
            await asyncio.gather(ended, exited, pipes, return_exceptions=True)

    async def _exit_reward(self, outcome: _Outcome, item: dict, name: str) -> float:
        """The reward of an agent that exited without posting one (module docstring); an agent
        that could not import its module or framework stops the run (AgentSetupError)."""
        code, tail = outcome.code, outcome.stderr_tail
        if code != 0 or self.reward_fn is None:
            interpreter = shutil.which(self.argv[0]) or self.argv[0]
            cannot_run = import_failure(tail, interpreter, self.described)
            if code and cannot_run is not None:
                raise cannot_run
            last = f" (its last stderr line: {tail.strip()[:300]})" if tail.strip() else ""
            where = f"; its stderr is in {self.log_path}" if self.log_path else ""
            raise AgentEpisodeError(
                f"agent {name} exited with code {code} without posting a reward{last}{where}"
            )
        stdout = outcome.stdout.decode(errors="replace")
        reward = await asyncio.to_thread(self.reward_fn, item, stdout)
        problems = reward_problems("reward", reward)
        if problems:
            raise AgentEpisodeError(
                f"workflow.agent.reward_path {self.config.reward_path} returned "
                f"{str(reward)[:80]} for agent {name}: {problems[0][1]}"
            )
        return float(reward)

    async def _log_stderr(self, stream: asyncio.StreamReader, name: str) -> str:
        """Copy the agent's stderr into the run's log, lines prefixed by the episode's name;
        the last non-blank line (Python's error line when it crashed)."""
        kept, last = 0, ""
        while line := await stream.readline():
            last = line.decode(errors="replace") if line.strip() else last
            if self.log_path is not None and kept < STDERR_LIMIT:
                kept += len(line)
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "a", errors="replace") as f:
                    f.write(f"[{name}] {line.decode(errors='replace').rstrip()}\n")
        return last.strip()


async def _read(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Everything ``stream`` says, the first ``limit`` bytes kept."""
    out = b""
    while chunk := await stream.read(65536):
        out += chunk[: max(0, limit - len(out))]
    return out


def _kill(proc: asyncio.subprocess.Process) -> None:
    """Kill the agent's whole process group (it may have started children, which outlive it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
