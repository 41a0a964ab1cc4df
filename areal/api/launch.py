"""The launch env contract: every environment variable a launcher sets for the processes it
starts, and that those processes read. No other module names one of these variables (a guard-rail
test checks), so a new launcher (Ray, Slurm) implements this module's contract and nothing else.

A trainer rank is started with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) plus ours: which launch attempt this is (0 first; a relaunch
with ``recover.mode=auto`` counts up) and how many torch threads to use. Servers and trainers
may get ``CUDA_VISIBLE_DEVICES`` and ``OMP_NUM_THREADS``, and both the servers' admin key
(``AREAL_SERVER_API_KEY``: by env, never on a command line, where every user can read it).
Every process a launcher starts gets ``AREAL_LAUNCHER_PID`` and exits when that process does.
With ``workflow.type: agent_cmd`` the agent proxy and the trainers share a control token
(``AREAL_AGENT_PROXY_TOKEN``, made per launch attempt).
Generation servers are not passed by env: they register ``host:port`` in the trial's name
registry and trainers read it there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
LAUNCH_ATTEMPT = "AREAL_LAUNCH_ATTEMPT"
TORCH_THREADS = "AREAL_TORCH_THREADS"
OMP_THREADS = "OMP_NUM_THREADS"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SERVER_API_KEY = "AREAL_SERVER_API_KEY"  # servers and trainers get the admin key by env, not argv
LAUNCHER_PID = "AREAL_LAUNCHER_PID"  # every started process dies when this process exits
COLOCATED = "AREAL_COLOCATED"  # "1": the trainer's GPUs also host generation servers
RAY_AUTH_MODE = "RAY_AUTH_MODE"  # Ray's token auth: "disabled" unless the user opts in
# the agent proxy's control token: the launcher makes one per attempt and gives it by env to the
# proxy and the trainers only (agents get per-session keys, never this)
AGENT_PROXY_TOKEN = "AREAL_AGENT_PROXY_TOKEN"
PROGRESS = (
    "AREAL_PROGRESS"  # "bar": a terminal shows the launcher's echo (tqdm redraws); "lines": a log
)
# What torchrun sets for a rank beyond the names above (a process that is not a rank drops them
# all).
TORCHRUN_ONLY = (
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
)
TORCHRUN_VARS = (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, *TORCHRUN_ONLY)


def drop_torchrun_env() -> None:
    """Forget torchrun's variables in this Ray worker process. A local Ray instance started by a
    process under torchrun passes them on to its workers; with TORCHELASTIC_USE_AGENT_STORE every
    rank would wait for an agent's store instead of rank 0 serving this job's rendezvous."""
    for var in [v for v in os.environ if v.startswith("TORCHELASTIC_")] + list(TORCHRUN_VARS):
        os.environ.pop(var, None)


@dataclass(frozen=True)
class LaunchEnv:
    """What a started process learns from its environment (defaults: one process, attempt 0)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    attempt: int = 0
    torch_threads: int = 0  # 0 = torch's default
    launcher_pid: int = 0  # 0 = not started by an areal launcher
    launched: bool = False  # RANK and WORLD_SIZE are set: a rendezvous (env://) is expected
    colocated: bool = False  # servers share the trainer's GPUs: they sleep while it steps
    progress: str = ""  # "bar" | "lines" as the launcher chose; "" = not told (see progress_mode)

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> LaunchEnv:
        """Parse ``environ``; a malformed value raises naming the variable and the value."""

        def number(name: str, default: int) -> int:
            raw = environ.get(name, "")
            if raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={raw!r} is not an integer; "
                    "it is set by the launcher (torchrun / areal launch)"
                ) from None

        return cls(
            rank=number(RANK, 0),
            world_size=number(WORLD_SIZE, 1),
            local_rank=number(LOCAL_RANK, 0),
            attempt=number(LAUNCH_ATTEMPT, 0),
            torch_threads=number(TORCH_THREADS, 0),
            launcher_pid=number(LAUNCHER_PID, 0),
            launched=RANK in environ and WORLD_SIZE in environ,
            colocated=number(COLOCATED, 0) == 1,
            progress=environ.get(PROGRESS, ""),
        )

    def progress_mode(self, stderr_is_tty: bool) -> str:
        """How this process shows step progress: the launcher's choice, else a bar on a terminal
        and plain lines elsewhere (a script run by hand, its output piped or not)."""
        if self.progress in ("bar", "lines"):
            return self.progress
        return "bar" if stderr_is_tty else "lines"


