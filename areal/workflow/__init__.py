"""Rollout workflows: one dataset item -> a scored group of trajectories.

* :class:`areal.workflow.rlvr.RLVRWorkflow`: single turn, ``n_samples`` per prompt.
* :class:`areal.workflow.multi_turn.MultiTurnWorkflow`: retry with feedback up to ``max_turns``.
* :class:`areal.workflow.agent.AgentWorkflow`: an agent written with the openai client, run
  through :class:`areal.workflow.openai_client.ArealOpenAI` (docs/agents.md).

Import each from its module: the package itself imports nothing, so the processes that need only
a light module of it (the launchers' agent-proxy key, ``agent_control``) do not load torch.
"""
