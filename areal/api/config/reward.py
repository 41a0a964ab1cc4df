"""Reward-execution and rollout-workflow config sections (owned by areal.reward / areal.workflow).

Conventions (see loader.py): frozen dataclasses, every field a :func:`param` with help text and a
real default, bounds on the field, cross-field rules in ``check()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param
from areal.utils.imports import IMPORT_PATH

# the environment hubs' workflow types (areal.workflow.envs; docs/environments.md)
ENV_WORKFLOWS = ("reasoning_gym", "openenv", "verifiers")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for running model-written code (areal.reward.sandbox)."""

    case_timeout: float = param(
        4.0, gt=0, help="Wall-clock seconds per test case; the case fails when exceeded."
    )
    submission_timeout: float = param(
        20.0, gt=0, help="Wall-clock seconds for all cases of one submission; later cases fail."
    )
    cpu_seconds: int = param(4, ge=1, help="RLIMIT_CPU per case process (seconds of CPU).")
    memory_mb: int = param(1024, ge=64, help="RLIMIT_AS per case process (MiB of address space).")
    max_processes: int = param(
        16,
        ge=1,
        help="Processes + threads one submission may hold, counted per sandbox (its own user "
        "namespace), never against the user's other processes.",
    )
    max_file_mb: int = param(
        4, ge=1, help="RLIMIT_FSIZE (MiB): caps every file the code writes, stdout included."
    )
    max_output_bytes: int = param(
        65536, ge=1024, help="Bytes of stdout/stderr read back per case (the rest is dropped)."
    )
    tmpfs_mb: int = param(
        64,
        ge=1,
        help="Size cap (MiB) of each private tmpfs the code sees: its working dir, /tmp and "
        "/dev/shm (RAM, freed when the case ends).",
    )
    python: str = param(
        "",
        help="Interpreter for submissions; empty = ours if the sandbox user may execute it, "
        "else /usr/bin/python3. Its prefix is mounted read-only inside the sandbox.",
    )
    isolation: Literal["required", "best_effort"] = param(
        "required",
        help="required: refuse to run (naming the missing layer and its fix) unless namespaces "
        "(bubblewrap) and seccomp both hold; best_effort: run with the layers this machine "
        "gives, logged once and named in each result (see docs/sandbox.md).",
    )
    scoring: Literal["fraction", "all_pass"] = param(
        "fraction", help="fraction: reward = passed / total cases; all_pass: 1.0 only if all pass."
    )

    def check(self) -> Iterator[str]:
        if self.case_timeout > self.submission_timeout:
            yield (
                f"case_timeout: {self.case_timeout} exceeds submission_timeout "
                f"{self.submission_timeout}; raise submission_timeout or lower case_timeout"
            )


def reward_fn_problem(spec: str) -> str | None:
    """Why ``spec`` is not a valid ``reward_fn`` value: ``math``, ``code`` or ``module:function``
    (None if its form is right; whether it imports is checked before the run starts)."""
    if spec in ("math", "code") or IMPORT_PATH.fullmatch(spec):
        return None
    return (
        f"reward_fn: {spec!r} is not 'math', 'code' or an import path 'module:function' "
        "(e.g. my_rewards:last_line_reward, my_rewards.py beside the entry script)"
    )


@dataclass(frozen=True)
class RewardConfig:
    """How reward functions run: a process pool with a deadline per call and a failure policy."""

    timeout: float = param(
        30.0, gt=0, help="Seconds one reward call may take; a late worker is killed and replaced."
    )
    n_workers: int = param(2, ge=1, help="Reward worker processes.")
    max_failure_fraction: float = param(
        0.5,
        ge=0,
        le=1,
        help="Stop the run when more than this fraction of a batch's reward calls failed.",
    )
    failure_policy: Literal["zero", "raise"] = param(
        "zero",
        help="zero: a failed call scores 0, is counted and logged; raise: the first failure "
        "stops the run.",
    )
    non_finite: Literal["drop", "zero", "error"] = param(
        "drop",
        help="A reward that is NaN or infinite as float32, the training dtype (1e308 is): drop: "
        "it scores 0 as a failed call (status error_reward, not trained on, counted toward "
        "max_failure_fraction); zero: it scores 0 and is trained on; error: the run stops. "
        "Counted as reward/n_non_finite and logged with its sample id.",
    )
    sandbox: SandboxConfig = param(factory=SandboxConfig, help="Limits for code rewards.")

    def check(self) -> Iterator[str]:
        if self.sandbox.submission_timeout + 2.0 > self.timeout:
            yield (
                f"timeout: {self.timeout}s leaves no margin over sandbox.submission_timeout "
                f"{self.sandbox.submission_timeout}s; set timeout >= submission_timeout + 2 so "
                "the sandbox cleans up its own processes before the worker is killed"
            )


