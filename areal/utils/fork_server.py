"""The server process of the agent fork server (areal.workflow.agent_fork, where the protocol is
described): ``python -m areal.utils.fork_server SOCKET SCRIPT``. It imports only the standard
library and :mod:`areal.utils.process`, so the agents it forks carry nothing of ours."""

from __future__ import annotations

import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from areal.utils.process import parent_death_signal

MAX_MESSAGE = 1 << 16  # bytes of one request (argv + environment overrides)


def _child(request: dict, fds: list[int], script: str, die_with_server) -> None:
    """In the forked child: become the episode's process, run the script, exit."""
    code = 1
    try:
        os.setsid()
        die_with_server()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 -- the process's own fds, kept open
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(request["env"])
        sys.argv = list(request["argv"][1:])
        random.seed()
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 -- the agent's crash: printed, exit code 1
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _accept(listener: socket.socket, running: dict[int, socket.socket], script: str) -> None:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
    if not message or len(fds) != 3:
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    die_with_server = parent_death_signal(signal.SIGKILL)  # made here: it checks the server's pid
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in running.values():
            other.close()
        conn.close()
        _child(json.loads(message), fds, script, die_with_server)
    for fd in fds:
        os.close(fd)
    try:
        conn.send(json.dumps(pid).encode())
        running[pid] = conn
    except OSError:  # the workflow gave up on it already: its exit is reaped unreported
        conn.close()


def _reap(running: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            try:
                conn.send(json.dumps(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass  # the workflow is gone
            conn.close()


def serve(path: str, script: str) -> None:
    """Preload ``script``, say ``ready``, fork an episode per request (module docstring)."""
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__areal_preload__")
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        raise SystemExit(
            f"agent fork server: importing {script} started threads {names}; a fork would "
            "lose them. Set workflow.agent.fork_server=false for this agent"
        )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(256)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for _ in selector.select(timeout=0.05):
            _accept(listener, running, script)
        _reap(running)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
