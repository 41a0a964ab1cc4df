"""A process that dies with the one that started it, even when that one is SIGKILLed.

Two kernel mechanisms, used together by the launchers and the processes they start:
``parent_death_signal`` (a ``preexec_fn``) asks the kernel to signal the child when its parent
dies; ``die_with`` watches any process (the launcher, two levels up for torchrun's workers)
through a pidfd and signals this process when it exits.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading

from areal.utils.logging import get_logger

logger = get_logger("process")
PR_SET_PDEATHSIG = 1
_watched: set[int] = set()  # pids die_with already watches in this process


def parent_death_signal(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when its parent
    dies (Linux; elsewhere a no-op, and :func:`die_with` still applies)."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def die_with(pid: int, sig: int = signal.SIGTERM, what: str = "launcher") -> None:
    """Send ``sig`` to this process once process ``pid`` has exited (a daemon thread waits on a
    pidfd, so a reused pid cannot fool it); at once if it is already gone."""
    if pid in _watched:
        return
    _watched.add(pid)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        logger.error(f"the {what} (pid {pid}) is gone; stopping")
        os.kill(os.getpid(), sig)
        return
    except (OSError, AttributeError) as e:  # no pidfd here (old kernel, not Linux)
        logger.warning(
            f"cannot watch the {what} (pid {pid}): {e!r}; relying on the parent-death signal"
        )
        return

    def wait() -> None:
        select.select([fd], [], [])
        logger.error(f"the {what} (pid {pid}) exited; stopping this process")
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait, name=f"areal-watch-{what}", daemon=True).start()
