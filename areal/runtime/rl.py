"""The rollout side of an RL entry script, shared by Lite's (``examples/gsm8k_grpo.py``) and
Core's (``areal core sync-ppo``): the client to the registered generation servers, the reward
workers, the training and eval workflows, the workflow executor, and held-out evaluation; when
distilling, the teacher's client and its scoring of every training group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from areal.api.config import GRPOConfig
from areal.api.config.reward import ENV_WORKFLOWS
from areal.api.launch import LaunchEnv, agent_proxy_token
from areal.api.workflow import RolloutWorkflow
from areal.reward.resolve import resolve_reward
from areal.reward.runner import RewardRunner
from areal.rollout.executor import WorkflowExecutor
from areal.rollout.remote import RemoteInferenceEngine, discover_servers
from areal.runtime.run import Run
from areal.utils.name_resolve import agent_proxy_key, gen_teacher_key, make_repository
from areal.workflow.agent import AgentWorkflow
from areal.workflow.agent_cmd import AgentCommandWorkflow
from areal.workflow.agent_control import ProxyClient
from areal.workflow.custom import make_custom_workflow
from areal.workflow.distill import TeacherScored
from areal.workflow.envs import make_env_workflow
from areal.workflow.multi_turn import MultiTurnWorkflow
from areal.workflow.rlvr import RLVRWorkflow


def make_workflow(cfg: GRPOConfig, reward, tokenizer, dump_dir) -> RolloutWorkflow:
    """The training workflow ``workflow.type`` names (yours by ``module:Class``)."""
    if cfg.workflow.type == "multi_turn":
        return MultiTurnWorkflow(reward, cfg.gconfig, tokenizer, cfg.workflow, dump_dir)
    if cfg.workflow.type == "agent":  # your openai-client agent, trained as it is (docs/agents.md)
        return AgentWorkflow(cfg.workflow.agent, cfg.gconfig, tokenizer, server=cfg.server)
    if cfg.workflow.type == "agent_cmd":  # your agent program, through the agent proxy
        return AgentCommandWorkflow(
            cfg.workflow.agent,
            cfg.gconfig,
            tokenizer,
            agent_proxy_client(cfg),
            Path(dump_dir).parent / "logs",
        )
    if cfg.workflow.type in ENV_WORKFLOWS:  # an environment hub's tasks (docs/environments.md)
        return make_env_workflow(cfg.workflow, cfg.gconfig, tokenizer, server=cfg.server)
    if cfg.workflow.type != "rlvr":
        return make_custom_workflow(cfg.workflow.type, reward, cfg.gconfig, tokenizer)
    return RLVRWorkflow(
        reward,
        cfg.gconfig,
        tokenizer,
        cfg.workflow,
        dump_dir,
        greedy_baseline=cfg.actor.remax_baseline,
    )


def registration_wait(cfg: GRPOConfig) -> float:
    """Seconds a process of a launched run waits for the trial's servers (or its agent proxy) to
    register: ``launcher.server_setup_timeout`` + ``rollout.setup_timeout``, as a launcher may
    start it beside them (``areal launch local`` does)."""
    return cfg.launcher.server_setup_timeout + cfg.rollout.setup_timeout


def agent_proxy_client(cfg: GRPOConfig) -> ProxyClient:
    """The control client of the trial's agent proxy, the role the launchers start with
    ``workflow.type: agent_cmd`` (areal.launcher.agent_proxy_task): its address from the trial
    registry (waiting up to :func:`registration_wait`), its token from the launcher's env."""
    token = agent_proxy_token()
    if not token:
        raise ValueError(
            "workflow.type=agent_cmd: no agent proxy control token in the environment "
            "(AREAL_AGENT_PROXY_TOKEN); start the run with `areal launch local|ray|slurm`, "
            "which starts the agent proxy and passes it"
        )
    registry = make_repository(cfg.cluster.name_resolve, cfg.name_resolve_root)
    key = agent_proxy_key(cfg.experiment_name, cfg.trial_name)
    return ProxyClient(registry.wait_subtree(key, 1, registration_wait(cfg))[0], token)


@dataclass
class RolloutSide:
    """What an RL script generates with; :meth:`close` frees it."""

    rollout: RemoteInferenceEngine
    reward: RewardRunner
    workflow: RolloutWorkflow  # training rollouts (teacher-scored when distilling)
    eval_workflow: RolloutWorkflow
    executor: WorkflowExecutor
    agent: AgentWorkflow | None = None  # the training workflow when it is an agent's (its stats)
    teacher: RemoteInferenceEngine | None = None  # distillation teacher's servers

    def batch_stats(self) -> dict[str, float]:
        """The last training batch's rollout stats: executor, reward workers, client, agents."""
        agent = self.agent.stats() if self.agent is not None else {}
        return {
            **self.executor.last_batch_stats,
            **self.reward.commit_batch(),
            **self.rollout.stats(),
            **agent,
        }

    def evaluate(self, valid_loader: Iterable[list[dict]], run: Run) -> None:
        """Record the held-out accuracy of the servers' current weights (:func:`evaluate`)."""
        evaluate(self.executor, valid_loader, self.eval_workflow, run)

    def close(self) -> None:
        for wf in {id(w): w for w in (self.agent, self.eval_workflow)}.values():
            if isinstance(wf, AgentCommandWorkflow):  # its control client runs on that loop
                self.executor.run_on_loop(wf.aclose(), timeout=10.0)
        self.executor.destroy()
        self.rollout.destroy()
        if self.teacher is not None:
            self.teacher.destroy()
        self.reward.close()


