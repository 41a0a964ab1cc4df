"""Run untrusted Python in a sandbox: one process tree per test case, torn down afterwards.

Every layer is enforced by the kernel; none depends on hooks inside the interpreter. What holds
in each mode, and what does not, is in docs/sandbox.md. The layers, outermost first
(``SandboxResult.isolation`` names the active ones, e.g. ``userns+mntns+pidns+...``):

* **Process**: stdin/stdout/stderr and the call result are files in a fresh host directory
  (mode 0700) handed over as open descriptors; an empty environment; a wall-clock deadline after
  which the whole tree is SIGKILLed; output read back capped at ``max_output_bytes``.
* **rlimits**: CPU seconds, address space, file size (which also caps stdout), open files, no
  core dumps; processes + threads per sandbox (below).
* **Fresh uid** (when we run as root): the tree runs as an unused uid with no groups, so it can
  read no private file and signal no process of ours; every process left with it is SIGKILLed.
* **Namespaces** (bubblewrap, started here; ``namespaces`` layer): user, mount, pid, network,
  ipc, uts and cgroup namespaces. The mount namespace sees read-only system and interpreter
  directories, its own /proc (only the sandbox's processes), a minimal /dev, and three private
  size-capped tmpfs (``tmpfs_mb``): /work (the working dir, the only writable path), /tmp and
  /dev/shm, all gone when the case ends. RLIMIT_NPROC is set inside the user namespace, where
  the kernel counts only this sandbox's tasks. When the pid namespace's init dies, the kernel
  kills everything in it (setsid daemons included).
* **seccomp** (installed by ``_sandbox_child.py`` before the solution runs; the BPF program is
  built here by libseccomp through pyseccomp): no running other programs (execve, execveat), no
  mknod/mkfifo, no ptrace or cross-process memory access, no socket() of any family (socketpair
  of AF_UNIX stays: pipes), no io_uring (its operations bypass seccomp), no mount, unshare,
  setns or namespace flags on clone, no bpf, perf, userfaultfd or keyrings.

* **Runner**: not dumpable (its ``/proc/<pid>/mem`` is closed to the solution, same uid), and
  the only judge of a sandbox failure: ``sandbox_error`` means it never wrote ``ready`` on the
  descriptor it closes before the solution runs (stderr, which the solution writes, counts not).

``isolation=required`` (the default) refuses to run unless namespaces and seccomp both hold;
``best_effort`` runs with what the machine gives (logged once, named in every result).

What it does not protect: the score against a submission that writes a fake result to the result
descriptor (function-call cases); use stdin/stdout cases for adversarial training data.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import random
import resource
import select
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

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_CHILD_SCRIPT = Path(__file__).with_name("_sandbox_child.py")
_UID_RANGE = (200_000, 400_000)  # unused uids the sandbox draws from when root
_INNER_ID = 1000  # uid and gid the code sees inside the user namespace

# Syscalls refused with EPERM once the runner installs the filter (see the module docstring).
_DENIED_SYSCALLS = (
    "execve", "execveat", "mknod", "mknodat", "ptrace", "process_vm_readv", "process_vm_writev",
    "pidfd_getfd", "kcmp", "socket", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsmount", "fspick", "fsconfig", "mount_setattr", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key",
)  # fmt: skip
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: refused as clone() flags.
_NAMESPACE_FLAGS = (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

# bad_result: a function-call case whose result descriptor holds no parsable result (missing,
# malformed, nested past the parser's depth); untrusted output, so the case fails (scores 0).
Status = Literal[
    "ok", "runtime_error", "timeout", "memory", "output_limit", "bad_result", "sandbox_error"
]


@dataclass
class SandboxResult:
    """Outcome of one case: status, exit code, capped output, the call result, isolation used."""

    status: Status
    returncode: int
    stdout: str
    stderr: str
    elapsed: float  # seconds, wall clock
    isolation: str  # e.g. "userns+mntns+pidns+netns+ipcns+seccomp+rlimits+uid"
    result: Any = None  # function-call cases: the returned value (JSON round-tripped)
    uid: int = -1  # the host uid the code ran as (-1: our own)


class SandboxUnavailable(RuntimeError):
    """``isolation=required`` and a layer the kernel or the machine refuses: nothing was run."""


@dataclass(frozen=True)
class Layers:
    """The kernel layers this machine gives the sandbox, and why the others are missing."""

    namespaces: bool  # bubblewrap: user, mount (own /proc, private tmpfs), pid, net, ipc, uts
    seccomp: bool
    missing: tuple[str, ...] = ()  # one "layer: why; fix" line per missing layer

    def describe(self, root: bool) -> str:
        """The ``+``-joined names of the active layers, as reported in ``SandboxResult``."""
        parts = ["userns", "mntns", "pidns", "netns", "ipcns"] if self.namespaces else []
        parts += ["seccomp"] if self.seccomp else []
        return "+".join(parts + ["rlimits"] + (["uid"] if root else []))


# ----------------------------------------------------------------------------- probing


def _world_executable(path: str) -> bool:
    real = Path(os.path.realpath(path))
    parents_ok = all(os.stat(p).st_mode & stat.S_IXOTH for p in real.parents)
    return parents_ok and bool(os.stat(real).st_mode & stat.S_IXOTH)


def resolve_python(configured: str = "") -> str:
    """The interpreter the sandbox user can run: ``configured``, else ours, else the system's."""
    return _resolve_python(configured, os.geteuid())