@dataclass(frozen=True)
class AgentConfig:
    """An agent written with the openai client, trained as it is (``workflow.type: agent``;
    areal.workflow.agent, docs/agents.md)."""

    path: str = param(
        "",
        help="Import path 'module:function' of `async def agent(client, item) -> float`: it "
        "talks to `client` as to openai.AsyncOpenAI and returns the episode reward.",
    )
    trajectory: Literal["concat", "per_call"] = param(
        "concat",
        help="concat: one sequence per episode, tool/user tokens between the model's "
        "turns masked out of the loss; per_call: one trajectory per model call (needs "
        "gconfig.n_samples=1: GRPO groups must hold n_samples sequences).",
    )
    on_template_mismatch: Literal["error", "per_call"] = param(
        "error",
        help="concat when a call's prompt does not start with the previous call's prompt + "
        "completion (a template that rewrites earlier turns, an agent that edits them): error "
        "fails the episode (counted, dropped); per_call falls back to per-call trajectories "
        "(needs gconfig.n_samples=1).",
    )
    gamma: float = param(
        1.0,
        ge=0,
        le=1,
        help="Discount of rewards back over an episode's calls: call k gets "
        "r_k + gamma * G_{k+1}; the episode reward counts as the last call's.",
    )
    episode_timeout: float = param(
        600.0,
        gt=0,
        help="Seconds one episode may take; a late one is cancelled, counted and dropped.",
    )
    max_failure_fraction: float = param(
        0.5,
        ge=0,
        le=1,
        help="Stop the run when more than this fraction of the last 64 episodes "
        "raised (an agent bug, not bad luck).",
    )
    command: str = param(
        "",
        help="type=agent_cmd: the agent's command line (split like a shell would, run without "
        "one), e.g. 'python my_agent.py' (a leading python is the trainer's own interpreter); "
        "started once per episode with OPENAI_BASE_URL and OPENAI_API_KEY set to its session on "
        "the agent proxy and the item as JSON on stdin. The "
        'episode ends when it POSTs {"reward": r} to $OPENAI_BASE_URL/reward.',
    )
    reward_path: str = param(
        "",
        help="type=agent_cmd: import path 'module:function' of `reward(item, stdout) -> float`, "
        "called when the agent exits with code 0 without posting a reward; empty: such an episode "
        "fails (counted, dropped).",
    )
    max_agents: int = param(
        0,
        ge=0,
        help="type=agent_cmd: agent processes running at once in this trainer process (0 = "
        "no cap beyond rollout.max_concurrent_rollouts x gconfig.n_samples).",
    )
    fork_server: bool = param(
        False,
        help="type=agent_cmd with a command 'python SCRIPT.py [args]': fork each episode's "
        "process from one server that imported the script's modules once (its __main__ block "
        "runs per episode), instead of paying the imports (~2 s of CPU for an agent framework) "
        "in every episode.",
    )
    sandbox: bool = param(
        False,
        help="type=agent_cmd: run each episode's program in the code sandbox's namespaces "
        "(bubblewrap: user, mount, pid, ipc, uts; read-only system, interpreter and working "
        "directories, a private /tmp, an environment of PATH, HOME and the session's two "
        "variables); the network stays shared to reach the proxy (docs/agents.md). Excludes "
        "fork_server.",
    )
    max_request_mb: float = param(
        4.0,
        gt=0,
        help="type=agent_cmd: largest request body the agent proxy accepts (MiB), checked "
        "before the body is read; a larger one gets 413. 4 MiB of text is far past any "
        "model's context, and each MiB costs ~1 s of tokenization.",
    )


