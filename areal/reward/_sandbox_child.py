"""Runs inside the sandbox (stdlib only, copied next to the case's inputs).

Started as ``python -I -B <inputs>/_runner.py`` by :func:`areal.reward.sandbox.run_python`, with
the writable working directory as cwd and the outer limits already applied (rlimits, uid,
namespaces). It reads ``spec.json``, ``solution.py`` and ``seccomp.bpf`` from its own directory,
then, before any submitted code runs:

1. sets RLIMIT_NPROC when the spec asks (inside the sandbox's user namespace, where the kernel
   counts only this sandbox's processes and threads);
2. makes itself not dumpable, so the solution (same uid) cannot open its ``/proc/<pid>/mem``;
3. installs the seccomp filter (``no_new_privs`` first); from then on the kernel enforces it
   and nothing in this process tree can remove it;
4. writes ``ready`` to the ready descriptor and closes it.

Any failure there ends the case with an ``areal-sandbox:`` line on stderr and exit code 125:
the solution never runs with fewer layers than the parent reported. The parent tells a sandbox
failure by the missing ``ready`` alone (never by stderr, which the solution writes too).

It then forks: the child runs ``solution.py`` (as ``__main__`` with the case's stdin, or calls
``spec["fn_name"](*spec["args"])`` and writes the JSON result to the result descriptor); the
parent waits for it and exits with its code, or ``128 + signal`` when it was killed by a signal.
"""

import ctypes
import json
import os
import resource
import sys

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SETUP_FAILED = 125


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_seccomp(program):
    """Load a BPF program (8-byte instructions) as this process's seccomp filter."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    ul = ctypes.c_ulong
    if libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ul(1), ul(0), ul(0), ul(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    filter_mode = ul(_SECCOMP_MODE_FILTER)
    if libc.prctl(ctypes.c_int(_PR_SET_SECCOMP), filter_mode, ctypes.byref(prog), ul(0), ul(0)):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _setup(inputs):
    """Read the case and apply the inner layers; returns (spec, solution source)."""
    with open(os.path.join(inputs, "spec.json"), encoding="utf-8") as f:
        spec = json.load(f)
    with open(os.path.join(inputs, "solution.py"), encoding="utf-8") as f:
        source = f.read()
    if spec["nproc"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    # Not dumpable: this runner's /proc/<pid>/mem (/proc/1/mem in the pid namespace) and its
    # other ptrace-guarded files are closed to the solution, which runs as the same uid.
    if ctypes.CDLL(None, use_errno=True).prctl(
        ctypes.c_int(_PR_SET_DUMPABLE),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    ):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    if spec["seccomp"]:
        with open(os.path.join(inputs, "seccomp.bpf"), "rb") as f:
            _install_seccomp(f.read())
    return spec, source


def _run_solution(spec, source):
    code = compile(source, "solution.py", "exec")
    if spec["fn_name"] is None:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        return
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(code, namespace)
    fn = namespace.get(spec["fn_name"])
    if fn is None and "Solution" in namespace:  # LeetCode style: class Solution: def fn(self, ..)
        fn = getattr(namespace["Solution"](), spec["fn_name"], None)
    if fn is None:
        raise NameError(f"solution.py defines no function {spec['fn_name']!r}")
    result = fn(*spec["args"])
    with os.fdopen(spec["result_fd"], "w", encoding="utf-8") as f:
        json.dump({"result": result}, f, default=repr)


def _child(spec, source):
    try:
        _run_solution(spec, source)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the submission's own error: reported on stderr, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def _wait_child(child_pid):
    while True:
        try:
            pid, raw = os.waitpid(child_pid, 0)
        except ChildProcessError:
            return 1
        if pid == child_pid:
            sig = os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else 0
            return 128 + sig if sig else os.WEXITSTATUS(raw)


def main():
    """Apply the inner layers, run the solution in a child, exit with its status."""
    try:
        spec, source = _setup(os.path.dirname(os.path.abspath(__file__)))
    except BaseException as e:
        sys.stderr.write(f"areal-sandbox: setup failed before the solution ran: {e!r}\n")
        sys.stderr.flush()
        os._exit(_SETUP_FAILED)
    # The only sign of a sandbox failure the host trusts: "ready" on this descriptor, closed
    # before the solution exists, so nothing the solution prints or does can forge or undo it.
    os.write(spec["ready_fd"], b"ready")
    os.close(spec["ready_fd"])
    child_pid = os.fork()
    if child_pid == 0:
        _child(spec, source)
    os._exit(_wait_child(child_pid))


if __name__ == "__main__":
    main()