@functools.cache
def _resolve_python(configured: str, euid: int) -> str:
    for candidate in (configured, sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if candidate and os.path.exists(candidate):
            usable = _world_executable(candidate) if euid == 0 else os.access(candidate, os.X_OK)
            if usable:
                return candidate
    raise RuntimeError(
        "sandbox: no Python interpreter the sandbox user may execute (tried "
        f"{configured or '<unset>'}, {sys.executable}, /usr/bin/python3); set "
        "reward.sandbox.python to a world-executable interpreter"
    )


@functools.cache
def seccomp_program() -> bytes:
    """The seccomp BPF program (x86-64 or the host's arch; other arches are killed)."""
    import pyseccomp as sc

    rules = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in _DENIED_SYSCALLS:
        rules.add_rule(sc.ERRNO(errno.EPERM), name)
    # clone3 takes its flags behind a pointer seccomp cannot read: ENOSYS makes libc use clone.
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _NAMESPACE_FLAGS:
        rules.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    rules.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socketpair", sc.Arg(0, sc.NE, 1))  # 1: AF_UNIX
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def probe_layers(python: str) -> Layers:
    """Which layers hold here for ``python`` (probed once per interpreter and uid, logged once)."""
    return _probe_layers(python, os.geteuid())


@functools.cache
def _probe_layers(python: str, euid: int) -> Layers:
    missing = []
    seccomp = _seccomp_problem()
    if seccomp:
        missing.append(seccomp)
    namespaces = _namespace_problem(python, euid)
    if namespaces:
        missing.append(namespaces)
    layers = Layers(namespaces=not namespaces, seccomp=not seccomp, missing=tuple(missing))
    active = layers.describe(euid == 0)
    if missing:
        logger.warning("sandbox isolation: %s; missing: %s", active, " | ".join(missing))
    else:
        logger.info("sandbox isolation: %s", active)
    return layers


def _seccomp_problem() -> str:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError as e:
        return f"seccomp: cannot read /proc/self/status ({e})"
    if "Seccomp_filters:" not in status:
        return "seccomp: the kernel lacks CONFIG_SECCOMP_FILTER; fix: a kernel with seccomp filters"
    try:
        seccomp_program()
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        return (
            f"seccomp: cannot build the filter ({e!r}); fix: pip install pyseccomp and "
            "apt-get install libseccomp2"
        )
    return ""


def _namespace_problem(python: str, euid: int) -> str:
    if shutil.which("bwrap") is None:
        return "namespaces: bwrap (bubblewrap) is not on PATH; fix: apt-get install bubblewrap"
    case = Path(tempfile.mkdtemp(prefix="areal_sandbox_probe_"))
    try:
        (case / "in").mkdir()
        uid = _pick_uid() if euid == 0 else -1
        if uid >= 0:
            for p in (case, case / "in"):
                os.chown(p, uid, uid)
        argv = _bwrap_argv(python, case, SandboxConfig(), info_fd=-1)
        argv = argv[: argv.index("--") + 2] + ["-I", "-c", "pass"]
        run = subprocess.run(argv, capture_output=True, timeout=30, env={}, preexec_fn=_drop(uid))
        if run.returncode != 0:
            why = run.stderr.decode(errors="replace").strip()
            return (
                f"namespaces: bwrap failed ({why}); fix: allow unprivileged user namespaces "
                "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, "
                "kernel.apparmor_restrict_unprivileged_userns=0) and a mountable /proc"
            )
    except (OSError, subprocess.SubprocessError) as e:
        return f"namespaces: cannot start bwrap ({e!r}); fix: apt-get install bubblewrap"
    finally:
        shutil.rmtree(case, ignore_errors=True)
    return ""


def require_layers(cfg: SandboxConfig, python: str) -> Layers:
    """The layers to run with; raises :class:`SandboxUnavailable` when ``isolation=required``
    and one is missing."""
    layers = probe_layers(python)
    if cfg.isolation == "required" and layers.missing:
        raise SandboxUnavailable(
            "reward.sandbox.isolation=required, but the sandbox lacks: "
            + " | ".join(layers.missing)
            + "; or set reward.sandbox.isolation=best_effort to run with only "
            + layers.describe(os.geteuid() == 0)
            + " (docs/sandbox.md says what that leaves open)"
        )
    return layers


# ----------------------------------------------------------------------------- uids


def _pick_uid() -> int:
    in_use = {_status_field(text, "Uid:") for text in _proc_statuses()}
    while True:
        uid = random.randrange(*_UID_RANGE)
        if uid not in in_use:
            return uid


def _proc_statuses():
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            yield status.read_text()
        except OSError:
            continue


def _status_field(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key):
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
            if _status_field(text, "Uid:") != uid or "\nState:\tZ" in text:
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


def _tasks_of_uid(uid: int) -> int:
    """Threads (what RLIMIT_NPROC counts) of every process with real uid ``uid``."""
    statuses = [t for t in _proc_statuses() if _status_field(t, "Uid:") == uid]
    return sum(max(_status_field(t, "Threads:"), 1) for t in statuses)


# ----------------------------------------------------------------------------- the command


@functools.cache
def _system_binds() -> tuple[str, ...]:
    out: list[str] = []
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    return (*out, "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache")


@functools.cache
def _python_binds(python: str) -> tuple[str, ...]:
    """Read-only binds for the interpreter's prefixes outside /usr (a venv, pyenv)."""
    ask = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix]))"
    out = subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(
            f"sandbox: {python} -I -c ... failed ({out.stderr.strip()}); set reward.sandbox.python "
            "to a working interpreter"
        )
    roots = {os.path.realpath(p) for p in json.loads(out.stdout)} | set(json.loads(out.stdout))
    roots.add(os.path.dirname(os.path.realpath(python)))
    binds: list[str] = []
    for root in sorted(roots):
        if root != "/usr" and not root.startswith("/usr/"):
            binds += ["--ro-bind", root, root]
    return tuple(binds)