def disable_ray_token_auth(environ: MutableMapping[str, str] = os.environ) -> None:
    """Call before a ``ray.init`` that may start a local Ray instance: Ray 2.60 would write
    ~/.ray/auth_token, which every later ``ray start`` on the machine then enforces on clients
    that do not send it (test clusters and other users' jobs included). ``RAY_AUTH_MODE=token``
    in the environment opts in."""
    environ.setdefault(RAY_AUTH_MODE, "disabled")


def threads_env(n: int) -> dict[str, str]:
    """Env for a process limited to ``n`` OpenMP/torch threads (``{}`` for 0 = default)."""
    return {OMP_THREADS: str(n), TORCH_THREADS: str(n)} if n else {}


def visible_devices(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The accelerator ids CUDA_VISIBLE_DEVICES lists (``[]`` for an empty value: none), or
    None when it is unset."""
    raw = environ.get(VISIBLE_DEVICES)
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def devices_env(devices: str | None) -> dict[str, str]:
    """Env pinning a process to accelerators ``devices`` (``"0,1"``); ``{}`` for None (CPU)."""
    return {VISIBLE_DEVICES: devices} if devices is not None else {}


def launcher_env() -> dict[str, str]:
    """Env naming this process as the launcher its children must die with."""
    return {LAUNCHER_PID: str(os.getpid())}


def torch_dist_env(
    rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """torchrun's variables for one trainer rank started without torchrun (Ray, Slurm)."""
    return {
        RANK: str(rank),
        WORLD_SIZE: str(world_size),
        LOCAL_RANK: str(local_rank),
        MASTER_ADDR: master_addr,
        MASTER_PORT: str(master_port),
    }


def trainer_env(attempt: int, colocated: bool = False, progress: str = "lines") -> dict[str, str]:
    """Our variables for the trainer ranks of launch attempt ``attempt`` (``colocated``: their
    GPUs also host generation servers; ``progress``: ``bar`` when the launcher's console is a
    terminal that shows their output as it comes, else ``lines``)."""
    return {
        LAUNCH_ATTEMPT: str(attempt),
        PROGRESS: progress,
        **({COLOCATED: "1"} if colocated else {}),
    }


def api_key_env(key: str) -> dict[str, str]:
    """Env carrying the servers' admin key (``{}`` for no key)."""
    return {SERVER_API_KEY: key} if key else {}


def agent_proxy_env(token: str) -> dict[str, str]:
    """Env carrying the agent proxy's control token (``{}`` for none: no agent proxy)."""
    return {AGENT_PROXY_TOKEN: token} if token else {}


def agent_proxy_token(environ: Mapping[str, str] = os.environ) -> str:
    """The agent proxy's control token a launcher passed ('' = none: no proxy was started)."""
    return environ.get(AGENT_PROXY_TOKEN, "")


def agent_env(
    session: Mapping[str, str], environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The environment of an agent program (``workflow.type: agent_cmd``): ``environ`` without
    the run's variables and secrets (every ``AREAL_*`` one: the control token, the servers'
    admin key, ...; torchrun's; any ``OPENAI_*`` the trainer had, such as a real API key), plus
    ``session`` (its ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``)."""
    dropped = set(TORCHRUN_VARS)
    kept = {
        k: v
        for k, v in environ.items()
        if not k.startswith(("AREAL_", "OPENAI_", "TORCHELASTIC_")) and k not in dropped
    }
    return {**kept, **session}


def server_api_key(configured: str = "", environ: Mapping[str, str] = os.environ) -> str:
    """The admin key: ``configured`` if set, else the one a launcher passed by env ('' = none)."""
    return configured or environ.get(SERVER_API_KEY, "")