@dataclass(frozen=True)
class WorkflowConfig:
    """Rollout-workflow knobs (areal.workflow): which workflow, multi-turn retries, the dump."""

    type: str = param(
        "rlvr",
        help="rlvr: one answer per sample (RLVRWorkflow); multi_turn: retry with feedback "
        "after a wrong answer, up to max_turns (MultiTurnWorkflow); or your RolloutWorkflow "
        "subclass by import path 'module:Class', built as Class(reward, gconfig, tokenizer); "
        "agent: the openai-client agent function workflow.agent.path names (AgentWorkflow); "
        "agent_cmd: the agent program workflow.agent.command names, in its own process, through "
        "the agent proxy (AgentCommandWorkflow); reasoning_gym, openenv, verifiers: an "
        "environment hub's tasks (workflow.env; docs/environments.md, needs the envs extra).",
    )
    max_turns: int = param(1, ge=1, help="Multi-turn: attempts per episode (1 = single turn).")
    turn_discount: float = param(
        0.9, ge=0, le=1, help="Multi-turn: reward is multiplied by this per extra turn used."
    )
    feedback: str = param(
        "Your answer is incorrect. Think again and give the final answer.",
        help="Multi-turn: user message appended after a wrong answer.",
    )
    dump_rollouts: bool = param(
        False, help="Append prompt/completion/reward as JSONL to RUN_DIR/rollouts/<version>.jsonl."
    )
    agent: AgentConfig = param(
        factory=AgentConfig,
        help="type=agent: the agent function and how its episodes become trajectories.",
    )
    env: str = param(
        "",
        help="type=openenv: an OpenEnv Environment subclass 'module:Class' (one instance per "
        "episode, in this process) or a running OpenEnv server 'http://host:port'; "
        "type=verifiers: the verifiers environment 'module:function' returning a vf.Taskset "
        "(docs/environments.md). reasoning_gym reads its tasks from the dataset path.",
    )
    env_timeout: float = param(
        60.0,
        gt=0,
        help="Seconds one call into an environment (reset, step, a scorer or rubric) may take; "
        "a late call fails its episode (counted as agent/env_timeouts, its group dropped), "
        "never the run.",
    )
    env_action_field: str = param(
        "",
        help="type=openenv: the action's text field the model's answer fills; empty = the "
        "action class's only str field ('message' for a server by address).",
    )

    def check(self) -> Iterator[str]:
        if self.type == "agent" and not IMPORT_PATH.fullmatch(self.agent.path):
            yield (
                f"agent.path: {self.agent.path!r} is not an import path 'module:function'; name "
                "your agent, e.g. agent_arithmetic:calculator_agent (a .py beside the entry script)"
            )
        if self.type == "agent_cmd" and not self.agent.command.strip():
            yield (
                "agent.command: empty with type=agent_cmd; name the agent program, e.g. "
                "'python examples/agent_arithmetic_sdk.py'"
            )
        if self.agent.reward_path and not IMPORT_PATH.fullmatch(self.agent.reward_path):
            yield (
                f"agent.reward_path: {self.agent.reward_path!r} is not an import path "
                "'module:function' (e.g. my_rewards:score_stdout); leave it empty when the agent "
                "posts its reward"
            )
        if self.type not in (
            "rlvr",
            "multi_turn",
            "agent",
            "agent_cmd",
            *ENV_WORKFLOWS,
        ) and not IMPORT_PATH.fullmatch(self.type):
            yield (
                f"type: {self.type!r} is not rlvr, multi_turn, agent, agent_cmd, reasoning_gym, "
                "openenv, verifiers or an import path 'module:Class' (e.g. "
                "my_workflows:SignalOnlyWorkflow, my_workflows.py beside the entry script)"
            )
        yield from self._env_problems()
        if self.type == "rlvr" and self.max_turns > 1:
            yield (
                f"max_turns: {self.max_turns} has no effect with type=rlvr (one turn); set "
                "workflow.type=multi_turn or max_turns=1"
            )

    def _env_problems(self) -> Iterator[str]:
        if self.type == "openenv" and not (
            IMPORT_PATH.fullmatch(self.env) or self.env.startswith(("http://", "https://"))
        ):
            yield (
                f"env: {self.env!r} with type=openenv is not an Environment class 'module:Class' "
                "nor a server 'http://host:port' (e.g. my_envs:GuessEnv)"
            )
        if self.type == "verifiers" and not IMPORT_PATH.fullmatch(self.env):
            yield (
                f"env: {self.env!r} with type=verifiers is not an import path 'module:function' "
                "of a function returning a vf.Taskset (e.g. my_envs:load_taskset)"
            )