def _bwrap_argv(python: str, case: Path, cfg: SandboxConfig, info_fd: int) -> list[str]:
    """bubblewrap around ``python -I -B /sandbox/_runner.py``; the case's inputs at /sandbox."""
    size = str(cfg.tmpfs_mb << 20)  # bytes
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns"]
    # --as-pid-1: the runner is the namespace's init, so bwrap itself reaps it (no zombie).
    argv += ["--die-with-parent", "--new-session", "--as-pid-1", "--clearenv"]
    argv += ["--uid", str(_INNER_ID), "--gid", str(_INNER_ID), "--proc", "/proc", "--dev", "/dev"]
    for mount in ("/tmp", "/dev/shm", "/work"):
        argv += ["--size", size, "--tmpfs", mount]
    argv += [*_system_binds(), *_python_binds(python)]
    argv += ["--ro-bind", str(case / "in"), "/sandbox", "--chdir", "/work"]
    if info_fd >= 0:
        argv += ["--info-fd", str(info_fd)]
    return argv + ["--", python, "-I", "-B", "/sandbox/_runner.py"]


def _drop(uid: int):
    """preexec: die with the reward worker; as root, become ``uid`` with no groups."""

    def setup() -> None:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if uid >= 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return setup


def _preexec(cfg: SandboxConfig, uid: int, nproc: int):
    """Runs in the forked child before exec: rlimits, then the death signal and the uid."""
    drop = _drop(uid)

    def setup() -> None:
        mib = 1 << 20
        limits = {
            resource.RLIMIT_CPU: (cfg.cpu_seconds, cfg.cpu_seconds + 1),
            resource.RLIMIT_AS: (cfg.memory_mb * mib, cfg.memory_mb * mib),
            resource.RLIMIT_FSIZE: (cfg.max_file_mb * mib, cfg.max_file_mb * mib),
            resource.RLIMIT_NOFILE: (64, 64),
            resource.RLIMIT_CORE: (0, 0),
        }
        if nproc:  # without a user namespace: the count is the uid's, set before the switch
            limits[resource.RLIMIT_NPROC] = (nproc, nproc)
        for which, value in limits.items():
            resource.setrlimit(which, value)
        drop()

    return setup


