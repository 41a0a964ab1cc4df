"""The agent fork server (areal.workflow.agent_fork, areal.utils.fork_server): each episode is a
process of its own forked from one server that imported the script once: its stdin, stdout,
stderr, environment overrides and exit code are its own, a kill of its process group ends it
alone, and its imports were paid by the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import pytest

from areal.workflow.agent import WINDOW, AgentFailureRate, AgentSetupError
from areal.workflow.agent_fork import ForkServer, ForkServerDied, fork_script

SCRIPT = """
import json, os, sys, time
ALREADY = "email.mime.multipart" in sys.modules  # in a forked episode: imported by the server
import email.mime.multipart
if __name__ == "__main__":
    item = json.loads(sys.stdin.readline())
    print(json.dumps({"item": item, "key": os.environ["OPENAI_API_KEY"], "argv": sys.argv,
                      "pgid": os.getpgid(0), "pid": os.getpid(), "preloaded": ALREADY}),
          flush=True)
    print("to stderr", file=sys.stderr)
    if item.get("hang"):
        time.sleep(3600)
    sys.exit(item.get("code", 0))
"""


async def _episode(server: ForkServer, item: dict, key: str):
    proc = await server.spawn([sys.executable, server.script, "--flag"], {"OPENAI_API_KEY": key})
    proc.stdin.write(json.dumps(item).encode() + b"\n")
    await proc.stdin.drain()
    proc.stdin.close()
    if item.get("hang"):
        line = await proc.stdout.readline()
        os.killpg(proc.pid, signal.SIGKILL)
        return json.loads(line), b"", await proc.wait()
    out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    return json.loads(out), err, await proc.wait()


def test_each_episode_is_its_own_forked_process_with_its_io_env_and_exit_code(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    stderr_lines: list[bytes] = []

    async def sink(stream):
        while line := await stream.readline():
            stderr_lines.append(line)

    async def run():
        server = ForkServer([sys.executable, str(script)])
        await server.start(sink)
        try:
            return await asyncio.gather(
                _episode(server, {"i": 0}, "k0"),
                _episode(server, {"i": 1, "code": 3}, "k1"),
                _episode(server, {"i": 2, "hang": True}, "k2"),
            )
        finally:
            await server.aclose()

    outcomes = asyncio.run(run())
    seen = [o[0] for o in outcomes]
    assert [s["item"]["i"] for s in seen] == [0, 1, 2]
    assert [s["key"] for s in seen] == ["k0", "k1", "k2"]  # each its own environment
    assert all(s["argv"] == [str(script), "--flag"] for s in seen)
    assert all(s["pgid"] == s["pid"] for s in seen)  # a process group each: killpg reaches it
    assert len({s["pid"] for s in seen}) == 3
    # the server ran the module body first: each episode found its imports done
    assert all(s["preloaded"] for s in seen)
    assert [o[2] for o in outcomes] == [0, 3, -signal.SIGKILL]
    assert outcomes[0][1] == b"to stderr\n"
    assert not stderr_lines  # the server itself said nothing


def test_a_script_whose_import_fails_is_named_at_once_with_pythons_line_and_the_fix(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")
    crashing = tmp_path / "crashing.py"
    crashing.write_text("raise RuntimeError('the module body failed')\n")

    async def sink(stream):  # as the workflow's: the log, and the last line back
        sink.text = (await stream.read()).decode()
        return sink.text.strip().splitlines()[-1]

    async def run(script, error):
        server = ForkServer([sys.executable, str(script)])
        start = time.monotonic()
        with pytest.raises(error) as e:
            await server.start(sink, "workflow.agent.command='python agent.py'")
        return str(e.value), time.monotonic() - start

    message, took = asyncio.run(run(broken, AgentSetupError))
    assert took < 30  # not the 300 s ready timeout
    assert "ModuleNotFoundError: No module named 'no_such_module_anywhere'" in message
    assert f"{sys.executable} -m pip install" in message and "python agent.py" in message
    assert "no_such_module_anywhere" in sink.text  # the traceback is in the run's log
    message, _ = asyncio.run(run(crashing, ForkServerDied))
    assert "exited with code 1 before it was ready: RuntimeError: the module body failed" in message

    async def noisy_starts():  # what a script prints while imported is not its failure
        noisy = tmp_path / "noisy.py"
        noisy.write_text("print('loading the framework')\n")
        server = ForkServer([sys.executable, str(noisy)])
        try:
            await asyncio.wait_for(server.start(sink), 30)
        finally:
            await server.aclose()

    asyncio.run(noisy_starts())
    with pytest.raises(ValueError, match="'python SCRIPT.py"):
        fork_script(["node", "agent.js"])


@pytest.mark.parametrize("fork_server", [False, True])
def test_an_agent_program_that_cannot_import_its_framework_stops_the_run_at_its_first_episode(
    tiny_tokenizer, tmp_path, fork_server
):
    from tests.workflow.test_agent_proxy import ToolThenAnswer, _episodes, _item

    agent = tmp_path / "agent.py"
    agent.write_text("import json\nimport no_such_framework.agents\n")
    engine = ToolThenAnswer(tiny_tokenizer)
    with pytest.raises(AgentSetupError) as e:
        _episodes(tiny_tokenizer, engine, tmp_path, [_item(0)], command=f"python {agent}",
                  fork_server=fork_server)  # fmt: skip
    message = str(e.value)
    assert "ModuleNotFoundError: No module named 'no_such_framework'" in message
    assert f"the agent (workflow.agent.command='python {agent}')" in message
    assert f"{sys.executable} -m pip install" in message


def test_the_failure_rate_error_names_the_agent_program(tiny_tokenizer, tmp_path):
    from tests.workflow.test_agent_proxy import ToolThenAnswer, _episodes, _item

    agent = tmp_path / "agent.py"
    agent.write_text("import sys\nsys.exit('no answer today')\n")
    engine = ToolThenAnswer(tiny_tokenizer)
    items = [_item(i) for i in range(WINDOW // 2)]  # 2 episodes each: the window fills
    with pytest.raises(AgentFailureRate) as e:
        _episodes(tiny_tokenizer, engine, tmp_path, items, command=f"python {agent}")
    message = str(e.value)
    assert f"Fix the agent (workflow.agent.command='python {agent}')" in message
    assert "its last stderr line: no answer today" in message


def test_an_in_process_agent_whose_framework_is_missing_names_it_and_the_interpreter(
    tmp_path, monkeypatch
):
    from areal.workflow.agent import load_agent

    (tmp_path / "fw_agent_t.py").write_text("import no_such_framework.agents\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        load_agent("fw_agent_t:agent")
    message = str(e.value)
    assert message.startswith(
        f"workflow.agent.path: 'fw_agent_t' does not import in {sys.executable}"
    )
    assert "ModuleNotFoundError: No module named 'no_such_framework'" in message
    assert f"provides 'no_such_framework' into that interpreter ({sys.executable} -m pip" in message
    with pytest.raises(ValueError, match="cannot import 'no_such_agent_t'.*beside the entry"):
        load_agent("no_such_agent_t:agent")  # the module itself missing: where to put it
