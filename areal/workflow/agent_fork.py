"""A fork server for agent programs written in Python (``workflow.agent.fork_server: true``).

A Python agent pays its imports in every episode's process: ~2 s of CPU for the OpenAI Agents
SDK or LangGraph, which on a small machine costs more than the episode's generation. With the
fork server, ``python SCRIPT.py [args]`` is still one process per episode (its own process
group, killed at its deadline, its stdin, stdout and stderr, its exit code), but each is forked
from one server process that imported the script's modules once:

* the server (``python -m areal.utils.fork_server SOCKET SCRIPT``: stdlib only, so nothing
  of ours is imported into the agents; its environment is the trainer's without the run's
  variables and secrets, areal.api.launch.agent_env) runs SCRIPT's module body
  under the name ``__areal_preload__`` (its imports and definitions; its ``if __name__ ==
  "__main__"`` block does not run), says ``ready`` on stdout, and listens on a Unix socket
  (SOCK_SEQPACKET, in a private temporary directory);
* per episode the workflow sends the argv, the environment overrides (``OPENAI_BASE_URL``,
  ``OPENAI_API_KEY``) and the three pipe ends for the episode's stdin, stdout and stderr
  (SCM_RIGHTS); the server forks, answers the child's pid, and sends its exit code when it
  ends (``os.waitstatus_to_exitcode``: -9 for SIGKILL);
* the child starts a session of its own (its pid is its process group's id), dies with the
  server (parent-death signal), reseeds ``random``, and runs SCRIPT as ``__main__`` (runpy),
  whose imports are found in ``sys.modules``.

A preload that leaves threads running is refused (a fork copies only the calling thread). The
server dies with the trainer process that started it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from areal.api.launch import agent_env
from areal.utils.process import parent_death_signal
from areal.workflow.agent import import_failure
from areal.workflow.openai_client import EngineFailure

READY_TIMEOUT = 300.0  # seconds the server may take to import the script's modules


class ForkServerDied(EngineFailure):
    """The fork server is gone: every later episode would fail; infrastructure, stops the run."""


class ForkedAgent:
    """An episode's process forked by the server; the part of ``asyncio.subprocess.Process``
    the workflow uses (``pid``, ``stdin``, ``stdout``, ``stderr``, ``wait``, ``returncode``)."""

    def __init__(self, sock: socket.socket, pid: int, stdin, stdout, stderr):
        self._sock, self.pid = sock, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    async def wait(self) -> int:
        """Its exit code, once the server reports it."""
        if self.returncode is None:
            data = await asyncio.get_running_loop().sock_recv(self._sock, 64)
            self._sock.close()
            if not data:
                raise ForkServerDied(
                    f"the agent fork server died while agent pid {self.pid} ran "
                    "(workflow.agent.fork_server); its stderr is in the run's agent_stderr.log"
                )
            self.returncode = int(json.loads(data))
        return self.returncode


class ForkServer:
    """The server process of one workflow and the client side of its protocol."""

    def __init__(self, argv: list[str]):
        self.script = fork_script(argv)
        self.argv = argv
        self._dir = tempfile.TemporaryDirectory(prefix="areal-fork-")  # mode 0700
        self.path = str(Path(self._dir.name) / "socket")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, stderr_sink, what: str = "") -> None:
        """Start the server and wait (``READY_TIMEOUT``) until it imported the script;
        ``stderr_sink(stream)`` copies its stderr (import errors) into the run's log and returns
        its last line. A server that exits before it is ready is reported at once with that line
        (an import failure as :class:`~areal.workflow.agent.AgentSetupError` naming the fix;
        ``what`` names the agent in the config)."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "areal.utils.fork_server", self.path, self.script,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, preexec_fn=parent_death_signal(signal.SIGKILL),
            env=agent_env({}),  # its children inherit it: none of the run's secrets
        )  # fmt: skip
        self._sink = asyncio.ensure_future(stderr_sink(self.proc.stderr))
        try:
            ready = await asyncio.wait_for(_says_ready(self.proc.stdout), READY_TIMEOUT)
        except TimeoutError:
            await self.aclose()
            raise ForkServerDied(
                f"the agent fork server for {self.script} did not get ready within "
                f"{READY_TIMEOUT:.0f} s (still importing it); see the run's agent_stderr.log"
            ) from None
        if not ready:  # it exited: its import (or its module body) failed
            code = await self.proc.wait()
            tail = await self._sink
            await self.aclose()
            tail = tail.strip() if isinstance(tail, str) else ""
            raise import_failure(tail, sys.executable, what or self.script) or ForkServerDied(
                f"the agent fork server for {self.script} exited with code {code} before it "
                f"was ready: {tail or '(no stderr)'}; its traceback is in the run's "
                "agent_stderr.log"
            )

    async def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedAgent:
        """Fork one episode's process running ``argv`` with ``env`` over the server's."""
        loop = asyncio.get_running_loop()
        ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write) each
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.path)
            socket.send_fds(sock, [json.dumps({"argv": argv, "env": env}).encode()], theirs)
            data = await loop.sock_recv(sock, 64)
        except OSError as e:
            sock.close()
            raise ForkServerDied(f"the agent fork server at {self.path} is gone: {e!r}") from e
        finally:
            for fd in theirs:
                os.close(fd)
        if not data:
            raise ForkServerDied("the agent fork server closed the connection before forking")
        stdout, stderr = asyncio.StreamReader(), asyncio.StreamReader()
        for reader, fd in ((stdout, ends[1][0]), (stderr, ends[2][0])):
            protocol = asyncio.StreamReaderProtocol(reader)
            await loop.connect_read_pipe(lambda p=protocol: p, os.fdopen(fd, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(ends[0][1], "wb", 0)
        )
        stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        return ForkedAgent(sock, int(json.loads(data)), stdin, stdout, stderr)

    async def aclose(self) -> None:
        """Stop the server (its children die with it)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
            await asyncio.gather(self._sink, return_exceptions=True)
        self._dir.cleanup()


async def _says_ready(stdout: asyncio.StreamReader) -> bool:
    """True once the server says ``ready`` (what the script printed while imported is passed
    over), False when its stdout ends first (it exited)."""
    while line := await stdout.readline():
        if line.strip() == b"ready":
            return True
    return False


def fork_script(argv: list[str]) -> str:
    """The script a fork server preloads: ``argv`` must be ``[python, SCRIPT.py, ...]`` (this
    interpreter); ValueError naming the fix otherwise."""
    if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
        raise ValueError(
            f"workflow.agent.fork_server: needs a command 'python SCRIPT.py [args]' (got "
            f"{' '.join(argv)!r}); set fork_server=false for other programs"
        )
    if not Path(argv[1]).is_file():
        raise ValueError(f"workflow.agent.fork_server: {argv[1]} is not a file")
    return argv[1]
