"""The agent sandbox (``workflow.agent.sandbox: true``): an agent program per episode inside the
code sandbox's namespaces (areal.reward.sandbox, docs/sandbox.md), by bubblewrap.

What holds: user, mount, pid, ipc, uts and cgroup namespaces; the program sees the system and
interpreter directories, the working directory and the directories its command names, all
read-only, its own /proc (only its processes), a minimal /dev, and a private size-capped tmpfs
at /tmp (``TMPFS_MB``; also its HOME); nothing else of the host's files. Its environment is
empty but for ``PATH``, ``HOME``, ``LANG`` and the session's ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY``. It cannot see or signal any process outside, and when the episode's
process is killed (deadline) the kernel kills everything in its pid namespace.

What does not hold, and why: the network namespace is shared, because the program must reach
the agent proxy over TCP; it can reach what the host reaches (set ``server.api_key`` so the
servers' admin endpoints refuse it; firewall egress where that matters). No seccomp filter and
no rlimits: an agent may legitimately run tools (execve) and load large frameworks. As root, the
program keeps uid 0 outside the user namespace (mapped to 1000 inside) rather than a fresh uid,
so that it can run the trainer's interpreter from a private prefix (a venv under /root); the
read-only binds and the pid namespace are what confine it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from areal.reward.sandbox import _python_binds, _system_binds

TMPFS_MB = 512  # the private /tmp (and HOME) of one episode
INNER_ID = 1000  # uid and gid the program sees inside the user namespace


@functools.cache
def sandbox_problem(python: str) -> str:
    """Why the agent sandbox cannot run ``python`` here ('' when it can): bubblewrap and user
    namespaces are needed; probed once per interpreter by running it in the sandbox."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not on PATH; fix: apt-get install bubblewrap"
    try:
        run = subprocess.run(
            sandbox_argv([python, "-I", "-c", "pass"], {}), capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot start bwrap ({e!r}); fix: apt-get install bubblewrap"
    if run.returncode != 0:
        why = run.stderr.decode(errors="replace").strip()[-300:]
        return (
            f"bwrap failed ({why}); fix: allow unprivileged user namespaces (sysctl "
            "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, "
            "kernel.apparmor_restrict_unprivileged_userns=0) and a mountable /proc"
        )
    return ""


def _read_only(argv: list[str], cwd: str) -> list[str]:
    """The directories bound read-only: ``cwd`` and those of the paths ``argv`` names."""
    dirs = {os.path.realpath(cwd)}
    for arg in argv[1:]:
        path = Path(cwd, arg)
        if path.exists():
            dirs.add(os.path.realpath(path if path.is_dir() else path.parent))
    out: list[str] = []
    for d in sorted(dirs):
        out += ["--ro-bind", d, d]
    return out


def sandbox_argv(argv: list[str], env: dict[str, str], cwd: str | None = None) -> list[str]:
    """bubblewrap around ``argv`` (module docstring), with ``env`` added to its environment."""
    cwd = cwd or os.getcwd()
    python = argv[0] if os.path.basename(argv[0]).startswith("python") else ""
    out = [shutil.which("bwrap") or "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc"]
    out += ["--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent"]
    out += ["--new-session", "--clearenv", "--uid", str(INNER_ID), "--gid", str(INNER_ID)]
    out += ["--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_MB << 20), "--tmpfs", "/tmp"]
    out += [*_system_binds(), *(_python_binds(python) if python else ()), *_read_only(argv, cwd)]
    base = {"PATH": f"{os.path.dirname(argv[0])}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}
    for key, value in {**base, "LANG": "C.UTF-8", **env}.items():
        out += ["--setenv", key, value]
    return out + ["--chdir", cwd, "--", *argv]
