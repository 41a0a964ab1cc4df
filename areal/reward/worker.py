"""A reward worker process, run by path (``python -P worker.py FD PARENT_PID``: -P, or its own
directory would shadow the standard library with ``areal/reward/math.py``) by
:class:`areal.reward.runner.RewardRunner`.

It imports only the standard library and, when a call's function is unpickled, that function's
own module. A ``multiprocessing`` spawn child would first re-import the caller's ``__main__``
(the whole training script: torch, transformers, the engines), seconds of CPU per worker for
nothing, since a reward is named by its module (``reward_fn=module:function``).

Protocol on the socket ``FD`` (a :class:`multiprocessing.connection.Connection`): the parent
sends its ``sys.path`` once, then ``(fn, args, kwargs)`` per call; the worker replies
``("ok", float)`` or ``("error", message)``. It exits when the parent closes the socket, and
(a watch on the parent's pid) when the parent exits, even in the middle of a call.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    """Worker loop: receive (fn, args, kwargs), reply ("ok", float) or ("error", message)."""
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return  # the runner closed the socket
        try:
            reply = ("ok", float(fn(*args, **kwargs)))
        except BaseException as e:  # reported to the parent, which counts and logs it
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


def main(fd: int, parent: int) -> None:
    """Take the parent's ``sys.path`` (its script's directory, ``PYTHONPATH``), watch the
    parent, then serve calls."""
    conn = Connection(fd)
    sys.path[:] = conn.recv()
    from areal.utils.process import die_with

    die_with(parent, signal.SIGKILL, what="reward runner's process")
    serve(conn)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
