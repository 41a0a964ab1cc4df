"""Run untrusted Python in a sandbox: one process tree per test case, torn down afterwards.

Layers, outermost first (``SandboxResult.isolation`` names the ones that were active):

* **Process**: a new session; stdin/stdout/stderr are files in a fresh temp working directory
  (mode 0700); an empty environment (no secrets); a wall-clock deadline, after which the whole
  tree is SIGKILLed; output read back is capped at ``max_output_bytes``.
* **rlimits**: CPU seconds, address space, number of processes, file size (which also caps
  stdout), open files, no core dumps.
* **Unprivileged uid** (when we run as root): the code runs as a fresh uid with no groups that
  owns only the working directory, so it cannot write other files and ``RLIMIT_NPROC`` (which
  root ignores) holds. After each case every process left with that uid is SIGKILLed.
* **Namespaces** (``unshare`` from util-linux, when the kernel allows it): a network namespace
  with only a downed loopback (no network at all) and a PID namespace (everything the case
  spawned dies with it).
  Fallback when that fails: the network namespace through ``libc.unshare`` via ctypes in the
  child; when that fails too, only the audit-hook layer blocks sockets (reported as such).
* **Audit hooks** in the child interpreter (``_sandbox_child.py``): no sockets, no running other
  programs, no ctypes, no writes outside the working directory. These hold in every mode.

What it does not protect: the score against a submission that writes a fake ``result.json``
(function-call cases); use stdin/stdout cases for adversarial training data.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from areal.api.config.reward import SandboxConfig

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
_CHILD_SCRIPT = Path(__file__).with_name("_sandbox_child.py")
_UID_RANGE = (200_000, 400_000)  # unused uids the sandbox draws from when root

Status = Literal["ok", "runtime_error", "timeout", "memory", "output_limit", "sandbox_error"]


@dataclass
class SandboxResult:
    """Outcome of one case: status, exit code, capped output, the call result, isolation used."""

    status: Status
    returncode: int
    stdout: str
    stderr: str
    elapsed: float  # seconds, wall clock
    isolation: str  # e.g. "uid+rlimits+netns+pidns+audit"
    result: Any = None  # function-call cases: the returned value (JSON round-tripped)
    uid: int = -1  # the uid the code ran as (-1: our own)


def _world_executable(path: str) -> bool:
    real = Path(os.path.realpath(path))
    parents_ok = all(os.stat(p).st_mode & stat.S_IXOTH for p in real.parents)
    return parents_ok and bool(os.stat(real).st_mode & stat.S_IXOTH)


@functools.lru_cache(maxsize=None)
def resolve_python(configured: str = "") -> str:
    """The interpreter the sandbox user can run: ``configured``, else ours, else the system's."""
    for candidate in (configured, sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if candidate and os.path.exists(candidate):
            if os.geteuid() != 0 or _world_executable(candidate):
                return candidate
    raise RuntimeError(
        "sandbox: no Python interpreter the unprivileged sandbox user may execute (tried "
        f"{configured or '<unset>'}, {sys.executable}, /usr/bin/python3); set "
        "reward.sandbox.python to a world-executable interpreter"
    )


def _libc_unshare_net() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


@functools.lru_cache(maxsize=None)
def isolation_mode() -> str:
    """Probe once per process: 'unshare' (net+pid namespaces), 'ctypes-netns' or 'none'."""
    unshare = shutil.which("unshare")
    if os.geteuid() == 0 and unshare:
        probe = [unshare, "--net", "--pid", "--fork", "--kill-child", "-S", "65534", "-G", "65534"]
        try:
            ok = subprocess.run(probe + ["true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return "unshare"
    try:
        pid = os.fork()
        if pid == 0:
            try:
                _libc_unshare_net()
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, raw = os.waitpid(pid, 0)
        if os.WIFEXITED(raw) and os.WEXITSTATUS(raw) == 0:
            return "ctypes-netns"
    except OSError:
        pass
    return "none"


def _pick_uid() -> int:
    in_use = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            in_use.add(_status_uid(status.read_text()))
        except OSError:
            continue
    while True:
        uid = random.randrange(*_UID_RANGE)
        if uid not in in_use:
            return uid


def _status_uid(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return -1


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every live process whose real uid is ``uid`` until none is left; returns kills."""
    killed = 0
    for _ in range(rounds):
        found = 0
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            if _status_uid(text) != uid or "\nState:\tZ" in text:
                continue
            found += 1
            try:
                os.kill(int(status.parent.name), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if not found:
            break
        time.sleep(0.01)
    return killed


def _preexec(cfg: SandboxConfig, uid: int, mode: str):
    """Runs in the forked child before exec: death signal, rlimits, then (fallback) uid/netns."""

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the reward worker
        mib = 1 << 20
        limits = {
            resource.RLIMIT_CPU: (cfg.cpu_seconds, cfg.cpu_seconds + 1),
            resource.RLIMIT_AS: (cfg.memory_mb * mib, cfg.memory_mb * mib),
            resource.RLIMIT_NPROC: (cfg.max_processes, cfg.max_processes),
            resource.RLIMIT_FSIZE: (cfg.max_file_mb * mib, cfg.max_file_mb * mib),
            resource.RLIMIT_NOFILE: (64, 64),
            resource.RLIMIT_CORE: (0, 0),
        }
        for which, value in limits.items():
            resource.setrlimit(which, value)
        if mode == "ctypes-netns":
            _libc_unshare_net()
        if uid >= 0 and mode != "unshare":  # unshare -S/-G switches uid itself
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return setup


def _command(python: str, uid: int, mode: str) -> list[str]:
    child = [python, "-I", "-B", "_runner.py"]
    if mode != "unshare":
        return child
    unshare = shutil.which("unshare") or "unshare"
    ids = ["-S", str(uid), "-G", str(uid)] if uid >= 0 else []
    return [unshare, "--net", "--pid", "--fork", "--kill-child", *ids, "--", *child]


def _describe(mode: str, uid: int) -> str:
    parts = ["rlimits"] + (["uid"] if uid >= 0 else [])
    parts += {"unshare": ["netns", "pidns"], "ctypes-netns": ["netns"], "none": []}[mode]
    return "+".join(parts + ["audit"])


def _prepare(workdir: Path, code: str, stdin: str, spec: dict, uid: int) -> None:
    (workdir / "solution.py").write_text(code, encoding="utf-8")
    (workdir / "stdin.txt").write_text(stdin, encoding="utf-8")
    (workdir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copyfile(_CHILD_SCRIPT, workdir / "_runner.py")
    for name in ("stdout.txt", "stderr.txt"):
        (workdir / name).touch()
    if uid >= 0:
        for p in [workdir, *workdir.iterdir()]:
            os.chown(p, uid, uid)
    os.chmod(workdir, 0o700)


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _classify(rc: int, timed_out: bool, stderr: str) -> Status:
    if timed_out or rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL, -signal.SIGXCPU):
        return "timeout"
    if rc in (128 + signal.SIGXFSZ, -signal.SIGXFSZ):
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory"
    return "ok" if rc == 0 else "runtime_error"


def run_python(
    code: str,
    cfg: SandboxConfig,
    stdin: str = "",
    fn_name: str | None = None,
    args: list | None = None,
    timeout: float | None = None,
    audit_network: bool = True,
) -> SandboxResult:
    """Run ``code`` once in the sandbox: as a script fed ``stdin``, or call ``fn_name(*args)``.

    ``audit_network=False`` leaves sockets to the kernel layer alone (tests use it to show the
    network namespace holds by itself)."""
    mode = isolation_mode()
    uid = _pick_uid() if os.geteuid() == 0 else -1
    python = resolve_python(cfg.python)
    timeout = cfg.case_timeout if timeout is None else timeout
    spec = {"fn_name": fn_name, "args": args or [], "block_network": audit_network}
    workdir = Path(tempfile.mkdtemp(prefix="areal_sandbox_"))
    try:
        _prepare(workdir, code, stdin, spec, uid)
        start = time.monotonic()
        rc, timed_out = _execute(_command(python, uid, mode), workdir, cfg, uid, mode, timeout)
        elapsed = time.monotonic() - start
        stdout = _read_capped(workdir / "stdout.txt", cfg.max_output_bytes)
        stderr = _read_capped(workdir / "stderr.txt", cfg.max_output_bytes)
        result = None
        result_file = workdir / "result.json"
        if rc == 0 and fn_name is not None and result_file.is_file():
            try:
                result = json.loads(_read_capped(result_file, cfg.max_file_mb << 20))["result"]
            except (ValueError, KeyError, TypeError):
                rc = 1  # a malformed result file counts as a failed case
        status = _classify(rc, timed_out, stderr)
        return SandboxResult(status, rc, stdout, stderr, elapsed, _describe(mode, uid), result, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _execute(
    cmd: list[str], workdir: Path, cfg: SandboxConfig, uid: int, mode: str, timeout: float
) -> tuple[int, bool]:
    """Start the case, wait up to ``timeout`` seconds, then kill whatever is left."""
    with (
        open(workdir / "stdin.txt", "rb") as fin,
        open(workdir / "stdout.txt", "wb") as fout,
        open(workdir / "stderr.txt", "wb") as ferr,
    ):
        proc = subprocess.Popen(
            cmd,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=workdir,
            env={},
            start_new_session=True,
            close_fds=True,
            preexec_fn=_preexec(cfg, uid, mode),
        )
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    finally:
        if uid >= 0:
            kill_uid(uid)
        proc.wait()
    return proc.returncode, timed_out