# ----------------------------------------------------------------------------- one case


def _prepare(case: Path, code: str, stdin: str, spec: dict, uid: int, seccomp: bool) -> None:
    inputs, work = case / "in", case / "work"
    inputs.mkdir()
    work.mkdir()
    (inputs / "solution.py").write_text(code, encoding="utf-8")
    (inputs / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copyfile(_CHILD_SCRIPT, inputs / "_runner.py")
    if seccomp:
        (inputs / "seccomp.bpf").write_bytes(seccomp_program())
    (case / "stdin.txt").write_text(stdin, encoding="utf-8")
    for name in ("stdout.txt", "stderr.txt", "result.json"):
        (case / name).touch()
    if uid >= 0:
        for p in [case, work, inputs, *inputs.iterdir()]:
            os.chown(p, uid, uid)
    os.chmod(case, 0o700)


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _classify(rc: int, timed_out: bool, stderr: str, ready: bool) -> Status:
    """``ready``: the runner reported its layers in place, on a pipe it closed before the
    submission ran; only then can the submission have run, so only without it is a failure the
    sandbox's own (``sandbox_error``, whatever the submission prints on stderr)."""
    if not ready and not timed_out:
        return "sandbox_error"
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
) -> SandboxResult:
    """Run ``code`` once in the sandbox: as a script fed ``stdin``, or call ``fn_name(*args)``.

    Raises :class:`SandboxUnavailable` when ``cfg.isolation=required`` and a layer is missing."""
    python = resolve_python(cfg.python)
    layers = require_layers(cfg, python)
    root = os.geteuid() == 0
    uid = _pick_uid() if root else -1
    timeout = cfg.case_timeout if timeout is None else timeout
    nproc = cfg.max_processes + 1  # RLIMIT_NPROC also counts the runner
    if not layers.namespaces and not root:
        nproc += _tasks_of_uid(os.getuid())  # per-user count: headroom over what we hold now
    case = Path(tempfile.mkdtemp(prefix="areal_sandbox_"))
    ready_r, ready_w = (
        os.pipe()
    )  # the runner writes "ready" here, then closes it, before the code runs
    try:
        with open(case / "result.json", "wb") as result_file:
            spec = {
                "fn_name": fn_name,
                "args": args or [],
                "result_fd": result_file.fileno(),
                "ready_fd": ready_w,
                "seccomp": layers.seccomp,
                "nproc": nproc if layers.namespaces else 0,  # else set before the uid switch
            }
            _prepare(case, code, stdin, spec, uid, layers.seccomp)
            start = time.monotonic()
            rc, timed_out = _execute(python, case, cfg, uid, layers, nproc, timeout,
                                     [result_file.fileno(), ready_w])  # fmt: skip
            elapsed = time.monotonic() - start
        stdout = _read_capped(case / "stdout.txt", cfg.max_output_bytes)
        stderr = _read_capped(case / "stderr.txt", cfg.max_output_bytes)
        status = _classify(rc, timed_out, stderr, _was_ready(ready_r))
        result = None
        if status == "ok" and fn_name is not None:
            try:
                result = json.loads(_read_capped(case / "result.json", cfg.max_file_mb << 20))[
                    "result"
                ]
            except (ValueError, KeyError, TypeError, RecursionError):
                # Untrusted output (the submission can write anything to its result descriptor):
                # one that does not parse scores 0, counted by its status, never raises.
                status, rc = "bad_result", 1
        isolation = layers.describe(root)
        return SandboxResult(status, rc, stdout, stderr, elapsed, isolation, result, uid)
    finally:
        os.close(ready_r)
        shutil.rmtree(case, ignore_errors=True)


