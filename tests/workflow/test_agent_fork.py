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

import pytest

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


def test_a_script_that_fails_to_import_or_a_dead_server_is_named(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")

    async def sink(stream):
        sink.text = (await stream.read()).decode()

    async def run():
        server = ForkServer([sys.executable, str(broken)])
        with pytest.raises(ForkServerDied, match="did not get ready"):
            await server.start(sink)

    asyncio.run(run())
    assert "no_such_module_anywhere" in sink.text
    with pytest.raises(ValueError, match="'python SCRIPT.py"):
        fork_script(["node", "agent.js"])
