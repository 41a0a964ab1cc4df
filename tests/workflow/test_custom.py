"""workflow.type by import path: a RolloutWorkflow subclass of the user's, or an error naming
the field, the value and the fix."""

from __future__ import annotations

import pytest

from areal.api.config.reward import WorkflowConfig
from areal.workflow.custom import make_custom_workflow, workflow_class


def test_a_subclass_by_import_path_is_built_with_reward_gconfig_tokenizer(tmp_path, monkeypatch):
    (tmp_path / "my_wf_t.py").write_text(
        "from areal.api.workflow import RolloutWorkflow\n"
        "class W(RolloutWorkflow):\n"
        "    def __init__(self, reward, gconfig, tokenizer):\n"
        "        self.args = (reward, gconfig, tokenizer)\n"
        "    async def arun_episode(self, engine, item):\n        return None\n"
        "class NotAWorkflow:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert make_custom_workflow("my_wf_t:W", "r", "g", "t").args == ("r", "g", "t")
    with pytest.raises(ValueError, match="workflow.type: my_wf_t:NotAWorkflow is not a subclass"):
        workflow_class("my_wf_t:NotAWorkflow")
    with pytest.raises(ValueError, match="workflow.type: cannot import 'no_such_wf_mod'"):
        workflow_class("no_such_wf_mod:W")


def test_the_config_refuses_a_type_that_is_neither_builtin_nor_an_import_path():
    assert list(WorkflowConfig(type="my_wf:W").check()) == []
    [problem] = list(WorkflowConfig(type="rlvr2").check())
    assert problem.startswith(
        "type: 'rlvr2' is not rlvr, multi_turn, agent, agent_cmd, reasoning_gym, openenv, "
        "verifiers or an import path"
    )