def _was_ready(ready_r: int) -> bool:
    """Whether the runner reported its layers in place (read once the case is over; nothing
    inside can still hold the pipe's write end, and a non-blocking read never waits anyway)."""
    os.set_blocking(ready_r, False)
    try:
        return os.read(ready_r, 16) == b"ready"
    except BlockingIOError:
        return False


def _execute(
    python: str,
    case: Path,
    cfg: SandboxConfig,
    uid: int,
    layers: Layers,
    nproc: int,
    timeout: float,
    fds: list[int],
) -> tuple[int, bool]:
    """Start the case (the runner inherits ``fds``), wait up to ``timeout`` seconds, then kill
    whatever is left."""
    info_r, info_w = os.pipe() if layers.namespaces else (-1, -1)
    if layers.namespaces:
        argv, cwd = _bwrap_argv(python, case, cfg, info_w), case
    else:
        argv, cwd = [python, "-I", "-B", str(case / "in" / "_runner.py")], case / "work"
    try:
        with (
            open(case / "stdin.txt", "rb") as fin,
            open(case / "stdout.txt", "wb") as fout,
            open(case / "stderr.txt", "wb") as ferr,
        ):
            proc = subprocess.Popen(
                argv, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, env={},
                start_new_session=True, close_fds=True,
                pass_fds=[fd for fd in (*fds, info_w) if fd >= 0],
                preexec_fn=_preexec(cfg, uid, 0 if layers.namespaces else nproc),
            )  # fmt: skip
    finally:
        if info_w >= 0:
            os.close(info_w)
    init = _namespace_init(info_r, timeout) if info_r >= 0 else -1
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        if init >= 0:  # killing the init first lets bwrap reap it: nothing lingers as a zombie
            _kill_init(init)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid)  # bwrap's death kills the namespace's init (--die-with-parent)
    finally:
        if uid >= 0:
            kill_uid(uid)
        proc.wait()
        if init >= 0:
            _wait_exited(init)
    return proc.returncode, timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_init(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _namespace_init(info_r: int, timeout: float) -> int:
    """A pidfd on the pid namespace's init (the runner; its death kills the rest), from bwrap's
    --info-fd; -1 when bwrap stopped before starting it."""
    with os.fdopen(info_r, "rb") as f:
        ready, _, _ = select.select([f], [], [], timeout)
        info = f.read() if ready else b""  # bwrap writes it and closes it once init runs
    try:
        return os.pidfd_open(int(json.loads(info)["child-pid"]))
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        return -1  # no init, or it already exited (bwrap waits for it before exiting)


def _wait_exited(pidfd: int, limit: float = 5.0) -> None:
    try:
        ready, _, _ = select.select([pidfd], [], [], limit)  # readable once the process exited
    finally:
        os.close(pidfd)
    if not ready:
        raise RuntimeError(f"sandbox: a pid namespace outlived its case by {limit}s")
