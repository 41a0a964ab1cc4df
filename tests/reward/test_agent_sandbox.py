"""The agent sandbox (areal.reward.agent_sandbox, ``workflow.agent.sandbox: true``): an agent
program runs its episode through the proxy from inside bubblewrap's namespaces, seeing only its
own processes, a minimal environment, no host file outside its read-only binds, and no writable
place but its private /tmp; a sandbox that cannot run is refused before the run, naming why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areal.api.config.reward import AgentConfig
from areal.reward.agent_sandbox import sandbox_problem
from areal.workflow.agent_cmd import command_problems
from tests.workflow.test_agent_proxy import ToolThenAnswer, _episodes

PROBE = f"{sys.executable} {Path(__file__).with_name('sandbox_probe_agent.py')}"


@pytest.mark.skipif(bool(sandbox_problem(sys.executable)), reason="no user namespaces here")
def test_a_sandboxed_agent_trains_through_the_proxy_and_sees_nothing_else(tiny_tokenizer, tmp_path):
    secret = tmp_path / "secret.txt"  # a host file outside every bind
    secret.write_text("not for agents")
    item = {"id": "q0", "secret": str(secret)}
    engine = ToolThenAnswer(tiny_tokenizer)
    wf, (group,) = _episodes(tiny_tokenizer, engine, tmp_path, [item], command=PROBE, sandbox=True)
    assert [t.reward for t in group] == [1.0, 1.0]  # it reached the proxy and posted
    log = (tmp_path / "logs" / "agent_stderr.log").read_text().splitlines()
    facts = [json.loads(line.split("] ", 1)[1]) for line in log]
    assert len(facts) == 2
    for f in facts:
        assert set(f["env"]) <= {"PATH", "HOME", "LANG", "PWD", "OPENAI_BASE_URL", "OPENAI_API_KEY"}
        assert f["pids"] == [1, 2]  # bubblewrap's init and the agent: nothing of the host
        assert not f["sees_secret"] and not f["cwd_writable"] and f["tmp_writable"]


def test_sandbox_and_fork_server_exclude_each_other_before_the_run():
    config = AgentConfig(command=PROBE, sandbox=True, fork_server=True)
    assert any("exclude each other" in p for p in command_problems(config))