def make_teacher(cfg: GRPOConfig, run) -> RemoteInferenceEngine | None:
    """The client to the distillation teacher's servers (``distill.addresses``, else the ones the
    launcher registered under the trial's teacher key); None when not distilling, or when Core
    scores with a teacher node instead (no servers). Teacher servers are never updated nor
    restarted."""
    d = cfg.distill
    if not d.enabled or not (d.addresses or d.n_servers):
        return None
    config = dataclasses.replace(cfg.rollout, addresses=list(d.addresses))
    teacher = RemoteInferenceEngine(
        config,
        api_key=cfg.server.api_key,
        no_restart_reason="distillation teacher servers are not restarted",
    )
    key = gen_teacher_key(cfg.experiment_name, cfg.trial_name)
    wait_s = registration_wait(cfg)
    teacher.initialize(discover_servers(config, run.registry(), key, d.n_servers, wait_s))
    return teacher


def server_restarts(cfg: GRPOConfig, env: LaunchEnv) -> tuple[int, str]:
    """(times the launcher restarts a generation server that dies, '') or (0, why it does not):
    the client's server-loss policy (wait for a restart, or fail fast naming this reason)."""
    if cfg.rollout.addresses:
        return 0, "servers given by rollout.addresses are not restarted"
    if not env.launcher_pid:
        return 0, "no areal launcher started them"
    why = cfg.server_restart_blocker()
    if why or cfg.launcher.server_restarts == 0:
        return 0, why or "launcher.server_restarts=0"
    return cfg.launcher.server_restarts, ""


def setup_rollout(cfg: GRPOConfig, run) -> RolloutSide:
    """Client to the registered servers, reward workers, workflows, executor (its batch is this
    trainer rank's share of ``train_dataset.batch_size`` groups)."""
    restarts, why_not = server_restarts(cfg, run.env)
    rollout = RemoteInferenceEngine(
        cfg.rollout, api_key=cfg.server.api_key, server_restarts=restarts, no_restart_reason=why_not
    )
    rollout.initialize(
        discover_servers(
            cfg.rollout,
            run.registry(),
            run.servers_key,
            cfg.cluster.n_servers,
            registration_wait(cfg),
        )
    )
    reward = RewardRunner(resolve_reward(cfg.reward_fn), cfg.reward)
    workflow = make_workflow(cfg, reward, run.tokenizer, run.run_dir / "rollouts")
    teacher = make_teacher(cfg, run)
    train_workflow = (
        workflow if teacher is None else TeacherScored(workflow, teacher, cfg.distill.timeout)
    )
    eval_workflow = RLVRWorkflow(reward, cfg.eval_gconfig, run.tokenizer)
    if cfg.workflow.type == "agent":
        eval_workflow = AgentWorkflow(
            cfg.workflow.agent, cfg.eval_gconfig, run.tokenizer, server=cfg.server
        )
    elif cfg.workflow.type in ENV_WORKFLOWS:
        eval_workflow = make_env_workflow(
            cfg.workflow, cfg.eval_gconfig, run.tokenizer, server=cfg.server
        )
    elif cfg.workflow.type == "agent_cmd":
        eval_workflow = AgentCommandWorkflow(
            cfg.workflow.agent,
            cfg.eval_gconfig,
            run.tokenizer,
            agent_proxy_client(cfg),
            run.run_dir / "logs",
        )
    executor = WorkflowExecutor(
        cfg.rollout,
        rollout,
        batch_size=cfg.train_dataset.batch_size // run.world_size,
        worker=f"rank{run.rank}",
    )
    executor.initialize()
    return RolloutSide(
        rollout,
        reward,
        train_workflow,
        eval_workflow,
        executor,
        agent=workflow if isinstance(workflow, AgentWorkflow) else None,
        teacher=teacher,
    )


def evaluate(executor: WorkflowExecutor, valid_loader, workflow: RolloutWorkflow, run) -> None:
    """Record held-out accuracy (mean reward of ``eval_gconfig`` samples); not staleness-bound."""
    with run.tracker.timer("eval"):
        for items in valid_loader:
            for group in executor.rollout_batch(items, workflow):
                run.tracker.mean("eval/accuracy", torch.tensor([t.reward for t in group]))
